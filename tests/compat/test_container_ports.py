"""Mechanism: a container's declared ``ports[].containerPort`` (issue #22). Instances share their
node's network, so the declared numbers are what each instance gets where free on its node (the
role's ``containerPorts``: TM_PORT/TM_PORTS, and what the framework advertises from them, e.g.
MASTER_PORT of a PyTorchJob's master from its ``pytorchjob-port``); where another instance on the
node holds one (Kubeflow files declare the port on every replica) or a program has it bound, that
instance gets a free port instead, and its variables say so. Upstream users' programs read the
port from those variables, as Kubeflow's operator sets them."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller_harness import run_job_file, run_logs
from trainmaster.backends.ports import PortPool
from trainmaster.errors import UserError
from trainmaster.loading import load_document
from trainmaster.spec.compat import convert


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_pool_gives_a_declared_port_where_it_is_free() -> None:
    pool, wanted = PortPool("127.0.0.1"), free_port()
    assert pool.take(2, [wanted])[0] == wanted
    second = pool.take(1, [wanted])  # held by the first instance: a free one
    assert second[0] != wanted
    pool.release([wanted])
    with socket.socket() as other:  # bound by a program that is not ours
        other.bind(("127.0.0.1", wanted))
        other.listen(1)
        assert pool.take(1, [wanted])[0] != wanted
    assert pool.take(1, [wanted]) == [wanted]


def pytorchjob(port: int, master: str, worker: str) -> dict[str, Any]:
    def replica(replicas: int, code: str) -> dict[str, Any]:
        container = {
            "name": "pytorch",
            "image": "localhost/none:0",
            "ports": [{"containerPort": port, "name": "pytorchjob-port"}],
            "command": [sys.executable, "-c", code],
        }
        return {"replicas": replicas, "restartPolicy": "Never", "template": {"spec": {"containers": [container]}}}

    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "ports"},
        "spec": {"pytorchReplicaSpecs": {"Master": replica(1, master), "Worker": replica(2, worker)}},
    }


def test_container_ports_convert_and_are_checked() -> None:
    converted = convert(pytorchjob(23456, "pass", "pass"))
    assert converted is not None
    master = converted.document["spec"]["roles"][0]
    assert master["containerPorts"] == [23456]
    assert load_document(converted.document).job.spec.role("master").ports == 1
    assert any("ports: approximated: instances share their node's network" in line for line in converted.ignored)
    raw = pytorchjob(23456, "pass", "pass")
    raw["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["ports"] = [
        {"containerPort": 80},
        {"containerPort": 8080, "hostPort": 80},
    ]
    role = convert(raw, lenient=True).document["spec"]["roles"][0]  # type: ignore[union-attr]
    assert role["containerPorts"] == [80, 8080] and load_document({**raw}).job.spec.role("master").ports == 2
    raw["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": 0}]
    with pytest.raises(UserError) as refused:
        convert(raw)
    assert "ports[0].containerPort: must be a port number" in str(refused.value.details)
    native = {"name": "a", "command": ["true"], "containerPorts": [5000, 5000]}
    with pytest.raises(UserError, match="each port once"):
        load_document(
            {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": {"roles": [native]}}
        )


MASTER = """
import json, os, pathlib, time
out = pathlib.Path(os.environ["TM_OUTPUT_DIR"])
deadline = time.monotonic() + 60
while len(list(out.glob("worker-*.json"))) < 2:  # the workers' answers, then the master's own
    assert time.monotonic() < deadline, "workers did not answer"
    time.sleep(0.1)
(out / "master.json").write_text(json.dumps({k: os.environ[k] for k in ("TM_PORT", "MASTER_PORT")}))
"""
WORKER = """
import json, os, pathlib
out = pathlib.Path(os.environ["TM_OUTPUT_DIR"])
answer = {k: os.environ[k] for k in ("TM_PORT", "MASTER_PORT")}
(out / f"worker-{os.environ['TM_REPLICA_INDEX']}.json").write_text(json.dumps(answer))
"""


def test_the_master_advertises_its_declared_port(tmp_path: Path) -> None:
    """Master and 2 workers on one node, all declaring the same port (as Kubeflow files do): the
    master has it (TM_PORT = MASTER_PORT = the declared port), each worker a free one of its own."""
    port = free_port()
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(pytorchjob(port, MASTER, WORKER)))
    proc, status = run_job_file(path, tmp_path, "--runtime", "host", timeout=120)
    assert proc.returncode == 0 and status["state"] == "succeeded", proc.stderr[-2000:] + run_logs(tmp_path)[-2000:]
    output = next((tmp_path / "home").rglob("master.json")).parent
    master = json.loads((output / "master.json").read_text())
    workers = [json.loads((output / f"worker-{i}.json").read_text()) for i in range(2)]
    assert master == {"TM_PORT": str(port), "MASTER_PORT": str(port)}
    assert all(w["MASTER_PORT"] == str(port) for w in workers), workers
    worker_ports = {w["TM_PORT"] for w in workers}
    assert len(worker_ports) == 2 and str(port) not in worker_ports, workers
