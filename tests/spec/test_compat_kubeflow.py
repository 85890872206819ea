"""Kubeflow PyTorchJob / TFJob / MPIJob -> trainmaster/v1 Job conversion (table-driven)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from trainmaster.errors import UserError
from trainmaster.loading import load_document as _load_document
from trainmaster.spec.compat import convert as _convert
from trainmaster.spec.load import LoadOptions
from trainmaster.spec.model import RuntimeKind


# These tests pin the --lenient reading (unknown fields listed and ignored, today's behaviour
# before strict reading); tests/spec/test_compat_strict.py pins the default, strict reading.
def convert(raw: Any, lenient: bool = True) -> Any:
    return _convert(raw, lenient=lenient)


def load_document(raw: Any, source: str = "job") -> Any:
    return _load_document(raw, source, LoadOptions(lenient=True))


def container(name: str = "pytorch", **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "example/train:1", "command": ["python", "train.py"], **extra}


def replica(
    replicas: int = 1, container_name: str = "pytorch", restart: str | None = None, **extra: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": replicas,
        "template": {"spec": {"containers": [container(container_name, **extra)]}},
    }
    if restart:
        spec["restartPolicy"] = restart
    return spec


def kubeflow(kind: str, replicas: dict[str, Any], version: str = "v1", **spec: Any) -> dict[str, Any]:
    key = {"PyTorchJob": "pytorchReplicaSpecs", "TFJob": "tfReplicaSpecs", "MPIJob": "mpiReplicaSpecs"}[kind]
    return {
        "apiVersion": f"kubeflow.org/{version}",
        "kind": kind,
        "metadata": {"name": "job-a"},
        "spec": {key: replicas, **spec},
    }


def roles_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in doc["spec"]["roles"]}


PYTORCH = kubeflow("PyTorchJob", {"Master": replica(1, restart="OnFailure"), "Worker": replica(2, restart="OnFailure")})
TF_PS = kubeflow("TFJob", {"PS": replica(2, "tensorflow"), "Worker": replica(4, "tensorflow")})
TF_CHIEF = kubeflow(
    "TFJob",
    {
        "Chief": replica(1, "tensorflow"),
        "PS": replica(1, "tensorflow"),
        "Worker": replica(2, "tensorflow"),
        "Evaluator": replica(1, "tensorflow"),
    },
)
TF_ALL = kubeflow(
    "TFJob", {"PS": replica(1, "tensorflow"), "Worker": replica(2, "tensorflow")}, successPolicy="AllWorkers"
)
MPI_V1 = kubeflow("MPIJob", {"Launcher": replica(1, "mpi"), "Worker": replica(2, "mpi")}, slotsPerWorker=1)
MPI_V2 = kubeflow("MPIJob", {"Launcher": replica(1, "launcher"), "Worker": replica(3, "worker")}, version="v2beta1")


@pytest.mark.parametrize(
    "raw, framework, roles, depends, status",
    [
        (PYTORCH, "pytorch", {"master": 1, "worker": 2}, {"worker": ["master"]}, {"preset": "kubeflow"}),
        # TFJob: every replica waits until the whole training cluster is placed (its TF_CONFIG)
        (
            TF_PS,
            "tensorflow",
            {"ps": 2, "worker": 4},
            {"ps": ["ps", "worker"], "worker": ["ps", "worker"]},
            {"preset": "tfjob-allworkers"},
        ),
        (
            TF_CHIEF,
            "tensorflow",
            {"chief": 1, "ps": 1, "worker": 2, "evaluator": 1},
            {r: ["chief", "ps", "worker"] for r in ("chief", "ps", "worker", "evaluator")},
            {"failed": "any", "succeeded": {"roles": ["chief"]}},
        ),
        (
            TF_ALL,
            "tensorflow",
            {"ps": 1, "worker": 2},
            {"ps": ["ps", "worker"], "worker": ["ps", "worker"]},
            {"preset": "tfjob-allworkers"},
        ),
        (
            MPI_V1,
            "mpi",
            {"launcher": 1, "worker": 2},
            {"launcher": ["worker"]},
            {"failed": "any", "succeeded": {"roles": ["launcher"]}},
        ),
        (
            MPI_V2,
            "mpi",
            {"launcher": 1, "worker": 3},
            {"launcher": ["worker"]},
            {"failed": "any", "succeeded": {"roles": ["launcher"]}},
        ),
    ],
    ids=["pytorch", "tf-ps", "tf-chief", "tf-allworkers", "mpi-v1", "mpi-v2beta1"],
)
def test_replica_specs_become_roles(
    raw: dict[str, Any], framework: str, roles: dict[str, int], depends: dict[str, list[str]], status: dict[str, Any]
) -> None:
    """Mechanism: replica specs -> roles (lower-cased type), replicas, implicit start order as
    dependsOn, the kind's success policy as the job status policy, and the framework id."""
    converted = convert(copy.deepcopy(raw))
    assert converted is not None
    doc = converted.document
    assert doc["apiVersion"] == "trainmaster/v1" and doc["kind"] == "Job"
    assert doc["metadata"]["name"] == "job-a"
    assert doc["spec"]["framework"] == framework
    by_name = roles_of(doc)
    assert {n: r["replicas"] for n, r in by_name.items()} == roles
    assert {n: [d["role"] for d in r["dependsOn"]] for n, r in by_name.items() if "dependsOn" in r} == depends
    assert doc["spec"]["statusPolicy"] == status
    assert by_name[next(iter(roles))]["command"] == ["python", "train.py"]
    loaded = load_document(doc)  # the converted job passes our normal validation
    assert loaded.job.spec.total_replicas == sum(roles.values())


