"""Mechanisms: strict reading of Kubeflow/Volcano files (as kubectl's strict field validation):
unknown fields are errors with their path in the user's file and a did-you-mean; --lenient lists
and ignores them; fields that would change what the job does are honoured or refused by name;
Volcano's own checks; every problem of a file reported at once."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from trainmaster.errors import UserError
from trainmaster.spec.compat import convert
from trainmaster.loading import load_document

CONTAINER = {"name": "pytorch", "image": "x", "command": ["python", "-c", "pass"]}


def pytorchjob(**spec: Any) -> dict[str, Any]:
    replica = {"replicas": 1, "template": {"spec": {"containers": [copy.deepcopy(CONTAINER)]}}}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "pt"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": copy.deepcopy(replica),
                "Worker": {**copy.deepcopy(replica), "replicas": 2},
            },
            **spec,
        },
    }


def volcano(*tasks: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "vc"},
        "spec": {"tasks": list(tasks), **spec},
    }


def task(name: str, replicas: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "replicas": replicas,
        "template": {"spec": {"containers": [{"name": name, "command": ["true"]}]}},
        **extra,
    }


def problems(raw: dict[str, Any]) -> str:
    with pytest.raises(UserError) as err:
        convert(raw)
    return str(err.value)


def test_a_typo_is_an_error_with_its_path_and_a_did_you_mean() -> None:
    raw = pytorchjob()
    raw["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["replica"] = 2
    raw["spec"]["pytorchReplicaSpecs"]["Worker"]["replica"] = 2
    text = problems(raw)
    assert "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].replica: unknown field" in text
    assert "spec.pytorchReplicaSpecs.Worker.replica: unknown field (did you mean 'replicas'?)" in text
    assert "(2 problem(s))" in text  # both at once


def test_lenient_lists_what_it_ignored() -> None:
    raw = pytorchjob()
    raw["spec"]["pytorchReplicaSpecs"]["Worker"]["replica"] = 2
    converted = convert(raw, lenient=True)
    assert converted is not None
    assert any(
        line.startswith("spec.pytorchReplicaSpecs.Worker.replica: unknown field, ignored") for line in converted.ignored
    )


def test_volcano_typos_anywhere() -> None:
    text = problems(volcano(task("a", minAvaliable=1), shedulerName="volcano"))
    assert "spec.shedulerName: unknown field (did you mean 'schedulerName'?)" in text
    assert "spec.tasks[0].minAvaliable: unknown field (did you mean 'minAvailable'?)" in text


@pytest.mark.parametrize(
    "spec, path",
    [
        ({"elasticPolicy": {"rdzvBackend": "etcd", "maxReplicas": 3}}, "spec.elasticPolicy.rdzvBackend: not supported"),
        ({"nprocPerNode": "auto"}, "spec.nprocPerNode: not supported"),
        ({"runPolicy": {"cleanPodPolicy": "Sometimes"}}, "spec.runPolicy.cleanPodPolicy: must be one of"),
    ],
)
def test_fields_that_change_the_job_are_refused_when_not_honoured(spec: dict[str, Any], path: str) -> None:
    assert path in problems(pytorchjob(**spec))


def test_nproc_per_node_is_honoured() -> None:
    converted = convert(pytorchjob(nprocPerNode=2))
    assert converted is not None and converted.document["spec"]["frameworkParams"] == {"nprocPerNode": 2}


def test_env_from_objects_is_refused_unless_lenient() -> None:
    raw = pytorchjob()
    raw["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "CONF", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
    ]
    assert "containers[0].env[0].valueFrom.configMapKeyRef: not supported" in problems(raw)
    assert convert(raw, lenient=True) is not None


def test_volcano_own_checks() -> None:
    """Volcano's admission checks: duplicate policy events, minAvailable bounds."""
    text = problems(
        volcano(
            task(
                "a",
                2,
                minAvailable=3,
                policies=[{"event": "PodFailed", "action": "RestartJob"}, {"event": "PodFailed", "action": "AbortJob"}],
            ),
            minAvailable=5,
        )
    )
    assert "spec.tasks[0].minAvailable: 3 is greater than the task's 2 replicas" in text
    assert "spec.minAvailable: 5 is greater than the 2 replicas" in text
    assert "duplicate event 'PodFailed'" in text


