"""What users ask of queues with quota: usage, waiting jobs, and why one job is pending.

Read from the store as the controller sees it (:mod:`trainmaster.controller.quota`): the queues'
rows and the admitted jobs that hold quota. Used by ``trainmaster queue list/show``,
``trainmaster job explain``, their REST routes and the dashboard.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Text, func, select, type_coerce
from sqlalchemy.orm import Session

from trainmaster.controller.admission import gang_demand
from trainmaster.controller.quota import RESOURCES, Holder, QueueQuota, QuotaBook, ResourceQuota, amount, job_demand
from trainmaster.spec.model import Job
from trainmaster.spec.states import JOB_TERMINAL
from trainmaster.store import queues as queue_store
from trainmaster.store import repository as repo
from trainmaster.store.models import JobRow, QueueRow

ENDED = [s.value for s in JOB_TERMINAL]
WAITING_SHOWN = 100  # waiting jobs listed by `queue show`


def queue_quota(row: QueueRow) -> QueueQuota:
    resources = {
        r: ResourceQuota(float(q["nominal"]), q.get("borrowingLimit"), q.get("lendingLimit"))
        for r, q in (row.quota or {}).items()
        if r in RESOURCES and isinstance(q, dict)
    }
    return QueueQuota(row.name, resources, row.cohort, row.weight)


def queue_quotas(session: Session) -> dict[str, QueueQuota]:
    return {row.name: queue_quota(row) for row in queue_store.list_queues(session)}


def _holders(session: Session, queues: dict[str, QueueQuota]) -> list[Holder]:
    if not queues:
        return []
    rows = session.execute(
        select(JobRow.id, JobRow.name, JobRow.queue, JobRow.priority, type_coerce(JobRow.spec, Text)).where(
            JobRow.admitted.is_(True), JobRow.state.not_in(ENDED), JobRow.queue.in_(list(queues))
        )
    ).all()
    return [
        Holder(job_id, name, queue, priority, job_demand(Job.model_validate(json.loads(text))))
        for job_id, name, queue, priority, text in rows
    ]


def book(session: Session) -> QuotaBook:
    queues = queue_quotas(session)
    return QuotaBook(queues, {h.id: h for h in _holders(session, queues)})


def _waiting(session: Session, queue: str) -> list[tuple[int, str, int, str, str]]:
    """A queue's waiting jobs in its order (priority, then age): id, name, priority, reason, message."""
    return [
        tuple(r)  # type: ignore[misc]
        for r in session.execute(
            select(JobRow.id, JobRow.name, JobRow.priority, JobRow.reason, JobRow.message)
            .where(JobRow.queue == queue, JobRow.admitted.is_(False), JobRow.state.not_in(ENDED))
            .order_by(JobRow.priority.desc(), JobRow.created_at, JobRow.id)
        )
    ]


def _usage(quotas: QuotaBook, name: str) -> dict[str, Any]:
    quota = quotas.queues[name]
    return {
        r: {
            "nominal": rq.nominal,
            "borrowingLimit": rq.borrowing_limit,
            "lendingLimit": rq.lending_limit,
            "used": quotas.usage[name][r],
            "borrowed": quotas.borrowed(name, r),
            "shown": f"{amount(r, quotas.usage[name][r])} of {amount(r, rq.nominal)}",
        }
        for r, rq in quota.resources.items()
    }


def queue_views(session: Session) -> list[dict[str, Any]]:
    """Every queue with quota: its definition, usage, borrowing share, admitted and waiting counts."""
    quotas = book(session)
    admitted: dict[str, int] = {}
    for holder in quotas.holders.values():
        admitted[holder.queue] = admitted.get(holder.queue, 0) + 1
    rows = queue_store.list_queues(session)
    waiting = dict(
        session.execute(
            select(JobRow.queue, func.count(JobRow.id))
            .where(JobRow.admitted.is_(False), JobRow.state.not_in(ENDED), JobRow.queue.in_([r.name for r in rows]))
            .group_by(JobRow.queue)
        ).all()
    )
    return [
        {
            **queue_store.queue_document(row),
            "usage": _usage(quotas, row.name),
            "share": _finite(quotas.share(row.name)),
            "admitted": admitted.get(row.name, 0),
            "waiting": waiting.get(row.name, 0),
        }
        for row in rows
    ]


