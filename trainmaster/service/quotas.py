"""How large the jobs a server accepts may be, per job and all together.

A job of 10 roles x 10,000 replicas is valid by the spec, and would make 100,000 instance rows,
a status answer of tens of MB and a reconcile pass that starves everything else. The operator
sets two limits (``trainmaster server --max-job-instances / --max-instances``), checked where a
job enters or grows (submit and scale, REST and dashboard alike):

- a job may ask for at most :attr:`JobQuota.per_job` instances (the sum of its roles' replicas):
  a job over it is refused (422) with the field path and the figures;
- the jobs that have not ended may hold at most :attr:`JobQuota.per_server` instances together:
  a job that would pass it is refused (429, try again when jobs end), as Kubernetes refuses a pod
  beyond a namespace's ResourceQuota.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from trainmaster.errors import UserError
from trainmaster.spec.model import Job
from trainmaster.store.models import JobRow, RoleRow

ENDED = ("succeeded", "failed", "cancelled")
ACTIVE = ("pending", "starting", "running")  # matched by IN: the state index, not a scan of every job ever run


class OverQuota(UserError):
    """The server holds as many instances as it may (HTTP 429)."""

    def __init__(self, message: str, details: list[str]):
        super().__init__(message, details, exit_code=1)


HELD_READ_EVERY = 1.0  # seconds a count of the active jobs' instances is used before it is read again


class HeldInstances:
    """The instances active jobs hold, as a submit checks them: read from the store at most once
    a :data:`HELD_READ_EVERY` (a sum over every active job's roles: at thousands of queued jobs
    and hundreds of submits a second, reading it per submit cost more than the submit), plus what
    this server admitted since (ended jobs are not taken off: the count only errs high). A submit
    the count would refuse reads the store first, so a refusal is always by the stored figures.
    Another server on the same store is seen at the next read, as before it was seen by the next
    submit (the check was never one transaction with the insert)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = 0
        self._read_at: float | None = None

    def take(self, session: Session, wanted: int, limit: int) -> int | None:
        """Count ``wanted`` more and return None when they fit under ``limit``; else the held
        count as the store has it now (nothing counted)."""
        with self._lock:
            now = time.monotonic()
            stale = self._read_at is None or now - self._read_at > HELD_READ_EVERY
            if stale or self._held + wanted > limit:
                self._held, self._read_at = active_instances(session), now
            if self._held + wanted > limit:
                return self._held
            self._held += wanted
            return None


@dataclass(frozen=True)
class JobQuota:
    per_job: int = 5_000
    per_server: int = 20_000
    held: HeldInstances = field(default_factory=HeldInstances, compare=False, repr=False)


def check_job(job: Job, quota: JobQuota, source: str = "submitted job") -> None:
    """Refuse a job asking for more instances than one job may have."""
    total = sum(role.replicas for role in job.spec.roles)
    if total <= quota.per_job:
        return
    largest = max(range(len(job.spec.roles)), key=lambda i: job.spec.roles[i].replicas)
    raise UserError(
        f"{source} is not a valid job (1 problem(s))",
        [
            f"spec.roles: the roles ask for {total:,} instances in all (the largest, spec.roles[{largest}].replicas, "
            f"{job.spec.roles[largest].replicas:,}); this server runs at most {quota.per_job:,} per job "
            "(trainmaster server --max-job-instances): split the job, or ask the operator"
        ],
    )


def active_instances(session: Session, except_job: int | None = None) -> int:
    """Instances the jobs that have not ended ask for (their roles' desired replicas)."""
    query = select(func.coalesce(func.sum(RoleRow.replicas), 0)).join(JobRow, JobRow.id == RoleRow.job_id)
    query = query.where(JobRow.state.in_(ACTIVE))
    if except_job is not None:
        query = query.where(JobRow.id != except_job)
    return int(session.scalar(query) or 0)


def check_room(session: Session, wanted: int, quota: JobQuota, except_job: int | None = None) -> None:
    """Refuse ``wanted`` more instances when the active jobs hold too many already (a new job's:
    :class:`HeldInstances`; a job's own growth, ``except_job``: read from the store)."""
    if except_job is None:
        over = quota.held.take(session, wanted, quota.per_server)
        if over is None:
            return
        held = over
    else:
        held = active_instances(session, except_job)
        if held + wanted <= quota.per_server:
            return
    raise OverQuota(
        f"this server's jobs hold {held:,} instances and may hold {quota.per_server:,} "
        f"(trainmaster server --max-instances); {wanted:,} more do not fit",
        [
            f"spec.roles: {wanted:,} instances asked for; {max(quota.per_server - held, 0):,} free: "
            "retry when jobs end, or ask the operator"
        ],
    )


def check_scale(session: Session, job: JobRow, role: str, replicas: int, quota: JobQuota) -> None:
    """Refuse scaling ``role`` of ``job`` to ``replicas`` beyond either limit."""
    total = sum(replicas if r.name == role else r.replicas for r in job.roles)
    if total > quota.per_job:
        raise UserError(
            f"scaling {role} to {replicas:,} makes job {job.name} {total:,} instances",
            [f"replicas: this server runs at most {quota.per_job:,} instances per job (--max-job-instances)"],
        )
    if job.state not in ENDED:
        check_room(session, total, quota, except_job=job.id)
