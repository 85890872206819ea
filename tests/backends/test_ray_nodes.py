"""Mechanisms on a Ray cluster of several nodes (controller spec, Ray backend; issue 14 part 3):
one node agent actor per Ray node (not one actor per instance) that starts that node's
instances in one batched call; an instance runs on the node of its placement group bundle;
addresses resolve across nodes (each node's own IP); node loss: a node removed mid-job makes its
instances Lost with the node named, and their restart policy runs them on the remaining nodes.

The cluster is ``ray.cluster_utils.Cluster`` with three nodes on three loopback addresses
(127.0.0.2 is the head, .3 and .4 join it), 2 CPUs each (Ray's accounting only: this machine
has 2 cores), shared by the whole module and shut down in its finalizer. The node-loss test
removes a node (gracefully, then by SIGKILL of all its processes), so it runs last and first adds
a node back when fewer than three are alive.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller_harness import CLIENT, SERVER, Harness, events, job, pids_alive, py, step_until
from trainmaster.contract import InstanceHandle

ray = pytest.importorskip("ray", reason="the optional ray extra (trainmaster[ray]) is not installed")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

NODE_IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
SPARE_IPS = iter(f"127.0.0.{n}" for n in range(5, 30))  # a new address for each node added later
NODE_CPUS = 2
# Ray declares a node dead after this many failed health checks, one per period: with Ray's
# defaults a node killed outright is seen dead only after about 15 s.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    from trainmaster.backends.ray import NAMESPACE

    if ray.is_initialized():  # another module's single-node cluster: this one needs its own
        ray.shutdown()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    nodes = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": NODE_CPUS,
            "node_ip_address": NODE_IPS[0],
            "include_dashboard": False,
            "_system_config": HEALTH_CHECKS,
        },
    )
    try:
        for ip in NODE_IPS[1:]:
            nodes.add_node(num_cpus=NODE_CPUS, node_ip_address=ip)
        ray.init(address=nodes.address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        nodes.wait_for_nodes()
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture
def harness(tmp_path: Path, cluster: Any) -> Iterator[Harness]:
    from trainmaster.backends.ray import RayBackend

    backend = RayBackend()  # joins the module's cluster (already connected)
    yield Harness(tmp_path, backend=backend)
    backend.close()


def agents() -> list[str]:
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("tm-agent-")
    )


def test_a_job_spreads_over_nodes_and_addresses_resolve_across_them(harness: Harness) -> None:
    """Each instance's bundle takes a whole node (2 CPUs), so the server and its two clients run
    on three different nodes; the server's address is its node's IP, and clients on the other
    nodes reach it there through TM_SERVICE_SERVER. One agent actor per node started them."""
    doc = job(
        "spread",
        [
            {"name": "server", "command": py(SERVER), "env": {"CLIENTS": "2"}, "resources": {"cpu": NODE_CPUS}},
            {
                "name": "client",
                "replicas": 2,
                "command": py(CLIENT),
                "dependsOn": [{"role": "server"}],
                "resources": {"cpu": NODE_CPUS},
            },
        ],
    )
    job_id = harness.submit(doc)
    status = step_until(harness, job_id, lambda s: s["state"] in ("succeeded", "failed"), timeout=120)
    assert status["state"] == "succeeded", status["events"]
    hosts = {i["role"] + str(i["index"]): i["address"].split(":")[0] for i in status["instances"]}
    assert sorted(hosts.values()) == sorted(NODE_IPS), hosts  # one instance per node
    server = next(i for i in status["instances"] if i["role"] == "server")
    for client in (i for i in status["instances"] if i["role"] == "client"):
        log = Path(client["logPath"]).read_text()
        assert f"TM_SERVICE_SERVER={server['address']}" in log and "client got hello" in log
        assert client["address"].split(":")[0] != server["address"].split(":")[0]
    assert len(agents()) == len(NODE_IPS)  # not one actor per instance


def test_many_replicas_start_through_one_agent_per_node(harness: Harness) -> None:
    """24 replicas over the cluster: every one runs, on the node of its bundle, and the cluster
    holds exactly one agent actor per node however many instances each node runs."""
    job_id = harness.submit(
        job("many", [{"name": "worker", "replicas": 24, "command": ["sleep", "30"], "resources": {"cpu": 0.25}}])
    )
    status = step_until(
        harness, job_id, lambda s: sum(i["state"] == "running" for i in s["instances"]) == 24, timeout=120
    )
    per_node: dict[str, int] = {}
    for inst in status["instances"]:
        host = inst["address"].split(":")[0] if inst["address"] else inst["host"]
        per_node[host] = per_node.get(host, 0) + 1
    assert set(per_node) <= set(NODE_IPS) and sum(per_node.values()) == 24
    assert len(agents()) == len(NODE_IPS)
    harness.controller.cancel(job_id)
    step_until(harness, job_id, lambda s: s["state"] == "cancelled")


def test_a_restarted_controller_finds_the_node_agents_by_name_and_adopts_their_instances(
    tmp_path: Path, cluster: Any
) -> None:
    """Controller restart on Ray: the node agents are detached actors, so they and their instances
    outlive the controller's Ray driver. A new controller over the same store (a new driver)
    finds each agent again by its name ``tm-agent-<node_id>`` and adopts the running instances:
    same processes, same attempt, nothing started twice; cancelling then ends them."""
    from trainmaster.backends.ray import NAMESPACE, RayBackend
    from trainmaster.store.models import InstanceRow

    first = Harness(tmp_path, backend=RayBackend())
    job_id = first.submit(
        job(
            "adopt",
            [
                {
                    "name": "worker",
                    "replicas": 3,
                    "resources": {"cpu": NODE_CPUS},  # one per node
                    "command": py(
                        "import subprocess, sys, time\n"
                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                        "time.sleep(120)"
                    ),
                }
            ],
        )
    )
    step_until(first, job_id, lambda s: sum(i["state"] == "running" for i in s["instances"]) == 3, timeout=120)
    with first.sessions() as session:
        handles = [r.handle for r in session.query(InstanceRow)]
    assert len({h.node for h in handles}) == 3
    trees = [pid for handle in handles for pid in instance_tree(handle)]

    ray.shutdown()  # the controller's driver goes away; what it owned (its placement groups) with it
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    second = Harness(tmp_path, backend=RayBackend())  # the same store
    second.controller.recover()
    status = second.status(job_id)
    assert len(events(status, "Adopted")) == 3, status["events"]
    for _ in range(5):
        second.controller.step()
    status = second.status(job_id)
    assert [(i["state"], i["attempt"]) for i in status["instances"]] == [("running", 1)] * 3
    assert pids_alive(trees) == trees  # the very same processes, none started again
    second.controller.cancel(job_id)
    step_until(second, job_id, lambda s: s["state"] == "cancelled")
    assert pids_alive(trees) == []


def instance_tree(handle: InstanceHandle) -> list[int]:
    """The pids of an instance whose command starts one child: the command and that child (waited
    for, so a tree taken right after the instance runs is complete)."""
    import json

    import psutil

    from trainmaster.backends.ray import ATTEMPT_RECORD

    pid = json.loads((Path(handle.instance_dir) / ATTEMPT_RECORD).read_text())["pid"]
    deadline = time.monotonic() + 30
    while not (children := psutil.Process(pid).children(recursive=True)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert children, f"instance {handle.instance_id} never started its child"
    return [pid, *(child.pid for child in children)]


def alive_nodes(cluster: Any) -> list[Any]:
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return [n for n in cluster.list_all_nodes() if n.node_id in alive]


@pytest.mark.parametrize("graceful", [True, False], ids=["removed", "killed"])
def test_losing_a_node_mid_job_restarts_its_instances_on_the_remaining_nodes(
    harness: Harness, cluster: Any, graceful: bool
) -> None:
    """Node loss: four 1-CPU workers fill two of three nodes; the non-head node among those two is
    lost, either removed (its processes shut down) or killed outright (SIGKILL of every process
    of the node, its raylet included, as a machine losing power: the instances read as
    unreachable until Ray's health checks declare the node dead). Its instances are reported
    Lost with an event naming the node, their process trees are gone, and restartPolicy
    OnFailure runs them again on the remaining nodes, where Ray placed their bundles again. The
    instances on the surviving node are untouched."""
    from trainmaster.store.models import InstanceRow

    while len(alive_nodes(cluster)) < len(NODE_IPS):
        cluster.add_node(num_cpus=NODE_CPUS, node_ip_address=next(SPARE_IPS))
    cluster.wait_for_nodes()
    job_id = harness.submit(
        job(
            "loss",
            [
                {
                    "name": "worker",
                    "replicas": 4,
                    "resources": {"cpu": 1},
                    "command": py(
                        "import subprocess, sys, time\n"
                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                        "time.sleep(120)"
                    ),
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 2, "backoffSeconds": 0},
                }
            ],
        )
    )
    status = step_until(
        harness, job_id, lambda s: sum(i["state"] == "running" for i in s["instances"]) == 4, timeout=120
    )
    with harness.sessions() as session:
        handles = {f"{r.role}-{r.index}": r.handle for r in session.query(InstanceRow)}
    head = cluster.head_node.node_id
    victim = next(
        n for n in alive_nodes(cluster) if n.node_id != head and any(h.node == n.node_id for h in handles.values())
    )
    doomed = {label for label, h in handles.items() if h.node == victim.node_id}
    trees = [pid for label in doomed for pid in instance_tree(handles[label])]
    survivors = {
        label: i["attempt"]
        for label, i in ((f"{i['role']}-{i['index']}", i) for i in status["instances"])
        if label not in doomed
    }

    lost_at = time.monotonic()
    cluster.remove_node(victim, allow_graceful=graceful)

    def replaced(s: dict[str, Any]) -> bool:
        by_label = {f"{i['role']}-{i['index']}": i for i in s["instances"]}
        return all(by_label[label]["attempt"] == 2 and by_label[label]["state"] == "running" for label in doomed)

    status = step_until(harness, job_id, replaced, timeout=90)
    took = time.monotonic() - lost_at
    by_label = {f"{i['role']}-{i['index']}": i for i in status["instances"]}
    for label in doomed:
        assert by_label[label]["address"].split(":")[0] != victim.node_ip_address
    for label, attempt in survivors.items():
        assert by_label[label]["attempt"] == attempt and by_label[label]["state"] == "running"
    restarting = events(status, "Restarting")
    assert len(restarting) == len(doomed), restarting
    for event in restarting:
        assert "NodeLost" in event["message"] and victim.node_id[:12] in event["message"]
        assert victim.node_ip_address in event["message"]
    assert pids_alive(trees) == [], f"left running after the node was lost ({took:.1f}s to replace)"
    with harness.sessions() as session:
        now_running = [r.handle for r in session.query(InstanceRow)]
    trees = [pid for handle in now_running for pid in instance_tree(handle)]
    harness.controller.cancel(job_id)
    step_until(harness, job_id, lambda s: s["state"] == "cancelled")
    assert pids_alive(trees) == [], "left running after the job was cancelled"


def test_instances_of_a_lost_node_wait_for_room_and_run_on_a_node_that_joins(harness: Harness, cluster: Any) -> None:
    """Node loss with a full cluster: six 1-CPU workers fill all three nodes, and a non-head node
    is removed. Nothing has room for the lost instances, so they wait, not running anywhere (never
    sent to the dead node's agent, nor run uncharged elsewhere): pending while the controller's
    own accounting sees the smaller cluster full, or starting with reason BundlePending while
    Ray has not placed their bundles again. Once a node joins, Ray places the bundles there and
    they run on it."""
    from trainmaster.store.models import InstanceRow

    while len(alive_nodes(cluster)) < len(NODE_IPS):
        cluster.add_node(num_cpus=NODE_CPUS, node_ip_address=next(SPARE_IPS))
    cluster.wait_for_nodes()
    job_id = harness.submit(
        job(
            "full",
            [
                {
                    "name": "worker",
                    "replicas": 3 * NODE_CPUS,
                    "resources": {"cpu": 1},
                    "command": ["sleep", "120"],
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 1, "backoffSeconds": 0},
                }
            ],
        )
    )
    step_until(
        harness, job_id, lambda s: sum(i["state"] == "running" for i in s["instances"]) == 3 * NODE_CPUS, timeout=120
    )
    with harness.sessions() as session:
        placed = {f"{r.role}-{r.index}": r.handle.node for r in session.query(InstanceRow)}
    victim = next(n for n in alive_nodes(cluster) if n.node_id != cluster.head_node.node_id)
    doomed = {label for label, node in placed.items() if node == victim.node_id}
    cluster.remove_node(victim)

    def waiting(s: dict[str, Any]) -> bool:
        return all(
            i["state"] == "pending"
            and i["reason"] == "Unschedulable"
            or i["state"] == "starting"
            and i["reason"] == "BundlePending"
            for i in s["instances"]
            if f"{i['role']}-{i['index']}" in doomed
        )

    step_until(harness, job_id, lambda s: len(events(s, "Restarting")) == len(doomed) and waiting(s), timeout=60)
    for _ in range(10):  # it stays so: nothing to place it on
        harness.controller.step()
        assert waiting(harness.status(job_id)), harness.status(job_id)["instances"]
        time.sleep(0.1)
    newcomer = cluster.add_node(num_cpus=NODE_CPUS, node_ip_address=next(SPARE_IPS))
    status = step_until(
        harness, job_id, lambda s: sum(i["state"] == "running" for i in s["instances"]) == 3 * NODE_CPUS, timeout=90
    )
    for inst in status["instances"]:
        if f"{inst['role']}-{inst['index']}" in doomed:
            assert inst["address"].split(":")[0] == newcomer.node_ip_address and inst["restarts"] == 1
    harness.controller.cancel(job_id)
    step_until(harness, job_id, lambda s: s["state"] == "cancelled")


def test_a_killed_nodes_raylet_refusing_connections_is_proof_of_loss_and_silence_is_not() -> None:
    """Node loss noticed before Ray's health checks conclude: when a node's agent does not answer
    an observe, the controller probes the node's raylet port. A refused connection (nothing
    listens: the node's Ray processes are gone) proves the node lost; a listening raylet, or a
    probe that times out (a slow or partitioned node), proves nothing."""
    import socket
    from types import SimpleNamespace

    from trainmaster.backends.ray import RayBackend

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        alive_port = listening.getsockname()[1]
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead_port = closed.getsockname()[1]  # bound, never listening: connections are refused
            view = SimpleNamespace(
                _raylets={
                    "alive": ("127.0.0.1", alive_port),
                    "dead": ("127.0.0.1", dead_port),
                    "silent": ("10.255.255.1", 9),
                }
            )
            assert RayBackend._raylet_gone(view, "alive") is False  # type: ignore[arg-type]
            assert RayBackend._raylet_gone(view, "dead") is True  # type: ignore[arg-type]
            assert RayBackend._raylet_gone(view, "silent") is False  # type: ignore[arg-type]
            assert RayBackend._raylet_gone(view, "unknown") is False  # type: ignore[arg-type]
