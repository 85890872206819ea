"""Volcano batch.volcano.sh/v1alpha1 Job -> trainmaster/v1 Job conversion (table-driven)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from trainmaster.errors import UserError
from trainmaster.loading import load_document as _load_document
from trainmaster.spec.compat import convert as _convert
from trainmaster.spec.load import LoadOptions
from trainmaster.spec.states import InstanceState, JobState
from trainmaster.spec.status import RoleSummary, job_state, role_state


# These tests pin the --lenient reading (unknown fields listed and ignored, today's behaviour
# before strict reading); tests/spec/test_compat_strict.py pins the default, strict reading.
def convert(raw: Any, lenient: bool = True) -> Any:
    return _convert(raw, lenient=lenient)


def load_document(raw: Any, source: str = "job") -> Any:
    return _load_document(raw, source, LoadOptions(lenient=True))


def task(name: str, replicas: int = 1, restart: str | None = "Never", **extra: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [{"name": name, "image": "busybox", "command": ["sh", "-c", f"echo {name}"]}]}
    if restart:
        pod["restartPolicy"] = restart
    return {"name": name, "replicas": replicas, "template": {"spec": pod}, **extra}


def volcano(*tasks: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "vc-job"},
        "spec": {"tasks": list(tasks), **spec},
    }


def converted(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]], str]:
    result = convert(raw)
    assert result is not None
    doc = result.document
    return doc, {r["name"]: r for r in doc["spec"]["roles"]}, "\n".join(result.ignored)


def test_tasks_dependencies_and_scheduling() -> None:
    """Mechanism: tasks -> roles, task.dependsOn.name -> dependsOn, minAvailable/queue/
    priorityClassName -> scheduling, maxRetry -> maxRestarts (task maxRetry wins)."""
    raw = volcano(
        task("ps", 2),
        task("worker", 4, dependsOn={"name": ["ps"]}, maxRetry=5),
        minAvailable=6,
        queue="research",
        priorityClassName="high",
        maxRetry=2,
    )
    doc, roles, _ = converted(raw)
    assert doc["spec"]["framework"] == "command"
    assert {n: r["replicas"] for n, r in roles.items()} == {"ps": 2, "worker": 4}
    assert roles["worker"]["dependsOn"] == [{"role": "ps"}] and "dependsOn" not in roles["ps"]
    assert doc["spec"]["scheduling"] == {"minAvailable": 6, "queue": "research", "priorityClass": "high"}
    assert roles["ps"]["restartPolicy"] == {"policy": "Never", "maxRestarts": 2}
    assert roles["worker"]["restartPolicy"] == {"policy": "Never", "maxRestarts": 5}
    job = load_document(doc).job
    assert job.spec.scheduling.min_available == 6 and job.spec.role("worker").depends_on[0].role == "ps"


def test_depends_on_any_is_reported_as_approximated() -> None:
    """Mechanism: dependsOn iteration 'any' over several tasks waits for all (reported)."""
    raw = volcano(task("a"), task("b"), task("c", dependsOn={"name": ["a", "b"], "iteration": "any"}))
    _, roles, ignored = converted(raw)
    assert [d["role"] for d in roles["c"]["dependsOn"]] == ["a", "b"]
    assert "spec.tasks[2].dependsOn.iteration: approximated" in ignored


@pytest.mark.parametrize(
    "policies, where, restart, status, reported",
    [
        ([{"event": "PodFailed", "action": "RestartTask"}], "task", "OnFailure/Role", None, None),
        ([{"event": "PodFailed", "action": "RestartPod"}], "task", "OnFailure", None, None),
        ([{"event": "PodFailed", "action": "RestartJob"}], "job", "OnFailure/Job", None, None),
        ([{"event": "PodFailed", "action": "AbortJob"}], "task", "Never", None, None),
        ([{"event": "TaskFailed", "action": "TerminateJob"}], "job", "Never", None, None),
        (
            [{"event": "TaskCompleted", "action": "CompleteJob"}],
            "task",
            "Never",
            {"failed": "any", "succeeded": {"roles": ["worker"]}},
            None,
        ),
        (
            [{"event": "TaskCompleted", "action": "CompleteJob"}],
            "job",
            "Never",
            {"failed": "any", "succeeded": "any"},
            None,
        ),
        ([{"event": "PodEvicted", "action": "RestartJob"}], "job", "Never", None, "never evicted"),
        (
            [{"events": ["PodFailed", "PodEvicted"], "action": "RestartTask"}],
            "task",
            "OnFailure/Role",
            None,
            "never evicted",
        ),
    ],
    ids=[
        "restart-task",
        "restart-pod",
        "restart-job",
        "abort",
        "terminate",
        "complete-task",
        "complete-any",
        "evicted",
        "events-list",
    ],
)
def test_lifecycle_policies(
    policies: list[dict[str, Any]], where: str, restart: str, status: dict[str, Any] | None, reported: str | None
) -> None:
    """Mechanism: Volcano policies (event -> action) -> restart policy (RestartPod, RestartTask,
    RestartJob: restart scope Instance, Role, Job) / job status policy; what cannot be mapped is
    reported with the reason."""
    worker = task("worker", 2, **({"policies": policies} if where == "task" else {}))
    raw = volcano(task("ps"), worker, **({"policies": policies} if where == "job" else {}))
    doc, roles, ignored = converted(raw)
    policy, _, scope = restart.partition("/")
    assert roles["worker"]["restartPolicy"]["policy"] == policy
    assert roles["worker"]["restartPolicy"].get("scope") == (scope or None)
    assert doc["spec"].get("statusPolicy") == status
    if reported:
        assert reported in ignored
    else:
        assert "policies" not in ignored
    load_document(doc)


def test_exit_code_policies_restrict_restarts_to_their_codes() -> None:
    """Mechanism: Volcano exitCode policies: restart actions restart only those exit codes
    (restartPolicy.exitCodes); AbortJob on a code beside an event restart is refused by name."""
    _, roles, _ = converted(
        volcano(
            task(
                "w",
                policies=[
                    {"exitCode": 3, "action": "RestartTask"},
                    {"exitCode": 5, "action": "RestartTask"},
                    {"exitCode": 4, "action": "AbortJob"},
                ],
            )
        )
    )
    assert roles["w"]["restartPolicy"] == {"policy": "OnFailure", "scope": "Role", "exitCodes": [3, 5]}
    with pytest.raises(UserError, match="restarts exclude no exit code"):
        convert(
            volcano(
                task(
                    "w",
                    policies=[{"event": "PodFailed", "action": "RestartPod"}, {"exitCode": 4, "action": "AbortJob"}],
                )
            )
        )
    with pytest.raises(UserError, match="Volcano refuses 0"):
        convert(volcano(task("w", policies=[{"exitCode": 0, "action": "RestartPod"}])))


def test_task_policy_overrides_job_policy() -> None:
    """Mechanism: a task's own failure policy wins over the job's for that task."""
    raw = volcano(
        task("ps"),
        task("worker", policies=[{"event": "PodFailed", "action": "AbortJob"}]),
        policies=[{"event": "PodFailed", "action": "RestartJob"}],
    )
    _, roles, _ = converted(raw)
    assert roles["ps"]["restartPolicy"]["policy"] == "OnFailure"
    assert roles["worker"]["restartPolicy"]["policy"] == "Never"


@pytest.mark.parametrize(
    "pod_policy, ours", [("Never", "Never"), ("OnFailure", "OnFailure"), ("Always", "Always"), (None, "Never")]
)
def test_pod_restart_policy(pod_policy: str | None, ours: str) -> None:
    """Mechanism: the pod template's restartPolicy is the role's restart policy."""
    _, roles, _ = converted(volcano(task("main", restart=pod_policy)))
    assert roles["main"]["restartPolicy"]["policy"] == ours


def test_min_success_rolls_up_over_instances() -> None:
    """Mechanism: minSuccess N -> job succeeded {instances: N}; the job fails only once N
    successes are out of reach, and one failed instance does not end its role."""
    doc, roles, _ = converted(volcano(task("worker", 4), minSuccess=3))
    assert doc["spec"]["statusPolicy"] == {"succeeded": {"instances": 3}, "failed": {"instances": 2}}
    job = load_document(doc).job
    role_policy = job.spec.role("worker").status_policy
    one_failed = Counter({InstanceState.FAILED: 1, InstanceState.SUCCEEDED: 3})
    verdict = role_state(role_policy, one_failed, 4)
    summary = {"worker": RoleSummary(verdict.state, one_failed)}
    assert job_state(job.spec.status_policy, summary).state == JobState.SUCCEEDED
    two_failed = Counter({InstanceState.FAILED: 2, InstanceState.RUNNING: 2})
    summary = {"worker": RoleSummary(role_state(role_policy, two_failed, 4).state, two_failed)}
    assert job_state(job.spec.status_policy, summary).state == JobState.FAILED


def test_task_min_available() -> None:
    """Mechanism: task.minAvailable -> the role succeeds with that many successes, and (with no
    job minAvailable) the job's gang is the sum of the tasks' minimums."""
    doc, roles, ignored = converted(volcano(task("ps", 1), task("worker", 4, minAvailable=2)))
    assert roles["worker"]["statusPolicy"] == {"failed": 3, "succeeded": 2}
    assert doc["spec"]["scheduling"] == {"minAvailable": 3}
    assert "spec.tasks[1].minAvailable: approximated" in ignored
    job = load_document(doc).job
    counts = Counter({InstanceState.SUCCEEDED: 2, InstanceState.RUNNING: 2})
    assert role_state(job.spec.role("worker").status_policy, counts, 4).state == JobState.SUCCEEDED


def test_cluster_only_fields_are_reported() -> None:
    """Mechanism: schedulerName, volumes, plugins, task topology and pod fields with no local
    meaning are reported as ignored, each with its path (the env plugin is honoured)."""
    raw = volcano(
        task("worker", topologyPolicy="single-numa-node"),
        schedulerName="volcano",
        volumes=[{"mountPath": "/data"}],
        plugins={"ssh": [], "svc": [], "env": []},
        ttlSecondsAfterFinished=60,
    )
    raw["metadata"]["namespace"] = "team-a"
    raw["status"] = {"state": {"phase": "Running"}}
    _, _, ignored = converted(raw)
    for path in (
        "spec.schedulerName",
        "spec.volumes",
        "spec.plugins.ssh",
        "spec.plugins.svc",
        "spec.tasks[0].topologyPolicy",
        "metadata.namespace",
        "status",
    ):
        assert f"{path}:" in ignored, path


def test_pytorch_plugin_selects_the_pytorch_framework() -> None:
    """Mechanism: Volcano's pytorch plugin (MASTER_ADDR etc.) is our pytorch framework."""
    raw = volcano(
        task("master"),
        task("worker", 2, dependsOn={"name": ["master"]}),
        plugins={"pytorch": ["--master=master", "--worker=worker", "--port=23456"]},
    )
    doc, _, ignored = converted(raw)
    assert doc["spec"]["framework"] == "pytorch" and "spec.plugins.pytorch: approximated" in ignored
    assert load_document(doc).job.spec.framework == "pytorch"


