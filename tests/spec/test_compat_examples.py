"""The shipped Kubeflow/Volcano examples: they convert, validate, print with ``trainmaster
convert``, and (PyTorchJob and Volcano Job) run unchanged to success under ``trainmaster run``."""

from __future__ import annotations

import json
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from controller_harness import ROOT, run_job_file, run_logs
from trainmaster.cli import convert as convert_cli
from trainmaster.errors import UserError
from trainmaster.containers.runtime import unavailable
from trainmaster.loading import load_job
from trainmaster.spec.load import LoadOptions
from trainmaster.spec.model import RuntimeKind
from trainmaster.spec.compat.meta import SOURCE_ANNOTATION

EXAMPLES = {
    "kubeflow-pytorchjob.yaml": ("pytorch", {"master": 1, "worker": 2}),
    "kubeflow-tfjob.yaml": (None, {"ps": 1, "worker": 2}),
    "kubeflow-mpijob.yaml": ("mpi", {"launcher": 1, "worker": 2}),
    "volcano-job.yaml": ("command", {"server": 1, "client": 2}),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_converts_and_validates(name: str) -> None:
    """Mechanism: each shipped example converts and passes load_job validation and defaulting."""
    framework, roles = EXAMPLES[name]
    loaded = load_job(ROOT / "examples" / name, LoadOptions())
    job = loaded.job
    if framework is not None:
        assert job.spec.framework == framework
    assert {r.name: r.replicas for r in job.spec.roles} == roles
    assert job.metadata.annotations[SOURCE_ANNOTATION]
    # converted as `auto`, settled when loaded: a container where podman runs here, else the host
    here = "container" if unavailable() == "" else "host"
    assert all(r.image and r.runtime == here for r in job.spec.roles)
    on_host = load_job(ROOT / "examples" / name, LoadOptions(runtime=RuntimeKind.HOST)).job  # --runtime host
    assert all(r.command and r.runtime == "host" for r in on_host.spec.roles)


def _app() -> typer.Typer:
    app = typer.Typer()
    convert_cli.register(app)

    @app.callback()
    def _root() -> None:
        """Test app."""

    return app


def test_convert_cli_prints_yaml_and_lists_ignored_fields() -> None:
    """Mechanism: `trainmaster convert FILE` prints the converted spec (YAML) on stdout and the
    ignored fields on stderr; --json prints JSON."""
    runner = CliRunner()
    path = str(ROOT / "examples" / "volcano-job.yaml")
    result = runner.invoke(_app(), ["convert", path])
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load(result.stdout)
    assert doc["apiVersion"] == "trainmaster/v1" and doc["metadata"]["name"] == "web-check"
    assert "ignored: spec.schedulerName:" in result.stderr
    result = runner.invoke(_app(), ["convert", path, "--json"])
    assert json.loads(result.stdout) == doc


def test_convert_cli_rejects_what_it_cannot_convert(tmp_path: Path) -> None:
    """Mechanism: convert on a non-Kubeflow/Volcano file or an invalid result is a UserError."""
    ours = tmp_path / "ours.yaml"
    ours.write_text(
        "apiVersion: trainmaster/v1\nkind: Job\nmetadata: {name: a}\nspec: {roles: [{name: a, command: [x]}]}\n"
    )
    result = CliRunner().invoke(_app(), ["convert", str(ours)])
    assert isinstance(result.exception, UserError) and "needs no conversion" in str(result.exception)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: kubeflow.org/v1\nkind: PyTorchJob\nmetadata: {name: Bad_Name}\n"
        "spec: {pytorchReplicaSpecs: {Master: {replicas: 2, template: {spec: "
        "{containers: [{name: pytorch, command: [python]}]}}}}}\n"
    )
    result = CliRunner().invoke(_app(), ["convert", str(bad)])
    assert isinstance(result.exception, UserError)
    assert "metadata.name" in str(result.exception) and "spec.roles[0].replicas" in str(result.exception)
    result = CliRunner().invoke(_app(), ["convert", str(bad), "--no-check"])
    assert result.exit_code == 0 and "Bad_Name" in result.stdout


def _run_example(name: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    return run_job_file(ROOT / "examples" / name, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kubeflow_pytorchjob_runs_unchanged(tmp_path: Path) -> None:
    """Mechanism: a Kubeflow PyTorchJob (master 1, worker 2, python command) runs unchanged:
    gloo rendezvous through the injected MASTER_ADDR/PORT and an all_reduce over 3 ranks."""
    proc, status = _run_example("kubeflow-pytorchjob.yaml", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "containers[0].image" not in proc.stderr  # kept as the role's image (TRAINMASTER_RUNTIME=host here)
    assert status["state"] == "succeeded"
    logs = run_logs(tmp_path)
    for rank in range(3):
        assert f"rank {rank} of 3: all_reduce sum = 6" in logs, logs


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_volcano_job_runs_unchanged(tmp_path: Path) -> None:
    """Mechanism: a Volcano Job with dependsOn and minAvailable runs unchanged: clients start
    after the server has an address, reach it through TM_SERVICE_SERVER, and TaskCompleted ->
    CompleteJob ends the job while the server still serves."""
    proc, status = _run_example("volcano-job.yaml", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert status["state"] == "succeeded"
    assert {r["name"]: r["state"] for r in status["roles"]}["client"] == "succeeded"
    logs = run_logs(tmp_path)
    for index in range(2):
        assert f"client {index}: http://127.0.0.1:" in logs and "says 'hello from server-0'" in logs, logs


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "name, line",
    [
        ("kubeflow-tfjob.yaml", "parameter is now"),
        ("kubeflow-mpijob.yaml", "pi is approximately 3.14159"),
    ],
)
def test_tfjob_and_mpijob_run_unchanged(tmp_path: Path, name: str, line: str) -> None:
    """Mechanism: the converted start order (every TF replica waits for the cluster to be placed,
    TF_CONFIG; the MPI launcher waits for every worker, then mpirun runs 4 ranks in them) and
    success policy (AllWorkers; launcher succeeded) hold when the job runs."""
    if name == "kubeflow-mpijob.yaml" and (
        shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None
    ):
        pytest.skip("the MPIJob example needs mpirun (Debian openmpi-bin) and mpi4py (the mpi extra)")
    proc, status = _run_example(name, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert status["state"] == "succeeded"
    assert line in run_logs(tmp_path)
