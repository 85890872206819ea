"""Mechanisms: the controller over the node agent (issue #14): kill -9 of the role command's
parent and of the agent while a job runs never makes a replica run twice and never loses an
exit (the restart policy applies); cancel, job end and `trainmaster run` SIGTERM leave no
process of the job, setsid grandchildren and double-forked daemons included; a second
controller on the same store reuses the running agent and leaves the other's instances alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent_fixtures import ESCAPERS, PY, doubles, escapers, job_processes, shell_parent, starts
from helpers import wait_until
from controller_harness import Harness, events, job, step_until
from trainmaster.agent.client import agent_pid
from trainmaster.backends.local import agent_state_dir
from trainmaster.controller import Controller

RESTART_TWICE = {"policy": "OnFailure", "maxRestarts": 2, "backoffSeconds": 0}


def _all_running(h: Harness, job_id: int, count: int, restarts: int = 0) -> dict[str, Any]:
    return step_until(
        h, job_id, lambda s: sum(i["state"] == "running" and i["restarts"] == restarts for i in s["instances"]) == count
    )


def _cancel(h: Harness, job_id: int) -> None:
    h.controller.cancel(job_id)
    assert h.controller.run_job(job_id) == "cancelled"


def test_kill9_of_the_commands_parent_restarts_once_and_never_overlaps(
    harness: Harness, tmp_path: Path, isolated_home: Path
) -> None:
    """The role command's parent (a shell running the replica as its child) is killed -9: the
    agent kills the rest of its tree before it reports the exit (137), the restart policy starts
    the next attempt, and no two copies of the replica were ever alive at once."""
    lock = tmp_path / "w.lock"
    job_id = harness.submit(
        job("parent", [{"name": "w", "command": shell_parent(lock, 300), "restartPolicy": RESTART_TWICE}])
    )
    status = _all_running(harness, job_id, 1)
    wait_until(lambda: starts(lock) == 1, what="the replica to start")
    os.kill(status["instances"][0]["pid"], signal.SIGKILL)
    status = _all_running(harness, job_id, 1, restarts=1)
    wait_until(lambda: starts(lock) == 2, what="the second attempt's replica")
    assert "exited with code 137" in events(status, "Restarting")[0]["message"]
    _cancel(harness, job_id)
    assert doubles(tmp_path) == [] and job_processes(isolated_home) == []


def test_kill9_of_the_agent_restarts_its_instances_by_policy_never_twice(
    harness: Harness, tmp_path: Path, isolated_home: Path
) -> None:
    """Agent death mid-job: the next controller call starts a new agent, which kills what the
    old one left and journals it AgentRestarted (137) before accepting any start; the restart
    policy then starts each replica again; no replica ever had two live copies, no exit was lost."""
    locks = [tmp_path / f"r{n}.lock" for n in range(2)]
    job_id = harness.submit(
        job(
            "agentdies",
            [
                {"name": f"r{n}", "command": shell_parent(lock, 300), "restartPolicy": RESTART_TWICE}
                for n, lock in enumerate(locks)
            ],
        )
    )
    _all_running(harness, job_id, 2)
    wait_until(lambda: all(starts(lock) == 1 for lock in locks), what="both replicas")
    old = agent_pid(agent_state_dir())
    assert old is not None
    os.kill(old, signal.SIGKILL)
    status = _all_running(harness, job_id, 2, restarts=1)
    wait_until(lambda: all(starts(lock) == 2 for lock in locks), what="both replicas again")
    assert agent_pid(agent_state_dir()) != old
    restarting = events(status, "Restarting")
    assert len(restarting) == 2 and all("AgentRestarted" in e["message"] for e in restarting)
    _cancel(harness, job_id)
    assert doubles(tmp_path) == [] and job_processes(isolated_home) == []


def test_cancel_and_job_end_leave_no_detached_descendants(harness: Harness, isolated_home: Path) -> None:
    """cancel, and a job that ends by itself: setsid grandchildren and double-forked daemons
    of its instances are gone (their cgroups held them)."""
    job_id = harness.submit(job("escapes", [{"name": "w", "replicas": 2, "command": [PY, "-c", ESCAPERS, "300"]}]))
    _all_running(harness, job_id, 2)
    wait_until(lambda: len(escapers()) == 4, what="two escapers per replica")
    _cancel(harness, job_id)
    assert escapers() == [] and job_processes(isolated_home) == []
    state, status = harness.run(job("ends", [{"name": "w", "command": [PY, "-c", ESCAPERS, "1"]}]))
    assert state == "succeeded", status["events"]
    assert escapers() == [] and job_processes(isolated_home) == []
    done = status["instances"][0]
    assert done["cpuSeconds"] > 0 and done["peakRss"] > 0  # the agent's figures, on the row


@pytest.mark.timeout(120)
def test_sigterm_of_trainmaster_run_leaves_no_process_of_the_job(tmp_path: Path) -> None:
    """Controller SIGTERM: `trainmaster run` cancels its job; every process of it (detached
    ones included) is gone when the command has exited."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job("term", [{"name": "w", "command": [PY, "-c", ESCAPERS, "300"]}])))
    home = tmp_path / "home"
    env = {**os.environ, "TRAINMASTER_HOME": str(home)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainmaster", "run", str(path), "--interval", "0.1", "--grace", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        wait_until(lambda: len(escapers()) == 2, 60, "the instance's escapers")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1 and "cancelled" in output, output
        assert escapers() == [] and job_processes(home) == []
    finally:
        proc.kill()
        from controller_harness import stop_agent

        stop_agent(home / "agent")


def test_a_second_controller_reuses_the_agent_and_leaves_the_others_instances(harness: Harness, tmp_path: Path) -> None:
    """Two controllers on one store and home: one agent; the second reconciles only its own jobs."""
    job_id = harness.submit(job("mine", [{"name": "w", "command": [PY, "-c", "import time; time.sleep(300)"]}]))
    _all_running(harness, job_id, 1)
    first_agent = harness.backend.agent.ping()["pid"]
    other = Controller(
        harness.sessions, type(harness.backend)(), harness.url, interval=0.1, runs_dir=tmp_path / "r2", owner="other"
    )
    other.recover()
    other.step()
    assert other.backend.agent.ping()["pid"] == first_agent  # type: ignore[attr-defined]
    assert harness.status(job_id)["instances"][0]["state"] == "running"
    other.backend.close()
    _cancel(harness, job_id)


def test_an_attempt_prepared_in_the_pass_its_job_ends_is_never_started(harness: Harness) -> None:
    """Job end: a worker restarted (Always) in the very pass the master's success ends the job
    (kubeflow preset) is stopped before its attempt starts; nothing of the job runs afterwards."""
    status = harness.run(
        job(
            "ends",
            [
                {"name": "master", "command": [PY, "-c", "import time; time.sleep(1)"]},
                {
                    "name": "worker",
                    "command": ["true"],
                    "restartPolicy": {"policy": "Always", "maxRestarts": 1000, "backoffSeconds": 0},
                },
            ],
            statusPolicy={"preset": "kubeflow"},
        )
    )[1]
    assert status["state"] == "succeeded", status["events"]
    ended = max(i for i, e in enumerate(status["events"]) if e["object"] == "job" and e["reason"] != "Submitted")
    late = [e for e in status["events"][ended:] if e["reason"] == "Started"]
    assert late == []  # no attempt started after the job ended
