"""Data transfer requests (the gateway): run the leg's rule once, answer its sealed result."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from trainmaster.gateway.executors.base import ExecutorDied, ExecutorStartError
from trainmaster.gateway.models import DataTransfer, MessageKind
from trainmaster.gateway.party.core import agent_of

router = APIRouter()


@router.post("/v1/transfer")
async def transfer(request: Request) -> Any:
    """Run the leg's rule once (a repeated transfer is answered from its record) and answer its
    result sealed to the gateway: inline, or as a stream for a large one."""
    agent = agent_of(request)
    env, req = await agent.open(request, MessageKind.data_transfer, {"gateway"}, DataTransfer)
    key = (req.task_id, req.data_id)
    leg = agent.executors.get(key)
    if leg is None:
        raise HTTPException(404, f"no live executor for task {req.task_id!r}, data id {req.data_id!r}")
    if req.call != leg.task.call:
        raise HTTPException(400, "the transfer names another rule call than the leg was created with")
    timeout_s = max(1.0, env.header.expires_at - agent.ctx.clock())
    if not leg.started.done():  # queued for an executor slot: wait for it, within the request's life
        try:
            await asyncio.wait_for(asyncio.shield(leg.started), timeout=timeout_s)
        except TimeoutError as exc:
            if leg.started.done():  # the executor's own start timed out
                raise HTTPException(503, f"executor for task {req.task_id!r} did not come up: {exc}") from exc
            raise HTTPException(
                503, f"leg ({req.task_id}, {req.data_id}) is still queued for an executor slot; retry later"
            ) from None
        except (OSError, ExecutorStartError) as exc:
            raise HTTPException(503, f"executor for task {req.task_id!r} could not start: {exc}") from exc
    run = agent.runs.get(key)
    if run is None and not leg.running:
        raise HTTPException(404, f"no live executor for task {req.task_id!r}, data id {req.data_id!r}")
    if run is None:  # the first delivery runs the rule; a repeated one waits for (or reads) its record
        timeout_s = max(1.0, env.header.expires_at - agent.ctx.clock())
        run = agent.runs[key] = asyncio.ensure_future(agent.run_once(key, req, leg, timeout_s))
    try:
        record = await asyncio.shield(run)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
        agent.runs.pop(key, None)  # the executor failed: nothing was released, a retry may run it again
        why = str(exc) if isinstance(exc, ExecutorDied) else type(exc).__name__
        raise HTTPException(503, f"executor for task {req.task_id!r} failed: {why}") from exc
    if not leg.released:  # its rule ran: the executor's slot goes to the next queued leg now
        agent.release(leg)
    if not record.ok:
        return agent.ctx.seal_to(
            agent.gateway.name,
            MessageKind.transfer_result,
            req.task_id,
            req.data_id,
            {"ok": False, "error": record.error},
        )
    if record.data is None:
        return agent.stream(req, record)
    payload = {
        "ok": True,
        "result_text": record.data.decode(),
        "error": "",
        "attestation": agent.attestation(req, record),
    }
    return agent.ctx.seal_to(agent.gateway.name, MessageKind.transfer_result, req.task_id, req.data_id, payload)