def test_other_volcano_kinds_are_user_errors() -> None:
    """Mechanism: a batch.volcano.sh document other than Job is a clear UserError."""
    with pytest.raises(UserError, match="not supported"):
        convert({"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Queue", "spec": {}})
    with pytest.raises(UserError, match="spec.tasks: must be a list"):
        convert(volcano(tasks_are="wrong") | {"spec": {"tasks": {"a": 1}}})


@pytest.mark.parametrize(
    "policy, message",
    [
        ({"exitCode": 3, "action": "CompleteJob"}, "exitCode: not supported: exitCode 3 -> CompleteJob"),
        ({"event": "Unknown", "action": "AbortJob"}, "Unknown -> AbortJob is not run here yet"),
        ({"event": "PodFailed", "action": "Reboot"}, "action: 'Reboot' is not a Volcano action"),
        ({"event": "PodCrashed", "action": "AbortJob"}, "'PodCrashed' is not a Volcano event"),
        ({"action": "AbortJob"}, "needs an event, events or an exitCode"),
    ],
    ids=["exit-code", "unknown-event-action", "bad-action", "bad-event", "no-event"],
)
def test_lifecycle_policies_that_would_run_differently_are_refused(policy: dict[str, Any], message: str) -> None:
    """Volcano policies: an event -> action pair that is not run here, or that Volcano itself
    refuses, is an error naming the policy's path (even with --lenient), never an ignored line."""
    with pytest.raises(UserError) as err:
        convert(volcano(task("ps"), task("worker", 2, policies=[policy])))
    assert "spec.tasks[1].policies[0]" in str(err.value) and message in str(err.value)
