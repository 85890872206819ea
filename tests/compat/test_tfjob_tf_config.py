"""Mechanisms: a Kubeflow TFJob's TF_CONFIG as the training operator sets it. Every replica of
a chief + 2 workers + ps + evaluator job reads its TF_CONFIG (no TensorFlow needed): the same
``cluster`` everywhere (chief, worker, ps address lists in index order; the evaluator left out,
as upstream), its own ``task`` type and index, ``environment: cloud``; each cluster member listens
on its own listed address and every replica connects to every cluster address, so the addresses
resolve and the ports are the ones the replicas really hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller_harness import PY, Harness

ROLE_SCRIPT = r"""
import json, os, socket, sys, threading, time
config = json.loads(os.environ["TF_CONFIG"])
me = config["task"]["type"], config["task"]["index"]
cluster = config["cluster"]
peers = [(t, i, a) for t, addrs in cluster.items() for i, a in enumerate(addrs) if (t, i) != me]
accepted = []
if me[0] in cluster:
    host, port = cluster[me[0]][me[1]].rsplit(":", 1)
    server = socket.create_server((host, int(port)))
    server.settimeout(60)
    expected = len(peers) + int(os.environ["EVALUATORS"])
    def serve():
        while len(accepted) < expected:
            conn, _ = server.accept()
            accepted.append(conn.recv(64).decode())
            conn.close()
    listener = threading.Thread(target=serve, daemon=True)
    listener.start()
reached = []
for t, i, address in peers:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=5) as conn:
                conn.sendall(f"{me[0]}-{me[1]}".encode())
            reached.append(f"{t}-{i}")
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"{me}: could not reach {t}-{i} at {address}")
            time.sleep(0.1)
if me[0] in cluster:
    listener.join(60)
out = os.path.join(os.environ["TM_OUTPUT_DIR"], f"{me[0]}-{me[1]}.json")
with open(out, "w") as f:
    json.dump({"tf_config": config, "reached": reached, "accepted": sorted(accepted)}, f)
if me[0] == "chief":  # the chief succeeding ends the job: it waits for the others' records
    deadline = time.monotonic() + 60
    while len(os.listdir(os.environ["TM_OUTPUT_DIR"])) < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
"""


def replica(replicas: int, script: Path) -> dict:
    return {
        "replicas": replicas,
        "restartPolicy": "Never",
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "tensorflow",
                        "image": "tensorflow/tensorflow",
                        "command": [PY, str(script)],
                        "env": [{"name": "EVALUATORS", "value": "1"}],
                    }
                ]
            }
        },
    }


@pytest.mark.timeout(180)
def test_every_replica_sees_one_consistent_tf_config(tmp_path: Path) -> None:
    script = tmp_path / "role.py"
    script.write_text(ROLE_SCRIPT)
    doc = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": "tf-config"},
        "spec": {
            "tfReplicaSpecs": {
                "Chief": replica(1, script),
                "Worker": replica(2, script),
                "PS": replica(1, script),
                "Evaluator": replica(1, script),
            }
        },
    }
    h = Harness(tmp_path)
    job_id = h.submit(doc)
    state = h.controller.run_job(job_id)
    status = h.status(job_id)
    outputs = Path(status["runDir"]) / "output"
    assert state == "succeeded", json.dumps(status["events"][-20:], indent=1)
    members = ["chief-0", "worker-0", "worker-1", "ps-0"]
    seen = {p.stem: json.loads(p.read_text()) for p in outputs.glob("*.json")}
    assert "chief-0" in seen, sorted(seen)
    clusters = {json.dumps(s["tf_config"]["cluster"], sort_keys=True) for s in seen.values()}
    assert len(clusters) == 1, clusters
    cluster = seen["chief-0"]["tf_config"]["cluster"]
    assert sorted(cluster) == ["chief", "ps", "worker"]  # evaluator: not in the training cluster
    assert len(cluster["worker"]) == 2 and len(cluster["chief"]) == 1 and len(cluster["ps"]) == 1
    addresses = [a for addrs in cluster.values() for a in addrs]
    assert len(set(addresses)) == len(addresses)
    for name, record in seen.items():
        kind, _, index = name.rpartition("-")
        assert record["tf_config"]["task"] == {"type": kind, "index": int(index)}
        assert record["tf_config"]["environment"] == "cloud"
        assert sorted(record["reached"]) == sorted(m for m in members if m != name)
        if name in members:  # every other replica (the evaluator too) connected to it
            assert record["accepted"] == sorted(n for n in [*members, "evaluator-0"] if n != name)