def test_tfjob_without_chief_lets_a_worker_finish_the_job() -> None:
    """Mechanism: TFJob default success policy with no chief (a worker finishing ends the job)."""
    doc = convert(copy.deepcopy(TF_PS)).document  # type: ignore[union-attr]
    assert roles_of(doc)["worker"]["statusPolicy"] == {"succeeded": 1}


@pytest.mark.parametrize(
    "kubeflow_policy, ours, approximated",
    [
        ("Never", "Never", False),
        ("OnFailure", "OnFailure", False),
        ("Always", "Always", False),
        ("ExitCode", "ExitCode", False),
    ],
)
def test_restart_policies(kubeflow_policy: str, ours: str, approximated: bool) -> None:
    """Mechanism: replica restartPolicy -> our restart policy kinds (ExitCode included: restarts
    after a signal only); runPolicy.backoffLimit -> maxRestarts."""
    raw = kubeflow("PyTorchJob", {"Master": replica(1, restart=kubeflow_policy)}, runPolicy={"backoffLimit": 5})
    converted = convert(raw)
    assert converted is not None
    assert roles_of(converted.document)["master"]["restartPolicy"] == {"policy": ours, "maxRestarts": 5}
    assert any("restartPolicy: approximated" in line for line in converted.ignored) == approximated


@pytest.mark.parametrize(
    "kind, replicas, expected",
    [
        ("PyTorchJob", {"Master": replica(1), "Worker": replica(1)}, {"master": "OnFailure", "worker": "OnFailure"}),
        (
            "TFJob",
            {"PS": replica(1, "tensorflow"), "Worker": replica(1, "tensorflow")},
            {"ps": "Never", "worker": "Never"},
        ),
        ("MPIJob", {"Launcher": replica(1), "Worker": replica(1)}, {"launcher": "OnFailure", "worker": "Never"}),
    ],
)
def test_kubeflow_default_restart_policies(kind: str, replicas: dict[str, Any], expected: dict[str, str]) -> None:
    """Mechanism: a replica spec without restartPolicy gets the Kubeflow default of its kind."""
    doc = convert(kubeflow(kind, replicas)).document  # type: ignore[union-attr]
    assert {n: r["restartPolicy"]["policy"] for n, r in roles_of(doc).items()} == expected


