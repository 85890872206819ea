"""The gateway service (the source's "load server"): the initiator's one door to every party.

It keeps the mapping table, and for a data receive request sends each leg's data transfer request
to the party that reported it, verifies and decrypts the party's result in memory, re-encrypts it
to the initiator and signs it, records the leg's one outcome, and only then answers. A per-task
queue (one request per task at a time, a bounded backlog) and a per-party concurrency limit keep
one slow task or party from blocking others; past the global cap it answers 429.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, HTTPException

from trainmaster.gateway.crypto import EnvelopeError
from trainmaster.gateway.gate import RESULT_TTL_S
from trainmaster.gateway.models import (
    DataReceive, DataTransfer, Envelope, ExecutorReport, LegOutcome, LegResult, MessageKind, RuleCall, Strict, TaskResult,
)
from trainmaster.gateway.provision import ServiceConfig
from trainmaster.gateway.routing import Leg, LegConflict, MappingTable
from trainmaster.gateway.service import ServiceContext, install_common, mtls_client


class TransferPayload(Strict):
    """What a party's sealed transfer result decrypts to."""

    ok: bool
    result: dict[str, Any] | None = None
    error: str = ""


def build_gateway_app(cfg: ServiceConfig) -> FastAPI:
    db_url = cfg.db_url or f"sqlite:///{Path(cfg.state_dir).resolve() / 'mapping.db'}"
    ctx = ServiceContext.load(cfg, db_url)
    table = MappingTable(db_url)
    initiator = next(p for p in ctx.roster.values() if p.role == "initiator")
    party_slots = {p.name: asyncio.Semaphore(cfg.party_concurrency) for p in ctx.roster.values() if p.role == "party"}
    task_locks: dict[str, asyncio.Lock] = {}
    task_backlog: dict[str, int] = {}
    inflight = {"tasks": 0}

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

    async def _run_leg(leg: Leg, call: RuleCall, timeout_s: float) -> tuple[LegOutcome, str, str | None]:
        party = ctx.roster.get(leg.party or "")
        if party is None or not party.endpoint:
            return LegOutcome.party_unavailable, f"party {leg.party!r} has no endpoint in the roster", None
        req = DataTransfer(task_id=leg.task_id, data_id=leg.data_id, call=call)
        env = ctx.seal_to(party.name, MessageKind.data_transfer, leg.task_id, leg.data_id, req.model_dump(mode="json"),
                          ttl_s=timeout_s + cfg.skew_s)
        try:
            async with asyncio.timeout(timeout_s):
                async with party_slots[party.name]:
                    resp = await app.state.http.post(f"{party.endpoint}/v1/transfer", content=env.model_dump_json(),
                                                     headers={"content-type": "application/json"}, timeout=timeout_s)
        except TimeoutError:
            return LegOutcome.timeout, f"party {party.name!r} did not answer within {timeout_s:.1f}s", None
        except httpx.TimeoutException:
            return LegOutcome.timeout, f"party {party.name!r} did not answer within {timeout_s:.1f}s", None
        except httpx.TransportError as exc:
            return LegOutcome.party_unavailable, f"party {party.name!r} unreachable: {type(exc).__name__}", None
        if resp.status_code != 200:
            return LegOutcome.rejected, f"party {party.name!r} refused ({resp.status_code}): {resp.text[:300]}", None
        try:
            result_env = Envelope.model_validate_json(resp.content)
            sender, payload = ctx.gate.open(result_env, MessageKind.transfer_result, {"party"}, TransferPayload)
        except EnvelopeError as exc:
            kind = LegOutcome.decrypt_failed if exc.status == 422 else LegOutcome.rejected
            return kind, f"result from {party.name!r} refused: {exc.reason}", None
        except ValueError as exc:
            return LegOutcome.rejected, f"result from {party.name!r} is not an envelope: {str(exc)[:200]}", None
        if sender.name != leg.party:
            return LegOutcome.rejected, f"result signed by {sender.name!r} for a leg owned by {leg.party!r}", None
        if not payload.ok:
            return LegOutcome.rejected, f"party {party.name!r}: {payload.error}", None
        out = ctx.seal_to(initiator.name, MessageKind.task_result, leg.task_id, leg.data_id,
                          {"party": party.name, "result": payload.result}, ttl_s=RESULT_TTL_S)
        return LegOutcome.result, "", out.model_dump_json()

    async def _dispatch(leg: Leg, call: RuleCall, timeout_s: float) -> None:
        table.mark_dispatched(leg.task_id, leg.data_id)
        try:
            outcome, detail, result_json = await _run_leg(leg, call, timeout_s)
        except Exception as exc:  # never leave a dispatched leg without its one outcome
            outcome, detail, result_json = LegOutcome.rejected, f"gateway error on this leg: {type(exc).__name__}", None
        table.record_outcome(leg.task_id, leg.data_id, outcome.value, detail, result_json)

    @app.post("/v1/receive")
    async def receive(env: Envelope) -> TaskResult:
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
                jobs = []
                for data_id in dict.fromkeys(req.data_ids):
                    leg = legs.get(data_id)
                    if leg is None:
                        table.mark_unrouted(req.task_id, data_id)
                    elif leg.outcome is None:
                        call = req.calls.get(data_id) or RuleCall.model_validate(leg.call)
                        jobs.append(_dispatch(leg, call, req.leg_timeout_s))
                await asyncio.gather(*jobs)
                legs = table.legs(req.task_id)
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
                                 envelope=envelope))
        return TaskResult(task_id=req.task_id, legs=out)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"name": cfg.name, "role": "gateway", "legs": table.count(), "in_flight_legs": table.in_flight(),
                "in_flight_tasks": inflight["tasks"], "handled": dict(ctx.handled), "rejected": dict(ctx.gate.rejected)}

    return app
