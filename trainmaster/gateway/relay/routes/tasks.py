"""Task creation and cancellation (initiators) and executor reports (parties)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from trainmaster.gateway.models import ExecutorReport, LegOutcome, MessageKind, TaskCancel, TaskRegister
from trainmaster.gateway.relay.core import LegRun, relay_of, task_digest
from trainmaster.gateway.relay.mapping import LegConflict, TaskConflict, TaskLimit

router = APIRouter()


@router.post("/v1/tasks")
async def task_register(request: Request) -> JSONResponse:
    """Create a task (its owner is the sender); the same task sent again is an idempotent retry."""
    relay = relay_of(request)
    requester, req = await relay.open(request, MessageKind.task_register, {"initiator"}, TaskRegister)
    sender = requester.name
    parties = {leg.party for leg in req.legs}
    unknown = sorted(p for p in parties if p not in relay.party_slots)
    if unknown:
        raise HTTPException(400, f"{unknown} are not parties in the gateway's roster")
    legs = {
        leg.data_id: (
            leg.party,
            leg.call.model_dump(mode="json"),
            leg.input.model_dump(mode="json") if leg.input is not None else None,
        )
        for leg in req.legs
    }
    too_big = [leg.data_id for leg in req.legs if leg.input is not None and leg.input.size > relay.cfg.max_input_bytes]
    if too_big:
        raise HTTPException(
            413, f"leg input(s) of {too_big} are over the gateway's {relay.cfg.max_input_bytes}-byte cap"
        )
    if len(legs) != len(req.legs):
        raise HTTPException(400, "a data id appears twice in the task; each data id is one leg")
    try:
        created, task = relay.table.create_task(
            req.task_id, sender, legs, task_digest(req), req.deadline_s, relay.cfg.max_open_legs_per_party, req.run_id
        )
    except TaskConflict as exc:
        raise HTTPException(409, str(exc)) from exc
    except TaskLimit as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": "5"}) from exc
    relay.audit.append(
        "task.register",
        requester,
        task_id=req.task_id,
        created=created,
        legs={leg.data_id: {"party": leg.party, "rule": leg.call.rule} for leg in req.legs},
    )
    return JSONResponse(
        {
            "task_id": req.task_id,
            "created": created,
            "created_at": task.created_at,
            "same_run": created or (req.run_id is not None and req.run_id == task.run_id),
        },
        status_code=201 if created else 200,
    )


@router.post("/v1/cancel")
async def task_cancel(request: Request) -> dict[str, Any]:
    """Finish the open legs of a task the sender owns as ``cancelled``."""
    relay = relay_of(request)
    requester, req = await relay.open(request, MessageKind.task_cancel, {"initiator"}, TaskCancel)
    task = relay.owned(req.task_id, requester.name)
    cancelled = [
        leg.data_id
        for leg in relay.table.legs(task.task_id).values()
        if leg.outcome is None
        and relay.table.record_outcome(
            task.task_id,
            leg.data_id,
            LegOutcome.cancelled.value,
            relay.seal_outcome(task, leg, LegRun(LegOutcome.cancelled, "cancelled by its initiator")),
        )
    ]
    relay.audit.append("task.cancel", requester, task_id=task.task_id, cancelled=cancelled)
    return {"task_id": task.task_id, "cancelled": cancelled}


@router.post("/v1/executors")
async def executor_report(request: Request) -> dict[str, Any]:
    """A party says where a leg's executor is (only the leg's own party may), or that it failed."""
    relay = relay_of(request)
    requester, rep = await relay.open(request, MessageKind.executor_report, {"party"}, ExecutorReport)
    try:
        leg = relay.table.register(
            rep.task_id, rep.data_id, requester.name, rep.address, rep.call.model_dump(mode="json")
        )
    except LegConflict as exc:
        raise HTTPException(409, str(exc)) from exc
    relay.audit.append(
        "executor.report", requester, task_id=rep.task_id, data_id=rep.data_id, ready=rep.ready, detail=rep.reason
    )
    if not rep.ready:
        task = relay.table.task(rep.task_id)
        assert task is not None  # register() found its leg
        relay.finish(task, leg, LegRun(LegOutcome.timeout, rep.reason or "executor did not come up"))
    if event := relay.reported.get((rep.task_id, rep.data_id)):
        event.set()
    return {"ok": True}