@pytest.mark.parametrize("plugin", ["mpi"])
def test_volcano_plugins_whose_variables_jobs_read_are_refused(plugin: str) -> None:
    assert f"spec.plugins.{plugin}: not supported" in problems(volcano(task("a"), plugins={plugin: []}))
    assert convert(volcano(task("a"), plugins={plugin: []}), lenient=True) is not None


def test_multi_replica_tfjob_runs_with_the_tensorflow_framework() -> None:
    """A multi-replica TFJob is honoured (TF_CONFIG from the tensorflow framework), not refused."""
    replica = {"replicas": 2, "template": {"spec": {"containers": [{"name": "tensorflow", "command": ["true"]}]}}}
    raw = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": "tf"},
        "spec": {"tfReplicaSpecs": {"Worker": replica}},
    }
    job = load_document(raw).job
    assert job.spec.framework == "tensorflow" and job.spec.total_replicas == 2
    assert [(d.role, d.condition.value) for d in job.spec.roles[0].depends_on] == [("worker", "Placed")]


def test_mpijob_slots_and_implementation_reach_the_framework() -> None:
    replica = {"template": {"spec": {"containers": [{"name": "m", "command": ["true"]}]}}}
    raw = {
        "apiVersion": "kubeflow.org/v2beta1",
        "kind": "MPIJob",
        "metadata": {"name": "m"},
        "spec": {
            "slotsPerWorker": 2,
            "mpiImplementation": "MPICH",
            "mpiReplicaSpecs": {"Launcher": replica, "Worker": {**replica, "replicas": 2}},
        },
    }
    converted = convert(raw)
    assert converted is not None
    assert converted.document["spec"]["frameworkParams"] == {"slotsPerWorker": 2, "mpiImplementation": "MPICH"}
    raw["spec"]["mpiImplementation"] = "LAM"
    assert "spec.mpiImplementation: must be one of OpenMPI, Intel, MPICH" in problems(raw)


def test_volcano_env_plugin_sets_the_task_index() -> None:
    """Volcano env plugin: VK_TASK_INDEX and VC_TASK_INDEX are the instance's index in its task
    (set by the command framework's environment, from frameworkParams.indexVariables)."""
    from trainmaster.frameworks import get_framework
    from trainmaster.frameworks.base import InstanceContext

    converted = convert(volcano(task("a", 3), plugins={"env": [], "ssh": []}))
    assert converted is not None
    job = load_document(converted.document).job
    assert job.spec.framework == "command"
    ctx = InstanceContext(
        job_name="vc",
        role="a",
        index=2,
        replicas=3,
        role_replicas={"a": 3},
        host="127.0.0.1",
        ports=[],
        services={},
        params=job.spec.framework_params,
    )
    assert get_framework("command").environment(ctx) == {"VK_TASK_INDEX": "2", "VC_TASK_INDEX": "2"}


@pytest.mark.parametrize(
    "implementation, expected",
    [
        ("OpenMPI", "pi-worker-0 slots=2\npi-worker-1 slots=2\n"),
        ("Intel", "pi-worker-0:2\npi-worker-1:2\n"),
        ("MPICH", "pi-worker-0:2\npi-worker-1:2\n"),
    ],
)
def test_mpi_hostfile_has_the_slots_in_the_implementations_format(implementation: str, expected: str) -> None:
    """MPIJob slotsPerWorker and mpiImplementation: the launcher's hostfile as the MPI operator
    writes it for each implementation."""
    from trainmaster.frameworks.mpi import hostfile_text, worker_name

    assert hostfile_text([worker_name("pi", 0), worker_name("pi", 1)], 2, implementation) == expected
