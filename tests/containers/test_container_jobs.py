"""Jobs whose roles run in containers (issue #22), end to end through ``trainmaster run``: the
shipped Kubeflow PyTorchJob example (master + 2 workers, a gloo all-reduce that checks its sum)
runs unchanged but for its image, first on the host and then in containers of an image that
holds this machine's Python and torch (bind-mounted ``hostPath`` volumes the operator allows),
with the same result; a role whose image is missing under ``imagePullPolicy: Never`` fails with
a clear reason."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from container_fixtures import REPO, labelled
from controller_harness import run_job_file, run_logs
from trainmaster.containers import images
from trainmaster.containers.runtime import ContainerRuntime

EXAMPLE = Path(REPO) / "examples" / "kubeflow-pytorchjob.yaml"
WHERE = "import os; print('in a container:', os.path.exists('/run/.containerenv'), flush=True)\n"


def _in_image(tag: str) -> tuple[dict[str, Any], list[str]]:
    """The example with its image replaced by ``tag`` (never pulled), the python mounts as
    hostPath volumes, and a line saying where each rank ran; and the paths to allow."""
    job = yaml.safe_load(EXAMPLE.read_text())
    mounts = images.python_mounts([REPO])
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        pod["volumes"] = [{"name": f"host{i}", "hostPath": {"path": m["source"]}} for i, m in enumerate(mounts)]
        for container in pod["containers"]:
            container.update(image=tag, imagePullPolicy="Never")
            container["args"] = [WHERE + container["args"][0]]
            container["volumeMounts"] = [
                {"name": f"host{i}", "mountPath": m["target"], "readOnly": True} for i, m in enumerate(mounts)
            ]
    return job, [str(m["source"]) for m in mounts]


def _ranks(logs: str) -> list[str]:
    return sorted(re.findall(r"rank \d of \d: all_reduce sum = \d+", logs))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_pytorchjob_example_runs_in_containers_as_on_the_host(
    podman: ContainerRuntime, python_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, allowed = _in_image(python_image)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    allow = [arg for p in allowed for arg in ("--allow-path", p)]
    results = {}
    for runtime in ("host", "auto"):
        folder = tmp_path / runtime
        folder.mkdir()
        if runtime == "auto":  # the default for a converted file: a container, podman being here
            monkeypatch.delenv("TRAINMASTER_RUNTIME")
        proc, status = run_job_file(path, folder, *allow, timeout=200)
        logs = run_logs(folder)
        assert proc.returncode == 0 and status["state"] == "succeeded", proc.stderr[-3000:] + logs[-3000:]
        results[runtime] = (_ranks(logs), logs.count("in a container: True"), logs.count("in a container: False"))
    expected = ["rank 0 of 3: all_reduce sum = 6", "rank 1 of 3: all_reduce sum = 6", "rank 2 of 3: all_reduce sum = 6"]
    assert results["host"] == (expected, 0, 3)
    assert results["auto"] == (expected, 3, 0)


@pytest.mark.timeout(240)
def test_missing_image_with_never_pull_fails_with_its_reason(
    podman: ContainerRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINMASTER_RUNTIME")
    job = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "no-image"},
        "spec": {
            "roles": [
                {
                    "name": "main",
                    "image": "localhost/tm-missing-image:0",
                    "runtime": "container",
                    "imagePullPolicy": "Never",
                    "restartPolicy": {"maxRestarts": 0},
                }
            ]
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    proc, status = run_job_file(path, tmp_path, timeout=200)
    assert proc.returncode != 0 and status["state"] == "failed", proc.stderr[-2000:]
    text = str(status)
    assert "ErrImageNeverPull" in text or "image not known" in text, text[-3000:]
    names = subprocess.run(
        [*podman.base(), "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "no-image" not in names and labelled(podman, "x") == []


@pytest.mark.timeout(240)
def test_cancel_of_a_job_leaves_no_container(
    small_image: str, podman: ContainerRuntime, tmp_path: Path, isolated_home: Path
) -> None:
    """Cancel through the controller: the agent stops each instance (TERM, KILL after the grace)
    and removes its container before the job is cancelled; no container of the agent is left."""
    import time

    from controller_harness import Harness
    from trainmaster.agent.core import AgentOptions

    harness = Harness(tmp_path)
    try:
        job_id = harness.submit(
            {
                "apiVersion": "trainmaster/v1",
                "kind": "Job",
                "metadata": {"name": "sleepers"},
                "spec": {
                    "roles": [
                        {
                            "name": "worker",
                            "replicas": 2,
                            "image": small_image,
                            "runtime": "container",
                            "imagePullPolicy": "Never",
                            "command": ["/bin/sleep", "300"],
                            "resources": {"memory": "64Mi"},
                        }
                    ]
                },
            }
        )
        key = AgentOptions(state_dir=isolated_home / "agent").node_key
        deadline = time.monotonic() + 120
        while len(labelled(podman, key, running_only=True)) < 2:
            assert time.monotonic() < deadline, "the two containers did not start"
            harness.controller.step()
            time.sleep(0.1)
        harness.controller.cancel(job_id)
        while harness.status(job_id)["state"] != "cancelled":
            assert time.monotonic() < deadline + 60, harness.status(job_id)["state"]
            harness.controller.step()
            time.sleep(0.1)
        assert labelled(podman, key) == []
    finally:
        harness.backend.close()


@pytest.mark.timeout(240)
def test_env_fields_reach_the_container(small_image: str, tmp_path: Path, isolated_home: Path) -> None:
    """``envFields`` (a pod's ``valueFrom.fieldRef``) are resolved for a container as for a
    process: the instance's address, Kubeflow's pod name, a UUID of the attempt."""
    from controller_harness import Harness

    harness = Harness(tmp_path)
    role = {
        "name": "main",
        "image": small_image,
        "runtime": "container",
        "imagePullPolicy": "Never",
        "args": ["echo facts ip=$POD_IP node=$NODE name=$POD_NAME uid=$POD_UID"],
        "envFields": {
            "POD_IP": "status.podIP",
            "NODE": "spec.nodeName",
            "POD_NAME": "metadata.name",
            "POD_UID": "metadata.uid",
        },
    }
    try:
        state, status = harness.run(
            {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": "facts"}, "spec": {"roles": [role]}}
        )
    finally:
        harness.backend.close()
    log = run_logs_of(tmp_path)
    assert state == "succeeded", (status, log)
    found = re.search(r"facts ip=(\S+) node=(\S+) name=(\S+) uid=([0-9a-f-]{36})\b", log)
    assert found and found.groups()[:3] == ("127.0.0.1", "127.0.0.1", "facts-main-0"), log


def run_logs_of(tmp_path: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((tmp_path / "runs").rglob("*.log")))


@pytest.mark.timeout(240)
def test_volcano_svc_job_reads_its_host_files_at_etc_volcano_in_containers(
    small_image: str, podman: ContainerRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mechanism (Volcano's svc plugin): a Volcano Job whose commands read
    /etc/volcano/<task>.host, as upstream's TensorFlow and MPI examples do, runs unchanged in
    containers: the job's own host files are mounted there (issue 38: they were only in
    $VC_HOSTS_DIR, so the commands read nothing)."""
    monkeypatch.delenv("TRAINMASTER_RUNTIME", raising=False)  # auto: a container, podman being here
    reads = "cat /etc/volcano/ps.host; echo; cat /etc/volcano/worker.host; echo"
    tasks = []
    for name, replicas in (("ps", 1), ("worker", 2)):
        container = {"name": name, "image": small_image, "imagePullPolicy": "Never", "command": ["sh", "-c", reads]}
        spec = {"restartPolicy": "Never", "containers": [container]}
        tasks.append({"name": name, "replicas": replicas, "template": {"spec": spec}})
    job = {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "vc-etc-volcano"},
        "spec": {"minAvailable": 3, "plugins": {"svc": []}, "tasks": tasks},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    proc, status = run_job_file(path, tmp_path, timeout=200)
    assert proc.returncode == 0 and status["state"] == "succeeded", proc.stderr[-3000:] + run_logs(tmp_path)[-3000:]
    addresses = {f"{i['role']}-{i['index']}": i["address"] for i in status["instances"]}
    logs = run_logs(tmp_path)
    expected = f"{addresses['ps-0']}\n{addresses['worker-0']}\n{addresses['worker-1']}\n"
    assert logs.count(expected) == 3, logs[-3000:]  # each instance read both files, with every address
