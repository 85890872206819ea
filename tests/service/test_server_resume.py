"""The controller service resumes a job whose `trainmaster run` was killed -9: it takes the job
over (one winner), re-adopts its live instances and finishes it, each instance having run once.

Mechanism: a controller that crashes and restarts carries on where it was (controller.md); the
service is the other controller that can carry a job on."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from orphans import orphan_a_run
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(180)


def test_the_service_resumes_an_orphaned_run_without_running_anything_twice(tmp_path: Path) -> None:
    release = tmp_path / "release"  # the instances run until the resumes were answered
    marks, env = orphan_a_run(tmp_path, "orphan", until=release)
    server = ServerProcess(tmp_path, db=env["TRAINMASTER_DB"], home=Path(env["TRAINMASTER_HOME"]))
    try:
        status = httpx.get(f"{server.url}/api/v1/jobs/orphan", timeout=10).json()
        assert status["state"] == "running" and status["reason"] == "ControllerGone"
        reply = httpx.post(f"{server.url}/api/v1/jobs/orphan/resume", json={}, timeout=30)
        assert reply.status_code == 200, reply.text
        again = httpx.post(f"{server.url}/api/v1/jobs/orphan/resume", json={}, timeout=30)
        assert again.status_code == 409 and "belongs to the controller service" in again.json()["detail"]
        release.touch()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            status = httpx.get(f"{server.url}/api/v1/jobs/orphan", params={"events": 200}, timeout=10).json()
            if status["state"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.3)
        assert status["state"] == "succeeded", status
        assert [i["attempt"] for i in status["instances"]] == [1, 1]
        assert {e["reason"] for e in status["events"]} >= {"Resumed", "Adopted"}
        assert len(list(marks.iterdir())) == 2  # neither instance ran a second time
        ended = httpx.post(f"{server.url}/api/v1/jobs/orphan/resume", json={}, timeout=30)
        assert ended.status_code == 409 and "already ended" in ended.json()["detail"]
        assert httpx.post(f"{server.url}/api/v1/jobs/nosuch/resume", json={}, timeout=30).status_code == 404
    finally:
        release.touch()
        server.stop()
