"""Task creation requests (initiators): a per-task isolated executor, reported to the gateway."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from trainmaster.gateway.executors.base import ExecutorStartError
from trainmaster.gateway.models import MessageKind, TaskCreate
from trainmaster.gateway.party.core import LegExecutor, agent_of
from trainmaster.gateway.party.data import resolve_data_file
from trainmaster.gateway.rules.registry import RuleError, validate_call

router = APIRouter()


@router.post("/v1/tasks", status_code=201)
async def create_task(request: Request) -> JSONResponse:
    """Start an isolated executor for (task, data id) and report it to the gateway; past the
    executor cap the leg queues (bounded) and starts when a slot frees."""
    agent = agent_of(request)
    _env, task = await agent.open(request, MessageKind.task_create, {"initiator"}, TaskCreate)
    if task.party != agent.cfg.name:
        raise HTTPException(400, f"task creation request is for party {task.party!r}, not {agent.cfg.name!r}")
    data_file = resolve_data_file(agent.data_dir, task.data_id)
    try:
        validate_call(task.call, agent.cfg.allowed_rules)
    except RuleError as exc:
        raise HTTPException(400, str(exc)) from exc
    key = (task.task_id, task.data_id)
    now = time.time()
    for k in [
        k
        for k, leg in agent.executors.items()
        if now >= leg.deadline or (leg.handle is not None and not leg.released and not leg.handle.alive)
    ]:
        agent.forget(k)
    if key in agent.executors:
        if agent.executors[key].task != task:
            raise HTTPException(
                409,
                f"leg ({task.task_id}, {task.data_id}) was created with another request; "
                "task ids are never reused: choose a new task id",
            )
        known = agent.executors[key]
        state = "queued" if known.handle is None else "pending"
        pending = known.report is not None and not known.report.done()
        return JSONResponse(
            {"task_id": task.task_id, "data_id": task.data_id, "report": state if pending else "done"},
            status_code=202 if pending else 201,
        )
    deadline = time.time() + task.deadline_s
    if agent.slots.locked():  # every slot taken: queue the leg (bounded), never fail it
        queued = sum(1 for leg in agent.executors.values() if leg.handle is None)
        if queued >= agent.cfg.max_queued_legs:
            raise HTTPException(
                503,
                f"party {agent.cfg.name!r} already runs {agent.cfg.max_executors} executors (its cap, max_executors) and "
                f"queues {queued} legs (max_queued_legs); retry later",
                headers={"Retry-After": "5"},
            )
        leg = agent.executors[key] = LegExecutor(task, deadline)
        leg.report = asyncio.create_task(agent.start_queued(key, leg, data_file))
        asyncio.get_running_loop().call_later(task.deadline_s, agent.expire, key, leg)
        return JSONResponse(
            {
                "task_id": task.task_id,
                "data_id": task.data_id,
                "report": "queued",
                "detail": f"all {agent.cfg.max_executors} executor slots are busy; the leg starts when one frees",
            },
            status_code=202,
        )
    await agent.slots.acquire()  # free now: does not wait
    try:
        handle = await agent.start_executor(data_file, task.deadline_s, f"{task.task_id}.{task.data_id}")
    except TimeoutError as exc:
        agent.slots.release()
        await agent.report_once(task, "", ready=False, reason=str(exc))
        raise HTTPException(504, f"executor for task {task.task_id!r} did not come up: {exc}") from exc
    except ExecutorStartError as exc:
        agent.slots.release()
        await agent.report_once(task, "", ready=False, reason=str(exc))
        raise HTTPException(503, f"executor for task {task.task_id!r} could not start: {exc}") from exc
    except BaseException:
        agent.slots.release()
        raise
    leg = agent.executors[key] = LegExecutor(task, deadline, handle, slot=True)
    leg.started.set_result(None)
    asyncio.get_running_loop().call_later(task.deadline_s, agent.expire, key, leg)
    attempt = await agent.report_once(task, handle.address, ready=True)
    if attempt.status == "refused":
        agent.forget(key)
        raise HTTPException(409, attempt.why)
    if attempt.status == "unreachable":
        leg.report = asyncio.create_task(agent.report_until_deadline(key, task, handle.address, deadline))
        return JSONResponse(
            {
                "task_id": task.task_id,
                "data_id": task.data_id,
                "report": "pending",
                "detail": f"{attempt.why}; the party keeps reporting until the task's deadline",
            },
            status_code=202,
        )
    return JSONResponse({"task_id": task.task_id, "data_id": task.data_id, "report": "done"}, status_code=201)
