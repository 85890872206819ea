"""The gateway service (the source's "load server"): the initiator's one door to every party.

An initiator first creates its task here (id, legs, which party holds each data id); the task is
its own (item 9) and its id is never reused (item 2). Only the party a leg is assigned to may
report that leg's executor or answer it, which the gateway checks from the connection's TLS
identity and the party's signatures (items 1, 6). For a data receive request it journals each
leg as dispatched, sends the data transfer request to the party, verifies and decrypts the
party's result in memory, and records the leg's one outcome sealed to the task's owner and signed
as a whole (item 7) before answering; a streamed result is relayed cut-through instead (the
leg's live outcome answers as soon as the party's signed opening checks out, the initiator tails
the spool while it is written, and the outcome is recorded when the stream is complete). A
per-task queue (one request per task at a time, a bounded backlog) and a per-party concurrency
limit keep one slow task or party from blocking others; past the global cap it answers 429.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from trainmaster.gateway.crypto import EnvelopeError, b64e, verify_attestation
from trainmaster.gateway.gate import RESULT_TTL_S
from trainmaster.gateway.models import (
    DataReceive,
    DataTransfer,
    Envelope,
    ExecutorReport,
    LegOutcome,
    LegOutcomePayload,
    LegResult,
    MessageKind,
    ResultFetch,
    RuleCall,
    SignedAttestation,
    Strict,
    TaskCancel,
    TaskRegister,
    TaskResult,
)
from trainmaster.gateway.partylink import PartyLinkError, PartyLinks, PartyResponse
from trainmaster.gateway.provision import ServiceConfig
from trainmaster.gateway.routing import Leg, LegConflict, MappingTable, Task, TaskConflict, TaskLimit
from trainmaster.gateway.service import (
    ServiceContext,
    client_ssl_context,
    install_common,
    read_envelope,
    request_peer,
)
from trainmaster.gateway.stream import MEDIA_TYPE as STREAM_MEDIA_TYPE
from trainmaster.gateway.tlsid import dns_name
from trainmaster.gateway.stream import ChunkOpener, ChunkSealer, LiveSpool, StreamInfo, aframes

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


def build_gateway_app(cfg: ServiceConfig) -> FastAPI:
    db_url = cfg.db_url or f"sqlite:///{Path(cfg.state_dir).resolve() / 'mapping.db'}"
    ctx = ServiceContext.load(cfg, db_url)
    table = MappingTable(db_url)
    party_slots = {p.name: asyncio.Semaphore(cfg.party_concurrency) for p in ctx.roster.values() if p.role == "party"}
    task_locks: dict[str, asyncio.Lock] = {}
    task_backlog: dict[str, int] = {}
    reported: dict[tuple[str, str], asyncio.Event] = {}
    inflight = {"tasks": 0, "legs": 0}
    live: dict[tuple[str, str], LiveSpool] = {}
    """Streamed results still being relayed, by (task id, data id): readers tail their spool files."""
    pending: dict[tuple[str, str], tuple[asyncio.Task[Leg], asyncio.Future[LiveSpool]]] = {}
    """Legs being run right now (the job, and its live spool once the party's stream is open): a
    second data receive request for one follows the same run instead of starting another (a
    request can outlive the one that started the run, whose client gave up and asked again)."""
    spool_root = Path(cfg.state_dir).resolve() / "results"
    for part in spool_root.glob("*/*.part"):  # left by a kill -9 mid-stream: the leg has no outcome, it runs again
        part.unlink(missing_ok=True)

    def spool_path(task_id: str, data_id: str) -> Path:
        """Where a streamed result's re-encrypted chunks live (ids match ID_PATTERN: no path tricks)."""
        return spool_root / task_id / f"{data_id}.stream"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.parties = PartyLinks(client_ssl_context(cfg), max_idle=cfg.party_concurrency)
        yield
        await app.state.parties.aclose()

    app = FastAPI(title="trainmaster gateway", lifespan=lifespan)
    app.state.ctx, app.state.table = ctx, table
    install_common(app, cfg.max_body_bytes)

    async def _open(request: Request, kind: MessageKind, roles: set[str], model: type[M]) -> tuple[str, M]:
        env = await read_envelope(request, cfg.max_body_bytes, cfg.body_timeout_s)
        sender, payload = ctx.gate.open(env, kind, roles, model, peer=request_peer(request))
        ctx.count(kind)
        return sender.name, payload

    def _owned(task_id: str, sender: str) -> Task:
        """The task, if ``sender`` created it (item 9): others may neither read nor cancel it."""
        task = table.task(task_id)
        if task is None:
            raise HTTPException(404, f"no task {task_id!r} at this gateway; create it first (POST /v1/tasks)")
        if task.owner != sender:
            raise HTTPException(403, f"task {task_id!r} belongs to another initiator")
        return task

    def _seal_outcome(task: Task, leg: Leg, run: LegRun, final: bool = True) -> str:
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
        return ctx.seal_to(
            task.owner,
            MessageKind.task_result,
            leg.task_id,
            leg.data_id,
            payload.model_dump(mode="json"),
            ttl_s=RESULT_TTL_S,
        ).model_dump_json()

    def _finish(task: Task, leg: Leg, run: LegRun) -> Leg:
        """Record the leg's one outcome; if someone recorded one first, theirs stands."""
        envelope = _seal_outcome(task, leg, run)
        if table.record_outcome(leg.task_id, leg.data_id, run.outcome.value, envelope, run.stream_bytes):
            return replace(
                leg, state="done", outcome=run.outcome.value, envelope_json=envelope, stream_bytes=run.stream_bytes
            )
        return table.legs(leg.task_id)[leg.data_id]

    @app.post("/v1/tasks")
    async def task_register(request: Request) -> JSONResponse:
        sender, req = await _open(request, MessageKind.task_register, {"initiator"}, TaskRegister)
        parties = {leg.party for leg in req.legs}
        unknown = sorted(p for p in parties if p not in party_slots)
        if unknown:
            raise HTTPException(400, f"{unknown} are not parties in the gateway's roster")
        legs = {leg.data_id: (leg.party, leg.call.model_dump(mode="json")) for leg in req.legs}
        if len(legs) != len(req.legs):
            raise HTTPException(400, "a data id appears twice in the task; each data id is one leg")
        try:
            created = table.create_task(
                req.task_id, sender, legs, task_digest(req), req.deadline_s, cfg.max_open_legs_per_party
            )
        except TaskConflict as exc:
            raise HTTPException(409, str(exc)) from exc
        except TaskLimit as exc:
            raise HTTPException(429, str(exc), headers={"Retry-After": "5"}) from exc
        return JSONResponse({"task_id": req.task_id, "created": created}, status_code=201 if created else 200)

    @app.post("/v1/cancel")
    async def task_cancel(request: Request) -> dict[str, Any]:
        sender, req = await _open(request, MessageKind.task_cancel, {"initiator"}, TaskCancel)
        task = _owned(req.task_id, sender)
        cancelled = [
            leg.data_id
            for leg in table.legs(task.task_id).values()
            if leg.outcome is None
            and table.record_outcome(
                task.task_id,
                leg.data_id,
                LegOutcome.cancelled.value,
                _seal_outcome(task, leg, LegRun(LegOutcome.cancelled, "cancelled by its initiator")),
            )
        ]
        return {"task_id": task.task_id, "cancelled": cancelled}

    @app.post("/v1/executors")
    async def executor_report(request: Request) -> dict[str, Any]:
        sender, rep = await _open(request, MessageKind.executor_report, {"party"}, ExecutorReport)
        try:
            leg = table.register(rep.task_id, rep.data_id, sender, rep.address, rep.call.model_dump(mode="json"))
        except LegConflict as exc:
            raise HTTPException(409, str(exc)) from exc
        if not rep.ready:
            task = table.task(rep.task_id)
            assert task is not None  # register() found its leg
            _finish(task, leg, LegRun(LegOutcome.timeout, rep.reason or "executor did not come up"))
        if event := reported.get((rep.task_id, rep.data_id)):
            event.set()
        return {"ok": True}

    async def _run_leg(
        task: Task, leg: Leg, call: RuleCall, timeout_s: float, opened: asyncio.Future[LiveSpool]
    ) -> LegRun:
        party = ctx.roster[leg.party]
        if not party.endpoint:
            return LegRun(LegOutcome.party_unavailable, f"party {leg.party!r} has no endpoint in the roster")
        req = DataTransfer(task_id=leg.task_id, data_id=leg.data_id, call=call)

        def envelope() -> bytes:
            """A freshly sealed data transfer request (a resend is a new message, never a replay)."""
            return (
                ctx.seal_to(
                    party.name,
                    MessageKind.data_transfer,
                    leg.task_id,
                    leg.data_id,
                    req.model_dump(mode="json"),
                    ttl_s=timeout_s + cfg.skew_s,
                )
                .model_dump_json()
                .encode()
            )

        try:
            async with asyncio.timeout(timeout_s):
                async with party_slots[party.name]:
                    async with app.state.parties.post(
                        party.endpoint, "/v1/transfer", envelope, dns_name(party.name, "party")
                    ) as resp:
                        if resp.status != 200:
                            text = (await resp.read(4096)).decode(errors="replace")
                            return LegRun(
                                LegOutcome.rejected, f"party {party.name!r} refused ({resp.status}): {text[:300]}"
                            )
                        if resp.content_type.startswith(STREAM_MEDIA_TYPE):
                            return await _relay_stream(task, leg, resp, opened)
                        return _check_inline(leg, await resp.read(cfg.max_body_bytes))
        except TimeoutError:
            return LegRun(LegOutcome.timeout, f"party {party.name!r} did not answer within {timeout_s:.1f}s")
        except PartyLinkError as exc:
            return LegRun(LegOutcome.party_unavailable, f"party {party.name!r} unreachable: {exc}"[:300])
        except EnvelopeError as exc:
            kind = LegOutcome.decrypt_failed if exc.status == 422 else LegOutcome.rejected
            return LegRun(kind, f"result from {party.name!r} refused: {exc.reason}")
        except ValueError as exc:
            return LegRun(LegOutcome.rejected, f"result from {party.name!r} is not an envelope: {str(exc)[:200]}")

    def _open_result(leg: Leg, raw: bytes) -> TransferPayload:
        """Authenticate a party's (opening) result envelope; it must come from the leg's own party."""
        sender, payload = ctx.gate.open(
            Envelope.model_validate_json(raw), MessageKind.transfer_result, {"party"}, TransferPayload, check_peer=False
        )  # the TLS server name was checked
        if sender.name != leg.party:
            raise EnvelopeError(403, f"result signed by {sender.name!r} for a leg owned by {leg.party!r}")
        if not payload.ok:
            raise EnvelopeError(400, f"party {leg.party!r}: {payload.error}")
        if payload.attestation is None:
            raise EnvelopeError(400, f"result from {leg.party!r} carries no attestation")
        verify_attestation(payload.attestation, ctx.roster[leg.party], leg.task_id, leg.data_id)
        return payload

    def _check_inline(leg: Leg, raw: bytes) -> LegRun:
        payload = _open_result(leg, raw)
        att = payload.attestation
        assert att is not None
        if payload.stream is not None or payload.result_text is None:
            raise EnvelopeError(400, "an inline result without its text")
        data = payload.result_text.encode()
        if hashlib.sha256(data).hexdigest() != att.body.sha256 or len(data) != att.body.size:
            raise EnvelopeError(422, "result text does not match the party's attested digest")
        return LegRun(LegOutcome.result, "", result_text=payload.result_text, attestation=att)

    async def _relay_stream(task: Task, leg: Leg, resp: PartyResponse, opened: asyncio.Future[LiveSpool]) -> LegRun:
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
        payload = _open_result(leg, first)
        info, att = payload.stream, payload.attestation
        if info is None or att is None:
            raise EnvelopeError(400, "stream without a stream opening")
        if att.body.sha256 != info.sha256 or att.body.size != info.total_bytes:
            raise EnvelopeError(422, "stream opening does not match the party's attested digest")
        # No SHA-256 here: the initiator checks the party's signed digest end to end, and what the
        # gateway must know before it records the outcome (every chunk authentic and in order, the
        # final one seen, the signed length) the chunk layer checks (docs/gateway.md, threat model).
        opener = ChunkOpener(
            info, Envelope.model_validate_json(first).header.msg_id, cfg.max_result_bytes, check_digest=False
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
        path = spool_path(leg.task_id, leg.data_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        try:
            with part.open("wb", buffering=0) as fh:
                spool = LiveSpool(part, _seal_outcome(task, leg, run, final=False))
                live[(leg.task_id, leg.data_id)] = spool
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

    async def _dispatch(task: Task, leg: Leg, call: RuleCall, timeout_s: float) -> SettledLeg:
        """Journal the leg as dispatched, run it, commit its one outcome.

        Returns the finished leg, or, for a streamed result, the leg's live outcome as soon as the
        party's stream is open: the relay goes on in the background and records the outcome when
        the stream is complete. After a crash between the journal entry and the outcome the leg is
        sent again; the party answers a repeated transfer from its own once-only record, so the
        rule runs once.
        """
        table.mark_dispatched(leg.task_id, leg.data_id)
        inflight["legs"] += 1
        opened: asyncio.Future[LiveSpool] = asyncio.get_running_loop().create_future()

        async def run_and_record() -> Leg:
            try:
                run = await _run_leg(task, leg, call, timeout_s, opened)
            except Exception as exc:  # never leave a dispatched leg without its one outcome
                run = LegRun(LegOutcome.rejected, f"gateway error on this leg: {type(exc).__name__}")
            finally:
                inflight["legs"] -= 1
            done = _finish(task, leg, run)
            pending.pop((leg.task_id, leg.data_id), None)
            spool = live.pop((leg.task_id, leg.data_id), None)
            if spool is not None:
                spool.end(done.outcome == LegOutcome.result.value and done.stream_bytes is not None)
            return done

        job = asyncio.create_task(run_and_record())
        pending[(leg.task_id, leg.data_id)] = (job, opened)
        return await _follow(leg, job, opened)

    async def _follow(leg: Leg, job: asyncio.Task[Leg], opened: asyncio.Future[LiveSpool]) -> SettledLeg:
        """The run's recorded outcome, or its live one as soon as its stream is open."""
        either: set[asyncio.Future[Any]] = {job, opened}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if job.done():
            return SettledLeg(job.result())
        return SettledLeg(leg, opened.result().envelope_json)

    async def _settle(task: Task, leg: Leg, req: DataReceive) -> SettledLeg:
        """A leg's recorded outcome, running it if it can run; a leg whose party has not reported
        yet waits up to the leg timeout, then answers a provisional `party_unavailable` (sealed,
        not recorded) until the task's deadline makes it final. A leg whose stream is being relayed
        answers its live outcome (not final: the initiator fetches it while it flows); a leg being
        run follows that run."""
        if (running := pending.get((leg.task_id, leg.data_id))) is not None:
            return await _follow(leg, *running)
        if leg.outcome is None and leg.state == "assigned":
            event = reported.setdefault((leg.task_id, leg.data_id), asyncio.Event())
            try:
                await asyncio.wait_for(
                    event.wait(), timeout=min(req.leg_timeout_s, max(0.0, task.deadline_at - time.time()))
                )
            except TimeoutError:
                pass
            finally:
                reported.pop((leg.task_id, leg.data_id), None)
            leg = table.legs(leg.task_id)[leg.data_id]
            if leg.outcome is None and leg.state == "assigned":
                run = LegRun(
                    LegOutcome.party_unavailable,
                    f"party {leg.party!r} has not reported an executor for this "
                    "leg (its task creation failed or has not reached the gateway)",
                )
                if time.time() >= task.deadline_at:
                    return SettledLeg(_finish(task, leg, run))
                return SettledLeg(leg, _seal_outcome(task, leg, run, final=False))
        if leg.outcome is None:
            if time.time() >= task.deadline_at:
                return SettledLeg(
                    _finish(task, leg, LegRun(LegOutcome.timeout, "the task's deadline passed before this leg ran"))
                )
            call = RuleCall.model_validate(leg.call)
            timeout_s = min(req.leg_timeout_s, task.deadline_at - time.time())
            return await _dispatch(task, leg, call, timeout_s)
        return SettledLeg(leg)

    @app.post("/v1/receive", response_model=TaskResult)
    async def receive(request: Request) -> Response:
        sender, req = await _open(request, MessageKind.data_receive, {"initiator"}, DataReceive)
        task = _owned(req.task_id, sender)
        data_ids = list(dict.fromkeys(req.data_ids))
        legs = table.legs(req.task_id)
        missing = [d for d in data_ids if d not in legs]
        if missing:
            raise HTTPException(400, f"data id(s) {missing} are not legs of task {req.task_id!r}")
        changed = [d for d, call in req.calls.items() if d in legs and call.model_dump(mode="json") != legs[d].call]
        if changed:
            raise HTTPException(
                400,
                f"data id(s) {changed}: a leg's rule is fixed when its task is created; "
                "create a new task to run another rule",
            )
        if inflight["tasks"] >= cfg.max_inflight_tasks or task_backlog.get(req.task_id, 0) >= cfg.task_queue_depth:
            raise HTTPException(
                429, "gateway busy: too many tasks in flight; retry later", headers={"Retry-After": "1"}
            )
        inflight["tasks"] += 1
        task_backlog[req.task_id] = task_backlog.get(req.task_id, 0) + 1
        try:
            lock = task_locks.setdefault(req.task_id, asyncio.Lock())
            async with lock:
                legs = table.legs(req.task_id)
                settled = await asyncio.gather(*(_settle(task, legs[d], req) for d in data_ids))
        finally:
            inflight["tasks"] -= 1
            task_backlog[req.task_id] -= 1
            if not task_backlog[req.task_id]:
                task_backlog.pop(req.task_id, None)
                task_locks.pop(req.task_id, None)
        out = []
        for data_id, one in zip(data_ids, settled):
            envelope = one.provisional or one.leg.envelope_json
            assert envelope is not None  # every recorded outcome carries its sealed envelope
            out.append(LegResult(data_id=data_id, envelope=Envelope.model_validate_json(envelope)))
        # Serialised here: FastAPI would validate the (already strict) model again on the way out.
        return Response(TaskResult(task_id=req.task_id, legs=out).model_dump_json(), media_type="application/json")

    @app.post("/v1/results")
    async def fetch_result(request: Request) -> StreamingResponse:
        """The chunk frames of one streamed result: tailing the spool while the relay still runs
        (cut-through), else read from the complete spool file a block at a time."""
        sender, req = await _open(request, MessageKind.result_fetch, {"initiator"}, ResultFetch)
        _owned(req.task_id, sender)
        spool = live.get((req.task_id, req.data_id))
        if spool is not None:
            try:
                fh = spool.open()
            except FileNotFoundError:  # the relay failed and removed its spool; its outcome is being recorded
                raise HTTPException(
                    503,
                    f"the stream of task {req.task_id!r}, data id {req.data_id!r} broke off; "
                    "ask for the leg's outcome again",
                    headers={"Retry-After": "1"},
                ) from None
            return StreamingResponse(spool.tail(fh, cfg.body_timeout_s), media_type=STREAM_MEDIA_TYPE)
        leg = table.legs(req.task_id).get(req.data_id)
        path = spool_path(req.task_id, req.data_id)
        if leg is None or leg.outcome != LegOutcome.result.value or leg.stream_bytes is None or not path.is_file():
            raise HTTPException(404, f"no streamed result for task {req.task_id!r}, data id {req.data_id!r}")

        def blocks() -> Iterator[bytes]:
            with path.open("rb") as fh:
                while block := fh.read(1 << 20):
                    yield block

        return StreamingResponse(blocks(), media_type=STREAM_MEDIA_TYPE)

    @app.get("/v1/health")
    async def health(request: Request) -> dict[str, Any]:
        """Liveness for every member; the counters only for the operator identity (item 8)."""
        out: dict[str, Any] = {"name": cfg.name, "role": "gateway", "ok": True}
        peer = request_peer(request)
        if peer is not None and peer.role == "operator":
            out.update(
                legs=table.count(),
                in_flight_legs=inflight["legs"],
                in_flight_tasks=inflight["tasks"],
                handled=dict(ctx.handled),
                rejected=dict(ctx.gate.rejected),
            )
        return out

    return app
