"""The gateway service (the source's "load server"): the initiator's one door to every party.

It keeps the mapping table, and for a data receive request sends each leg's data transfer request
to the party that reported it, verifies and decrypts the party's result in memory, re-encrypts it
to the initiator and signs it, records the leg's one outcome, and only then answers. A per-task
queue (one request per task at a time, a bounded backlog) and a per-party concurrency limit keep
one slow task or party from blocking others; past the global cap it answers 429.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, HTTPException
from fastapi.responses import Response, StreamingResponse

from trainmaster.gateway.crypto import EnvelopeError, b64e, make_header, seal
from trainmaster.gateway.gate import RESULT_TTL_S
from trainmaster.gateway.models import (
    DataReceive, DataTransfer, Envelope, ExecutorReport, LegOutcome, LegResult, MessageKind, ResultFetch, RuleCall, Strict,
    TaskResult,
)
from trainmaster.gateway.provision import ServiceConfig
from trainmaster.gateway.routing import Leg, LegConflict, MappingTable
from trainmaster.gateway.service import ServiceContext, install_common, mtls_client
from trainmaster.gateway.stream import MEDIA_TYPE as STREAM_MEDIA_TYPE
from trainmaster.gateway.stream import ChunkOpener, ChunkSealer, StreamInfo, aframes, frame


class TransferPayload(Strict):
    """What a party's sealed transfer result decrypts to."""

    ok: bool
    result: dict[str, Any] | None = None
    error: str = ""
    stream: StreamInfo | None = None


@dataclass(frozen=True)
class LegRun:
    """What one leg's transfer came to: its outcome and, for a result, the envelope sealed to the initiator."""

    outcome: LegOutcome
    detail: str = ""
    result_json: str | None = None
    stream_bytes: int | None = None


async def _read_capped(resp: httpx.Response, cap: int) -> bytes:
    """A (non-stream) response body, refused past ``cap`` bytes instead of buffered without bound."""
    buf = bytearray()
    async for data in resp.aiter_bytes():
        buf += data
        if len(buf) > cap:
            raise EnvelopeError(413, f"response body over the {cap}-byte cap")
    return bytes(buf)


