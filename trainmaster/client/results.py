"""What the job verbs answer, the same from the local store and from a service.

A verb that changes a job answers a small frozen dataclass. ``list_jobs`` and ``status`` answer
the REST API's JSON documents (the one wire format the CLI, the dashboard and API clients
share), typed here as :class:`~typing.TypedDict`: a reader of the document gets its keys
checked by mypy, and neither side converts anything, so ``--json`` prints exactly what
``GET /api/v1/jobs`` answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

from trainmaster.errors import UserError

ENDED = frozenset({"succeeded", "failed", "cancelled"})


class JobNotFound(UserError):
    """No job (or no instance, or no log yet) answers the reference (HTTP 404)."""


class StoreMissing(UserError):
    """A verb that only looks at jobs was pointed at a SQLite store that does not exist yet."""


class ServiceUnreachable(UserError):
    """No controller service answers at the URL."""


class WaitTimedOut(UserError):
    """A wait gave up; the message says on what and in which state."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=1)


@dataclass(frozen=True)
class JobRef:
    """A job as a verb found it."""

    id: int
    name: str
    state: str


@dataclass(frozen=True)
class Submitted:
    """A job queued by a service (``POST /api/v1/jobs``)."""

    id: int
    name: str
    ignored: list[str] = field(default_factory=list)  # Kubeflow/Volcano fields left out (--lenient)


@dataclass(frozen=True)
class CancelResult:
    id: int
    cancel_requested: bool  # False: the job had already ended
    note: str  # what happens next (who carries the cancellation out)


@dataclass(frozen=True)
class SuspendResult:
    id: int
    suspended: bool  # the job's runPolicy.suspend now
    changed: bool  # False: it already had that value


@dataclass(frozen=True)
class ScaleResult:
    id: int
    role: str
    replicas: int


@dataclass(frozen=True)
class Deleted:
    """A job deleted with its records."""

    id: int


class JobSummary(TypedDict):
    """One job of ``list_jobs`` (``GET /api/v1/jobs``)."""

    id: int
    name: str
    state: str
    reason: str
    queue: str
    priority: int
    createdAt: str | None
    completedAt: str | None


class RoleStatus(TypedDict):
    name: str
    replicas: int
    state: str
    reason: str
    message: str
    counts: dict[str, int]
    lastTransitionAt: str | None


class InstanceStatus(TypedDict):
    role: str
    index: int
    state: str
    reason: str
    message: str
    attempt: int
    restarts: int
    pid: int | None
    address: str | None
    exitCode: int | None
    logPath: str | None
    cpuSeconds: float | None
    peakRss: int | None
    startedAt: str | None
    endedAt: str | None
    metrics: dict[str, Any] | None


class JobStatus(TypedDict):
    """A job's status document (``GET /api/v1/jobs/{ref}``): its state and why, its roles with
    per-state counts, one page of its instances (``instanceCount`` in all) and recent events.
    A service adds ``controller`` (who reconciles)."""

    id: int
    uid: str
    name: str
    state: str
    reason: str
    message: str
    queue: str
    priority: int
    backend: str
    runDir: str | None
    outputPath: str | None
    createdAt: str | None
    startedAt: str | None
    runningAt: str | None
    completedAt: str | None
    lastTransitionAt: str | None
    conditions: list[dict[str, Any]]
    roles: list[RoleStatus]
    instances: list[InstanceStatus]
    instanceCount: int
    instancesFrom: int
    events: list[dict[str, Any]]
    controller: NotRequired[dict[str, Any]]  # from a service: who reconciles its store
