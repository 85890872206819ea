"""Mechanisms: Kubeflow Trainer v2 on Kubernetes (issue 34; controller spec, 'Our product
decisions': Kubeflow Trainer v2 files run unchanged, and on Kubernetes as an operator): a
``TrainJob`` applied with kubectl runs with the runtime it names read from the cluster (a
``ClusterTrainingRuntime``, or a ``TrainingRuntime`` of its namespace), and its status is
upstream's (``Created``, ``Complete``/``Failed`` conditions, ``jobsStatus``). Upstream's own
multi-node example on its own torch runtime (torchrun, a gloo world of 2 pods) and a TrainJob on
the deepspeed (MPI) runtime (mpirun, 4 ranks in 2 rank-host pods) run end to end; a TrainJob whose
runtime is not in the cluster gets a Failed condition naming ``spec.runtimeRef`` and the operator
carries on. ``trainmaster job run --backend kubernetes trainjob.yaml runtime.yaml`` runs one too,
and finds a runtime applied to the cluster when no file gives it.

The Trainer project's files are read in place from the shared data folder; the tests that need
them skip, saying so, where it is absent."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_helpers import REPO, TRAINMASTER, apply, condition, env_of, get_json, kubectl, wait_for
from test_operator import Operators, _lease_exists

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]


def _data() -> Path:
    """$TRAINMASTER_SHARED_DATA, else ``shared/data`` beside the checkout (or beside the folder
    of worktrees it is one of)."""
    env = os.environ.get("TRAINMASTER_SHARED_DATA")
    beside = [folder / "shared" / "data" for folder in (REPO.parent, REPO.parents[1])]
    base = Path(env) if env else next((b for b in beside if b.is_dir()), beside[0])
    return base / "kubeflow-trainer-v2"


DATA = _data()
needs_data = pytest.mark.skipif(
    not (DATA / "SOURCES.txt").is_file(),
    reason=f"the Kubeflow Trainer v2 files ({DATA}; set TRAINMASTER_SHARED_DATA) are not on this machine",
)
TORCH_RUNTIME = DATA / "runtimes" / "manifests--base--runtimes--torch_distributed.yaml"
MPI_RUNTIME = DATA / "runtimes" / "manifests--base--runtimes--deepspeed_distributed.yaml"
MULTI_NODE = DATA / "trainjobs" / "examples--yaml--01-multi-node.yaml"


def tiny_runtime(name: str, kind: str = "ClusterTrainingRuntime") -> dict[str, Any]:
    """A runtime without an mlPolicy: its one replicated job prints a line per pod."""
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "replicas": 2,
                            "template": {
                                "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                                "spec": {
                                    "template": {
                                        "spec": {
                                            "containers": [
                                                {
                                                    "name": "node",
                                                    "image": "trainmaster.local/python:3.11",
                                                    "command": ["python", "-c", "print('tiny node', flush=True)"],
                                                }
                                            ]
                                        }
                                    }
                                },
                            },
                        }
                    ]
                }
            }
        },
    }


def trainjob(name: str, runtime: str, kind: str = "ClusterTrainingRuntime", **trainer: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"runtimeRef": {"name": runtime, "kind": kind}}
    if trainer:
        spec["trainer"] = trainer
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def operator(k8s_cluster, tmp_path_factory) -> Iterator[Operators]:
    ops = Operators(k8s_cluster, tmp_path_factory.mktemp("trainjob-operator"))
    ops.start("op-t")
    wait_for(lambda: ops.leader() == "op-t" if _lease_exists(k8s_cluster) else False, 120, "op-t leading")
    try:
        yield ops
    finally:
        ops.stop_all()


def complete(cluster: Any, name: str, timeout: float, operator: Operators) -> dict[str, Any]:
    try:
        kubectl(
            cluster,
            "wait",
            "--for=condition=Complete",
            f"trainjob/{name}",
            f"--timeout={timeout:.0f}s",
            timeout=timeout + 30,
        )
    except AssertionError:
        print(kubectl(cluster, "get", "pods", "-o", "wide"), get_json(cluster, "trainjob", name).get("status"))
        print(operator.log(operator.leader()))
        raise
    return dict(get_json(cluster, "trainjob", name))


def test_the_trainer_crds_are_installed(k8s_cluster, operator) -> None:
    for crd, scope in (
        ("trainjobs.trainer.kubeflow.org", "Namespaced"),
        ("trainingruntimes.trainer.kubeflow.org", "Namespaced"),
        ("clustertrainingruntimes.trainer.kubeflow.org", "Cluster"),
    ):
        found = get_json(k8s_cluster, "crd", crd)
        assert found["apiVersion"] == "apiextensions.k8s.io/v1" and found["spec"]["scope"] == scope
        assert [v["name"] for v in found["spec"]["versions"]] == ["v1alpha1"]
        assert all(v["subresources"] == {"status": {}} for v in found["spec"]["versions"])


def test_a_trainjob_whose_runtime_is_missing_fails_naming_runtimeref_and_the_operator_carries_on(
    k8s_cluster, operator
) -> None:
    apply(k8s_cluster, trainjob("orphan", "no-such-runtime"))
    failed = wait_for(
        lambda: condition(get_json(k8s_cluster, "trainjob", "orphan"), "Failed"), 90, "a Failed condition"
    )
    assert failed["status"] == "True" and failed["reason"] == "InvalidSpec", failed
    assert "spec.runtimeRef.name: no ClusterTrainingRuntime named 'no-such-runtime'" in failed["message"], failed
    assert "kubectl apply" in failed["message"], failed
    assert set(failed) == {"type", "status", "reason", "message", "lastTransitionTime"}  # a metav1.Condition
    assert not get_json(k8s_cluster, "pods", "-l", "jobset.sigs.k8s.io/jobset-name=orphan")["items"]
    # the operator serves on: a namespaced runtime applied, a TrainJob naming it completes
    apply(k8s_cluster, tiny_runtime("tm-tiny-ns", kind="TrainingRuntime"))
    apply(k8s_cluster, trainjob("after-orphan", "tm-tiny-ns", kind="TrainingRuntime"))
    done = complete(k8s_cluster, "after-orphan", 120, operator)
    assert [c["type"] for c in done["status"]["conditions"]] == ["Created", "Complete"]
    assert condition(done, "Complete")["reason"] == "AllJobsCompleted"
    assert done["status"]["jobsStatus"] == [
        {"name": "node", "active": 0, "ready": 0, "succeeded": 2, "failed": 0, "suspended": 0}
    ]
    table = kubectl(k8s_cluster, "get", "trainjobs")
    assert "after-orphan" in table and "Complete" in table and "Failed" in table
    kubectl(k8s_cluster, "delete", "trainjob/orphan", "trainjob/after-orphan", "trainingruntime/tm-tiny-ns")


@needs_data
def test_upstreams_multi_node_example_runs_on_its_torch_runtime_from_the_cluster(k8s_cluster, operator) -> None:
    """Upstream's ClusterTrainingRuntime ``torch-distributed`` applied unchanged from its file;
    its 01-multi-node TrainJob with numNodes 2 (3 in the file: one torch process fewer on this
    2-core machine): torchrun in 2 pods, one gloo world of 2."""
    kubectl(k8s_cluster, "apply", "-f", str(TORCH_RUNTIME))
    job = yaml.safe_load(MULTI_NODE.read_text())
    job["spec"]["trainer"]["numNodes"] = 2
    apply(k8s_cluster, job)
    done = complete(k8s_cluster, "multi-node-example", 420, operator)
    logs = kubectl(k8s_cluster, "logs", "-l", "jobset.sigs.k8s.io/jobset-name=multi-node-example", "--tail=-1")
    assert logs.count("WORLD_SIZE: 2") == 2 and "RANK: 0" in logs and "RANK: 1" in logs, logs
    assert done["status"]["jobsStatus"][0]["name"] == "node" and done["status"]["jobsStatus"][0]["succeeded"] == 2
    pod = get_json(k8s_cluster, "pod", "multi-node-example-node-0")
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["apiVersion"], owner["kind"], owner["name"]) == (
        "trainer.kubeflow.org/v1alpha1",
        "TrainJob",
        "multi-node-example",
    )
    assert pod["metadata"]["labels"]["jobset.sigs.k8s.io/replicatedjob-name"] == "node"
    kubectl(k8s_cluster, "delete", "trainjob/multi-node-example", "clustertrainingruntime/torch-distributed")


MPI_COMMAND = [
    "mpirun",
    "python",
    "-c",
    "import os; print('rank', os.environ['OMPI_COMM_WORLD_RANK'], 'of', os.environ['OMPI_COMM_WORLD_SIZE'], flush=True)",
]


@needs_data
def test_an_mpi_trainjob_runs_its_ranks_on_a_namespaced_runtime(k8s_cluster, operator) -> None:
    """Upstream's deepspeed runtime (MPI policy, OpenMPI) applied as a TrainingRuntime of the
    namespace; a TrainJob naming it: mpirun in the launcher pod runs 2 x 2 ranks through the
    hostfile in the 2 node pods; the launcher's success ends the job (its successPolicy)."""
    runtime = yaml.safe_load(MPI_RUNTIME.read_text())
    runtime["kind"] = "TrainingRuntime"
    apply(k8s_cluster, runtime)
    apply(
        k8s_cluster,
        trainjob(
            "mpi-ranks",
            "deepspeed-distributed",
            kind="TrainingRuntime",
            numNodes=2,
            numProcPerNode=2,
            command=MPI_COMMAND,
        ),
    )
    done = complete(k8s_cluster, "mpi-ranks", 420, operator)
    logs = kubectl(k8s_cluster, "logs", "mpi-ranks-launcher-0")
    for rank in range(4):
        assert f"rank {rank} of 4" in logs, logs
    jobs = {s["name"]: s for s in done["status"]["jobsStatus"]}  # the runtime's replicated jobs' names
    assert set(jobs) == {"node", "launcher"} and jobs["launcher"]["succeeded"] == 1, jobs
    launcher = get_json(k8s_cluster, "pod", "mpi-ranks-launcher-0")  # kept (the node pods were stopped)
    assert launcher["metadata"]["labels"]["jobset.sigs.k8s.io/replicatedjob-name"] == "launcher"
    kubectl(k8s_cluster, "delete", "trainjob/mpi-ranks", "trainingruntime/deepspeed-distributed")


