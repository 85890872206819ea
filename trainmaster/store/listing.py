"""Jobs listed in pages with filters, and watched from a resource version, as the Kubernetes API
lists and watches its objects.

A list answers one page (``limit`` jobs, oldest first) and a ``continue`` token for the next:
the id after which the next page starts, so a page costs its own rows whatever the store holds
and a job submitted meanwhile is never shown twice. Filters (state, queue, name, labels) are
SQL conditions over indexed or plain columns, never a Python pass over every job.

Every change of a job is an event row (submitted, admitted, started, running, ended, per job,
role and instance), numbered by the store in commit order. Its id is the store's **resource
version**: a list says the newest one, and a watch from it answers each job changed since, in
order, with the event that changed it; nothing is missed between a list and a watch that starts
from the version the list gave.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from trainmaster.errors import UserError
from trainmaster.spec.states import JobState
from trainmaster.store.models import EventRow, JobRow
from trainmaster.store.repository import shown_reason_of

MAX_LIMIT = 1000
DEFAULT_LIMIT = 500
MAX_LABELS = 8
# Kubernetes' label syntax: an optional DNS prefix and a name; a value of up to 63 characters
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class JobFilter:
    """What a list or a watch keeps: every given condition holds (``name``: exact, or a
    fragment when ``name_contains``); ``labels``: each ``key=value`` is one of the job's labels."""

    state: str = ""
    queue: str = ""
    name: str = ""
    name_contains: bool = False
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(
        cls, state: str = "", queue: str = "", name: str = "", labels: list[str] | None = None, contains: bool = False
    ) -> JobFilter:
        """From query parameters; a :class:`UserError` names a wrong one."""
        if state and state not in {s.value for s in JobState}:
            raise UserError(f"state '{state}': expected one of {', '.join(s.value for s in JobState)}")
        selector: dict[str, str] = {}
        for item in labels or []:
            key, sep, value = item.partition("=")
            if not sep or not LABEL_KEY.match(key) or not LABEL_VALUE.match(value):
                raise UserError(
                    f"label '{item[:80]}': expected KEY=VALUE with a Kubernetes label key and value "
                    "(letters, digits, '-', '_', '.'; e.g. team=vision)"
                )
            selector[key] = value
        if len(selector) > MAX_LABELS:
            raise UserError(f"at most {MAX_LABELS} label filters at once (got {len(selector)})")
        return cls(state, queue, name, contains, selector)

    def params(self) -> dict[str, Any]:
        """As the query parameters of ``GET /api/v1/jobs``."""
        found: dict[str, Any] = {
            k: v for k, v in (("state", self.state), ("queue", self.queue), ("name", self.name)) if v
        }
        if self.labels:
            found["label"] = [f"{k}={v}" for k, v in self.labels.items()]
        return found

    def conditions(self) -> list[ColumnElement[bool]]:
        found: list[ColumnElement[bool]] = []
        if self.state:
            found.append(JobRow.state == self.state)
        if self.queue:
            found.append(JobRow.queue == self.queue)
        if self.name:
            found.append(
                JobRow.name.contains(self.name, autoescape=True) if self.name_contains else JobRow.name == self.name
            )
        for key, value in self.labels.items():
            found.append(JobRow.spec[("metadata", "labels", key)].as_string() == value)
        return found


@dataclass(frozen=True)
class JobPage:
    """One page of a list: its jobs, the token of the next page (None on the last), how many
    matching jobs come after this page, and the store's resource version when it was read."""

    items: list[dict[str, Any]]
    next: str | None
    remaining: int
    resource_version: int

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobPage:
        """A page as the REST API answers it (``to_dict``), for a client."""
        meta = data.get("metadata") or {}
        return cls(
            list(data.get("items") or []),
            meta.get("continue") or None,
            int(meta.get("remainingItemCount") or 0),
            int(meta.get("resourceVersion") or 0),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "JobList",
            "items": self.items,
            "metadata": {
                "resourceVersion": str(self.resource_version),
                "continue": self.next,
                "remainingItemCount": self.remaining,
            },
        }


def resource_version(session: Session) -> int:
    """The newest event's id (0 for a store without events)."""
    return session.scalar(select(func.max(EventRow.id))) or 0


def list_jobs(session: Session, where: JobFilter, limit: int = DEFAULT_LIMIT, after: str | None = None) -> JobPage:
    """One page of the jobs ``where`` keeps, oldest first, after the ``continue`` token ``after``."""
    if not 1 <= limit <= MAX_LIMIT:
        raise UserError(f"limit {limit}: expected 1 to {MAX_LIMIT} jobs per page")
    start = _token(after)
    conditions = where.conditions()
    if session.get_bind().dialect.name == "sqlite":
        return _sqlite_page(session, start, conditions, limit)
    return _portable_page(session, start, conditions, limit)


def _portable_page(session: Session, start: int, conditions: list[ColumnElement[bool]], limit: int) -> JobPage:
    """A page read as rows (PostgreSQL's driver reads them all at once)."""
    version = resource_version(session)  # read first: a watch from it misses nothing of this page
    rows = session.execute(
        select(*SUMMARY_COLUMNS).where(JobRow.id > start, *conditions).order_by(JobRow.id).limit(limit + 1)
    ).all()
    page = list(rows[:limit])
    remaining = 0
    if len(rows) > limit:
        remaining = session.scalar(select(func.count(JobRow.id)).where(JobRow.id > page[-1].id, *conditions)) or 0
    return JobPage([summary(j) for j in page], str(page[-1].id) if remaining else None, remaining, version)