def queue_view(session: Session, name: str) -> dict[str, Any]:
    """One queue: as in :func:`queue_views`, with its admitted jobs and first waiting jobs."""
    row = queue_store.get_queue(session, name)
    quotas = book(session)
    waiting = _waiting(session, name)
    held = sorted((h for h in quotas.holders.values() if h.queue == name), key=lambda h: h.id)
    return {
        **queue_store.queue_document(row),
        "usage": _usage(quotas, name),
        "share": _finite(quotas.share(name)),
        "cohortQueues": [m for m in quotas.members(name) if m != name] if row.cohort else [],
        "admitted": len(held),
        "admittedJobs": [{"id": h.id, "name": h.name, "priority": h.priority} for h in held],
        "waiting": len(waiting),
        "waitingJobs": [
            {"position": i + 1, "id": j, "name": n, "priority": p, "reason": reason, "message": message}
            for i, (j, n, p, reason, message) in enumerate(waiting[:WAITING_SHOWN])
        ],
    }


def explain(session: Session, ref: str | int) -> dict[str, Any]:
    """Why a job is not running: its state and reason, which quota or capacity blocks it and by
    how much, and its position among its queue's waiting jobs (1: next)."""
    job = repo.find_job(session, ref)
    spec = Job.model_validate(job.spec)
    out: dict[str, Any] = {
        "id": job.id,
        "name": job.name,
        "queue": job.queue,
        "priority": job.priority,
        "state": job.state,
        "reason": job.reason,
        "message": job.message,
        "admitted": job.admitted,
        "pending": not job.admitted and job.state not in ENDED,
        "position": None,
        "waitingInQueue": None,
        "demand": {r: v for r, v in job_demand(spec).items() if v},
        "gang": {r: v for r, v in zip(RESOURCES, _gang(spec)) if v},
        "blocking": [],
        "quota": None,
    }
    if not out["pending"]:
        out["summary"] = f"job {job.name} is {job.state}" + (" (admitted)" if job.admitted else "")
        return out
    waiting = _waiting(session, job.queue)
    ids = [w[0] for w in waiting]
    out["position"] = ids.index(job.id) + 1 if job.id in ids else None
    out["waitingInQueue"] = len(ids)
    quotas = book(session)
    if quotas.governs(job.queue):
        demand = job_demand(spec)
        never = quotas.never_fits(job.queue, demand)
        blocking = never or quotas.shortfalls(job.queue, demand)
        out["blocking"] = [s.to_dict() for s in blocking]
        out["quota"] = {
            "queue": job.queue,
            "cohort": quotas.queues[job.queue].cohort,
            "usage": _usage(quotas, job.queue),
        }
    ahead = (out["position"] or 1) - 1
    where = f"position {out['position']} of {out['waitingInQueue']} waiting in queue '{job.queue}'"
    if out["blocking"]:
        what = "; ".join(str(b["message"]) for b in out["blocking"])
        out["summary"] = f"waiting for quota of queue '{job.queue}': {what}; {where}"
    elif job.reason:
        out["summary"] = f"{job.reason}: {job.message}; {where}" if job.message else f"{job.reason}; {where}"
    else:
        out["summary"] = f"not yet looked at by the controller; {where}"
    out["ahead"] = ahead
    return out


def _gang(spec: Job) -> tuple[float, float, float]:
    demand = gang_demand(spec)
    return demand.cpu, float(demand.memory), float(demand.gpu)


def _finite(value: float) -> float | None:
    return None if value == float("inf") else value
