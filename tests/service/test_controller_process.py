"""Mechanisms: the controller service's reconcile loop in a process of its own beside the API's
(``trainmaster server``), and crash safety of each: the controller process killed with SIGKILL
is started again by the server and loses no job, re-adopts live instances and runs each instance
once; the server killed with SIGKILL takes its controller process with it (nothing is left
reconciling without an API), and a server started at once after carries on; the server
process's own controller keeps nothing per submitted job."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_process import ServerProcess
from test_server import write_job

from trainmaster.api import LocalTrainmaster
from trainmaster.service.controller_process import ControllerConfig
from trainmaster.store.db import make_engine, session_factory

pytestmark = pytest.mark.timeout(180)


def controller_process(server: ServerProcess, timeout: float = 30) -> psutil.Process:
    """The server's controller process: its one child (forked at its start, with the server's
    command line; a fresh ``python -m trainmaster.service.controller_process`` once restarted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(server.proc.pid).children()
        assert len(children) <= 1, [c.cmdline() for c in children]
        if children:
            return children[0]
        time.sleep(0.1)
    raise AssertionError(f"the server {server.proc.pid} has no controller process after {timeout:g} s")


def durable_job(tmp_path: Path, runs: Path) -> Path:
    code = (
        f"import os, time\nopen('{runs}', 'a').write(os.environ['TM_ROLE'] + os.environ['TM_REPLICA_INDEX'] + '\\n')\n"
        "time.sleep(6)\n"
    )
    return write_job(
        tmp_path,
        "durable",
        [
            {"name": "a", "replicas": 2, "command": ["python", "-c", code]},
            {"name": "late", "command": ["python", "-c", code], "dependsOn": [{"role": "a", "condition": "Succeeded"}]},
        ],
    )


def running_pids(server: ServerProcess, job: str, count: int) -> dict[str, int]:
    status = server.wait_state(job, {"running"})
    deadline = time.monotonic() + 30
    while sum(i["state"] == "running" for i in status["instances"]) < count:
        assert time.monotonic() < deadline, status["instances"]
        time.sleep(0.2)
        status = server.status(job)
    return {f"{i['role']}{i['index']}": i["pid"] for i in status["instances"] if i["state"] == "running"}


def test_controller_process_killed_with_sigkill_is_restarted_and_loses_nothing(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path)
    try:
        runs = tmp_path / "runs.txt"
        assert server.cli("submit", str(durable_job(tmp_path, runs))).returncode == 0
        pids = running_pids(server, "durable", 2)
        first = controller_process(server)
        # the first is forked from the server (up at once, no second interpreter's imports); the
        # server runs threads by now, so the one started again is a fresh interpreter
        assert first.cmdline() == psutil.Process(server.proc.pid).cmdline()
        first.kill()
        first.wait(10)
        # the API answers while no controller process runs, and says the loop is away
        assert httpx.get(f"{server.url}/api/v1/jobs/durable", timeout=5).status_code == 200
        deadline = time.monotonic() + 30
        while (second := controller_process(server)).pid == first.pid:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        final = server.wait_state("durable", {"succeeded", "failed"}, timeout=90)
        assert final["state"] == "succeeded", final["events"][-10:]
        assert sorted(runs.read_text().split()) == ["a0", "a1", "late0"]  # every instance ran exactly once
        for inst in final["instances"]:
            assert inst["attempt"] == 1
            if f"{inst['role']}{inst['index']}" in pids:
                assert inst["pid"] == pids[f"{inst['role']}{inst['index']}"]  # re-adopted, not started again
        # (whether an instance was still alive to re-adopt, or had ended while no controller
        # watched and its exit was read from its agent, depends on how fast the new process came up)
        assert server.health()["ok"], server.health()
        assert second.is_running()
        assert "trainmaster.service.controller_process" in second.cmdline()
    finally:
        server.stop()
    assert not second.is_running() or second.wait(5) is not None  # stopped with its server


def test_server_killed_with_sigkill_takes_its_controller_process_along(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path)
    try:
        runs = tmp_path / "runs.txt"
        assert server.cli("submit", str(durable_job(tmp_path, runs))).returncode == 0
        server.wait_state("durable", {"running"})
        child = controller_process(server)
        server.kill9()
        child.wait(15)  # it ends its pass and exits once the server's end of their socket closes
        server.start()  # at once: the lock the orphan shared is free (or waited for)
        final = server.wait_state("durable", {"succeeded", "failed"}, timeout=90)
        assert final["state"] == "succeeded", final["events"][-10:]
        assert sorted(runs.read_text().split()) == ["a0", "a1", "late0"]
    finally:
        server.stop()


def test_the_server_process_controller_keeps_nothing_per_submitted_job(tmp_path: Path) -> None:
    """Mechanism: the server process's controller (:meth:`ControllerConfig.api_controller`) only
    records intents, so a submit leaves nothing behind in the API process. It kept each submitted
    job's validated spec for a pass that runs in the controller process (~35 objects a job, let go
    only when a pass here ended the job, which never came): in the Kueue replay the API process
    grew to ~460,000 such objects, and each full garbage collection walked them all, up to
    360 ms in which no request was read (issue 31: list p99 138-214 ms as the client saw it,
    25-30 ms in the server; the list is the prober's first request after its pause, so it is
    the one that arrives while a collection runs)."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    controller = ControllerConfig(url, "hollow").api_controller(session_factory(make_engine(url)))
    facade = LocalTrainmaster(controller.sessions, url)

    def submit(names: range) -> None:
        for n in names:
            document: dict[str, Any] = {
                "apiVersion": "trainmaster/v1",
                "kind": "Job",
                "metadata": {"name": f"job-{n}", "labels": {"class": "small"}},
                "spec": {"roles": [{"name": "main", "command": ["true"], "resources": {"cpu": 1}}]},
            }
            facade.submit(facade.load(document, "hollow"), controller)

    submit(range(20))  # the first submits fill the store's and the validators' caches
    gc.collect()
    before = len(gc.get_objects())
    submit(range(20, 320))
    gc.collect()
    kept = len(gc.get_objects()) - before
    assert kept < 100, f"{kept} more objects tracked by the collector after 300 submits"
