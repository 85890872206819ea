"""Test helpers for the controller: a controller over a fresh store, job builders, process checks.

A plain module (not conftest) so tests import it by a unique name: several conftest.py files
live in this tree and ``from conftest import`` would pick whichever loaded first.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import yaml

from trainmaster.api import LocalTrainmaster
from trainmaster.backends.local import LocalBackend
from trainmaster.controller import Controller
from trainmaster.loading import load_document
from trainmaster.spec.load import LoadOptions
from trainmaster.spec.model import RuntimeKind
from trainmaster.store import repository as repo
from trainmaster.store.db import make_engine, session_factory

PY = sys.executable

# The tests' private Ray cluster listens on this loopback address, not the controller's
# 127.0.0.1, so every Ray test moves its instances to "another node's" address, as on a
# cluster of several machines.
RAY_NODE_IP = "127.0.0.2"


def operator_runtime() -> RuntimeKind | None:
    """What ``--runtime`` would be for a CLI started now: its variable TRAINMASTER_RUNTIME (the
    test fixtures set host, so converted files' images are not pulled; container tests unset it)."""
    import os

    value = os.environ.get("TRAINMASTER_RUNTIME", "").strip().lower()
    return RuntimeKind(value) if value in ("host", "container", "auto") else None


class Harness:
    """A controller over a fresh SQLite store with a fast reconcile interval."""

    def __init__(self, tmp_path: Path, backend: Any = None, url: str | None = None):
        self.url = url or f"sqlite:///{tmp_path / 'store.db'}"
        self.sessions = session_factory(make_engine(self.url))
        self.backend = backend or LocalBackend()
        self.controller = Controller(
            self.sessions, self.backend, self.url, interval=0.1, grace=2.0, runs_dir=tmp_path / "runs"
        )
        self.jobs = LocalTrainmaster(self.sessions, self.url)

    def submit(self, doc: dict[str, Any] | str) -> int:
        """Through the facade, as the CLI and the server submit (names need not be unique here)."""
        raw = yaml.safe_load(doc) if isinstance(doc, str) else doc
        loaded = load_document(raw, options=LoadOptions(runtime=operator_runtime()))
        return self.jobs.submit(loaded, self.controller, unique_name=False).id

    def run(self, doc: dict[str, Any] | str) -> tuple[str, dict[str, Any]]:
        job_id = self.submit(doc)
        state = self.controller.run_job(job_id)
        return state, self.status(job_id)

    def status(self, job_id: int) -> dict[str, Any]:
        with self.sessions() as session:
            return repo.job_status(session, repo.load_job(session, job_id), events=500)


def job(name: str, roles: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": name}, "spec": {"roles": roles, **spec}}


def py(code: str) -> list[str]:
    return [PY, "-c", code]


def events(status: dict[str, Any], reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in status["events"] if reason is None or e["reason"] == reason]


def stop_agent(state_dir: Path, timeout: float = 15.0) -> None:
    """End the node agent serving ``state_dir`` (a test's), if any: SIGTERM (it stops its
    instances and removes their cgroups), SIGKILL after ``timeout``, then kill whatever still
    carries its marker. Used by a finalizer, so it runs when a test fails too."""
    import os
    import signal

    from trainmaster.agent.client import agent_pid
    from trainmaster.agent.core import AgentOptions
    from trainmaster.agent.tree import kill_tree, make_trees

    pid = agent_pid(state_dir)
    if pid is None:
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if str(state_dir).encode() in cmdline:  # that pid is still this agent (not a recycled pid)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    trees = make_trees(AgentOptions(state_dir.resolve()).node_key)
    for name in trees.leftovers():
        kill_tree(trees, name)
        trees.remove(name)
    trees.close()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an agent this test process spawned stays one until reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_alive(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


SERVER = (
    "import os, socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((os.environ['TM_HOST'], int(os.environ['TM_PORT']))); s.listen()\n"
    "for _ in range(int(os.environ['CLIENTS'])):\n"
    "    c, _ = s.accept(); c.sendall(b'hello'); c.close()\n"
)
CLIENT = (
    "import os, socket, time\n"
    "print('TM_SERVICE_SERVER=' + os.environ['TM_SERVICE_SERVER'], flush=True)\n"
    "host, port = os.environ['TM_SERVICE_SERVER'].split(',')[0].split(':')\n"
    "for attempt in range(100):\n"
    "    try:\n"
    "        s = socket.create_connection((host, int(port))); break\n"
    "    except OSError: time.sleep(0.1)\n"
    "assert s.recv(5) == b'hello'\n"
    "print('client got hello')\n"
)


def server_client_job(name: str, clients: int = 3) -> dict[str, Any]:
    """A server listening on TM_PORT and clients that reach it through TM_SERVICE_SERVER."""
    return job(
        name,
        [
            {"name": "server", "command": py(SERVER), "env": {"CLIENTS": str(clients)}},
            {"name": "client", "replicas": clients, "command": py(CLIENT), "dependsOn": [{"role": "server"}]},
        ],
    )


def step_until(h: Harness, job_id: int, done: Any, timeout: float = 60) -> dict[str, Any]:
    """Reconcile until ``done(status)`` holds; fail with the job's state after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h.controller.step()
        status = h.status(job_id)
        if done(status):
            return status
        time.sleep(0.1)
    raise AssertionError(f"timed out; job is {status['state']}: {status['message']}")


ROOT = Path(__file__).resolve().parents[1]


def run_job_file(path: Path, tmp_path: Path, *args: str, timeout: float = 150) -> tuple[Any, dict[str, Any]]:
    """``trainmaster run PATH --json`` in a fresh home under ``tmp_path``, as a user runs an
    example; returns the finished process and the job's final status (empty if none printed)."""
    import json
    import os
    import subprocess

    env = {**os.environ, "TRAINMASTER_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [
            PY,
            "-m",
            "trainmaster",
            "run",
            str(path),
            "--interval",
            "0.2",
            "--grace",
            "1",
            "--json",
            "--db",
            f"sqlite:///{tmp_path / 'tm.db'}",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    status = json.loads(proc.stdout[proc.stdout.index("{") :]) if "{" in proc.stdout else {}
    return proc, status


def run_logs(tmp_path: Path) -> str:
    """Every instance log of jobs run by :func:`run_job_file` in ``tmp_path``."""
    return "\n".join(p.read_text() for p in sorted((tmp_path / "home").rglob("*.log")))
