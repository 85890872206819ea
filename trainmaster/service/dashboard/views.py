"""What the dashboard's pages show, read from the store as plain data (no ORM objects leave)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from trainmaster.store import repository as repo
from trainmaster.store.listing import JobFilter
from trainmaster.store.models import JobRow, MetricRow, RoleRow
from trainmaster.store.ownership import owner_alive

PAGE_SIZE = 100
INSTANCES_SHOWN = 500  # rows of a job page's instance table; the REST status pages through all
LOG_TAIL = 64 * 1024  # bytes of a log a page starts with; older lines are in the download
STATES = ("pending", "starting", "running", "succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class RoleCounts:
    name: str
    replicas: int
    state: str
    counts: str  # "2 running, 1 pending"


@dataclass(frozen=True)
class JobLine:
    id: int
    name: str
    framework: str
    state: str
    reason: str
    age: str
    queue: str
    priority: int
    roles: list[RoleCounts]


@dataclass(frozen=True)
class JobList:
    jobs: list[JobLine]
    total: int
    page: int
    pages: int


@dataclass
class InstanceLine:
    label: str
    role: str
    index: int
    state: str
    attempt: int
    restarts: int
    host: str
    address: str
    pid: int | None
    exit_code: int | None
    reason: str
    message: str
    cpu_seconds: float | None
    peak_rss: int | None
    progress: float | None  # 0..1 where the role reported a total
    latest: dict[str, float] = field(default_factory=dict)


def age(moment: datetime | None, now: datetime | None = None) -> str:
    if moment is None:
        return ""
    moment = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
    seconds = int(((now or datetime.now(timezone.utc)) - moment).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def counts_text(counts: dict[str, Any]) -> str:
    return ", ".join(f"{n} {state}" for state, n in counts.items() if n) or "none yet"


def job_list(session: Session, state: str = "", name: str = "", page: int = 1) -> JobList:
    """One page of jobs, newest first, filtered by state and a name fragment. Queries touch
    only the page's jobs, so a store of thousands answers as fast as a store of ten."""
    where = JobFilter(state=state, name=name, name_contains=True)
    query = select(JobRow.id).where(*where.conditions())  # the REST list's filters (store.listing)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    pages = max(1, -(-total // PAGE_SIZE))
    page = min(max(page, 1), pages)
    ids = session.scalars(query.order_by(JobRow.id.desc()).limit(PAGE_SIZE).offset((page - 1) * PAGE_SIZE)).all()
    jobs = session.scalars(select(JobRow).where(JobRow.id.in_(ids)).order_by(JobRow.id.desc())).all()
    roles: dict[int, list[RoleCounts]] = defaultdict(list)
    for role in session.scalars(select(RoleRow).where(RoleRow.job_id.in_(ids)).order_by(RoleRow.position)):
        roles[role.job_id].append(RoleCounts(role.name, role.replicas, role.state, counts_text(role.counts)))
    lines = [
        JobLine(
            j.id,
            j.name,
            str((j.spec.get("spec") or {}).get("framework", "")),
            j.state,
            j.reason,
            age(j.created_at),
            j.queue,
            j.priority,
            roles[j.id],
        )
        for j in jobs
    ]
    return JobList(lines, total, page, pages)


def instances(session: Session, job: JobRow, limit: int = INSTANCES_SHOWN) -> list[InstanceLine]:
    """The first ``limit`` instances of the job as table rows."""
    latest = repo.latest_points(session, job.id)
    lines = []
    for inst in job.instances[:limit]:
        point = latest.get((inst.role, inst.index))
        lines.append(
            InstanceLine(
                inst.label,
                inst.role,
                inst.index,
                inst.state,
                inst.attempt,
                inst.restarts,
                inst.host or "",
                inst.address or "",
                inst.pid,
                inst.exit_code,
                inst.reason,
                inst.message,
                getattr(inst, "cpu_seconds", None),
                getattr(inst, "peak_rss", None),
                _progress(point),
                dict(point.values) if point else {},
            )
        )
    return lines


def _progress(point: MetricRow | None) -> float | None:
    if point is None or not point.total:
        return None
    done = point.step if point.step is not None else point.epoch
    return None if done is None else min(1.0, done / point.total)


def metric_series(session: Session, job_id: int, after: int = 0, limit: int = 5000) -> dict[str, Any]:
    """Points after id ``after`` as chart series: one per (instance, metric), x = step or epoch."""
    rows = session.scalars(
        select(MetricRow).where(MetricRow.job_id == job_id, MetricRow.id > after).order_by(MetricRow.id).limit(limit)
    ).all()
    points = [
        {
            "series": f"{r.role}-{r.index} {name}",
            "metric": name,
            "x": r.step if r.step is not None else (r.epoch if r.epoch is not None else r.id),
            "y": value,
        }
        for r in rows
        for name, value in r.values.items()
    ]
    return {"last": rows[-1].id if rows else after, "points": points}


@dataclass(frozen=True)
class LogChunk:
    text: str
    offset: int  # where the next read starts
    size: int
    truncated: bool  # the chunk starts after the beginning of the log


def read_log(path: str | None, offset: int | None, limit: int = LOG_TAIL) -> LogChunk:
    """``limit`` bytes of a log from ``offset``, or its last ``limit`` bytes when offset is None.
    Never the whole file: a 100 MB log costs one seek and one bounded read."""
    if not path or not Path(path).exists():
        return LogChunk("", 0, 0, False)
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        start = max(0, size - limit) if offset is None else min(max(offset, 0), size)
        handle.seek(start)
        data = handle.read(limit)
    return LogChunk(data.decode("utf-8", "replace"), start + len(data), size, start > 0)


def spec_yaml(job: JobRow) -> str:
    return yaml.safe_dump(job.spec, sort_keys=False)


def job_detail(session: Session, job: JobRow) -> dict[str, Any]:
    status = repo.job_status(session, job, events=200, instances=(0, 0))  # the page lists instances()
    status["framework"] = (job.spec.get("spec") or {}).get("framework", "")
    status["age"] = age(job.created_at)
    # a job whose `trainmaster run` died: nobody reconciles it until someone resumes it
    status["orphaned"] = not repo.is_terminal(job.state) and owner_alive(job.owner) is False
    return status
