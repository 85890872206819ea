"""Task creation requests (initiators): the leg recorded, a per-task isolated executor started
and reported to the gateway."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from trainmaster.gateway.executors.base import ExecutorStartError
from trainmaster.gateway.models import MessageKind, TaskCreate
from trainmaster.gateway.party.core import LegExecutor, agent_of
from trainmaster.gateway.party.data import resolve_data_file
from trainmaster.gateway.party.records import LegExists
from trainmaster.gateway.rules.registry import REGISTRY, RuleError, validate_call

router = APIRouter()


@router.post("/v1/tasks", status_code=201)
async def create_task(request: Request) -> JSONResponse:
    """Record the leg, start an isolated executor for it and report it to the gateway; past the
    executor cap the leg queues (bounded) and starts when a slot frees; an executor that does not
    come up is started again in the background until the task's deadline (202, report pending).
    The same request again is an idempotent retry."""
    agent = agent_of(request)
    cfg = agent.cfg
    _env, requester, task = await agent.open(request, MessageKind.task_create, {"initiator"}, TaskCreate)
    if task.party != cfg.name:
        raise HTTPException(400, f"task creation request is for party {task.party!r}, not {cfg.name!r}")
    data_file = resolve_data_file(agent.data_dir, task.data_id)
    try:
        validate_call(task.call, cfg.allowed_rules)
    except RuleError as exc:
        raise HTTPException(400, str(exc)) from exc
    needs_input = REGISTRY[task.call.rule].needs_input
    if needs_input and task.input is None:
        raise HTTPException(400, f"rule {task.call.rule!r} reads an input: the leg must declare one (size, sha256)")
    if task.input is not None and not needs_input:
        raise HTTPException(400, f"rule {task.call.rule!r} takes no input; the leg declares one")
    if task.input is not None and task.input.size > cfg.max_input_bytes:
        raise HTTPException(
            413, f"the leg's input of {task.input.size} bytes is over this party's {cfg.max_input_bytes}-byte cap"
        )
    key = (task.task_id, task.data_id)
    now = time.time()
    for k in [
        k
        for k, leg in agent.executors.items()
        if now >= leg.deadline or (leg.handle is not None and not leg.released and not leg.handle.alive)
    ]:
        agent.drop_executor(k)
    try:
        new, record = agent.records.create(task, requester.name, now + task.deadline_s)
    except LegExists as exc:
        raise HTTPException(409, str(exc)) from exc
    if not new and record.state == "start_failed":
        raise HTTPException(
            503,
            f"executor for task {task.task_id!r} could not start: {record.error}; the party is reporting it to the "
            "gateway, after which the leg may be created again",
            headers={"Retry-After": "5"},
        )
    if not new:
        known = agent.executors.get(key)
        pending = known is not None and known.report is not None and not known.report.done()
        state = "queued" if known is not None and known.handle is None else "pending"
        return JSONResponse(
            {"task_id": task.task_id, "data_id": task.data_id, "report": state if pending else "done"},
            status_code=202 if pending else 201,
        )
    agent.audit.append(
        "task.create",
        requester,
        task_id=task.task_id,
        data_id=task.data_id,
        rule=task.call.rule,
        params_sha256=_digest(task),
        input_size=task.input.size if task.input else None,
    )
    if agent.slots.locked():  # every slot taken: queue the leg (bounded), never fail it
        queued = sum(1 for leg in agent.executors.values() if leg.handle is None)
        if queued >= cfg.max_queued_legs:
            agent.forget(key)
            raise HTTPException(
                503,
                f"party {cfg.name!r} already runs {cfg.max_executors} executors (its cap, max_executors) and "
                f"queues {queued} legs (max_queued_legs); retry later",
                headers={"Retry-After": "5"},
            )
        agent.schedule(record)
        return JSONResponse(
            {
                "task_id": task.task_id,
                "data_id": task.data_id,
                "report": "queued",
                "detail": f"all {cfg.max_executors} executor slots are busy; the leg starts when one frees",
            },
            status_code=202,
        )
    await agent.slots.acquire()  # free now: does not wait
    leg = agent.executors[key] = LegExecutor(task, record.deadline_at, slot=True)
    asyncio.get_running_loop().call_later(task.deadline_s, agent.expire, key, leg)
    try:
        handle = await agent.start_attempt(leg, data_file)
    except (TimeoutError, ExecutorStartError) as exc:  # a starved machine, a transient sandbox error
        leg.last_error = str(exc) or type(exc).__name__
        leg.report = agent.spawn(agent.start_queued(key, leg, data_file))
        return JSONResponse(
            {
                "task_id": task.task_id,
                "data_id": task.data_id,
                "report": "pending",
                "detail": f"executor did not come up ({leg.last_error}); the party retries with backoff "
                "until the task's deadline",
            },
            status_code=202,
        )
    except BaseException:
        agent.drop_executor(key)
        raise
    leg.handle = handle
    leg.started.set_result(None)
    attempt = await agent.report_once(task, handle.address, ready=True)
    if attempt.status == "refused":
        agent.refused(key)
        raise HTTPException(409, attempt.why)
    if attempt.status == "unreachable":
        leg.report = agent.spawn(agent.report_until_deadline(key, task, handle.address, record.deadline_at))
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


def _digest(task: TaskCreate) -> str:
    """The rule's parameters, as the audit log keeps them: a digest (they may hold a model's weights)."""
    import hashlib

    return hashlib.sha256(task.call.model_dump_json().encode()).hexdigest()
