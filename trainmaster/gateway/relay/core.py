"""The gateway's state and its leg logic: what the route modules call.

A leg is journaled as dispatched, its data transfer request goes to the party, and the party's
result is verified and decrypted in memory and recorded, sealed to the task's owner and signed as
a whole (item 7), before the request answers; a streamed result is relayed cut-through instead
(the leg's live outcome answers as soon as the party's signed opening checks out, the initiator
tails the spool while it is written, and the outcome is recorded when the stream is complete). A
per-task queue (one request per task at a time, a bounded backlog) and a per-party concurrency
limit keep one slow task or party from blocking others.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from pydantic import BaseModel

from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.crypto.chunks import MEDIA_TYPE as STREAM_MEDIA_TYPE
from trainmaster.gateway.crypto.chunks import ChunkOpener, ChunkSealer, StreamInfo, aframes
from trainmaster.gateway.crypto.envelope import EnvelopeError, b64e, verify_attestation
from trainmaster.gateway.crypto.gate import RESULT_TTL_S
from trainmaster.gateway.crypto.tlsid import dns_name
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
from trainmaster.gateway.relay.partylink import PartyLinkError, PartyLinks, PartyResponse
from trainmaster.gateway.relay.spool import LiveSpool

M = TypeVar("M", bound=BaseModel)
SPOOL_SYNC_BYTES = 32 << 20
"""How much of a relayed stream may sit unsynced in the page cache before the relay starts a write-back."""


class TransferPayload(Strict):
    """What a party's sealed transfer result decrypts to."""

    ok: bool
    result_text: str | None = None
    error: str = ""
    stream: StreamInfo | None = None
    attestation: SignedAttestation | None = None


@dataclass(frozen=True)
class LegRun:
    """What one leg's transfer came to: its outcome and the parts the sealed outcome carries."""

    outcome: LegOutcome
    detail: str = ""
    result_text: str | None = None
    stream: StreamInfo | None = None
    attestation: SignedAttestation | None = None
    stream_bytes: int | None = None
    """Set when the result sits in the spool file (served by ``/v1/results``)."""


@dataclass(frozen=True)
class SettledLeg:
    """A leg as a data receive request answers it: its row, and for a leg whose party has not
    reported yet, a provisional sealed outcome (not recorded: ask again before the deadline)."""

    leg: Leg
    provisional: str | None = None


