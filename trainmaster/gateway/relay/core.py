"""The gateway's state and its leg logic: what the route modules and the stream port call.

A leg is journaled as dispatched, its data transfer request goes to the party, and the party's
answer is verified and recorded, sealed to the task's owner and signed as a whole (item 7),
before the request answers: an inline result (decrypted in memory and re-encrypted in the sealed
outcome), or, for a large one, the party's signed attestation that it stores it; its bytes cross
the gateway only when the initiator fetches them through the stream port (:mod:`.streams`),
decrypted and re-encrypted a chunk at a time. A party that cannot be reached or answers 503 (it
restarts, its executor is queued, the leg's input is still arriving) leaves the leg open: the
request answers a provisional outcome and the initiator asks again, until the task's deadline
makes it final. A per-task queue (one request per task at a time, a bounded backlog) and a
per-party concurrency limit keep one slow task or party from blocking others.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from fastapi import HTTPException, Request
from pydantic import BaseModel

from trainmaster.gateway.audit.log import SELF, AuditLog, Requester
from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.crypto.envelope import EnvelopeError, verify_attestation
from trainmaster.gateway.crypto.gate import RESULT_TTL_S
from trainmaster.gateway.crypto.tlsid import PeerIdentity, dns_name
from trainmaster.gateway.models import (
    DataReceive,
    DataTransfer,
    Envelope,
    LegOutcome,
    LegOutcomePayload,
    MessageKind,
    RuleCall,
    SignedAttestation,
    Strict,
    TaskRegister,
)
from trainmaster.gateway.net.service import ServiceContext, read_envelope, request_peer
from trainmaster.gateway.relay.mapping import Leg, MappingTable, Task
from trainmaster.gateway.relay.partylink import PartyLinkError, PartyLinks

M = TypeVar("M", bound=BaseModel)
TRANSIENT_STATUSES = (429, 502, 503, 504)
"""A party answering these has not decided the leg: it is asked again, not recorded."""


class TransferPayload(Strict):
    """What a party's sealed transfer result decrypts to."""

    ok: bool
    result_text: str | None = None
    error: str = ""
    stored: bool = False
    attestation: SignedAttestation | None = None


@dataclass(frozen=True)
class LegRun:
    """What one leg's transfer came to: its outcome and the parts the sealed outcome carries."""

    outcome: LegOutcome
    detail: str = ""
    result_text: str | None = None
    attestation: SignedAttestation | None = None
    stream_bytes: int | None = None
    """Set for a result stored at its party (fetched through the stream port)."""
    provisional: bool = False
    """The party did not decide the leg (unreachable, restarting, busy): not recorded, asked again."""


@dataclass(frozen=True)
class SettledLeg:
    """A leg as a data receive request answers it: its row, and for a leg that may still run, a
    provisional sealed outcome (not recorded: ask again before the deadline)."""

    leg: Leg
    provisional: str | None = None


