"""Who reconciles a job: the controller service, or one ``trainmaster run`` process.

A run names itself by pid *and* start time, so a job whose ``trainmaster run`` died (kill -9,
out of memory, a machine reboot) is recognisably orphaned rather than shown as running
forever, and ``trainmaster resume`` can take it over (a conditional update, so two resumes
never both win).
"""

from __future__ import annotations

import psutil

SERVICE = "service"
RUN_PREFIX = "run-"


def run_owner() -> str:
    """The owner name of this ``trainmaster run`` process."""
    me = psutil.Process()
    return f"{RUN_PREFIX}{me.pid}-{me.create_time():.2f}"


def run_pid(owner: str) -> int | None:
    """The pid of a run owner, None for the service (or an owner from an older release)."""
    if not owner.startswith(RUN_PREFIX):
        return None
    try:
        return int(owner[len(RUN_PREFIX) :].split("-")[0])
    except ValueError:
        return None


def owner_alive(owner: str) -> bool | None:
    """Whether a run owner's process still runs; None for the service, which restarts itself."""
    if not owner.startswith(RUN_PREFIX):
        return None
    try:
        pid, created = owner[len(RUN_PREFIX) :].split("-", 1)
        return abs(psutil.Process(int(pid)).create_time() - float(created)) < 0.05
    except psutil.AccessDenied:
        return True  # someone else's live process: not ours to call dead
    except (ValueError, psutil.NoSuchProcess):
        return False


def orphan_note(job_id: int, owner: str) -> str:
    """What to tell a user about a job whose ``trainmaster run`` ended before the job did."""
    pid = run_pid(owner)
    by = f"the `trainmaster run` (pid {pid})" if pid else "the `trainmaster run`"
    return f"{by} reconciling this job has ended; `trainmaster resume {job_id}` takes it over"


def why_not_resumable(state_terminal: bool, owner: str, what: str) -> str | None:
    """Why a job cannot be taken over now (``what`` names it), or None when its owner is gone.

    One answer for `trainmaster resume` and for the service's resume (API and dashboard)."""
    if state_terminal:
        return f"{what} has already ended; nothing to resume"
    alive = owner_alive(owner)
    if alive is None:
        return f"{what} belongs to the controller service, which carries it on while it runs"
    if alive:
        return (
            f"{what} is still run by `trainmaster run` (pid {run_pid(owner)}); stop that command "
            "(Ctrl-C cancels the job) or let it finish"
        )
    return None
