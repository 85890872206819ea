"""Mechanisms on the Ray backend, through the controller: dependencies with the wait step and the
address registry (spec steps 4-5), gang scheduling with one placement group per job (a job whose
group Ray cannot place stays pending with the reason), fault tolerance when a node agent
dies (spec step 6; its instances' process trees die with it, never two copies), logs collected, and
``trainmaster run --backend ray``. One local Ray cluster serves the whole module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller_harness import RAY_NODE_IP, Harness, events, job, pids_alive, py, server_client_job, step_until

ray = pytest.importorskip("ray", reason="the optional ray extra (trainmaster[ray]) is not installed")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def ray_backend() -> Iterator[Any]:
    from trainmaster.backends.ray import RayBackend

    backend = RayBackend(node_ip=RAY_NODE_IP)
    yield backend
    backend.close()


@pytest.fixture
def ray_harness(tmp_path: Path, ray_backend: Any) -> Harness:
    return Harness(tmp_path, backend=ray_backend)


def test_server_client_dependency_job_succeeds_on_ray(ray_harness: Harness) -> None:
    """Dependencies and the communication service on Ray: instances are addressed by the node
    Ray placed them on (not the controller's host), and clients reach the server there."""
    state, status = ray_harness.run(server_client_job("svc", clients=2))
    assert state == "succeeded", status["events"]
    assert status["backend"] == "ray"
    server = next(i for i in status["instances"] if i["role"] == "server")
    assert server["address"].startswith(f"{RAY_NODE_IP}:")  # its node's address, where it listens
    assert (
        f"TM_SERVICE_SERVER={server['address']}"
        in Path(next(i for i in status["instances"] if i["role"] == "client")["logPath"]).read_text()
    )
    for client in (i for i in status["instances"] if i["role"] == "client"):
        assert client["state"] == "succeeded"
        assert "client got hello" in Path(client["logPath"]).read_text()  # logs collected
    assert events(status, "Admitted")  # its placement group was reserved first


def test_a_port_taken_on_the_node_is_replaced_and_the_address_follows(
    ray_harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Placement after start on Ray: the port the controller reserved for the server is taken on
    the node Ray chose (Ray's own workers hold ports there too). The attempt gets a free port of
    that node instead of failing, and the address the registry publishes follows it, so the
    clients still reach the server."""
    import socket

    from trainmaster.backends.base import Placement

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind((RAY_NODE_IP, 0))  # bound, not listening: a client sent here would be refused
    port = taken.getsockname()[1]
    backend = ray_harness.backend
    real_place = backend.place
    placed: list[Placement] = []

    def place(count: int, resources: dict[str, Any]) -> Placement:
        placement = real_place(count, resources) if placed else Placement("127.0.0.1", [port])
        placed.append(placement)
        return placement

    monkeypatch.setattr(backend, "place", place)  # the server is placed first (dependency order)
    try:
        state, status = ray_harness.run(server_client_job("moved", clients=2))
    finally:
        taken.close()
    assert state == "succeeded", status["events"]
    server = next(i for i in status["instances"] if i["role"] == "server")
    assert server["address"].startswith(f"{RAY_NODE_IP}:") and server["address"] != f"{RAY_NODE_IP}:{port}"
    for client in (i for i in status["instances"] if i["role"] == "client"):
        assert f"TM_SERVICE_SERVER={server['address']}" in Path(client["logPath"]).read_text()


def test_stopping_an_attempt_whose_start_was_refused_is_quiet(ray_backend: Any, tmp_path: Path) -> None:
    """Stop on Ray: an attempt the node refused to start (its workingDir is missing) never ran,
    so a stop that comes before any poll (a job cancelled at once) has nothing to ask its actor
    and ends quietly; the attempt then reads as a failed start."""
    from test_backend_suite import launch_request
    from trainmaster.backends.base import Phase

    request = launch_request(ray_backend, tmp_path, "", "refused", cwd=str(tmp_path / "missing"), argv=["true"])
    [handle] = list(ray_backend.start_all([request]))
    ray_backend.stop([handle], grace=30)  # waits for the start call's outcome, then asks nothing
    obs = ray_backend.poll(handle)
    assert obs.phase == Phase.EXITED and obs.reason == "StartFailed" and "missing" in obs.message


def test_a_gang_just_admitted_is_being_placed_not_diagnosed() -> None:
    """Gang scheduling on Ray: a placement group Ray has had no time to place yet is reported as
    being placed (issue 38: 'not placed after 0s; no single node fits a bundle like {'CPU':
    0.01}' for a job admitted the same second); after GANG_SETTLE seconds the reason says what
    the cluster lacks, or that no node fits its largest bundle."""
    from trainmaster.backends.ray import GANG_SETTLE, gang_pending_reason

    bundles = [{"CPU": 0.01}, {"CPU": 0.01}]
    fresh = gang_pending_reason(bundles, 0.0, {}, {})
    assert fresh == "Ray is placing the placement group of 2 instance bundle(s)"
    late = gang_pending_reason(bundles, GANG_SETTLE + 1, {"CPU": 2.0}, {"CPU": 0.0})
    assert "not placed after 6s; short of 0.02 CPU (cluster has 2 CPU, 0 CPU free)" in late
    unfit = gang_pending_reason([{"CPU": 3.0}], GANG_SETTLE, {"CPU": 4.0}, {"CPU": 4.0})
    assert unfit.endswith("no single node fits a bundle like {'CPU': 3.0}")


def test_gang_stays_pending_with_the_reason_until_ray_can_place_it(ray_harness: Harness) -> None:
    """Another tenant of the cluster holds every CPU: the controller's own accounting admits the
    job, but Ray cannot place its placement group, so nothing starts and the reason says why."""
    from ray.util.placement_group import placement_group, remove_placement_group

    cpus = ray.cluster_resources()["CPU"]
    blocker = placement_group([{"CPU": cpus}])
    assert blocker.wait(timeout_seconds=30)
    try:
        job_id = ray_harness.submit(
            job(
                "gang",
                [{"name": "worker", "replicas": 2, "resources": {"cpu": cpus / 2}, "command": py("print('ran')")}],
            )
        )
        status = step_until(ray_harness, job_id, lambda s: s["reason"] == "GangPending", timeout=20)
        assert "Ray is placing the placement group of 2 instance bundle(s)" in status["message"]  # not yet judged
        status = step_until(ray_harness, job_id, lambda s: "not placed after" in s["message"], timeout=30)
        assert status["state"] == "pending" and status["reason"] == "GangPending"
        assert f"short of {cpus:g} CPU (cluster has {cpus:g} CPU, 0 CPU free)" in status["message"]
        assert status["instances"] == []  # gang: not one instance started
    finally:
        remove_placement_group(blocker)
    status = step_until(ray_harness, job_id, lambda s: s["state"] in ("succeeded", "failed"))
    assert status["state"] == "succeeded", status["events"]


def test_instance_whose_node_agent_is_killed_is_replaced_and_its_process_tree_killed(ray_harness: Harness) -> None:
    """Fault tolerance on Ray (spec step 6): kill -9 of the node agent actor (its worker runs
    ``trainmaster.agent.NodeAgent``) that owns an instance. The instance is reported lost with the
    node named, its whole process tree is gone with the agent (``ray_agent.AgentGuard``: never two
    copies at once), and its restart policy starts attempt 2 on a new agent of the same node,
    which took the state dir's owner lock after the guard and journaled attempt 1 as
    ``AgentRestarted`` (the real agent's restart rule)."""
    import signal

    import psutil

    from trainmaster.agent.tree import cgroups_available
    from trainmaster.backends.ray import ATTEMPT_RECORD, NAMESPACE

    job_id = ray_harness.submit(
        job(
            "ft",
            [
                {
                    "name": "worker",
                    "command": py(
                        "import subprocess, sys, time\n"
                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                        "time.sleep(60)"
                    ),
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 1, "backoffSeconds": 0},
                }
            ],
        )
    )
    step_until(ray_harness, job_id, lambda s: s["state"] == "running")
    with ray_harness.sessions() as session:
        from trainmaster.store.models import InstanceRow

        first = session.query(InstanceRow).one().handle
    first_pid = json.loads((Path(first["instance_dir"]) / ATTEMPT_RECORD).read_text())["pid"]
    tree: list[int] = []
    deadline = time.monotonic() + 30
    while not tree and time.monotonic() < deadline:  # the command and the child it starts
        tree = [p.pid for p in psutil.Process(first_pid).children(recursive=True)]
        time.sleep(0.05)
    assert tree
    agent = ray.get_actor(first["agent"], namespace=NAMESPACE)
    where = ray.get(agent.where.remote())
    assert where["trees"] == ("cgroup" if not cgroups_available() else "marker"), where
    os.kill(where["pid"], signal.SIGKILL)
    status = step_until(
        ray_harness, job_id, lambda s: s["instances"][0]["attempt"] == 2 and s["instances"][0]["state"] == "running"
    )
    restarting = events(status, "Restarting")
    assert restarting and "AgentLost" in restarting[0]["message"], restarting
    assert first["node"][:12] in restarting[0]["message"]
    assert pids_alive([first_pid, *tree]) == [], restarting[0]["message"]
    again = ray.get_actor(first["agent"], namespace=NAMESPACE)
    assert ray.get(again.where.remote())["pid"] != where["pid"]
    # the record itself may be forgotten already (the controller stored the loss): its journal line stays
    lines = [json.loads(line) for line in (Path(where["state_dir"]) / "journal.jsonl").read_text().splitlines()]
    exits = [
        line
        for line in lines
        if line.get("t") == "exit" and line["status"]["handle"]["instance_id"] == first["instance_id"]
    ]
    assert [(e["status"]["reason"], e["status"]["exit_code"]) for e in exits] == [("AgentRestarted", 137)], lines
    ray_harness.controller.cancel(job_id)
    status = step_until(ray_harness, job_id, lambda s: s["state"] == "cancelled")


def test_an_attempt_that_ended_before_its_handle_was_saved_runs_once_after_a_controller_crash(
    tmp_path: Path, ray_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crash safety on Ray: the controller dies after its node agent started the attempts but
    before it saved their handles, and the attempts run to completion while no controller
    watches. The new controller asks the node agents for each attempt by its instance id
    (``handle_of``: the agent's journal is keyed by it, attempt included), learns each exit, and
    applies the restart policy to it: nothing runs a second time, nothing is NotStarted."""
    from trainmaster.backends.base import Phase
    from trainmaster.backends.ray import RayBackend
    from trainmaster.controller.launching import instance_id
    from trainmaster.store import repository as repo

    class ControllerCrash(Exception):
        """Stands for the controller process dying at that point."""

    markers = tmp_path / "markers"
    markers.mkdir()
    first = Harness(tmp_path, backend=ray_backend)
    job_id = first.submit(
        job(
            "once",
            [
                {
                    "name": "worker",
                    "replicas": 2,
                    "command": ["/bin/sh", "-c", f"mktemp -p {markers}"],
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 3},
                }
            ],
        )
    )
    spawn = ray_backend.start_all

    def start_then_crash(requests):  # type: ignore[no-untyped-def]
        list(spawn(requests))  # every attempt is sent to its node's agent...
        raise ControllerCrash  # ...and the controller dies before recording one

    monkeypatch.setattr(ray_backend, "start_all", start_then_crash)
    with pytest.raises(ControllerCrash):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # passes until Ray has placed the gang and it starts
            first.controller.step()
            time.sleep(0.1)
    monkeypatch.undo()
    ray_backend.release_gang(job_id)  # what the dead controller's driver held goes with it
    with first.sessions() as session:
        row = repo.load_job(session, job_id)
        ids = [instance_id(row, inst) for inst in row.instances]
    assert len(ids) == 2
    watcher = RayBackend(node_ip=RAY_NODE_IP)  # a bystander: the attempts end unwatched
    deadline = time.monotonic() + 60
    while True:
        found = [watcher.handle_of(i) for i in ids]
        if all(h is not None and watcher.poll(h).phase == Phase.EXITED for h in found):
            break
        assert time.monotonic() < deadline, f"the attempts did not end: {found}"
        time.sleep(0.2)
    assert watcher.handle_of(ids[0].rsplit("/", 1)[0] + "/9") is None  # an attempt never started
    second = Harness(tmp_path, backend=RayBackend(node_ip=RAY_NODE_IP))
    second.controller.recover()
    assert second.controller.run_job(job_id) == "succeeded"
    assert len(list(markers.iterdir())) == 2
    events_seen = [e["reason"] for e in second.status(job_id)["events"]]
    assert "NotStarted" not in events_seen and "Adopted" not in events_seen, events_seen


def test_trainmaster_run_backend_ray(tmp_path: Path) -> None:
    """The CLI path: ``trainmaster run --backend ray`` starts its own local cluster and succeeds."""
    spec = tmp_path / "svc.yaml"
    spec.write_text(yaml.safe_dump(server_client_job("svc-cli", clients=2)))
    out = subprocess.run(
        [sys.executable, "-m", "trainmaster", "run", str(spec), "--backend", "ray", "--interval", "0.1", "--json"],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "TRAINMASTER_DB": f"sqlite:///{tmp_path / 'cli.db'}"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    final = json.loads(out.stdout)
    assert final["state"] == "succeeded" and final["backend"] == "ray"
    assert sorted(i["state"] for i in final["instances"]) == ["succeeded"] * 3