def _sqlite_page(session: Session, start: int, conditions: list[ColumnElement[bool]], limit: int) -> JobPage:
    """The same page from SQLite in one row: the version, the page's rows as one JSON array and
    the count of what follows, in one statement (one snapshot, so the three agree).

    Why one row: Python's SQLite driver gives up the interpreter lock at every row it steps to,
    and in a server whose other threads are busy each of those waits up to a thread switch
    (1 ms) to get it back; a page of 100 rows read row by row waited ~100 times."""
    after = (JobRow.id > start, *conditions)
    rows = (
        select(
            func.json_array(
                *(SUMMARY_COLUMNS[:8]), func.json_extract(JobRow.spec, "$.metadata.labels"), *SUMMARY_COLUMNS[9:]
            ).label("row")
        )
        .where(*after)
        .order_by(JobRow.id)
        .limit(limit + 1)
        .subquery()
    )
    version, text, matching = session.execute(
        select(
            select(func.max(EventRow.id)).scalar_subquery(),
            select(func.json_group_array(func.json(rows.c.row))).scalar_subquery(),
            select(func.count(JobRow.id)).where(*after).scalar_subquery(),
        )
    ).one()
    found = sorted(json.loads(text or "[]"), key=lambda r: r[0])[:limit]
    page = [summary(_SqliteRow(*r)) for r in found]
    remaining = max(0, int(matching or 0) - limit)
    return JobPage(page, str(page[-1]["id"]) if remaining else None, remaining, version or 0)


class _SqliteRow(NamedTuple):
    """A row of :data:`SUMMARY_COLUMNS` as :func:`_sqlite_page` reads it (JSON: times as SQLite's text)."""

    id: int
    name: str
    state: str
    reason: str
    message: str
    owner: str
    queue: str
    priority: int
    labels: dict[str, str] | None
    created: str | None
    completed: str | None

    @property
    def created_at(self) -> datetime | None:
        return datetime.fromisoformat(self.created) if self.created else None

    @property
    def completed_at(self) -> datetime | None:
        return datetime.fromisoformat(self.completed) if self.completed else None


@dataclass(frozen=True)
class WatchEvent:
    """One change of a job, Kubernetes style: ``ADDED`` (submitted) or ``MODIFIED``, the job as
    it is now, and the event that changed it (its id is the resource version)."""

    type: str
    job: dict[str, Any]
    event: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "object": self.job, "event": self.event}


def changes_since(
    session: Session, version: int, where: JobFilter, limit: int = DEFAULT_LIMIT
) -> tuple[list[WatchEvent], int]:
    """The jobs ``where`` keeps that changed after resource version ``version``, in order (at
    most ``limit`` events), and the version to watch from next."""
    if version < 0:
        raise UserError(f"resourceVersion {version}: expected a version a list or a watch gave (0 or more)")
    events = session.execute(
        select(EventRow.id, EventRow.job_id, EventRow.object, EventRow.reason, EventRow.message, EventRow.time)
        .where(EventRow.id > version)
        .order_by(EventRow.id)
        .limit(limit)
    ).all()
    if not events:
        return [], version
    ids = {e.job_id for e in events}
    jobs = {
        j.id: summary(j)
        for j in session.execute(select(*SUMMARY_COLUMNS).where(JobRow.id.in_(ids), *where.conditions()))
    }
    found = [
        WatchEvent(
            "ADDED" if e.reason == "Submitted" else "MODIFIED",
            jobs[e.job_id],
            {
                "resourceVersion": str(e.id),
                "object": e.object,
                "reason": e.reason,
                "message": e.message,
                "time": _iso(e.time),
            },
        )
        for e in events
        if e.job_id in jobs
    ]
    return found, events[-1].id


#: What a list shows of a job, read as plain columns: a page of 500 costs its rows, not 500 ORM
#: objects each with its whole spec parsed (only the spec's labels are read, by the database).
SUMMARY_COLUMNS = (
    JobRow.id,
    JobRow.name,
    JobRow.state,
    JobRow.reason,
    JobRow.message,
    JobRow.owner,
    JobRow.queue,
    JobRow.priority,
    JobRow.spec[("metadata", "labels")].label("labels"),
    JobRow.created_at,
    JobRow.completed_at,
)


def summary(job: Any) -> dict[str, Any]:
    """A job as a list shows it, from a row of :data:`SUMMARY_COLUMNS`."""
    reason, message = shown_reason_of(job.id, job.state, job.reason, job.message, job.owner)
    return {
        "id": job.id,
        "name": job.name,
        "state": job.state,
        "reason": reason,
        "message": message,
        "queue": job.queue,
        "priority": job.priority,
        "labels": dict(job.labels or {}),
        "createdAt": _iso(job.created_at),
        "completedAt": _iso(job.completed_at),
    }


def _token(text: str | None) -> int:
    if not text:
        return 0
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise UserError(
            f"continue '{text[:40]}': not a token a list gave (pass the metadata.continue of the last page)"
        )
    return int(text)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None
