"""Status policies: how instance states roll up into a role's state, and role states into a job's.

A policy is data (see :class:`~trainmaster.spec.model.StatusPolicy`): a ``failed`` and a
``succeeded`` condition over per-state counts. The presets reproduce the success policies of
the tools our users come from.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from trainmaster.spec.model import Condition, InstanceCount, Job, RoleSelector, StatusPolicy
from trainmaster.spec.states import JOB_TERMINAL, InstanceState, JobState

DEFAULT_ROLE_POLICY = StatusPolicy(failed="any", succeeded="all")
DEFAULT_JOB_POLICY = StatusPolicy(failed="any", succeeded="all")

#: Named policies. ``kubeflow``: Kubeflow PyTorchJob/TFJob default (the master/chief succeeding
#: ends the job). ``tfjob-allworkers``: TFJob ``successPolicy: AllWorkers``. ``jobset-all`` /
#: ``jobset-any``: JobSet's success policy operators. ``any-succeeded``: a role done when any
#: instance succeeds (e.g. a leader election). Volcano's ``minSuccess: N`` is
#: ``succeeded: {instances: N}``.
PRESETS: dict[str, StatusPolicy] = {
    "default": StatusPolicy(failed="any", succeeded="all"),
    "kubeflow": StatusPolicy(failed="any", succeeded=RoleSelector(roles=["master"])),
    "tfjob-allworkers": StatusPolicy(failed="any", succeeded=RoleSelector(roles=["worker"])),
    "jobset-all": StatusPolicy(failed="any", succeeded="all"),
    "jobset-any": StatusPolicy(failed="any", succeeded="any"),
    "any-succeeded": StatusPolicy(failed="all", succeeded="any"),
}


def resolve(policy: StatusPolicy, default: StatusPolicy) -> StatusPolicy:
    """Fill a policy's empty conditions from its preset, then from ``default``."""
    base = PRESETS[policy.preset] if policy.preset else default
    return StatusPolicy(
        failed=policy.failed if policy.failed is not None else base.failed,
        succeeded=policy.succeeded if policy.succeeded is not None else base.succeeded,
    )


def with_policies_resolved(job: Job) -> Job:
    """``job`` (a copy) with every status policy as the controller applies it: presets expanded
    and empty conditions filled with the defaults, so that what is printed is what is used
    (``run --dry-run``)."""
    job = job.model_copy(deep=True)
    job.spec.status_policy = resolve(job.spec.status_policy, DEFAULT_JOB_POLICY)
    for role in job.spec.roles:
        role.status_policy = resolve(role.status_policy, DEFAULT_ROLE_POLICY)
    return job


@dataclass(frozen=True)
class Verdict:
    """A rolled-up state with the reason and message a user sees."""

    state: JobState
    reason: str
    message: str


def _holds(
    cond: Condition | None,
    count: int,
    total: int,
    member_states: dict[str, JobState] | None,
    state: JobState,
    instance_count: int,
) -> bool:
    if cond is None:
        return False
    if cond == "any":
        return count >= 1
    if cond == "all":
        return total > 0 and count == total
    if isinstance(cond, int):
        return count >= cond
    if isinstance(cond, RoleSelector):
        return member_states is not None and all(member_states.get(r) == state for r in cond.roles)
    if isinstance(cond, InstanceCount):
        return instance_count >= cond.instances
    raise TypeError(f"unknown condition {cond!r}")


def role_state(policy: StatusPolicy, counts: Counter[InstanceState], replicas: int) -> Verdict:
    """Roll a role's instance counts up into the role's state.

    ``counts`` counts an instance its restart policy will start again as pending, never as
    failed: it fails only when its restarts are exhausted.
    """
    policy = resolve(policy, DEFAULT_ROLE_POLICY)
    failed = counts[InstanceState.FAILED]
    succeeded = counts[InstanceState.SUCCEEDED]
    if _holds(policy.failed, failed, replicas, None, JobState.FAILED, failed):
        return Verdict(JobState.FAILED, "InstancesFailed", f"{failed} of {replicas} instances failed")
    if _holds(policy.succeeded, succeeded, replicas, None, JobState.SUCCEEDED, succeeded):
        return Verdict(JobState.SUCCEEDED, "InstancesSucceeded", f"{succeeded} of {replicas} instances succeeded")
    ended = failed + succeeded + counts[InstanceState.STOPPED]
    if ended >= replicas:
        return Verdict(
            JobState.FAILED,
            "CannotSucceed",
            f"every instance ended ({succeeded} succeeded, {failed} failed) without meeting the success condition",
        )
    return _progress(
        counts[InstanceState.RUNNING] + counts[InstanceState.UNKNOWN] + succeeded,
        counts[InstanceState.STARTING],
        replicas,
        "instances",
    )


def _progress(running: int, starting: int, total: int, what: str) -> Verdict:
    if running:
        return Verdict(JobState.RUNNING, "Running", f"{running} of {total} {what} running or done")
    if starting:
        return Verdict(JobState.STARTING, "Starting", f"{starting} of {total} {what} starting")
    return Verdict(JobState.PENDING, "Pending", f"waiting for {total} {what}")


@dataclass
class RoleSummary:
    """What the job roll-up needs to know of one role."""

    state: JobState
    counts: Counter[InstanceState] = field(default_factory=Counter)


def job_state(policy: StatusPolicy, roles: dict[str, RoleSummary]) -> Verdict:
    """Roll role states up into the job's state."""
    policy = resolve(policy, DEFAULT_JOB_POLICY)
    states = {name: r.state for name, r in roles.items()}
    total = len(roles)
    by_state = Counter(states.values())
    inst_failed = sum(r.counts[InstanceState.FAILED] for r in roles.values())
    inst_succeeded = sum(r.counts[InstanceState.SUCCEEDED] for r in roles.values())
    failed_roles = sorted(n for n, s in states.items() if s == JobState.FAILED)
    if _holds(policy.failed, by_state[JobState.FAILED], total, states, JobState.FAILED, inst_failed):
        return Verdict(JobState.FAILED, "RolesFailed", f"role(s) failed: {', '.join(failed_roles)}")
    if _holds(policy.succeeded, by_state[JobState.SUCCEEDED], total, states, JobState.SUCCEEDED, inst_succeeded):
        return Verdict(JobState.SUCCEEDED, "Succeeded", "the job's success condition is met")
    if all(s in JOB_TERMINAL for s in states.values()):
        return Verdict(JobState.FAILED, "CannotSucceed", "every role ended without meeting the job's success condition")
    running = by_state[JobState.RUNNING] + by_state[JobState.SUCCEEDED]
    return _progress(running, by_state[JobState.STARTING], total, "roles")
