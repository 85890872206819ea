"""Which roles run in containers and what they mount (issue #22), with and without a container
runtime (the probe's answer is replaced, so these run on any machine): role > job > host, ``auto``
follows the operator's ``--runtime`` (its variable TRAINMASTER_RUNTIME), else podman's presence; a role that needs a missing
runtime is refused by ``trainmaster run`` (exit 2, how to install podman or run on the host);
hostPath volumes are confined like every job path; the podman command line follows Kubernetes'
command/args semantics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainmaster.contract import ContainerLaunch
from trainmaster.containers import policy
from trainmaster.containers.runtime import ContainerRuntime, run_argv
from trainmaster.errors import UserError
from trainmaster.spec import load_document
from trainmaster.spec.load import LoadOptions
from trainmaster.spec.model import RuntimeKind
from trainmaster.spec.paths import PathPolicy

REPO = str(Path(__file__).resolve().parents[2])
MISSING = "podman is not installed: install podman and runc (...), or ... 'runtime: host'"


def job(**role: object) -> dict:
    spec_role = {"name": "main", "command": ["true"], **role}
    spec_role = {k: v for k, v in spec_role.items() if v is not None}
    return {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": {"roles": [spec_role]}}


@pytest.mark.parametrize("present", [True, False])
def test_runtime_resolution(present: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "unavailable", lambda: "" if present else MISSING)
    monkeypatch.delenv("TRAINMASTER_RUNTIME", raising=False)

    def runs(doc: dict, operator: RuntimeKind | None = None) -> bool:
        loaded = load_document(doc, options=LoadOptions(runtime=operator)).job
        return policy.runs_in_container(loaded.spec, loaded.spec.roles[0])

    assert not runs(job(image="x"))  # default: host
    assert runs(job(image="x", runtime="container"))
    assert runs(job(image="x", runtime="auto")) == present  # with a command: host where no podman
    assert runs(job(image="x", runtime="auto", command=None))  # entry point only: always a container
    doc = job(image="x")
    doc["spec"]["runtime"] = "container"
    assert runs(doc)  # the job's default
    doc["spec"]["roles"][0]["runtime"] = "host"
    assert not runs(doc)  # the role's own wins
    assert not runs(job(runtime="auto"))  # nothing to run a container from
    assert not runs(job(image="x", runtime="auto"), RuntimeKind.HOST)  # the operator's choice for auto
    assert runs(job(image="x", runtime="auto"), RuntimeKind.CONTAINER)
    assert runs(job(image="x", runtime="auto"), RuntimeKind.AUTO) == present
    assert runs(job(image="x", runtime="container"), RuntimeKind.HOST)  # never over the job's own choice
    assert not runs(job(image="x", runtime="host"), RuntimeKind.CONTAINER)


def test_the_operator_runtime_is_a_flag_with_its_variable(tmp_path: Path) -> None:
    """``trainmaster run --runtime host|container`` (TRAINMASTER_RUNTIME when the flag is not
    given) pins a converted file's ``auto`` roles when the job is loaded: the job says where it runs."""
    path = tmp_path / "job.yaml"
    container = {"name": "pytorch", "image": "localhost/x:1", "command": ["true"]}
    master = {"replicas": 1, "template": {"spec": {"containers": [container]}}}
    doc = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "p"}}
    path.write_text(yaml.safe_dump({**doc, "spec": {"pytorchReplicaSpecs": {"Master": master}}}))
    env = {**os.environ, "PYTHONPATH": REPO, "TRAINMASTER_HOME": str(tmp_path / "home"), "COLUMNS": "1000"}

    def dry_run(*flags: str, variable: str | None = None) -> subprocess.CompletedProcess[str]:
        run_env = {k: v for k, v in env.items() if k != "TRAINMASTER_RUNTIME"}
        if variable is not None:
            run_env["TRAINMASTER_RUNTIME"] = variable
        argv = [sys.executable, "-m", "trainmaster", "run", str(path), "--dry-run", *flags]
        return subprocess.run(argv, capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=60)

    def runtime_of(proc: subprocess.CompletedProcess[str]) -> str:
        assert proc.returncode == 0, proc.stderr
        return next(yaml.safe_load_all(proc.stdout))["spec"]["roles"][0]["runtime"]

    assert runtime_of(dry_run("--runtime", "host")) == "host"
    assert runtime_of(dry_run(variable="container")) == "container"
    assert runtime_of(dry_run("--runtime", "host", variable="container")) == "host"  # the flag wins
    assert runtime_of(dry_run()) == "auto"  # decided at launch by podman's presence
    bad = dry_run("--runtime", "sideways")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "sideways" in bad.stderr, bad.stderr


def test_the_server_pins_auto_roles_with_its_runtime_option(tmp_path: Path) -> None:
    """``trainmaster server --runtime host`` is ``ServiceOptions.runtime``: a submitted file's
    ``auto`` roles are stored pinned to it (the reconcile loop never reads the environment)."""
    from fastapi.testclient import TestClient

    from trainmaster.backends.local import LocalBackend
    from trainmaster.controller import Controller
    from trainmaster.service.app import ServiceOptions, create_app
    from trainmaster.store import repository as repo
    from trainmaster.store.db import make_engine, session_factory

    url = f"sqlite:///{tmp_path / 'store.db'}"
    controller = Controller(session_factory(make_engine(url)), LocalBackend(), url, runs_dir=tmp_path / "runs")
    app = create_app(controller, reconcile=False, options=ServiceOptions(runtime=RuntimeKind.HOST))
    container = {"name": "pytorch", "image": "localhost/x:1", "command": ["true"]}
    master = {"replicas": 1, "template": {"spec": {"containers": [container]}}}
    doc = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "p"}}
    with TestClient(app) as client:
        reply = client.post("/api/v1/jobs", json={**doc, "spec": {"pytorchReplicaSpecs": {"Master": master}}})
        assert reply.status_code == 201, reply.text
    with controller.sessions() as session:
        stored = repo.load_job(session, reply.json()["id"]).spec
    assert stored["spec"]["roles"][0]["runtime"] == "host"


