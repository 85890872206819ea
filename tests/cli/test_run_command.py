"""Mechanisms: `trainmaster run` end to end: the main PyTorch job trains for real, and Ctrl-C /
SIGTERM cancels the job leaving no instance process behind (controller spec, steps 7 and 9)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orphans import orphan_a_run

from controller_harness import ROOT, pids_alive, run_job_file, run_logs


@pytest.mark.timeout(240)
def test_pytorch_digits_reaches_accuracy(tmp_path: Path) -> None:
    out, status = run_job_file(ROOT / "examples/pytorch-digits.yaml", tmp_path, timeout=230)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = json.loads((tmp_path / "outputs/pytorch-digits/metrics.json").read_text())
    assert metrics["world_size"] == 3 and metrics["test_accuracy"] >= 0.9
    master = next(i for i in status["instances"] if i["role"] == "master")
    assert master["state"] == "succeeded"
    # kubeflow preset: the master succeeding ends the job; a worker still exiting is stopped, and
    # says that it was because the job succeeded; every role reads as a success (issue 38)
    assert {i["state"] for i in status["instances"]} <= {"succeeded", "stopped"}
    assert {i["reason"] for i in status["instances"] if i["state"] == "stopped"} <= {"JobSucceeded"}
    assert {r["state"] for r in status["roles"]} == {"succeeded"}
    assert "Warning" not in run_logs(tmp_path)  # the workload's own logs carry no library warning


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_on_run_leaves_no_instance_behind(tmp_path: Path, sig: signal.Signals) -> None:
    spec = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "sleepy"},
        "spec": {
            "roles": [
                {"name": "a", "replicas": 2, "command": ["python", "-c", "import time; time.sleep(120)"]},
                {
                    "name": "b",
                    "command": ["python", "-c", "import time; time.sleep(120)"],
                    "dependsOn": [{"role": "a"}],
                },
            ]
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "TRAINMASTER_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainmaster", "run", str(path), "--interval", "0.1", "--grace", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    pids = _instance_process_trees(tmp_path / "home", expected=3, timeout=60)
    assert len(pids) == 3
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    assert "cancelled" in output
    assert pids_alive(pids) == []


def _instance_process_trees(home: Path, expected: int, timeout: float) -> list[int]:
    """The pids of every process the node agent started for this Trainmaster home (each carries
    the agent's ``TM_INSTANCE_ID`` marker), once ``expected`` of them run the role's command
    (the wait step execs the command: there is no wrapper process)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        tree: list[int] = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                environ = p.environ()
            except psutil.Error:
                continue
            # an instance's environment is built, not inherited: its output folder says whose it is
            if environ.get("TM_OUTPUT_DIR", "").startswith(str(home)) and "TM_INSTANCE_ID" in environ:
                tree.append(p.pid)
        commands = [pid for pid in tree if _runs_sleep(pid)]
        if len(commands) == expected:
            return tree
        assert time.monotonic() < deadline, f"instances never all ran their command ({len(commands)} of {expected})"
        time.sleep(0.1)


def _runs_sleep(pid: int) -> bool:
    import psutil

    try:
        return "time.sleep(120)" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


@pytest.mark.timeout(180)
def test_a_run_killed_with_sigkill_is_resumed_without_running_anything_twice(tmp_path: Path) -> None:
    """Nothing is lost when the embedded controller dies: a job whose `trainmaster run` was
    killed -9 shows why its state is stale, and `trainmaster resume` re-adopts its live
    instances and finishes it, each instance having run once."""
    from trainmaster.store import repository as repo
    from trainmaster.store.db import make_engine, session_factory

    marks, env = orphan_a_run(tmp_path, "orphan", seconds=8)

    sessions = session_factory(make_engine(env["TRAINMASTER_DB"]))
    with sessions() as session:
        stale = repo.job_status(session, repo.find_job(session, "orphan"))
    assert stale["state"] == "running" and stale["reason"] == "ControllerGone"
    assert "trainmaster resume" in stale["message"]

    out = subprocess.run(
        [sys.executable, "-m", "trainmaster", "resume", "orphan", "--interval", "0.1", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    status = json.loads(out.stdout)
    assert status["state"] == "succeeded" and [i["attempt"] for i in status["instances"]] == [1, 1]
    assert {e["reason"] for e in status["events"]} >= {"Resumed", "Adopted"}
    assert len(list(marks.iterdir())) == 2  # neither instance ran a second time
    again = subprocess.run(
        [sys.executable, "-m", "trainmaster", "resume", "orphan"], capture_output=True, text=True, env=env, timeout=60
    )
    assert again.returncode == 2 and "already ended" in again.stderr


#: Runs the CLI with every node agent's ``stop`` refused, as the agent refused it on a busy
#: machine (issue 38): ``OSError: [Errno 19] No such device``.
REFUSING_STOP = """
import sys
from trainmaster.agent import client
def refuse(self, ids, grace):
    raise client.AgentUnavailable("the node agent refused 'stop': OSError: [Errno 19] No such device")
client.AgentClient.stop = refuse
from trainmaster.cli.main import main
sys.argv[0] = "trainmaster"
main()
"""


@pytest.mark.timeout(120)
def test_an_agent_refusal_is_one_line_and_recorded_on_the_job_never_a_traceback(tmp_path: Path) -> None:
    """Mechanism (controller step 9, a job's end stops its instances): when the node agent keeps
    refusing ``stop``, `trainmaster run` retries the pass, then exits 1 with one ``error:``
    line that says what happened and how to carry on, and the job records why (an event and its
    reason), instead of a traceback through the controller."""
    from controller_harness import stop_agent
    from trainmaster.api import LocalTrainmaster

    spec = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "refused"},
        "spec": {
            # the job succeeds when `done` does; `idle` still runs then, so the job's end stops it
            "statusPolicy": {"succeeded": {"roles": ["done"]}},
            "roles": [
                {"name": "idle", "command": ["python", "-c", "import time; time.sleep(60)"]},
                {"name": "done", "command": ["python", "-c", "pass"]},
            ],
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    home = tmp_path / "home"
    db = f"sqlite:///{tmp_path / 'tm.db'}"
    env = {**os.environ, "TRAINMASTER_HOME": str(home)}
    try:
        out = subprocess.run(
            [sys.executable, "-c", REFUSING_STOP, "job", "run", str(path), "--interval", "0.1", "--db", db],
            capture_output=True,
            text=True,
            env=env,
            timeout=100,
        )
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
        assert "Traceback" not in out.stderr, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: job refused (id 1) left "), out.stderr
        assert "No such device" in lines[0] and "trainmaster job resume 1" in lines[0], lines[0]
        status = LocalTrainmaster.open(db).status("refused", events=200)
        failed = [e for e in status["events"] if e["reason"] == "BackendFailed"]
        assert failed and failed[-1]["type"] == "Warning" and "No such device" in failed[-1]["message"]
        assert status["reason"] == "BackendFailed" and "trainmaster resume 1" in status["message"]
    finally:
        stop_agent(home / "agent")
