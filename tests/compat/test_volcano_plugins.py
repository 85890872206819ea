"""Mechanisms: a Volcano Job's plugins and policies with real processes. ``svc``: every
instance gets VC_<TASK>_HOSTS / VC_<TASK>_NUM for every task and the <task>.host files (in
VC_HOSTS_DIR), consistent everywhere, and the listed addresses reach the instances; ``env``:
VK_TASK_INDEX / VC_TASK_INDEX. Policies: PodFailed -> RestartJob restarts every task's instances,
TaskCompleted -> CompleteJob ends the job when the task completes."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from controller_harness import PY, Harness

PS = r"""
import json, os, socket
record = {k: v for k, v in os.environ.items() if k.startswith(("VC_", "VK_"))}
record["files"] = {n: open(os.path.join(os.environ["VC_HOSTS_DIR"], n)).read()
                   for n in ("ps.host", "worker.host")}
open(os.path.join(os.environ["OUT"], "ps-" + os.environ["VK_TASK_INDEX"] + ".json"), "w").write(json.dumps(record))
server = socket.create_server((os.environ["TM_HOST"], int(os.environ["TM_PORT"])))
while True:
    conn, _ = server.accept()
    conn.sendall(b"ps here")
    conn.close()
"""
WORKER = r"""
import json, os, socket, time
record = {k: v for k, v in os.environ.items() if k.startswith(("VC_", "VK_"))}
record["files"] = {n: open(os.path.join(os.environ["VC_HOSTS_DIR"], n)).read()
                   for n in ("ps.host", "worker.host")}
host, port = os.environ["VC_PS_HOSTS"].split(",")[0].rsplit(":", 1)
deadline = time.monotonic() + 60
while True:
    try:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            record["reply"] = conn.recv(64).decode()
        break
    except OSError:
        assert time.monotonic() < deadline, "the ps address did not answer"
        time.sleep(0.1)
open(os.path.join(os.environ["OUT"], "worker-" + os.environ["VC_TASK_INDEX"] + ".json"), "w").write(json.dumps(record))
"""


def task(name: str, replicas: int, script: Path, out: Path, **extra: object) -> dict:
    return {
        "name": name,
        "replicas": replicas,
        **extra,
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": name,
                        "image": "busybox",
                        "command": [PY, str(script)],
                        "env": [{"name": "OUT", "value": str(out)}],
                    }
                ],
            }
        },
    }


def ps_and_workers(name: str, tmp_path: Path, out: Path, **spec: object) -> dict:
    """A Volcano Job of one ps and two workers (tmp_path/ps.py, tmp_path/worker.py) whose
    workers' completion completes the job."""
    workers = task(
        "worker", 2, tmp_path / "worker.py", out, policies=[{"event": "TaskCompleted", "action": "CompleteJob"}]
    )
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {**spec, "tasks": [task("ps", 1, tmp_path / "ps.py", out), workers]},
    }


def run_to_end(tmp_path: Path, doc: dict) -> tuple[str, dict]:
    """Submit the job and run it to its end: its final state and status."""
    h = Harness(tmp_path)
    try:
        job_id = h.submit(doc)
        state = h.controller.run_job(job_id)
        return state, h.status(job_id)
    finally:
        h.backend.close()


@pytest.mark.timeout(120)
def test_svc_and_env_plugins_give_every_instance_every_task(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "ps.py").write_text(PS)
    (tmp_path / "worker.py").write_text(WORKER)
    state, status = run_to_end(
        tmp_path, ps_and_workers("vc-svc", tmp_path, out, minAvailable=3, plugins={"svc": [], "env": []})
    )
    assert state == "succeeded", status["events"][-10:]
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(records) == ["ps-0", "worker-0", "worker-1"]
    addresses = {i["role"] + "-" + str(i["index"]): i["address"] for i in status["instances"]}
    ps_hosts = addresses["ps-0"]
    worker_hosts = f"{addresses['worker-0']},{addresses['worker-1']}"
    for name, record in records.items():
        assert record["VC_PS_HOSTS"] == ps_hosts and record["VC_PS_NUM"] == "1"
        assert record["VC_WORKER_HOSTS"] == worker_hosts and record["VC_WORKER_NUM"] == "2"
        assert record["files"] == {"ps.host": ps_hosts, "worker.host": worker_hosts.replace(",", "\n")}
        assert record["VK_TASK_INDEX"] == record["VC_TASK_INDEX"] == name.rpartition("-")[2]
    assert records["worker-0"]["reply"] == records["worker-1"]["reply"] == "ps here"
    ps = next(i for i in status["instances"] if i["role"] == "ps")
    assert ps["state"] == "stopped"  # the job completed with the workers' task; the ps was stopped