def test_scheduling_policy_becomes_scheduling() -> None:
    """Mechanism: runPolicy.schedulingPolicy minAvailable/queue/priorityClass -> scheduling;
    ttlSecondsAfterFinished carries over, cleanPodPolicy All is approximated, the schedule
    timeout is reported."""
    raw = kubeflow(
        "PyTorchJob",
        {"Master": replica(1), "Worker": replica(3)},
        runPolicy={
            "schedulingPolicy": {
                "minAvailable": 4,
                "queue": "research",
                "priorityClass": "high",
                "scheduleTimeoutSeconds": 30,
            },
            "cleanPodPolicy": "All",
            "ttlSecondsAfterFinished": 100,
        },
    )
    converted = convert(raw)
    assert converted is not None
    assert converted.document["spec"]["scheduling"] == {"minAvailable": 4, "queue": "research", "priorityClass": "high"}
    ignored = "\n".join(converted.ignored)
    for path in (
        "spec.runPolicy.schedulingPolicy.scheduleTimeoutSeconds",
        "spec.runPolicy.cleanPodPolicy: approximated",
    ):
        assert path + ":" in ignored
    assert converted.document["spec"]["runPolicy"] == {"ttlSecondsAfterFinished": 100}
    assert load_document(converted.document).job.spec.scheduling.priority == 100


@pytest.mark.parametrize("kind", ["PyTorchJob", "TFJob", "MPIJob"])
def test_run_policy_carries_over(kind: str) -> None:
    """Mechanism: Kubeflow runPolicy backoffLimit, activeDeadlineSeconds, ttlSecondsAfterFinished
    and suspend become our runPolicy (same meanings, enforced by the controller); cleanPodPolicy
    Running is what the controller does, All and None are approximated, anything else refused."""
    container = {"PyTorchJob": "pytorch", "TFJob": "tensorflow", "MPIJob": "mpi"}[kind]
    replicas = (
        {"Launcher": replica(1, container), "Worker": replica(1, container)}
        if kind == "MPIJob"
        else {"Worker": replica(2, container)}
        if kind == "TFJob"
        else {"Master": replica(1, container)}
    )
    policy = {
        "backoffLimit": 4,
        "activeDeadlineSeconds": 60,
        "ttlSecondsAfterFinished": 0,
        "suspend": True,
        "cleanPodPolicy": "Running",
    }
    converted = convert(kubeflow(kind, replicas, runPolicy=policy))
    assert converted is not None and not [line for line in converted.ignored if "runPolicy" in line]
    job = load_document(converted.document).job
    assert job.spec.run_policy.model_dump() == {
        "backoff_limit": 4,
        "active_deadline_seconds": 60,
        "ttl_seconds_after_finished": 0,
        "suspend": True,
    }
    for value in ("All", "None"):
        policy["cleanPodPolicy"] = value
        lines = convert(kubeflow(kind, replicas, runPolicy=policy)).ignored  # type: ignore[union-attr]
        assert any(line.startswith("spec.runPolicy.cleanPodPolicy: approximated") for line in lines)
    policy["cleanPodPolicy"] = "Sometimes"
    with pytest.raises(UserError, match="must be one of All, Running, None"):
        convert(kubeflow(kind, replicas, runPolicy=policy))


