"""The job verbs every client surface offers (:class:`Trainmaster`), and the one way to wait on
a job that both implementations share (:func:`wait_for`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from trainmaster.store.listing import DEFAULT_LIMIT, JobFilter, JobPage
from trainmaster.client.results import (
    ENDED,
    CancelResult,
    Deleted,
    JobRef,
    JobStatus,
    ScaleResult,
    SuspendResult,
    WaitTimedOut,
)


class Trainmaster(Protocol):
    """The job verbs that look at and change jobs, wherever the jobs live. A reference is a
    job's name (the most recent of that name), uid or id; an unknown one raises
    :class:`~trainmaster.client.results.JobNotFound`, a verb the job's state forbids
    :class:`~trainmaster.errors.JobConflict`, any other mistake a
    :class:`~trainmaster.errors.UserError` that says what to do."""

    def find(self, ref: str | int) -> JobRef:
        """The job ``ref`` names, with its state now."""
        ...

    def list_jobs(
        self, where: JobFilter | None = None, limit: int = DEFAULT_LIMIT, after: str | None = None
    ) -> JobPage:
        """One page of the summaries of the jobs ``where`` keeps, oldest first, after the page
        token ``after`` (:class:`~trainmaster.store.listing.JobPage`: its items, the next token)."""
        ...

    def status(self, ref: str | int, events: int = 50) -> JobStatus:
        """A job's status document with its ``events`` latest events."""
        ...

    def wait(self, ref: str | int, timeout: float, states: frozenset[str] | None = None) -> JobRef:
        """Wait until the job is in one of ``states`` (default: ended); :class:`WaitTimedOut`
        after ``timeout`` seconds."""
        ...

    def tail(self, ref: str | int, role: str | None = None, index: int = 0, lines: int = 100) -> str:
        """The last ``lines`` lines of instance ``role``-``index``'s log (default role: the first)."""
        ...

    def read_log(
        self, ref: str | int, role: str | None = None, index: int = 0, follow: bool = False
    ) -> Iterator[bytes]:
        """An instance's log in chunks; with ``follow``, new output as it comes until it ends."""
        ...

    def cancel(self, ref: str | int) -> CancelResult:
        """Record the job's cancellation; its controller stops every instance."""
        ...

    def scale(self, ref: str | int, role: str, replicas: int) -> ScaleResult:
        """Set a role's desired replicas; its controller creates or deletes instances to match."""
        ...

    def suspend(self, ref: str | int, suspend: bool = True) -> SuspendResult:
        """Hold a job (``runPolicy.suspend``) or release it."""
        ...

    def delete(self, ref: str | int) -> Deleted:
        """Delete an ended job and its records; :class:`~trainmaster.errors.JobConflict` while it is active."""
        ...


def wait_for(
    find: Callable[[], JobRef], timeout: float, states: frozenset[str] | None = None, poll: float = 0.25
) -> JobRef:
    """Poll ``find`` until the job is in one of ``states`` (default: ended); :class:`WaitTimedOut`
    after ``timeout`` seconds, naming the job, its state and what was awaited."""
    wanted = states or ENDED
    deadline = time.monotonic() + timeout
    while True:
        job = find()
        if job.state in wanted:
            return job
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimedOut(
                f"job {job.name} (id {job.id}) still {job.state} after {timeout:g} s "
                f"(waited for: {', '.join(sorted(wanted))})"
            )
        time.sleep(min(poll, left))
