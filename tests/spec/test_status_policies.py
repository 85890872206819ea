"""Mechanism: role and job status policies (controller spec, 'Status' step 7), table-driven.

Instance states roll up into a role's state by the role's policy, role states into the job's
by the job's policy; presets reproduce Kubeflow, TFJob AllWorkers, JobSet All/Any and
Volcano minSuccess.
"""

from collections import Counter

import pytest

from trainmaster.spec.model import InstanceCount, RoleSelector, StatusPolicy
from trainmaster.spec.states import InstanceState as I
from trainmaster.spec.states import JobState as J
from trainmaster.spec.status import PRESETS, RoleSummary, job_state, role_state

DEFAULT = StatusPolicy()


@pytest.mark.parametrize(
    "policy,counts,replicas,expected",
    [
        (DEFAULT, {I.RUNNING: 3}, 3, J.RUNNING),
        (DEFAULT, {I.PENDING: 3}, 3, J.PENDING),
        (DEFAULT, {I.STARTING: 1, I.PENDING: 2}, 3, J.STARTING),
        (DEFAULT, {I.SUCCEEDED: 3}, 3, J.SUCCEEDED),
        (DEFAULT, {I.SUCCEEDED: 2, I.RUNNING: 1}, 3, J.RUNNING),
        (DEFAULT, {I.FAILED: 1, I.RUNNING: 2}, 3, J.FAILED),  # any failed => failed
        (StatusPolicy(preset="any-succeeded"), {I.SUCCEEDED: 1, I.FAILED: 1, I.RUNNING: 1}, 3, J.SUCCEEDED),
        (StatusPolicy(preset="any-succeeded"), {I.FAILED: 2, I.RUNNING: 1}, 3, J.RUNNING),
        (StatusPolicy(preset="any-succeeded"), {I.FAILED: 3}, 3, J.FAILED),
        (StatusPolicy(failed=2, succeeded=2), {I.FAILED: 1, I.SUCCEEDED: 1, I.RUNNING: 2}, 4, J.RUNNING),
        (StatusPolicy(failed=2, succeeded=2), {I.FAILED: 2, I.SUCCEEDED: 2}, 4, J.FAILED),  # failed checked first
        (StatusPolicy(failed=2, succeeded=3), {I.FAILED: 1, I.SUCCEEDED: 2}, 3, J.FAILED),  # cannot succeed
    ],
)
def test_role_roll_up(policy: StatusPolicy, counts: dict, replicas: int, expected: J) -> None:
    assert role_state(policy, Counter(counts), replicas).state == expected


def roles(**states: J) -> dict[str, RoleSummary]:
    return {
        name: RoleSummary(state, Counter({I.SUCCEEDED: 1} if state == J.SUCCEEDED else {}))
        for name, state in states.items()
    }


@pytest.mark.parametrize(
    "policy,role_states,expected",
    [
        (DEFAULT, roles(a=J.RUNNING, b=J.RUNNING), J.RUNNING),
        (DEFAULT, roles(a=J.SUCCEEDED, b=J.RUNNING), J.RUNNING),
        (DEFAULT, roles(a=J.SUCCEEDED, b=J.SUCCEEDED), J.SUCCEEDED),
        (DEFAULT, roles(a=J.FAILED, b=J.RUNNING), J.FAILED),
        (DEFAULT, roles(a=J.PENDING, b=J.STARTING), J.STARTING),
        (StatusPolicy(preset="kubeflow"), roles(master=J.SUCCEEDED, worker=J.RUNNING), J.SUCCEEDED),
        (StatusPolicy(preset="kubeflow"), roles(master=J.RUNNING, worker=J.SUCCEEDED), J.RUNNING),
        (StatusPolicy(preset="tfjob-allworkers"), roles(chief=J.RUNNING, worker=J.SUCCEEDED), J.SUCCEEDED),
        (StatusPolicy(preset="jobset-any"), roles(a=J.SUCCEEDED, b=J.RUNNING), J.SUCCEEDED),
        (StatusPolicy(preset="jobset-all"), roles(a=J.SUCCEEDED, b=J.RUNNING), J.RUNNING),
        (
            StatusPolicy(failed="any", succeeded=RoleSelector(roles=["a", "b"])),
            roles(a=J.SUCCEEDED, b=J.SUCCEEDED, c=J.RUNNING),
            J.SUCCEEDED,
        ),
        (StatusPolicy(failed="all", succeeded="any"), roles(a=J.FAILED, b=J.RUNNING), J.RUNNING),
        (DEFAULT, roles(a=J.SUCCEEDED, b=J.CANCELLED), J.FAILED),  # every role ended, condition unmet
    ],
)
def test_job_roll_up(policy: StatusPolicy, role_states: dict, expected: J) -> None:
    assert job_state(policy, role_states).state == expected


def test_volcano_min_success_counts_instances_across_roles() -> None:
    policy = StatusPolicy(failed="all", succeeded=InstanceCount(instances=3))
    two = {
        "a": RoleSummary(J.RUNNING, Counter({I.SUCCEEDED: 2, I.RUNNING: 1})),
        "b": RoleSummary(J.RUNNING, Counter({I.RUNNING: 2})),
    }
    assert job_state(policy, two).state == J.RUNNING
    two["b"] = RoleSummary(J.RUNNING, Counter({I.SUCCEEDED: 1, I.RUNNING: 1}))
    assert job_state(policy, two).state == J.SUCCEEDED


def test_presets_are_documented_policies() -> None:
    assert {"kubeflow", "tfjob-allworkers", "jobset-all", "jobset-any", "default"} <= set(PRESETS)
    verdict = job_state(StatusPolicy(preset="kubeflow"), roles(master=J.FAILED, worker=J.RUNNING))
    assert verdict.state == J.FAILED and "master" in verdict.message