def test_job_run_backend_kubernetes_takes_the_runtime_from_a_file_or_the_cluster(
    k8s_cluster, operator, tmp_path: Path
) -> None:
    """``trainmaster job run --backend kubernetes trainjob.yaml runtime.yaml``; then, the runtime
    applied to the cluster instead, ``job run --backend kubernetes trainjob.yaml`` alone (the
    operator's CRDs are installed; the operator itself plays no part)."""
    env = env_of(k8s_cluster, TRAINMASTER_HOME=str(tmp_path / "home"), TRAINMASTER_RUNTIME="host")
    runtime_file, job_file = tmp_path / "runtime.yaml", tmp_path / "trainjob.yaml"
    runtime_file.write_text(yaml.safe_dump(tiny_runtime("tm-tiny-file")))
    job_file.write_text(yaml.safe_dump(trainjob("tiny-from-file", "tm-tiny-file")))
    run = [TRAINMASTER, "job", "run", "--backend", "kubernetes"]
    done = subprocess.run(
        [*run, str(job_file), str(runtime_file)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "succeeded" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    job_file.write_text(yaml.safe_dump(trainjob("tiny-from-cluster", "tm-tiny-cluster")))
    missing = subprocess.run([*run, str(job_file)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "spec.runtimeRef.name: no ClusterTrainingRuntime" in missing.stderr, missing
    apply(k8s_cluster, tiny_runtime("tm-tiny-cluster"))
    done = subprocess.run([*run, str(job_file)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "succeeded" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    kubectl(k8s_cluster, "delete", "clustertrainingruntime/tm-tiny-cluster")