def task_digest(req: TaskRegister) -> str:
    """The idempotency key's body check: same task body, same digest (leg order and the sending
    run's id do not matter)."""
    body = req.model_dump(mode="json", exclude={"run_id"})
    body["legs"] = sorted(body["legs"], key=lambda leg: leg["data_id"])
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Relay:
    """One gateway's state: its identity and gate, the mapping table, the audit log, the links to
    parties, and the legs being run right now."""

    cfg: ServiceConfig
    ctx: ServiceContext
    table: MappingTable
    audit: AuditLog
    party_slots: dict[str, asyncio.Semaphore]
    parties: PartyLinks | None = None
    """Set while the app runs (its lifespan opens and closes the connections)."""
    loop: asyncio.AbstractEventLoop | None = None
    task_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    task_backlog: dict[str, int] = field(default_factory=dict)
    reported: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=lambda: {"tasks": 0, "legs": 0, "streams": 0})
    pending: dict[tuple[str, str], asyncio.Task[SettledLeg]] = field(default_factory=dict)
    """Legs being run right now: a second data receive request for one follows the same run
    instead of starting another (a request can outlive the one that started the run, whose
    client gave up and asked again)."""

    @classmethod
    def load(cls, cfg: ServiceConfig) -> "Relay":
        state = Path(cfg.state_dir).resolve()
        db_url = cfg.db_url or f"sqlite:///{state / 'mapping.db'}"
        ctx = ServiceContext.load(cfg, db_url)
        party_slots = {
            p.name: asyncio.Semaphore(cfg.party_concurrency) for p in ctx.roster.values() if p.role == "party"
        }
        audit = AuditLog(state / "audit.log", ctx.me)
        audit.append("service.start", SELF)
        return cls(cfg, ctx, MappingTable(db_url), audit, party_slots)

    async def open(self, request: Request, kind: MessageKind, roles: set[str], model: type[M]) -> tuple[Requester, M]:
        """The request's envelope through the gate: its authenticated sender and its payload."""
        env = await read_envelope(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)
        return self.open_envelope(env, kind, roles, model, request_peer(request))

    def open_envelope(
        self, env: Envelope, kind: MessageKind, roles: set[str], model: type[M], peer: PeerIdentity | None
    ) -> tuple[Requester, M]:
        sender, payload = self.ctx.gate.open(env, kind, roles, model, peer=peer)
        self.ctx.count(kind)
        return Requester(sender.name, sender.role, env.header.msg_id, env.signature), payload

    def owned(self, task_id: str, sender: str) -> Task:
        """The task, if ``sender`` created it (item 9): others may neither read nor cancel it."""
        task = self.table.task(task_id)
        if task is None:
            raise HTTPException(404, f"no task {task_id!r} at this gateway; create it first (POST /v1/tasks)")
        if task.owner != sender:
            raise HTTPException(403, f"task {task_id!r} belongs to another initiator")
        return task

    def seal_outcome(self, task: Task, leg: Leg, run: LegRun, final: bool = True) -> str:
        """The leg's whole outcome, sealed to the task's owner and signed by the gateway (item 7)."""
        payload = LegOutcomePayload(
            task_id=leg.task_id,
            data_id=leg.data_id,
            party=leg.party,
            outcome=run.outcome,
            detail=run.detail,
            result_text=run.result_text,
            stored=run.stream_bytes is not None,
            attestation=run.attestation,
            final=final,
        )
        return self.ctx.seal_to(
            task.owner,
            MessageKind.task_result,
            leg.task_id,
            leg.data_id,
            payload.model_dump(mode="json"),
            ttl_s=RESULT_TTL_S,
        ).model_dump_json()

    def finish(self, task: Task, leg: Leg, run: LegRun) -> Leg:
        """Record the leg's one outcome; if someone recorded one first, theirs stands."""
        envelope = self.seal_outcome(task, leg, run)
        if self.table.record_outcome(leg.task_id, leg.data_id, run.outcome.value, envelope, run.stream_bytes):
            self.audit.append(
                "leg.outcome",
                SELF,
                task_id=leg.task_id,
                data_id=leg.data_id,
                party=leg.party,
                outcome=run.outcome.value,
                detail=run.detail[:300],
                stored_bytes=run.stream_bytes,
            )
            return replace(
                leg, state="done", outcome=run.outcome.value, envelope_json=envelope, stream_bytes=run.stream_bytes
            )
        return self.table.legs(leg.task_id)[leg.data_id]

    async def run_leg(self, task: Task, leg: Leg, call: RuleCall, timeout_s: float) -> LegRun:
        """Send the leg's data transfer request to its party and take its answer."""
        party = self.ctx.roster[leg.party]
        if not party.endpoint:
            return LegRun(LegOutcome.party_unavailable, f"party {leg.party!r} has no endpoint in the roster")
        assert self.parties is not None, "the gateway app is not running"
        req = DataTransfer(task_id=leg.task_id, data_id=leg.data_id, call=call)

        def envelope() -> bytes:
            """A freshly sealed data transfer request (a resend is a new message, never a replay)."""
            return (
                self.ctx.seal_to(
                    party.name,
                    MessageKind.data_transfer,
                    leg.task_id,
                    leg.data_id,
                    req.model_dump(mode="json"),
                    ttl_s=timeout_s + self.cfg.skew_s,
                )
                .model_dump_json()
                .encode()
            )

        try:
            async with asyncio.timeout(timeout_s):
                async with self.party_slots[party.name]:
                    async with self.parties.post(
                        party.endpoint, "/v1/transfer", envelope, dns_name(party.name, "party")
                    ) as resp:
                        body = await resp.read(self.cfg.max_body_bytes)
        except TimeoutError:
            return LegRun(LegOutcome.timeout, f"party {party.name!r} did not answer within {timeout_s:.1f}s")
        except PartyLinkError as exc:
            return LegRun(
                LegOutcome.party_unavailable, f"party {party.name!r} unreachable: {exc}"[:300], provisional=True
            )
        except EnvelopeError as exc:
            return LegRun(LegOutcome.rejected, f"result from {party.name!r} refused: {exc.reason}")
        if resp.status != 200:
            text = body[:4096].decode(errors="replace")
            return LegRun(
                LegOutcome.party_unavailable if resp.status in TRANSIENT_STATUSES else LegOutcome.rejected,
                f"party {party.name!r} answered {resp.status}: {text[:300]}",
                provisional=resp.status in TRANSIENT_STATUSES,
            )
        try:
            return self.check_result(leg, body)
        except EnvelopeError as exc:
            kind = LegOutcome.decrypt_failed if exc.status == 422 else LegOutcome.rejected
            return LegRun(kind, f"result from {party.name!r} refused: {exc.reason}")
        except ValueError as exc:
            return LegRun(LegOutcome.rejected, f"result from {party.name!r} is not an envelope: {str(exc)[:200]}")

    def check_result(self, leg: Leg, raw: bytes) -> LegRun:
        """Authenticate a party's result envelope; it must come from the leg's own party and carry
        that party's attestation (an inline result is checked against it here; a stored one by the
        initiator, end to end, when it fetches it)."""
        sender, payload = self.ctx.gate.open(
            Envelope.model_validate_json(raw), MessageKind.transfer_result, {"party"}, TransferPayload, check_peer=False
        )  # the TLS server name was checked
        if sender.name != leg.party:
            raise EnvelopeError(403, f"result signed by {sender.name!r} for a leg owned by {leg.party!r}")
        if not payload.ok:
            return LegRun(LegOutcome.rejected, f"party {leg.party!r}: {payload.error}")
        att = payload.attestation
        if att is None:
            raise EnvelopeError(400, f"result from {leg.party!r} carries no attestation")
        verify_attestation(att, self.ctx.roster[leg.party], leg.task_id, leg.data_id)
        if payload.stored:
            if payload.result_text is not None:
                raise EnvelopeError(400, "a stored result with an inline text")
            if att.body.size > self.cfg.max_result_bytes:
                raise EnvelopeError(413, f"stored result of {att.body.size} bytes is over the gateway's cap")
            return LegRun(LegOutcome.result, "", attestation=att, stream_bytes=att.body.size)
        if payload.result_text is None:
            raise EnvelopeError(400, "an inline result without its text")
        data = payload.result_text.encode()
        if hashlib.sha256(data).hexdigest() != att.body.sha256 or len(data) != att.body.size:
            raise EnvelopeError(422, "result text does not match the party's attested digest")
        return LegRun(LegOutcome.result, "", result_text=payload.result_text, attestation=att)

    def provisional(self, task: Task, leg: Leg, run: LegRun) -> SettledLeg:
        """A leg the party has not decided: a sealed, not final outcome until the deadline, then final."""
        if time.time() >= task.deadline_at:
            return SettledLeg(self.finish(task, leg, replace(run, provisional=False)))
        return SettledLeg(leg, self.seal_outcome(task, leg, run, final=False))

    async def dispatch(self, task: Task, leg: Leg, call: RuleCall, timeout_s: float) -> SettledLeg:
        """Journal the leg as dispatched, run it, commit its one outcome (or, if its party did not
        decide it, answer a provisional one). After a crash between the journal entry and the
        outcome the leg is sent again; the party answers a repeated transfer from its own once-only
        record, so the rule runs once."""
        self.table.mark_dispatched(leg.task_id, leg.data_id)
        self.audit.append(
            "leg.dispatch", SELF, task_id=leg.task_id, data_id=leg.data_id, party=leg.party, attempt=leg.dispatches + 1
        )
        self.inflight["legs"] += 1

        async def run_and_record() -> SettledLeg:
            try:
                run = await self.run_leg(task, leg, call, timeout_s)
            except Exception as exc:  # never leave a dispatched leg without its one outcome
                run = LegRun(LegOutcome.rejected, f"gateway error on this leg: {type(exc).__name__}")
            finally:
                self.inflight["legs"] -= 1
            try:
                if run.provisional:
                    return self.provisional(task, leg, run)
                return SettledLeg(self.finish(task, leg, run))
            finally:
                self.pending.pop((leg.task_id, leg.data_id), None)

        job = asyncio.create_task(run_and_record())
        self.pending[(leg.task_id, leg.data_id)] = job
        return await asyncio.shield(job)

    async def settle(self, task: Task, leg: Leg, req: DataReceive) -> SettledLeg:
        """A leg's recorded outcome, running it if it can run; a leg whose party has not reported
        yet waits up to the leg timeout, then answers a provisional `party_unavailable` (sealed,
        not recorded) until the task's deadline makes it final; a leg whose input has not reached
        its party whole answers a provisional outcome too. A leg being run follows that run."""
        if (running := self.pending.get((leg.task_id, leg.data_id))) is not None:
            return await asyncio.shield(running)
        if leg.outcome is None and leg.state == "assigned":
            event = self.reported.setdefault((leg.task_id, leg.data_id), asyncio.Event())
            try:
                await asyncio.wait_for(
                    event.wait(), timeout=min(req.leg_timeout_s, max(0.0, task.deadline_at - time.time()))
                )
            except TimeoutError:
                pass
            finally:
                self.reported.pop((leg.task_id, leg.data_id), None)
            leg = self.table.legs(leg.task_id)[leg.data_id]
            if leg.outcome is None and leg.state == "assigned":
                return self.provisional(
                    task,
                    leg,
                    LegRun(
                        LegOutcome.party_unavailable,
                        f"party {leg.party!r} has not reported an executor for this "
                        "leg (its task creation failed or has not reached the gateway)",
                    ),
                )
        if leg.outcome is None and leg.waits_for_input:
            return self.provisional(
                task,
                leg,
                LegRun(
                    LegOutcome.timeout,
                    f"the leg's input has not reached party {leg.party!r} whole: send it "
                    "(Initiator.send_input) before the task's deadline",
                ),
            )
        if leg.outcome is None:
            if time.time() >= task.deadline_at:
                return SettledLeg(
                    self.finish(task, leg, LegRun(LegOutcome.timeout, "the task's deadline passed before this leg ran"))
                )
            call = RuleCall.model_validate(leg.call)
            timeout_s = min(req.leg_timeout_s, task.deadline_at - time.time())
            return await self.dispatch(task, leg, call, timeout_s)
        return SettledLeg(leg)

    async def sync_audit(self) -> None:
        """The audit log's group commit, once a second while the gateway runs."""
        while True:
            await asyncio.sleep(1.0)
            self.audit.sync()


def relay_of(request: Request) -> Relay:
    """The running gateway's :class:`Relay` (route modules reach it through their request)."""
    relay: Relay = request.app.state.relay
    return relay
