"""Data receive requests: a task's leg outcomes, running the legs that can run (a stored result's
bytes are fetched through the stream port, :mod:`trainmaster.gateway.relay.streams`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

from trainmaster.gateway.models import (
    DataReceive,
    Envelope,
    LegResult,
    MessageKind,
    TaskResult,
)
from trainmaster.gateway.relay.core import relay_of

router = APIRouter()


@router.post("/v1/receive", response_model=TaskResult)
async def receive(request: Request) -> Response:
    relay = relay_of(request)
    requester, req = await relay.open(request, MessageKind.data_receive, {"initiator"}, DataReceive)
    task = relay.owned(req.task_id, requester.name)
    data_ids = list(dict.fromkeys(req.data_ids))
    legs = relay.table.legs(req.task_id)
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
    if (
        relay.inflight["tasks"] >= relay.cfg.max_inflight_tasks
        or relay.task_backlog.get(req.task_id, 0) >= relay.cfg.task_queue_depth
    ):
        raise HTTPException(429, "gateway busy: too many tasks in flight; retry later", headers={"Retry-After": "1"})
    relay.audit.append("data.receive", requester, task_id=req.task_id, data_ids=data_ids)
    relay.inflight["tasks"] += 1
    relay.task_backlog[req.task_id] = relay.task_backlog.get(req.task_id, 0) + 1
    try:
        lock = relay.task_locks.setdefault(req.task_id, asyncio.Lock())
        async with lock:
            legs = relay.table.legs(req.task_id)
            settled = await asyncio.gather(*(relay.settle(task, legs[d], req) for d in data_ids))
    finally:
        relay.inflight["tasks"] -= 1
        relay.task_backlog[req.task_id] -= 1
        if not relay.task_backlog[req.task_id]:
            relay.task_backlog.pop(req.task_id, None)
            relay.task_locks.pop(req.task_id, None)
    out = []
    for data_id, one in zip(data_ids, settled):
        envelope = one.provisional or one.leg.envelope_json
        assert envelope is not None  # every recorded outcome carries its sealed envelope
        out.append(LegResult(data_id=data_id, envelope=Envelope.model_validate_json(envelope)))
    # Serialised here: FastAPI would validate the (already strict) model again on the way out.
    return Response(TaskResult(task_id=req.task_id, legs=out).model_dump_json(), media_type="application/json")
