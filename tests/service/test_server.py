"""Mechanisms: the controller as a service (queue of jobs, status you can query at any time,
logs, cancel, delete, metrics) and crash safety: a controller killed with SIGKILL and
restarted loses no job, re-adopts live instances and runs each instance once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path)
    yield s
    s.stop()


def write_job(tmp_path: Path, name: str, roles: list[dict]) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": name}, "spec": {"roles": roles}}
        )
    )
    return path


def test_submit_status_logs_cancel_delete(server: ServerProcess, tmp_path: Path) -> None:
    ok = write_job(
        tmp_path,
        "hello",
        [
            {
                "name": "say",
                "replicas": 2,
                "command": ["python", "-c", "print('hello from', __import__('os').environ['TM_REPLICA_INDEX'])"],
            }
        ],
    )
    out = server.cli("submit", str(ok))
    assert out.returncode == 0 and "submitted job hello" in out.stdout
    server.wait_state("hello", {"succeeded"})
    logs = server.cli("logs", "hello", "--role", "say", "--index", "1")
    assert "hello from 1" in logs.stdout
    listed = json.loads(server.cli("list", "--json").stdout)
    assert [j["name"] for j in listed] == ["hello"]
    status = json.loads(server.cli("status", "hello", "--json").stdout)
    assert status["roles"][0]["counts"]["succeeded"] == 2

    slow = write_job(
        tmp_path,
        "slow",
        [{"name": "w", "command": ["python", "-c", "import time; print('up', flush=True); time.sleep(60)"]}],
    )
    server.cli("submit", str(slow))
    server.wait_state("slow", {"running"})
    follow = subprocess.Popen(
        [sys.executable, "-m", "trainmaster", "logs", "slow", "--follow"],
        env=server.client_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.cli("delete", "slow").returncode == 2  # still running: cancel first (a user mistake)
    assert server.cli("cancel", "slow").returncode == 0
    assert server.wait_state("slow", {"cancelled"})["instances"][0]["state"] == "stopped"
    followed, _ = follow.communicate(timeout=30)  # the stream ends when the instance ends
    assert "up" in followed
    assert server.cli("delete", "slow").returncode == 0
    assert server.cli("status", "slow").returncode == 2  # unknown job: a user mistake


def test_invalid_submission_is_rejected_with_every_error(server: ServerProcess, tmp_path: Path) -> None:
    bad = write_job(tmp_path, "bad", [{"name": "a", "replicas": 0, "command": ["true"], "dependsOn": [{"role": "x"}]}])
    out = server.cli("submit", str(bad))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "spec.roles[0].replicas" in out.stderr and "unknown role 'x'" in out.stderr


def test_scale_a_running_role_up_and_down(server: ServerProcess, tmp_path: Path) -> None:
    """Reconcile (spec step 8) driven through the API: `trainmaster scale` changes the desired
    replicas; instances are created or deleted to match; an invalid scale is refused."""
    job = write_job(
        tmp_path, "elastic", [{"name": "w", "replicas": 1, "command": ["python", "-c", "import time; time.sleep(600)"]}]
    )
    server.cli("submit", str(job))
    server.wait_state("elastic", {"running"})
    out = server.cli("scale", "elastic", "w", "3")
    assert out.returncode == 0 and "scaled to 3" in out.stdout

    def live(status: dict) -> int:
        return sum(i["state"] == "running" for i in status["instances"])

    deadline = time.monotonic() + 60
    while live(server.status("elastic")) != 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live(server.status("elastic")) == 3
    assert server.cli("scale", "elastic", "w", "1").returncode == 0
    while live(server.status("elastic")) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live(server.status("elastic")) == 1
    missing = server.cli("scale", "elastic", "nope", "2")
    assert missing.returncode == 2 and "has no role 'nope'" in missing.stderr
    zero = server.cli("scale", "elastic", "w", "0")
    assert zero.returncode == 2 and "Traceback" not in zero.stderr
    server.cli("cancel", "elastic")
    server.wait_state("elastic", {"cancelled"})
    ended = server.cli("scale", "elastic", "w", "2")
    assert ended.returncode == 2 and "only an active job scales" in ended.stderr


def test_openapi_and_metrics(server: ServerProcess, tmp_path: Path) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/api/v1/jobs" in spec["paths"]
    server.cli("submit", str(write_job(tmp_path, "m", [{"name": "a", "command": ["true"]}])))
    server.wait_state("m", {"succeeded"})
    text = httpx.get(server.url + "/metrics").text
    assert 'trainmaster_jobs{state="succeeded"} 1.0' in text
    assert "trainmaster_reconcile_seconds_count" in text and "trainmaster_instance_launch_seconds_count" in text


def test_server_killed_with_sigkill_loses_nothing(server: ServerProcess, tmp_path: Path) -> None:
    runs = tmp_path / "runs.txt"
    code = (
        f"import os, time\nopen('{runs}', 'a').write(os.environ['TM_ROLE'] + os.environ['TM_REPLICA_INDEX'] + '\\n')\n"
        "time.sleep(4)\n"
    )
    path = write_job(
        tmp_path,
        "durable",
        [
            {"name": "a", "replicas": 2, "command": ["python", "-c", code]},
            {"name": "b", "command": ["python", "-c", code], "dependsOn": [{"role": "a"}]},
            {"name": "late", "command": ["python", "-c", code], "dependsOn": [{"role": "a", "condition": "Succeeded"}]},
        ],
    )
    assert server.cli("submit", str(path)).returncode == 0
    running = server.wait_state("durable", {"running"})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(i["state"] == "running" for i in running["instances"]) < 3:
        time.sleep(0.2)
        running = server.status("durable")
    pids = {f"{i['role']}{i['index']}": i["pid"] for i in running["instances"] if i["state"] == "running"}
    server.kill9()
    time.sleep(1)
    server.start()
    final = server.wait_state("durable", {"succeeded", "failed"}, timeout=90)
    assert final["state"] == "succeeded", final["events"][-10:]
    lines = sorted(runs.read_text().split())
    assert lines == ["a0", "a1", "b0", "late0"]  # every instance ran exactly once
    for inst in final["instances"]:
        assert inst["attempt"] == 1
        if f"{inst['role']}{inst['index']}" in pids:
            assert inst["pid"] == pids[f"{inst['role']}{inst['index']}"]
    assert any(e["reason"] == "Adopted" for e in final["events"])