def test_container_fields_translate_and_the_rest_is_reported() -> None:
    """Mechanism: container command+args, env (valueFrom fieldRef as envFields), resources
    (requests cpu/memory, nvidia.com/gpu limit), image (runtime auto) and emptyDir volumes at
    their mounts -> role; node selectors, sidecars and probes are reported as ignored, never
    dropped silently."""
    master = replica(
        1,
        args=["--epochs", "3"],
        env=[
            {"name": "LR", "value": "0.1"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
        resources={
            "requests": {"cpu": "500m", "memory": "1Gi"},
            "limits": {"cpu": "2", "nvidia.com/gpu": 1, "ephemeral-storage": "1Gi"},
        },
        volumeMounts=[{"name": "data", "mountPath": "/data"}],
        livenessProbe={"exec": {}},
    )
    pod = master["template"]["spec"]
    pod["volumes"] = [{"name": "data", "emptyDir": {}}]
    pod["nodeSelector"] = {"gpu": "a100"}
    pod["tolerations"] = [{"key": "x"}]
    pod["containers"].append({"name": "sidecar", "image": "envoy"})
    master["template"]["metadata"] = {"annotations": {"sidecar.istio.io/inject": "false"}}
    converted = convert(kubeflow("PyTorchJob", {"Master": master}), lenient=True)
    assert converted is not None
    role = roles_of(converted.document)["master"]
    assert role["command"] == ["python", "train.py"] and role["args"] == ["--epochs", "3"]
    assert role["env"] == {"LR": "0.1"} and role["envFields"] == {"POD_IP": "status.podIP"}
    assert role["resources"] == {"cpu": 0.5, "memory": "1Gi", "gpu": 1}
    assert role["image"] == "example/train:1" and role["runtime"] == "auto"
    assert role["volumes"] == [{"name": "data", "mountPath": "/data", "emptyDir": True}]
    base = "spec.pytorchReplicaSpecs.Master.template"
    ignored = "\n".join(converted.ignored)
    for path in (
        f"{base}.metadata.annotations",
        f"{base}.spec.nodeSelector",
        f"{base}.spec.tolerations",
        f"{base}.spec.containers[1]",
        f"{base}.spec.containers[0].env[2].valueFrom.secretKeyRef",
        f"{base}.spec.containers[0].livenessProbe",
        f"{base}.spec.containers[0].resources.limits.cpu",
        f"{base}.spec.containers[0].resources.limits.ephemeral-storage",
    ):
        assert path + ":" in ignored, path
    assert "TOKEN is not set" in ignored
    assert load_document(converted.document).job.spec.role("master").resources.gpu == 1


def test_main_container_is_chosen_by_name() -> None:
    """Mechanism: Kubeflow's main container (``pytorch``) runs, whatever its position."""
    master = replica(1)
    master["template"]["spec"]["containers"].insert(0, {"name": "log-shipper", "command": ["tail"]})
    role = roles_of(convert(kubeflow("PyTorchJob", {"Master": master})).document)["master"]  # type: ignore[union-attr]
    assert role["command"] == ["python", "train.py"]


@pytest.mark.parametrize("lenient", [False, True])
def test_args_without_command_keep_the_image_entrypoint(lenient: bool) -> None:
    """Kubernetes semantics (issue #22): args without command replace the image's CMD and keep
    its ENTRYPOINT, so the role has no command and runs in a container from its image (refused
    on the host: nothing to run there)."""
    from trainmaster.containers.policy import container_problems

    master = replica(1)
    del master["template"]["spec"]["containers"][0]["command"]
    master["template"]["spec"]["containers"][0]["args"] = ["python", "-c", "print(1)"]
    converted = convert(kubeflow("PyTorchJob", {"Master": master}), lenient=lenient)
    assert converted is not None
    role = roles_of(converted.document)["master"]
    assert "command" not in role and role["args"] == ["python", "-c", "print(1)"] and role["runtime"] == "auto"
    job = _load_document(converted.document, "job", LoadOptions(lenient=True, runtime=RuntimeKind.HOST)).job
    assert job.spec.role("master").command is None  # the framework's command is not filled in
    problems = container_problems(job)  # the operator's --runtime host
    assert len(problems) == 1 and "runs its image's entry point" in problems[0]


def test_cpu_quantities() -> None:
    """Mechanism: Kubernetes CPU quantities (millicores) become cores."""
    from trainmaster.spec.compat.pod import cpu_quantity

    assert [cpu_quantity(v) for v in ("250m", "2", "1.5", 3, "lots")] == [0.25, 2.0, 1.5, 3.0, "lots"]


@pytest.mark.parametrize(
    "api_version, kind, needle",
    [
        ("kubeflow.org/v1", "XGBoostJob", "XGBoostJob is not supported"),
        ("kubeflow.org/v1", "PaddleJob", "PaddleJob is not supported"),
        ("kubeflow.org/v2beta1", "PyTorchJob", "kubeflow.org/v1"),
        ("trainer.kubeflow.org/v1alpha1", "TrainJob", "spec.runtimeRef.name: required"),
        ("trainer.kubeflow.org/v2alpha1", "TrainJob", "TrainJob is not supported"),
        ("trainer.kubeflow.org/v1alpha1", "TrainingJob", "TrainingJob is not supported"),
    ],
)
def test_unknown_kubeflow_kinds_are_user_errors(api_version: str, kind: str, needle: str) -> None:
    """Mechanism: a kubeflow.org document we cannot convert is a clear UserError."""
    with pytest.raises(UserError) as err:
        convert({"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}, "spec": {}})
    assert needle in str(err.value)


def test_broken_structure_is_a_user_error_with_the_path() -> None:
    """Mechanism: structure (a list where a mapping goes) is checked; values are left to validation."""
    with pytest.raises(UserError) as err:
        convert(kubeflow("PyTorchJob", {"Master": ["not", "a", "mapping"]}))
    assert "spec.pytorchReplicaSpecs.Master: must be a mapping" in str(err.value)


def test_invalid_values_are_reported_with_paths() -> None:
    """Mechanism: a restart policy Kubeflow does not have is reported with its path in the
    user's file; other values by our validation, with their path in the converted job."""
    raw = kubeflow("PyTorchJob", {"Master": replica(1, restart="Sometimes"), "Worker": replica(0)})
    with pytest.raises(UserError) as err:
        convert(raw)
    assert "spec.pytorchReplicaSpecs.Master.restartPolicy: must be one of" in str(err.value)
    converted = convert(kubeflow("PyTorchJob", {"Master": replica(1), "Worker": replica(0)}))
    with pytest.raises(UserError) as err:
        load_document(converted.document)
    assert "spec.roles[1].replicas" in str(err.value)


def test_foreign_documents_are_left_alone() -> None:
    """Mechanism: documents that are neither Kubeflow nor Volcano are not converted."""
    assert convert({"apiVersion": "trainmaster/v1", "kind": "Job"}) is None
    assert convert({"apiVersion": "batch/v1", "kind": "Job"}) is None


@pytest.mark.parametrize("workers, roles", [(3, {"master": 1, "worker": 2}), (1, {"master": 1})])
def test_pytorchjob_without_master_promotes_worker_zero(workers: int, roles: dict[str, int]) -> None:
    """Mechanism: a worker-only PyTorchJob (Kubeflow makes worker 0 rank 0) gets worker 0 as
    the pytorch master, the rest as workers; success needs every instance (no kubeflow preset)."""
    converted = convert(kubeflow("PyTorchJob", {"Worker": replica(workers, restart="OnFailure")}))
    assert converted is not None
    doc = converted.document
    assert {n: r["replicas"] for n, r in roles_of(doc).items()} == roles
    assert doc["spec"]["statusPolicy"] == {"preset": "default"}
    ignored = "\n".join(converted.ignored)
    assert "spec.pytorchReplicaSpecs.Worker: approximated" in ignored
    job = load_document(doc).job
    assert job.spec.framework == "pytorch" and job.spec.total_replicas == workers
    assert job.spec.status_policy.preset == "default"  # not replaced by the framework's kubeflow preset