@pytest.mark.timeout(120)
def test_pod_failed_restart_job_restarts_every_task(tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    record = f"import os, time; open({str(marker)!r}, 'a').write(os.environ['TM_ROLE'] + '\\n')\n"
    (tmp_path / "ps.py").write_text(record + "time.sleep(60)\n")
    (tmp_path / "worker.py").write_text(
        record + f"time.sleep(0.5); raise SystemExit(1 if open({str(marker)!r}).read().count('worker') < 3 else 0)\n"
    )
    policies = [{"event": "PodFailed", "action": "RestartJob"}]
    state, status = run_to_end(
        tmp_path, ps_and_workers("vc-restart", tmp_path, tmp_path, maxRetry=3, policies=policies)
    )
    assert state == "succeeded", status["events"][-10:]
    starts = marker.read_text().split()
    assert starts.count("ps") == 2 and starts.count("worker") == 4  # one restart of the whole job
    assert [e for e in status["events"] if e["reason"] == "RestartingGroup"]


def _reads_etc_volcano(runtime: str | None = None) -> dict:
    """A Volcano Job with the svc plugin whose tasks read /etc/volcano/<task>.host, as upstream's
    TensorFlow and MPI examples do."""
    reads = "cat /etc/volcano/ps.host /etc/volcano/worker.host"
    tasks = []
    for name in ("ps", "worker"):
        container = {"name": name, "image": "busybox", "command": ["sh", "-c", reads]}
        tasks.append({"name": name, "replicas": 1, "template": {"spec": {"containers": [container]}}})
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "vc-etc-volcano"},
        "spec": {"plugins": {"svc": []}, "tasks": tasks},
    }


def test_a_command_reading_etc_volcano_is_refused_on_the_host_naming_the_file() -> None:
    """Mechanism (Volcano's svc plugin files): a role that runs on the host but reads
    /etc/volcano/<task>.host would read this machine's folder, not its job's; it is refused when
    the job is loaded, naming the files it reads and where the job's copies are, unless
    --lenient (then it is noted); in a container the files are mounted there, so nothing is
    refused (issue 38: 4 of upstream's 60 files changed meaning silently)."""
    from trainmaster.errors import UserError
    from trainmaster.loading import LoadOptions, load_document
    from trainmaster.spec.model import RuntimeKind

    with pytest.raises(UserError) as refused:
        load_document(_reads_etc_volcano(), options=LoadOptions(runtime=RuntimeKind.HOST))
    assert "--lenient" in refused.value.message and len(refused.value.details) == 2
    for i, role in enumerate(("ps", "worker")):
        assert refused.value.details[i].startswith(
            f"spec.roles[{i}] ({role}): its command reads /etc/volcano/ps.host, /etc/volcano/worker.host"
        ), refused.value.details
        assert "$VC_HOSTS_DIR/ps.host, $VC_HOSTS_DIR/worker.host" in refused.value.details[i]
    lenient = load_document(_reads_etc_volcano(), options=LoadOptions(runtime=RuntimeKind.HOST, lenient=True))
    assert sum("reads /etc/volcano/ps.host" in line for line in lenient.ignored) == 2
    in_container = load_document(_reads_etc_volcano(), options=LoadOptions(runtime=RuntimeKind.CONTAINER))
    assert not any("reads /etc/volcano" in line for line in in_container.ignored)


def test_a_container_of_a_svc_job_gets_the_host_files_at_etc_volcano(tmp_path: Path) -> None:
    """Mechanism: the launch of a container role of a svc-plugin job mounts the job's own copy
    of the files (<run dir>/volcano) read-only at /etc/volcano, as Volcano mounts them
    (tests/containers runs such a job in podman)."""
    from trainmaster.backends.base import Placement
    from trainmaster.controller.launching import PLANNED_CHANNEL, launch_spec, role_launch
    from trainmaster.loading import LoadOptions, load_document
    from trainmaster.spec.model import RuntimeKind
    from trainmaster.store import repository as repo
    from trainmaster.store.models import InstanceRow

    h = Harness(tmp_path)
    try:
        loaded = load_document(_reads_etc_volcano(), options=LoadOptions(runtime=RuntimeKind.CONTAINER))
        job_id = h.jobs.submit(loaded, h.controller, unique_name=False).id
        with h.sessions() as session:
            job = repo.load_job(session, job_id)
            inst = InstanceRow(job_id=job_id, role="ps", index=0, attempt=1)
            shared = role_launch(job, loaded.job, loaded.job.spec.role("ps"), {}, PLANNED_CHANNEL.url, True)
            launch = launch_spec(
                job, loaded.job, shared, inst, Placement("127.0.0.1", [40000]), PLANNED_CHANNEL, "log", "i"
            )
            run_dir = job.run_dir
    finally:
        h.backend.close()
    assert launch.container is not None
    mount = {"source": f"{run_dir}/volcano", "target": "/etc/volcano", "read_only": True}
    assert mount in launch.container.mounts and Path(mount["source"]).is_dir()