def task_digest(req: TaskRegister) -> str:
    """The idempotency key's body check: same task body, same digest (leg order does not matter)."""
    body = req.model_dump(mode="json")
    body["legs"] = sorted(body["legs"], key=lambda leg: leg["data_id"])
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Relay:
    """One gateway's state: its identity and gate, the mapping table, the links to parties, and
    the legs being run or relayed right now."""

    cfg: ServiceConfig
    ctx: ServiceContext
    table: MappingTable
    party_slots: dict[str, asyncio.Semaphore]
    spool_root: Path
    parties: PartyLinks | None = None
    """Set while the app runs (its lifespan opens and closes the connections)."""
    task_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    task_backlog: dict[str, int] = field(default_factory=dict)
    reported: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=lambda: {"tasks": 0, "legs": 0})
    live: dict[tuple[str, str], LiveSpool] = field(default_factory=dict)
    """Streamed results still being relayed, by (task id, data id): readers tail their spool files."""
    pending: dict[tuple[str, str], tuple[asyncio.Task[Leg], asyncio.Future[LiveSpool]]] = field(default_factory=dict)
    """Legs being run right now (the job, and its live spool once the party's stream is open): a
    second data receive request for one follows the same run instead of starting another (a
    request can outlive the one that started the run, whose client gave up and asked again)."""

    @classmethod
    def load(cls, cfg: ServiceConfig) -> "Relay":
        db_url = cfg.db_url or f"sqlite:///{Path(cfg.state_dir).resolve() / 'mapping.db'}"
        ctx = ServiceContext.load(cfg, db_url)
        party_slots = {
            p.name: asyncio.Semaphore(cfg.party_concurrency) for p in ctx.roster.values() if p.role == "party"
        }
        spool_root = Path(cfg.state_dir).resolve() / "results"
        for part in spool_root.glob("*/*.part"):  # left by a kill -9 mid-stream: the leg has no outcome, it runs again
            part.unlink(missing_ok=True)
        return cls(cfg, ctx, MappingTable(db_url), party_slots, spool_root)

    def spool_path(self, task_id: str, data_id: str) -> Path:
        """Where a streamed result's re-encrypted chunks live (ids match ID_PATTERN: no path tricks)."""
        return self.spool_root / task_id / f"{data_id}.stream"

    async def open(self, request: Request, kind: MessageKind, roles: set[str], model: type[M]) -> tuple[str, M]:
        """The request's envelope through the gate: its sender's name and its payload."""
        env = await read_envelope(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)
        sender, payload = self.ctx.gate.open(env, kind, roles, model, peer=request_peer(request))
        self.ctx.count(kind)
        return sender.name, payload

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
            stream=run.stream.model_dump() if run.stream else None,
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
            return replace(
                leg, state="done", outcome=run.outcome.value, envelope_json=envelope, stream_bytes=run.stream_bytes
            )
        return self.table.legs(leg.task_id)[leg.data_id]

    async def run_leg(
        self, task: Task, leg: Leg, call: RuleCall, timeout_s: float, opened: asyncio.Future[LiveSpool]
    ) -> LegRun:
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
                        if resp.status != 200:
                            text = (await resp.read(4096)).decode(errors="replace")
                            return LegRun(
                                LegOutcome.rejected, f"party {party.name!r} refused ({resp.status}): {text[:300]}"
                            )
                        if resp.content_type.startswith(STREAM_MEDIA_TYPE):
                            return await self.relay_stream(task, leg, resp, opened)
                        return self.check_inline(leg, await resp.read(self.cfg.max_body_bytes))
        except TimeoutError:
            return LegRun(LegOutcome.timeout, f"party {party.name!r} did not answer within {timeout_s:.1f}s")
        except PartyLinkError as exc:
            return LegRun(LegOutcome.party_unavailable, f"party {party.name!r} unreachable: {exc}"[:300])
        except EnvelopeError as exc:
            kind = LegOutcome.decrypt_failed if exc.status == 422 else LegOutcome.rejected
            return LegRun(kind, f"result from {party.name!r} refused: {exc.reason}")
        except ValueError as exc:
            return LegRun(LegOutcome.rejected, f"result from {party.name!r} is not an envelope: {str(exc)[:200]}")

    def open_result(self, leg: Leg, raw: bytes) -> TransferPayload:
        """Authenticate a party's (opening) result envelope; it must come from the leg's own party."""
        sender, payload = self.ctx.gate.open(
            Envelope.model_validate_json(raw), MessageKind.transfer_result, {"party"}, TransferPayload, check_peer=False
        )  # the TLS server name was checked
        if sender.name != leg.party:
            raise EnvelopeError(403, f"result signed by {sender.name!r} for a leg owned by {leg.party!r}")
        if not payload.ok:
            raise EnvelopeError(400, f"party {leg.party!r}: {payload.error}")
        if payload.attestation is None:
            raise EnvelopeError(400, f"result from {leg.party!r} carries no attestation")
        verify_attestation(payload.attestation, self.ctx.roster[leg.party], leg.task_id, leg.data_id)
        return payload

    def check_inline(self, leg: Leg, raw: bytes) -> LegRun:
        payload = self.open_result(leg, raw)
        att = payload.attestation
        assert att is not None
        if payload.stream is not None or payload.result_text is None:
            raise EnvelopeError(400, "an inline result without its text")
        data = payload.result_text.encode()
        if hashlib.sha256(data).hexdigest() != att.body.sha256 or len(data) != att.body.size:
            raise EnvelopeError(422, "result text does not match the party's attested digest")
        return LegRun(LegOutcome.result, "", result_text=payload.result_text, attestation=att)

    async def relay_stream(
        self, task: Task, leg: Leg, resp: PartyResponse, opened: asyncio.Future[LiveSpool]
    ) -> LegRun:
        """Decrypt the party's chunks one at a time and re-encrypt each to the owner under a fresh
        key, spooling only ciphertext to disk; the plaintext is never held whole. Cut-through: as
        soon as the party's signed opening checks out, ``opened`` gets the live spool, so the data
        receive request answers and the initiator tails the spool while the party still uploads.
        The spool file is fsynced before the caller records the outcome (persist before
        acknowledging); only then does the live spool release its final frame."""
        frames = aframes(resp.blocks())
        first = await anext(frames, None)
        if first is None:
            raise EnvelopeError(400, "empty stream")
        payload = self.open_result(leg, first)
        info, att = payload.stream, payload.attestation
        if info is None or att is None:
            raise EnvelopeError(400, "stream without a stream opening")
        if att.body.sha256 != info.sha256 or att.body.size != info.total_bytes:
            raise EnvelopeError(422, "stream opening does not match the party's attested digest")
        # No SHA-256 here: the initiator checks the party's signed digest end to end, and what the
        # gateway must know before it records the outcome (every chunk authentic and in order, the
        # final one seen, the signed length) the chunk layer checks (docs/gateway.md, threat model).
        opener = ChunkOpener(
            info, Envelope.model_validate_json(first).header.msg_id, self.cfg.max_result_bytes, check_digest=False
        )
        plain_buf, sealed_buf = bytearray(info.chunk_bytes), bytearray(opener.max_frame)
        out_key = os.urandom(32)
        stream_id = os.urandom(16).hex()
        sealer = ChunkSealer(out_key, stream_id)
        out_info = StreamInfo(
            key=b64e(out_key),
            total_bytes=info.total_bytes,
            sha256=info.sha256,
            chunk_bytes=info.chunk_bytes,
            stream_id=stream_id,
        )
        run = LegRun(LegOutcome.result, "", stream=out_info, attestation=att, stream_bytes=info.total_bytes)
        path = self.spool_path(leg.task_id, leg.data_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        try:
            with part.open("wb", buffering=0) as fh:
                spool = LiveSpool(part, self.seal_outcome(task, leg, run, final=False))
                self.live[(leg.task_id, leg.data_id)] = spool
                if not opened.done():
                    opened.set_result(spool)
                syncing: asyncio.Future[None] | None = None
                synced = 0
                try:
                    async for body in frames:
                        plain, last = opener.open_into(body, plain_buf)
                        head, sealed = sealer.seal_frame_into(plain, last, sealed_buf)
                        if os.writev(fh.fileno(), (head, sealed)) != len(head) + len(sealed):
                            raise OSError("short write to the spool file")
                        spool.wrote(len(head) + len(sealed), last)
                        if spool.written - synced >= SPOOL_SYNC_BYTES:
                            # Write back as it goes, in a thread beside the relay, so the fsync before
                            # the outcome is recorded finds little left to do (fsyncing 256 MB at the
                            # end took 0.2-0.4 s on the benchmark machine's disk).
                            if syncing is not None:
                                await syncing
                            syncing = asyncio.ensure_future(asyncio.to_thread(os.fdatasync, fh.fileno()))
                            synced = spool.written
                finally:
                    if syncing is not None:  # never close the file under a running write-back
                        await asyncio.gather(syncing, return_exceptions=True)
                opener.finish()
                await asyncio.to_thread(os.fsync, fh.fileno())
            os.replace(part, path)
            spool.path = path
        finally:
            part.unlink(missing_ok=True)
        return run

    async def dispatch(self, task: Task, leg: Leg, call: RuleCall, timeout_s: float) -> SettledLeg:
        """Journal the leg as dispatched, run it, commit its one outcome.

        Returns the finished leg, or, for a streamed result, the leg's live outcome as soon as the
        party's stream is open: the relay goes on in the background and records the outcome when
        the stream is complete. After a crash between the journal entry and the outcome the leg is
        sent again; the party answers a repeated transfer from its own once-only record, so the
        rule runs once.
        """
        self.table.mark_dispatched(leg.task_id, leg.data_id)
        self.inflight["legs"] += 1
        opened: asyncio.Future[LiveSpool] = asyncio.get_running_loop().create_future()

        async def run_and_record() -> Leg:
            try:
                run = await self.run_leg(task, leg, call, timeout_s, opened)
            except Exception as exc:  # never leave a dispatched leg without its one outcome
                run = LegRun(LegOutcome.rejected, f"gateway error on this leg: {type(exc).__name__}")
            finally:
                self.inflight["legs"] -= 1
            done = self.finish(task, leg, run)
            self.pending.pop((leg.task_id, leg.data_id), None)
            spool = self.live.pop((leg.task_id, leg.data_id), None)
            if spool is not None:
                spool.end(done.outcome == LegOutcome.result.value and done.stream_bytes is not None)
            return done

        job = asyncio.create_task(run_and_record())
        self.pending[(leg.task_id, leg.data_id)] = (job, opened)
        return await self.follow(leg, job, opened)

    async def follow(self, leg: Leg, job: asyncio.Task[Leg], opened: asyncio.Future[LiveSpool]) -> SettledLeg:
        """The run's recorded outcome, or its live one as soon as its stream is open."""
        either: set[asyncio.Future[Any]] = {job, opened}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if job.done():
            return SettledLeg(job.result())
        return SettledLeg(leg, opened.result().envelope_json)

    async def settle(self, task: Task, leg: Leg, req: DataReceive) -> SettledLeg:
        """A leg's recorded outcome, running it if it can run; a leg whose party has not reported
        yet waits up to the leg timeout, then answers a provisional `party_unavailable` (sealed,
        not recorded) until the task's deadline makes it final. A leg whose stream is being relayed
        answers its live outcome (not final: the initiator fetches it while it flows); a leg being
        run follows that run."""
        if (running := self.pending.get((leg.task_id, leg.data_id))) is not None:
            return await self.follow(leg, *running)
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
                run = LegRun(
                    LegOutcome.party_unavailable,
                    f"party {leg.party!r} has not reported an executor for this "
                    "leg (its task creation failed or has not reached the gateway)",
                )
                if time.time() >= task.deadline_at:
                    return SettledLeg(self.finish(task, leg, run))
                return SettledLeg(leg, self.seal_outcome(task, leg, run, final=False))
        if leg.outcome is None:
            if time.time() >= task.deadline_at:
                return SettledLeg(
                    self.finish(task, leg, LegRun(LegOutcome.timeout, "the task's deadline passed before this leg ran"))
                )
            call = RuleCall.model_validate(leg.call)
            timeout_s = min(req.leg_timeout_s, task.deadline_at - time.time())
            return await self.dispatch(task, leg, call, timeout_s)
        return SettledLeg(leg)


def relay_of(request: Request) -> Relay:
    """The running gateway's :class:`Relay` (route modules reach it through their request)."""
    relay: Relay = request.app.state.relay
    return relay
