"""Mechanism: the Kubernetes backend runs every framework's jobs (controller spec, 'Our product
decisions': Kubernetes, instances as pods, a headless Service per role; Kubeflow and Volcano
files run unchanged): the README's digits job, a PyTorchJob under torchrun (PET_*), a TFJob
(TF_CONFIG), an MPIJob with OpenMPI and a Volcano job, through ``trainmaster job run --backend
kubernetes`` on the session's cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_helpers import REPO, TRAINMASTER, env_of, example

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

JOBS_DIR = Path(__file__).parent / "jobs"


def torchrun_job() -> dict[str, Any]:
    text = (
        (JOBS_DIR / "pytorchjob-torchrun.yaml").read_text().replace("SCRIPT", str(JOBS_DIR / "torchrun_allreduce.py"))
    )
    return dict(yaml.safe_load(text))


def must_show_jobs() -> dict[str, dict[str, Any]]:
    """The five jobs of the issue, as their users write them."""
    return {
        "digits": example("pytorch-digits.yaml"),
        "pytorchjob": torchrun_job(),
        "tfjob": example("kubeflow-tfjob.yaml"),
        "mpijob": example("kubeflow-mpijob.yaml"),
        "volcano": example("volcano-job.yaml"),
    }


def test_every_framework_runs_through_job_run_backend_kubernetes(k8s_cluster, tmp_path: Path) -> None:
    """The five run at once, each in its own ``trainmaster job run --backend kubernetes``."""
    home = tmp_path / "home"
    env = env_of(k8s_cluster, TRAINMASTER_HOME=str(home), TRAINMASTER_RUNTIME="host")
    # the store made once first: five first runs at once would race in its migrations
    subprocess.run([TRAINMASTER, "db", "upgrade"], env=env, check=True, capture_output=True, timeout=120)
    running = {}
    for name, document in must_show_jobs().items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(document))
        log = open(tmp_path / f"{name}.out", "w")
        running[name] = (
            subprocess.Popen(
                [TRAINMASTER, "job", "run", str(path), "--backend", "kubernetes"],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            ),
            log,
        )
    failed = {}
    for name, (process, log) in running.items():
        try:
            code = process.wait(timeout=420)
        except subprocess.TimeoutExpired:
            process.kill()
            code = -9
        log.close()
        if code != 0:
            failed[name] = (tmp_path / f"{name}.out").read_text()[-3000:]
    assert not failed, failed
    logs = {p.parent.parent.name + "/" + p.name: p.read_text() for p in home.glob("runs/*/logs/*.log")}
    text = "\n".join(logs.values())
    assert "all_reduce sum = 6" in text and "'PET_NNODES': '3'" in text, "torchrun's ranks all-reduced (PET_*)"
    assert "pi is approximately 3.14159" in text, "the MPIJob's 4 ranks ran in 2 worker pods"
    assert "says 'hello from server-0'" in text, "the Volcano clients reached the server's pod"
    assert "parameter is now" in text
    # TF_CONFIG, as the wait step resolved it in each TFJob instance (every address a pod IP)
    env_files = sorted(home.glob("runs/*tf-parameter-server/instances/*/pod-env.json"))
    assert len(env_files) == 3, env_files
    tf_config = json.loads(json.loads(env_files[-1].read_text())["env"]["TF_CONFIG"])
    assert set(tf_config["cluster"]) == {"ps", "worker"} and len(tf_config["cluster"]["worker"]) == 2
    # every peer by its pod IP; the instance itself as $(TM_POD_IP), which its pod's entry expands
    own = tf_config["cluster"][tf_config["task"]["type"]][tf_config["task"]["index"]]
    assert own.startswith("$(TM_POD_IP):")
    peers = [a for addresses in tf_config["cluster"].values() for a in addresses if a != own]
    assert len(peers) == 2 and all(a.startswith("172.") for a in peers), tf_config
    digits = next(home.glob("runs/*pytorch-digits/logs/master-0.log")).read_text()
    assert "accuracy" in digits.lower() and "report():" not in digits, digits[-1500:]
    # trainmaster.report() in the pods reached the controller over the instance channel (TCP:
    # pods cannot see the controller's Unix socket): every instance's last point is stored
    status = json.loads(
        subprocess.run(
            [TRAINMASTER, "job", "status", "pytorch-digits", "--json"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    points = {f"{i['role']}-{i['index']}": i["metrics"] for i in status["instances"]}
    assert len(points) == 3 and all(p is not None for p in points.values()), points
    assert all(p["epoch"] == 20 and p["total"] == 20 and "loss" in p["values"] for p in points.values()), points