def test_container_roles_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError) as err:
        load_document(job(runtime="container"))
    assert "runtime: container needs an image" in str(err.value) + str(getattr(err.value, "details", ""))
    monkeypatch.setattr(policy, "unavailable", lambda: MISSING)
    problems = policy.container_problems(load_document(job(image="x", runtime="container")).job)
    assert len(problems) == 1 and "spec.roles[0] (main)" in problems[0] and "runtime: host" in problems[0]


def test_run_refuses_a_container_role_without_podman(tmp_path: Path) -> None:
    """``trainmaster run`` where podman is not on PATH: exit 2, no traceback, what to do."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(image="localhost/x:1", runtime="container")))
    env = {
        **os.environ,
        "PATH": str(Path(sys.executable).parent),
        "PYTHONPATH": REPO,
        "TRAINMASTER_HOME": str(tmp_path / "home"),
        "COLUMNS": "1000",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "trainmaster", "run", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "apt-get install -y podman runc" in proc.stderr and "runtime: host" in proc.stderr


def test_host_path_volumes_are_confined_like_job_paths(tmp_path: Path) -> None:
    doc = job(image="x", runtime="container", volumes=[{"name": "d", "hostPath": "/etc", "mountPath": "/d"}])
    options = LoadOptions(paths=PathPolicy(base=tmp_path, allowed_roots=(tmp_path,)))
    with pytest.raises(UserError) as err:
        load_document(doc, options=options)
    assert "spec.roles[0].volumes[0].hostPath" in str(getattr(err.value, "details", "")) + str(err.value)
    allowed = LoadOptions(paths=PathPolicy(base=tmp_path, allowed_roots=(tmp_path, Path("/etc"))))
    assert load_document(doc, options=allowed).job.spec.roles[0].volumes[0].host_path == "/etc"
    relative = job(image="x", runtime="container", volumes=[{"name": "d", "hostPath": "data", "mountPath": "/d"}])
    role = load_document(relative, options=options).job.spec.roles[0]
    launch = policy.container_launch(str(tmp_path / "run"), role)
    assert {"source": str(tmp_path / "data"), "target": "/d", "read_only": False} in launch.mounts
    assert {"source": str(tmp_path / "run"), "target": str(tmp_path / "run"), "read_only": False} in launch.mounts
    for bad in (
        {"name": "d", "mountPath": "/d"},
        {"name": "d", "mountPath": "rel", "emptyDir": True},
        {"name": "d", "mountPath": "/d", "emptyDir": True, "hostPath": "x"},
    ):
        with pytest.raises(UserError):
            load_document(job(image="x", volumes=[bad]))


def test_podman_command_line_follows_kubernetes() -> None:
    runtime = ContainerRuntime("/usr/bin/podman", "runc")

    def argv(launch: ContainerLaunch, **extra: object) -> list[str]:
        return run_argv(
            runtime,
            launch,
            name="n",
            node_key="k",
            instance_id="j/r-0/1",
            env_file="/e",
            cid_file="/c",
            cpu=extra.get("cpu", 0.0),
            memory=extra.get("memory", 0),
        )  # type: ignore[arg-type]

    own = argv(ContainerLaunch("img"))
    assert own[:3] == ["/usr/bin/podman", "--runtime", "runc"] and own[-1] == "img" and "--entrypoint" not in own
    for flag in (["--network", "host"], ["--name", "n"], ["--label", "trainmaster.agent=k"], ["--pull", "missing"]):
        assert any(own[i : i + 2] == flag for i in range(len(own))), flag
    args_only = argv(ContainerLaunch("img", args=["a", "b"]))
    assert args_only[-3:] == ["img", "a", "b"] and "--entrypoint" not in args_only
    both = argv(
        ContainerLaunch("img", command=["/bin/x", "-c"], args=["y"], pull_policy="Never"), cpu=1.5, memory=1 << 20
    )
    i = both.index("--entrypoint")
    assert json.loads(both[i + 1]) == ["/bin/x", "-c"] and both[-2:] == ["img", "y"]
    assert "--cpus" in both and "1.5" in both and str(1 << 20) in both and "never" in both


def test_backends_without_containers_run_auto_roles_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend whose agents start processes only (a third-party one): an auto role with a
    command runs on the host there; a role that must run in a container is refused, naming the
    backend. The local, Ray and testbed backends' agents run containers."""
    monkeypatch.setattr(policy, "unavailable", lambda: "")
    auto = load_document(job(image="x", runtime="auto")).job
    assert policy.runs_in_container(auto.spec, auto.spec.roles[0])
    assert not policy.runs_in_container(auto.spec, auto.spec.roles[0], backend_runs_containers=False)
    assert policy.container_problems(auto, "elsewhere") == []
    explicit = load_document(job(image="x", runtime="container")).job
    problems = policy.container_problems(explicit, "elsewhere")
    assert len(problems) == 1 and "the elsewhere backend does not run containers" in problems[0]
    for backend in ("local", "ray", "testbed"):  # each node's (each testbed host's) agent runs them
        assert policy.container_problems(explicit, backend) == []
