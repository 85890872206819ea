"""Mechanisms: a job's runPolicy (Kubeflow's meanings), with real processes: activeDeadlineSeconds
(the job fails DeadlineExceeded and its instances are killed), backoffLimit (restarts counted over
the whole job, then BackoffLimitExceeded), ttlSecondsAfterFinished (the ended job and its run
folder are deleted), suspend (a held job that `job unsuspend` starts; suspending a running job
stops its instances), and cleanPodPolicy Running (instances still running when the job ends are
stopped)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from controller_harness import Harness, events, job, pids_alive, py

from trainmaster.store import repository as repo


def pids(status: dict) -> list[int]:
    return [i["pid"] for i in status["instances"] if i.get("pid")]


def step_until(h: Harness, job_id: int, predicate, timeout: float = 30.0) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        h.controller.step()
        status = h.status(job_id)
        if predicate(status):
            return status
        assert time.monotonic() < deadline, (
            f"waited {timeout}s for a condition: {status['state']} {status['events'][-5:]}"
        )
        time.sleep(0.1)


def test_active_deadline_fails_the_job_and_kills_its_instances(harness: Harness) -> None:
    job_id = harness.submit(
        job(
            "deadline",
            [{"name": "slow", "replicas": 2, "command": ["sleep", "60"]}],
            runPolicy={"activeDeadlineSeconds": 2},
        )
    )
    running = step_until(harness, job_id, lambda s: s["state"] == "running")
    started = pids(running)
    assert len(started) == 2 and pids_alive(started) == started
    began = time.monotonic()
    state = harness.controller.run_job(job_id)
    status = harness.status(job_id)
    assert state == "failed" and status["reason"] == "DeadlineExceeded", status["message"]
    assert time.monotonic() - began < 20
    assert pids_alive(started) == []
    assert {i["state"] for i in status["instances"]} == {"stopped"}


def test_backoff_limit_counts_restarts_over_the_whole_job(harness: Harness) -> None:
    failing = {
        "name": "w",
        "replicas": 3,
        "command": py("import sys; sys.exit(3)"),
        "restartPolicy": {"policy": "OnFailure", "maxRestarts": 100, "backoffSeconds": 0},
    }
    state, status = harness.run(job("backoff", [failing], runPolicy={"backoffLimit": 2}))
    assert state == "failed" and status["reason"] == "BackoffLimitExceeded", status["message"]
    assert sum(i["restarts"] for i in status["instances"]) == 2  # per instance it would be 300
    assert events(status, "BackoffLimitExceeded")


def test_ttl_after_finished_deletes_the_job_and_its_folder(harness: Harness) -> None:
    kept = harness.submit(job("kept", [{"name": "a", "command": ["true"]}]))
    assert harness.controller.run_job(kept) == "succeeded"
    job_id = harness.submit(
        job("short-lived", [{"name": "a", "command": ["true"]}], runPolicy={"ttlSecondsAfterFinished": 1})
    )
    assert harness.controller.run_job(job_id) == "succeeded"
    run_dir = Path(harness.status(job_id)["runDir"])
    assert run_dir.is_dir()  # readable right after it ended
    deadline = time.monotonic() + 15
    while True:
        harness.controller.step()
        with harness.sessions() as session:
            from trainmaster.store.models import JobRow

            gone = session.get(JobRow, job_id) is None
        if gone:
            break
        assert time.monotonic() < deadline, "the job outlived its ttlSecondsAfterFinished"
        time.sleep(0.2)
    assert not run_dir.exists()
    assert harness.status(kept)["state"] == "succeeded"  # a job without a TTL stays


def test_suspended_job_waits_until_unsuspended(harness: Harness, tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    code = f"open({str(marker)!r}, 'a').write('x'); import time; time.sleep(1.5)"
    job_id = harness.submit(job("held", [{"name": "a", "command": py(code)}], runPolicy={"suspend": True}))
    for _ in range(5):
        harness.controller.step()
        time.sleep(0.1)
    status = harness.status(job_id)
    assert status["state"] == "pending" and status["reason"] == "Suspended"
    assert not marker.exists() and pids(status) == []
    with harness.sessions() as session:
        assert repo.set_suspended(session, repo.load_job(session, job_id), False)
        session.commit()
    assert harness.controller.run_job(job_id) == "succeeded"
    assert marker.read_text() == "x"


def test_suspending_a_running_job_stops_it_and_unsuspend_starts_it_again(harness: Harness, tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    code = f"open({str(marker)!r}, 'a').write('x'); import time; time.sleep(float(open({str(tmp_path / 'sleep')!r}).read()))"
    (tmp_path / "sleep").write_text("60")
    job_id = harness.submit(job("paused", [{"name": "a", "command": py(code)}]))
    running = step_until(harness, job_id, lambda s: s["state"] == "running")
    first = pids(running)
    db = harness.url
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "trainmaster", "job", "suspend", str(job_id), "--db", db],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0 and "suspended" in out.stdout, out.stderr
    held = step_until(harness, job_id, lambda s: s["reason"] == "Suspended")
    assert held["state"] == "pending" and pids_alive(first) == []
    (tmp_path / "sleep").write_text("0.5")
    out = subprocess.run(
        [sys.executable, "-m", "trainmaster", "job", "unsuspend", str(job_id), "--db", db],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0 and "resumed" in out.stdout, out.stderr
    assert harness.controller.run_job(job_id) == "succeeded"
    assert marker.read_text() == "xx"  # started again from scratch, as Kubeflow recreates its pods


def test_clean_pod_policy_running_stops_what_still_runs_at_the_end(harness: Harness) -> None:
    state, status = harness.run(
        job(
            "chief-ends",
            [
                {"name": "ps", "command": ["sleep", "60"]},
                {"name": "chief", "command": py("import time; time.sleep(1)")},
            ],
            statusPolicy={"failed": "any", "succeeded": {"roles": ["chief"]}},
        )
    )
    assert state == "succeeded"
    ps = next(i for i in status["instances"] if i["role"] == "ps")
    assert ps["state"] == "stopped" and pids_alive([ps["pid"]]) == []