def build_gateway_app(cfg: ServiceConfig) -> FastAPI:
    db_url = cfg.db_url or f"sqlite:///{Path(cfg.state_dir).resolve() / 'mapping.db'}"
    ctx = ServiceContext.load(cfg, db_url)
    table = MappingTable(db_url)
    initiator = next(p for p in ctx.roster.values() if p.role == "initiator")
    party_slots = {p.name: asyncio.Semaphore(cfg.party_concurrency) for p in ctx.roster.values() if p.role == "party"}
    task_locks: dict[str, asyncio.Lock] = {}
    task_backlog: dict[str, int] = {}
    inflight = {"tasks": 0, "legs": 0}
    spool_root = Path(cfg.state_dir).resolve() / "results"

    def spool_path(task_id: str, data_id: str) -> Path:
        """Where a streamed result's re-encrypted chunks live (ids match ID_PATTERN: no path tricks)."""
        return spool_root / task_id / f"{data_id}.stream"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.http = mtls_client(cfg, max_connections=cfg.party_concurrency * max(1, len(party_slots)))
        yield
        await app.state.http.aclose()

    app = FastAPI(title="trainmaster gateway", lifespan=lifespan)
    app.state.ctx, app.state.table = ctx, table
    install_common(app, cfg.max_body_bytes)

    @app.post("/v1/executors")
    async def executor_report(env: Envelope) -> dict[str, Any]:
        sender, rep = ctx.gate.open(env, MessageKind.executor_report, {"party"}, ExecutorReport)
        ctx.count(MessageKind.executor_report)
        try:
            table.register(rep.task_id, rep.data_id, sender.name, rep.address, rep.call.model_dump(mode="json"),
                           rep.ready, rep.reason)
        except LegConflict as exc:
            raise HTTPException(409, str(exc)) from exc
        return {"ok": True}

    async def _run_leg(leg: Leg, call: RuleCall, timeout_s: float) -> LegRun:
        party = ctx.roster.get(leg.party or "")
        if party is None or not party.endpoint:
            return LegRun(LegOutcome.party_unavailable, f"party {leg.party!r} has no endpoint in the roster")
        req = DataTransfer(task_id=leg.task_id, data_id=leg.data_id, call=call)
        env = ctx.seal_to(party.name, MessageKind.data_transfer, leg.task_id, leg.data_id, req.model_dump(mode="json"),
                          ttl_s=timeout_s + cfg.skew_s)
        try:
            async with asyncio.timeout(timeout_s):
                async with party_slots[party.name]:
                    async with app.state.http.stream(
                            "POST", f"{party.endpoint}/v1/transfer", content=env.model_dump_json(),
                            headers={"content-type": "application/json"}, timeout=timeout_s) as resp:
                        if resp.status_code != 200:
                            text = (await _read_capped(resp, 4096)).decode(errors="replace")
                            return LegRun(LegOutcome.rejected, f"party {party.name!r} refused ({resp.status_code}): {text[:300]}")
                        if resp.headers.get("content-type", "").startswith(STREAM_MEDIA_TYPE):
                            return await _relay_stream(leg, party.name, resp)
                        return _reseal(leg, party.name, await _read_capped(resp, cfg.max_body_bytes))
        except TimeoutError:
            return LegRun(LegOutcome.timeout, f"party {party.name!r} did not answer within {timeout_s:.1f}s")
        except httpx.TimeoutException:
            return LegRun(LegOutcome.timeout, f"party {party.name!r} did not answer within {timeout_s:.1f}s")
        except httpx.TransportError as exc:
            return LegRun(LegOutcome.party_unavailable, f"party {party.name!r} unreachable: {type(exc).__name__}")
        except EnvelopeError as exc:
            kind = LegOutcome.decrypt_failed if exc.status == 422 else LegOutcome.rejected
            return LegRun(kind, f"result from {party.name!r} refused: {exc.reason}")
        except ValueError as exc:
            return LegRun(LegOutcome.rejected, f"result from {party.name!r} is not an envelope: {str(exc)[:200]}")

    def _open_result(leg: Leg, party: str, raw: bytes) -> TransferPayload:
        """Authenticate a party's (opening) result envelope; it must come from the leg's own party."""
        sender, payload = ctx.gate.open(Envelope.model_validate_json(raw), MessageKind.transfer_result, {"party"},
                                        TransferPayload)
        if sender.name != leg.party:
            raise EnvelopeError(403, f"result signed by {sender.name!r} for a leg owned by {leg.party!r}")
        if not payload.ok:
            raise EnvelopeError(400, f"party {party!r}: {payload.error}")
        return payload

    def _reseal(leg: Leg, party: str, raw: bytes) -> LegRun:
        payload = _open_result(leg, party, raw)
        if payload.stream is not None:
            raise EnvelopeError(400, "a stream opening arrived without its chunks")
        out = ctx.seal_to(initiator.name, MessageKind.task_result, leg.task_id, leg.data_id,
                          {"party": party, "result": payload.result}, ttl_s=RESULT_TTL_S)
        return LegRun(LegOutcome.result, "", out.model_dump_json())

    async def _relay_stream(leg: Leg, party: str, resp: httpx.Response) -> LegRun:
        """Decrypt the party's chunks one at a time and re-encrypt each to the initiator under a fresh
        key, spooling only ciphertext to disk; the plaintext is never held whole. The spool file is
        fsynced before the caller records the outcome (persist before acknowledging)."""
        frames = aframes(resp.aiter_bytes())
        first = await anext(frames, None)
        if first is None:
            raise EnvelopeError(400, "empty stream")
        info = _open_result(leg, party, first).stream
        if info is None:
            raise EnvelopeError(400, "stream without a stream opening")
        opener = ChunkOpener(info, Envelope.model_validate_json(first).header.msg_id, cfg.max_result_bytes)
        out_key = os.urandom(32)
        header = make_header(ctx.me.name, initiator.name, MessageKind.task_result.value, leg.task_id, leg.data_id,
                             RESULT_TTL_S, now=ctx.clock())
        sealer = ChunkSealer(out_key, header.msg_id)
        path = spool_path(leg.task_id, leg.data_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        try:
            with part.open("wb") as fh:
                async for body in frames:
                    plain, last = opener.open(body)
                    fh.write(frame(sealer.seal(plain, last)))
                opener.finish()
                fh.flush()
                await asyncio.to_thread(os.fsync, fh.fileno())
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
        out_info = StreamInfo(key=b64e(out_key), total_bytes=info.total_bytes, sha256=info.sha256,
                              chunk_bytes=info.chunk_bytes)
        out = seal(ctx.me, ctx.roster[initiator.name], header, {"party": party, "result": None, "stream": out_info.model_dump()})
        return LegRun(LegOutcome.result, "", out.model_dump_json(), info.total_bytes)

    async def _dispatch(leg: Leg, call: RuleCall, timeout_s: float) -> Leg:
        """Run one leg and commit its one outcome; returns the finished leg.

        Nothing is written when the leg goes out (a leg without an outcome is simply dispatched
        again by the next data receive request, also after a crash), so the in-flight gauge lives
        in memory: one commit fewer per leg on the hot path.
        """
        inflight["legs"] += 1
        try:
            run = await _run_leg(leg, call, timeout_s)
        except Exception as exc:  # never leave a dispatched leg without its one outcome
            run = LegRun(LegOutcome.rejected, f"gateway error on this leg: {type(exc).__name__}")
        finally:
            inflight["legs"] -= 1
        if table.record_outcome(leg.task_id, leg.data_id, run.outcome.value, run.detail, run.result_json, run.stream_bytes):
            return replace(leg, state="done", outcome=run.outcome.value, detail=run.detail, result_json=run.result_json,
                           stream_bytes=run.stream_bytes)
        return table.legs(leg.task_id)[leg.data_id]  # someone else recorded it first: theirs stands

    @app.post("/v1/receive", response_model=TaskResult)
    async def receive(env: Envelope) -> Response:
        _sender, req = ctx.gate.open(env, MessageKind.data_receive, {"initiator"}, DataReceive)
        ctx.count(MessageKind.data_receive)
        if inflight["tasks"] >= cfg.max_inflight_tasks or task_backlog.get(req.task_id, 0) >= cfg.task_queue_depth:
            raise HTTPException(429, "gateway busy: too many tasks in flight; retry later", headers={"Retry-After": "1"})
        inflight["tasks"] += 1
        task_backlog[req.task_id] = task_backlog.get(req.task_id, 0) + 1
        try:
            lock = task_locks.setdefault(req.task_id, asyncio.Lock())
            async with lock:
                legs = table.legs(req.task_id)
                todo: list[Leg] = []
                for data_id in dict.fromkeys(req.data_ids):
                    leg = legs.get(data_id)
                    if leg is None:
                        table.mark_unrouted(req.task_id, data_id)
                        legs[data_id] = table.legs(req.task_id)[data_id]
                    elif leg.outcome is None:
                        todo.append(leg)
                if todo:
                    done = await asyncio.gather(*(_dispatch(leg, req.calls.get(leg.data_id) or RuleCall.model_validate(leg.call),
                                                            req.leg_timeout_s) for leg in todo))
                    legs.update({leg.data_id: leg for leg in done})
        finally:
            inflight["tasks"] -= 1
            task_backlog[req.task_id] -= 1
            if not task_backlog[req.task_id]:
                task_backlog.pop(req.task_id, None)
                task_locks.pop(req.task_id, None)
        out = []
        for data_id in dict.fromkeys(req.data_ids):
            leg = legs[data_id]
            envelope = Envelope.model_validate_json(leg.result_json) if leg.result_json else None
            out.append(LegResult(data_id=data_id, party=leg.party, outcome=LegOutcome(leg.outcome), detail=leg.detail,
                                 envelope=envelope, stream_bytes=leg.stream_bytes))
        # Serialised here: FastAPI would validate the (already strict) model again on the way out.
        return Response(TaskResult(task_id=req.task_id, legs=out).model_dump_json(), media_type="application/json")

    @app.post("/v1/results")
    async def fetch_result(env: Envelope) -> StreamingResponse:
        """The chunk frames of one streamed result, read from the spool file a block at a time."""
        _sender, req = ctx.gate.open(env, MessageKind.result_fetch, {"initiator"}, ResultFetch)
        ctx.count(MessageKind.result_fetch)
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
    async def health() -> dict[str, Any]:
        return {"name": cfg.name, "role": "gateway", "legs": table.count(), "in_flight_legs": inflight["legs"],
                "in_flight_tasks": inflight["tasks"], "handled": dict(ctx.handled), "rejected": dict(ctx.gate.rejected)}

    return app
