"""Data receive requests (a task's leg outcomes, running legs that can run) and the chunk frames
of a streamed result."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response, StreamingResponse

from trainmaster.gateway.crypto.chunks import MEDIA_TYPE as STREAM_MEDIA_TYPE
from trainmaster.gateway.models import (
    DataReceive,
    Envelope,
    LegOutcome,
    LegResult,
    MessageKind,
    ResultFetch,
    TaskResult,
)
from trainmaster.gateway.relay.core import relay_of

router = APIRouter()


@router.post("/v1/receive", response_model=TaskResult)
async def receive(request: Request) -> Response:
    relay = relay_of(request)
    sender, req = await relay.open(request, MessageKind.data_receive, {"initiator"}, DataReceive)
    task = relay.owned(req.task_id, sender)
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


@router.post("/v1/results")
async def fetch_result(request: Request) -> StreamingResponse:
    """The chunk frames of one streamed result: tailing the spool while the relay still runs
    (cut-through), else read from the complete spool file a block at a time."""
    relay = relay_of(request)
    sender, req = await relay.open(request, MessageKind.result_fetch, {"initiator"}, ResultFetch)
    relay.owned(req.task_id, sender)
    spool = relay.live.get((req.task_id, req.data_id))
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
        return StreamingResponse(spool.tail(fh, relay.cfg.body_timeout_s), media_type=STREAM_MEDIA_TYPE)
    leg = relay.table.legs(req.task_id).get(req.data_id)
    path = relay.spool_path(req.task_id, req.data_id)
    if leg is None or leg.outcome != LegOutcome.result.value or leg.stream_bytes is None or not path.is_file():
        raise HTTPException(404, f"no streamed result for task {req.task_id!r}, data id {req.data_id!r}")

    def blocks() -> Iterator[bytes]:
        with path.open("rb") as fh:
            while block := fh.read(1 << 20):
                yield block

    return StreamingResponse(blocks(), media_type=STREAM_MEDIA_TYPE)
