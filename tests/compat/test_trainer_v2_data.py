"""Mechanisms: Kubeflow Trainer v2 files read strictly and resolved against their runtime, on the
Trainer project's own files (shared data folder ``kubeflow-trainer-v2``: 29 TrainJobs, 27
runtimes, both schema generations, some that fail upstream's own schema on purpose), read in
place. Every runtime is read on its own: read, or refused by its named fields. Every TrainJob,
with the runtimes of its own era (as SOURCES.txt says to resolve ``runtimeRef``), is loaded and
then either runnable here or refused by ``run`` naming the role and why, or refused at loading
with each problem's field path and reason, exactly as listed below. Jobs from the torch and MPI
runtimes run end to end on the local backend: upstream's own multi-node example with the master
torch runtime (a real torchrun + gloo world of 3), and a TrainJob on the deepspeed (MPI) runtime
whose mpirun runs 2 x 2 ranks in the rank hosts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controller_harness import run_job_file, run_logs
from trainmaster.errors import UserError
from trainmaster.loading import check_runnable, load_job
from trainmaster.spec.compat.trainer import RuntimeDoc, is_runtime, runtime_doc
from trainmaster.spec.load import LoadOptions, read_documents
from trainmaster.spec.model import RuntimeKind


def _data() -> Path:
    env = os.environ.get("TRAINMASTER_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"
    return base / "kubeflow-trainer-v2"


DATA = _data()
pytestmark = pytest.mark.skipif(
    not (DATA / "SOURCES.txt").is_file(),
    reason=f"the Kubeflow Trainer v2 files ({DATA}; set TRAINMASTER_SHARED_DATA) are not on this machine",
)
RUNTIMES = sorted((DATA / "runtimes").glob("*.yaml"))
TRAINJOBS = sorted((DATA / "trainjobs").glob("*.yaml"))

V2ALPHA1 = ["apiVersion"]  # a KEP's version, never served by a CRD
NO_RUNTIME = ["spec.runtimeRef.name"]  # its runtime is not among the files (or refused on its own)
FLUX = ["ClusterTrainingRuntime/flux-distributed:spec.mlPolicy.flux"]
#: TrainJob -> "run" (runs here as it is), "loads" (converted, but ``run`` refuses a role that
#: runs an image's entry point on the host, or suspended), or the paths of every problem it is refused for
EXPECTED: dict[str, str | list[str]] = {
    "docs--operator-guides--job-scheduling--kai--doc2": NO_RUNTIME,  # its runtime is malformed upstream
    "docs--operator-guides--migration--doc2": "run",
    "docs--operator-guides--runtime--doc2": "loads",
    "docs--operator-guides--runtime--doc4": "loads",
    "docs--operator-guides--runtime-patches--doc1": NO_RUNTIME,
    "docs--user-guides--megatron--doc2": "loads",
    "docs--user-guides--trainjob-lifecycle--doc1": "run",
    "docs--user-guides--trainjob-lifecycle--doc2": "loads",
    "examples--flux--flux-interactive": FLUX,
    "examples--flux--lammps-train-gpus": FLUX,
    "examples--flux--lammps-train-job": FLUX,
    "examples--yaml--01-multi-node": "run",
    "examples--yaml--02-runtime-patches": "run",
    "examples--yaml--03-kueue-integration--doc1": "run",
    "examples--yaml--04-volcano-integration--doc2": "run",
    "examples--yaml--05-multi-step--doc2": "loads",
    "pr2925-0ab6c6a--examples--yaml--advanced--01-podspec-overrides": "run",
    "proposals--2170-kubeflow-trainer-v2--README--doc1": V2ALPHA1,
    "proposals--2170-kubeflow-trainer-v2--README--doc11": V2ALPHA1,
    "proposals--2170-kubeflow-trainer-v2--README--doc12": V2ALPHA1,
    "proposals--2170-kubeflow-trainer-v2--README--doc17": V2ALPHA1,
    "proposals--2170-kubeflow-trainer-v2--README--doc2": V2ALPHA1,
    "proposals--2401-llm-trainer-v2--README--doc2": NO_RUNTIME,  # names torchtune-llama3.2-1B; it is ...-1b
    "proposals--2598-XGboost-runtime-trainer-v2--README--doc7": V2ALPHA1,
    "proposals--2598-XGboost-runtime-trainer-v2--README--doc8": V2ALPHA1,
    "proposals--2841-flux-hpc--README--doc2": NO_RUNTIME,
    "proposals--2899-resource-timeouts--README--doc1": NO_RUNTIME,
    "v2.1.0--docs--proposals--2170-kubeflow-trainer-v2--README--doc11": V2ALPHA1,
    "v2.1.0--docs--proposals--2170-kubeflow-trainer-v2--README--doc12": V2ALPHA1,
}
#: runtime -> the paths it is refused for on its own (the others are read)
REFUSED_RUNTIMES = {
    "docs--operator-guides--job-scheduling--kai--doc1": [
        "ClusterTrainingRuntime/pytorch-kai-runtime:spec.mlPolicy.torch.numNodes",
        "ClusterTrainingRuntime/pytorch-kai-runtime:spec.template.spec.containers",
        "ClusterTrainingRuntime/pytorch-kai-runtime:spec.template.spec.replicatedJobs",
        "ClusterTrainingRuntime/pytorch-kai-runtime:spec.template.spec.schedulerName",
    ]
}


def era(name: str) -> str:
    """A file's era, from its name's prefix (master holds the docs' and proposals' files too)."""
    if name.startswith(("v2.1.0--", "pr2925-")):
        return "v2.1.0"
    return "v2.0.0" if name.startswith("v2.0.0--") else "master"


def runtimes_of(target: str) -> tuple[RuntimeDoc, ...]:
    """The readable runtimes of one era (v2.0.0 has one file; the rest of it is v2.1.0's)."""
    eras = {target, "v2.1.0"} if target == "v2.0.0" else {target}
    found = []
    for path in RUNTIMES:
        if era(path.name) in eras:
            try:
                found.append(runtime_doc(read_documents(path)[0], str(path)))
            except UserError:
                pass  # refused on its own (test below): a TrainJob naming it finds none
    return tuple(found)


def fields(exc: UserError) -> list[str]:
    """The field path of each problem (``path: why``), checking that each says why."""
    out = []
    for line in exc.details:
        path, sep, why = line.partition(": ")
        assert sep and why.strip(), line
        out.append(path)
    return sorted(out)


def test_the_data_folder_holds_what_sources_lists() -> None:
    assert len(TRAINJOBS) == 29 and len(RUNTIMES) == 27
    assert sorted(EXPECTED) == [p.stem for p in TRAINJOBS]


@pytest.mark.parametrize("path", RUNTIMES, ids=[p.stem for p in RUNTIMES])
def test_each_runtime_is_read_or_refused_by_its_fields(path: Path) -> None:
    raw = read_documents(path)[0]
    assert is_runtime(raw)
    if path.stem in REFUSED_RUNTIMES:
        with pytest.raises(UserError) as refused:
            runtime_doc(raw, str(path))
        assert fields(refused.value) == REFUSED_RUNTIMES[path.stem]
    else:
        assert runtime_doc(raw, str(path)).name == raw["metadata"]["name"]


@pytest.mark.parametrize("path", TRAINJOBS, ids=[p.stem for p in TRAINJOBS])
def test_each_trainjob_runs_or_is_refused_naming_the_field_and_why(path: Path) -> None:
    expected = EXPECTED[path.stem]
    options = LoadOptions(runtime=RuntimeKind.HOST, runtimes=runtimes_of(era(path.name)))
    if isinstance(expected, list):
        with pytest.raises(UserError) as refused:
            load_job(path, options)
        assert fields(refused.value) == expected, refused.value.details
        return
    loaded = load_job(path, options)
    assert loaded.job.spec.framework == "pytorch"  # every loadable one names a torch runtime
    node = loaded.job.spec.role("node")
    assert node.replicas >= 1
    if expected == "run":
        check_runnable(loaded, "local")
    else:  # the role runs its image's entry point (or an initializer's image): not on the host
        with pytest.raises(UserError) as refused:
            check_runnable(loaded, "local")
        assert all("image's entry point" in line for line in refused.value.details), refused.value.details


def test_numproc_auto_and_runtime_patches_carry_over() -> None:
    """v2.1's ``numProcPerNode: auto`` is one CPU process (noted); master's ``runtimePatches``
    reach the node pod (its cluster-only fields noted by their TrainJob path); the trainer's env
    and numNodes land on the node role."""
    path = DATA / "trainjobs" / "examples--yaml--02-runtime-patches.yaml"
    loaded = load_job(path, LoadOptions(runtime=RuntimeKind.HOST, runtimes=runtimes_of("master")))
    node = loaded.job.spec.role("node")
    assert node.replicas == 2 and node.env["CUSTOM_VAR"] == "custom-value"
    assert any("spec.runtimePatches[0].trainingRuntimeSpec.template.metadata.labels" in n for n in loaded.ignored)
    assert any(n.endswith("nodeSelector: the local backend does not select nodes") for n in loaded.ignored)
    v21 = load_job(
        DATA / "trainjobs" / "pr2925-0ab6c6a--examples--yaml--advanced--01-podspec-overrides.yaml",
        LoadOptions(runtime=RuntimeKind.HOST, runtimes=runtimes_of("v2.1.0")),
    )
    assert v21.job.spec.framework_params.get("nprocPerNode") == 1
    assert any("numProcPerNode: approximated: 'auto'" in n for n in v21.ignored)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_upstream_multi_node_example_runs_on_the_torch_runtime(tmp_path: Path) -> None:
    """``trainmaster run trainjob.yaml runtime.yaml``: upstream's 01-multi-node TrainJob with the
    master torch-distributed runtime, unchanged: torchrun on 3 nodes, a gloo world of 3."""
    job = DATA / "trainjobs" / "examples--yaml--01-multi-node.yaml"
    runtime = DATA / "runtimes" / "manifests--base--runtimes--torch_distributed.yaml"
    proc, status = run_job_file(job, tmp_path, str(runtime), "--runtime", "host", timeout=220)
    logs = run_logs(tmp_path)
    assert proc.returncode == 0 and status["state"] == "succeeded", proc.stderr[-2000:] + logs[-3000:]
    for rank in range(3):
        assert f"RANK: {rank}" in logs, logs
    assert logs.count("WORLD_SIZE: 3") == 3, logs


MPI_TRAINJOB = """
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata:
  name: mpi-ranks
spec:
  runtimeRef:
    name: deepspeed-distributed
  trainer:
    numNodes: 2
    numProcPerNode: 2
    command:
      - mpirun
      - python
      - -c
      - "import os; print('rank', os.environ['OMPI_COMM_WORLD_RANK'], 'of', os.environ['OMPI_COMM_WORLD_SIZE'], flush=True)"
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_trainjob_on_the_mpi_runtime_runs_its_ranks_in_the_rank_hosts(tmp_path: Path) -> None:
    """The deepspeed runtime (MPI policy, OpenMPI, numProcPerNode) installed with ``trainmaster
    runtime add``, a TrainJob naming it: mpirun in the launcher runs numNodes x numProcPerNode = 4
    ranks through the hostfile, in the 2 rank hosts."""
    import shutil
    import subprocess
    import sys

    if shutil.which("mpirun") is None:
        pytest.skip("mpirun (openmpi-bin) is not installed")
    runtime = DATA / "runtimes" / "manifests--base--runtimes--deepspeed_distributed.yaml"
    env = {**os.environ, "TRAINMASTER_HOME": str(tmp_path / "home")}
    db = f"sqlite:///{tmp_path / 'tm.db'}"
    added = subprocess.run(
        [sys.executable, "-m", "trainmaster", "runtime", "add", str(runtime), "--db", db],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert added.returncode == 0 and "ClusterTrainingRuntime/deepspeed-distributed: installed" in added.stdout, added
    listed = subprocess.run(
        [sys.executable, "-m", "trainmaster", "runtime", "list", "--db", db],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert "deepspeed-distributed" in listed.stdout and "mpi" in listed.stdout, listed
    job = tmp_path / "mpi-trainjob.yaml"
    job.write_text(MPI_TRAINJOB)
    proc, status = run_job_file(job, tmp_path, "--runtime", "host", timeout=220)
    logs = run_logs(tmp_path)
    assert proc.returncode == 0 and status["state"] == "succeeded", proc.stderr[-2000:] + logs[-3000:]
    for rank in range(4):
        assert f"rank {rank} of 4" in logs, logs
