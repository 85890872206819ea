"""Soak (issue 31): mixed jobs through a real ``trainmaster server`` on PostgreSQL and the local
node agent, with random SIGKILLs of the server, SIGKILLs of the agent and immediate PostgreSQL
restarts, for ``--minutes``; then every job must have ended exactly once and nothing be left.

    nice -n 19 .venv/bin/python bench/soak.py --minutes 30 [--seed 1] [--out bench/results]

A correctness run, not a performance figure (run it niced). It writes ``soak.json`` and
``soak.md`` under ``--out`` and exits 1 when a check failed.

**Jobs** (unique names, submitted over REST by one client that retries a lost request with the
same name until it is stored: 201, or 409 once a lost reply had stored it):

- ``true``: one instance of ``true`` (expected: succeeded);
- ``sleep``: 1-3 replicas that sleep 0.5-4 s, each holding an exclusive ``flock`` on a file of
  its own for as long as it lives, so a second live copy of a replica is seen; ``OnFailure``, as
  a killed agent kills its instances (exit 137) and the restart policy decides (succeeded);
- ``fail``: exits 3 with ``restartPolicy: Never`` (failed);
- ``retry``: fails on its first attempt and succeeds on the next, ``OnFailure`` (succeeded);
- ``cancel``: sleeps 60 s and is cancelled over REST 1-3 s after its submit (cancelled).

**Faults**, one every 15-45 s at random: SIGKILL of the server (started again at once, same port
and store), SIGKILL of the node agent (the server starts a new one on its next request), or
``pg_ctl stop -m immediate`` + start of PostgreSQL (every connection drops).

**Checks afterwards** (after a clean server stop):

- every submitted job is stored once, has ended, and has exactly one terminal event (the event
  of its final reason) with nothing started after it; its events' ids and times never go back;
- no replica ran two live copies at once (restarts one after the other are counted);
- the outcome of each job is the one its kind expects (a fault may fail a job: such jobs are
  listed, not hidden);
- no instance process of this run's agent, no agent, no cgroup under the agent's tree and no
  listening port of an instance is left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers import free_port  # noqa: E402  (the tests' loopback port helper)

PY = sys.executable
# A replica holding an exclusive flock on its own file while it lives; a second live copy
# records itself in <lock>.double; every start appends its pid to <lock>.starts.
REPLICA = (
    "import fcntl, os, sys, time\n"
    "lock = sys.argv[1] + '-' + os.environ.get('TM_ROLE', 'r') + '-' + os.environ.get('TM_REPLICA_INDEX', '0')\n"
    "f = open(lock, 'a+')\n"
    "try:\n"
    "    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "except BlockingIOError:\n"
    "    open(lock + '.double', 'a').write(f'{os.getpid()}\\n')\n"
    "open(lock + '.starts', 'a').write(f'{os.getpid()}\\n')\n"
    "time.sleep(float(sys.argv[2]))\n"
)
RETRY = (
    "import os, sys\nmark = sys.argv[1]\nif not os.path.exists(mark):\n    open(mark, 'w').close()\n    sys.exit(4)\n"
)
EXPECTED = {"true": "succeeded", "sleep": "succeeded", "fail": "failed", "retry": "succeeded", "cancel": "cancelled"}
# A killed agent kills what it ran (exit 137, AgentRestarted: core.py) and the restart policy
# decides; these jobs restart on it, so they end as their kind says whatever the faults did
AGENT_DEATH = {"policy": "OnFailure", "maxRestarts": 10, "backoffSeconds": 1}
START_TIMEOUT = 600  # s; a niced server beside a benchmark at raised priority starts slowly
TERMINAL = {"succeeded", "failed", "cancelled"}


def uptime() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class Server:
    """``trainmaster server`` (local backend) that can be killed -9 and started again."""

    def __init__(self, workdir: Path, db: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = workdir / "home"
        self.env = {**os.environ, "TRAINMASTER_HOME": str(self.home), "TRAINMASTER_DB": db}
        self.log = open(workdir / "server.log", "ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        argv = [PY, "-m", "trainmaster", "server", "--port", str(self.port), "--interval", "0.2", "--grace", "2"]
        self.proc = subprocess.Popen(
            argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the server did not answer /healthz within {START_TIMEOUT} s; see {self.log.name}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def agent_pid(home: Path) -> int | None:
    try:
        pid = int((home / "agent" / "agent.pid").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pid if psutil.pid_exists(pid) else None


def job_doc(kind: str, name: str, rng: random.Random, marks: Path) -> dict[str, Any]:
    role: dict[str, Any] = {"name": "main"}
    if kind == "true":
        role["command"] = ["true"]
    elif kind == "sleep":
        role["replicas"] = rng.randint(1, 3)
        role["command"] = [PY, "-c", REPLICA, str(marks / name), f"{rng.uniform(0.5, 4):.2f}"]
        role["restartPolicy"] = AGENT_DEATH
    elif kind == "fail":
        role["command"] = [PY, "-c", "import sys; sys.exit(3)"]
        role["restartPolicy"] = {"policy": "Never"}
    elif kind == "retry":
        role["command"] = [PY, "-c", RETRY, str(marks / f"{name}.failed-once")]
        role["restartPolicy"] = {"policy": "OnFailure", "maxRestarts": 3, "backoffSeconds": 1}
    else:  # cancel
        role["command"] = [PY, "-c", REPLICA, str(marks / name), "60"]
        role["restartPolicy"] = AGENT_DEATH
    return {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {"soak": kind}},
        "spec": {"roles": [role]},
    }


class Soak:
    def __init__(self, minutes: float, seed: int, workdir: Path):
        from postgres_server import PostgresServer, why_unavailable

        why = why_unavailable()
        if why:
            raise SystemExit(f"the soak needs PostgreSQL: {why}")
        self.minutes = minutes
        self.rng = random.Random(seed)
        self.workdir = workdir
        self.marks = workdir / "marks"
        self.marks.mkdir()
        self.pg = PostgresServer()
        self.db = self.pg.url()
        self.server = Server(workdir, self.db)
        self.jobs: dict[str, str] = {}  # name: kind
        self.faults: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()  # what a client saw while faults went on
        self.cancels: list[str] = []
        self.down = threading.Lock()  # held while the chaos thread restarts something
        self.stop = threading.Event()
        self.errors: list[str] = []

    # ---- a client that survives faults ------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with self.down:
                    url = self.server.url
                reply = httpx.request(method, url + path, timeout=30, **kwargs)
                if reply.status_code < 500:
                    return reply
                self.retries[f"HTTP {reply.status_code}"] += 1
            except httpx.HTTPError as exc:
                self.retries[type(exc).__name__] += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"{method} {path} got no answer below 500 for {START_TIMEOUT} s")
            time.sleep(0.5)

    def submit(self, kind: str, name: str) -> None:
        doc = job_doc(kind, name, self.rng, self.marks)
        reply = self._request("POST", "/api/v1/jobs", json=doc)
        if reply.status_code == 409:
            self.retries["409 (a lost reply had stored it)"] += 1
        elif reply.status_code != 201:
            raise RuntimeError(f"submit {name}: {reply.status_code} {reply.text[:300]}")
        self.jobs[name] = kind

    def guarded(self, target: Any) -> Any:
        def run() -> None:
            try:
                target()
            except Exception as exc:  # the run goes on to its checks; the error fails it
                self.errors.append(f"{target.__name__}: {type(exc).__name__}: {exc}")
                self.stop.set()

        return run

    def submitter(self) -> None:
        kinds = ["true", "sleep", "sleep", "fail", "retry", "cancel"]
        n = 0
        pending_cancels: list[tuple[float, str]] = []
        while not self.stop.is_set():
            n += 1
            kind = self.rng.choice(kinds)
            name = f"soak-{n}-{kind}"
            self.submit(kind, name)
            if kind == "cancel":
                pending_cancels.append((time.monotonic() + self.rng.uniform(1, 3), name))
            now = time.monotonic()
            for due, victim in [c for c in pending_cancels if c[0] <= now]:
                reply = self._request("POST", f"/api/v1/jobs/{victim}/cancel", json={})
                if reply.status_code >= 400 and reply.status_code != 409:  # 409: it had ended
                    raise RuntimeError(f"cancel {victim}: {reply.status_code} {reply.text[:300]}")
                self.cancels.append(victim)
                pending_cancels.remove((due, victim))
            self.stop.wait(self.rng.uniform(0.5, 2.5))
        for _, victim in pending_cancels:
            self._request("POST", f"/api/v1/jobs/{victim}/cancel", json={})
            self.cancels.append(victim)

    def chaos(self) -> None:
        while not self.stop.wait(self.rng.uniform(15, 45)):
            fault = self.rng.choice(["server", "agent", "postgresql"])
            with self.down:
                if fault == "server":
                    self.server.kill9()
                    self.server.start()
                elif fault == "agent":
                    pid = agent_pid(self.server.home)
                    if pid is None:
                        fault = "agent (none running)"
                    else:
                        os.kill(pid, signal.SIGKILL)
                else:
                    self.pg.restart()
            self.faults[fault] += 1
            print(f"{time.strftime('%H:%M:%S')} fault: {fault} ({len(self.jobs)} jobs so far)", flush=True)

    # ---- the run and its checks -------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        began = time.monotonic()
        load = {"before": uptime()}
        threads = [threading.Thread(target=self.guarded(f)) for f in (self.submitter, self.chaos)]
        for t in threads:
            t.start()
        try:
            self.stop.wait(self.minutes * 60)
        finally:
            self.stop.set()
            for t in threads:
                t.join(600)
        drain = self._wait_all_ended(timeout=900)
        load["after"] = uptime()
        key = self._agent_key()
        self.server.stop()
        leftovers = self._leftovers(key)
        checks = self._check_store()
        self.pg.close()
        return {
            "minutes": self.minutes,
            "wall_s": time.monotonic() - began,
            "load": load,
            "jobs": len(self.jobs),
            "jobs_by_kind": dict(Counter(self.jobs.values())),
            "cancel_requests": len(self.cancels),
            "faults": dict(self.faults),
            "client_retries": dict(self.retries),
            "drain_after_faults_s": drain,
            **checks,
            "leftovers": leftovers,
            "errors": self.errors,
        }

    def _wait_all_ended(self, timeout: float) -> float:
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            waiting = 0
            for state in ("pending", "starting", "running"):
                page = self._request("GET", "/api/v1/jobs", params={"limit": 1, "state": state}).json()
                waiting += len(page["items"]) + int(page["metadata"]["remainingItemCount"])
            if waiting == 0:
                return time.monotonic() - began
            time.sleep(2)
        return float("nan")

    def _agent_key(self) -> str | None:
        pid = agent_pid(self.server.home)
        if pid is None:
            return None
        try:
            return psutil.Process(pid).environ().get("TM_AGENT_KEY")
        except psutil.Error:
            return None

    def _leftovers(self, key: str | None) -> dict[str, Any]:
        from agent_fixtures import job_processes

        home = self.server.home
        deadline = time.monotonic() + 60  # the agent lingers a moment once its last client left
        while time.monotonic() < deadline and (agent_pid(home) or job_processes(home)):
            time.sleep(1)
        cgroups = []
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            for tree in hierarchy.rglob("trainmaster"):
                for node in tree.iterdir() if tree.is_dir() else []:
                    if key and node.name.endswith(key.rsplit("-", 1)[-1]):
                        cgroups += [str(p) for p in node.iterdir() if p.is_dir()]
        ports = []
        from sqlalchemy import select

        from trainmaster.store.db import make_engine, session_factory
        from trainmaster.store.models import InstanceRow

        with session_factory(make_engine(self.db))() as session:
            for (taken,) in session.execute(select(InstanceRow.ports)):
                for port in taken or []:
                    number = port if isinstance(port, int) else port.get("port") if isinstance(port, dict) else None
                    if isinstance(number, int) and not _bindable(number):
                        ports.append(number)
        return {
            "agent_alive": agent_pid(home) is not None,
            "server_alive": self.server.proc is not None and self.server.proc.poll() is None,
            "instance_processes": job_processes(home),
            "cgroups": cgroups,
            "instance_ports_in_use": sorted(set(ports)),
        }

    def _check_store(self) -> dict[str, Any]:
        from sqlalchemy import select

        from trainmaster.store.db import make_engine, session_factory
        from trainmaster.store.models import EventRow, JobRow

        problems: list[str] = []
        outcomes: Counter[str] = Counter()
        unexpected: list[str] = []
        with session_factory(make_engine(self.db))() as session:
            rows = session.execute(select(JobRow.id, JobRow.name, JobRow.state, JobRow.reason)).all()
            events: dict[int, list[tuple[int, str, str, Any]]] = {}
            for job_id, eid, obj, reason, when in session.execute(
                select(EventRow.job_id, EventRow.id, EventRow.object, EventRow.reason, EventRow.time).order_by(
                    EventRow.id
                )
            ):
                events.setdefault(job_id, []).append((eid, obj, reason, when))
        stored = Counter(name for _, name, _, _ in rows)
        for name in self.jobs:
            if stored[name] != 1:
                problems.append(f"{name}: stored {stored[name]} times")
        for job_id, name, state, reason in rows:
            kind = self.jobs.get(name)
            if kind is None:
                problems.append(f"{name}: stored but never submitted")
                continue
            outcomes[f"{kind}: {state}"] += 1
            if state not in TERMINAL:
                problems.append(f"{name}: not ended ({state}/{reason})")
                continue
            expected = EXPECTED[kind]
            if state != expected and not (kind == "cancel" and state == "succeeded"):
                unexpected.append(f"{name}: {state} ({reason}), expected {expected}")
            history = events.get(job_id, [])
            ends = [i for i, (_, obj, why, _) in enumerate(history) if obj == "job" and why == reason]
            if len(ends) != 1:
                problems.append(f"{name}: {len(ends)} events of its final reason {reason}")
            else:
                after = [why for _, obj, why, _ in history[ends[0] + 1 :] if why in ("Created", "Started", "Admitted")]
                if after:
                    problems.append(f"{name}: {after} after its end ({reason})")
            if [e for e in history if e[1] == "job" and e[2] == "Submitted"].__len__() != 1:
                problems.append(f"{name}: not exactly one Submitted event")
            times = [when for _, _, _, when in history]
            if any(b < a for a, b in zip(times, times[1:])):
                problems.append(f"{name}: event times go back")
        doubles = sorted(p.name for p in self.marks.glob("*.double"))
        twice = []
        for starts in self.marks.glob("*.starts"):
            if len(starts.read_text().split()) > 1:
                twice.append(starts.name)  # one after the other (a restart): allowed, counted
        return {
            "outcomes": dict(sorted(outcomes.items())),
            "problems": problems,
            "unexpected_outcomes": unexpected,
            "replicas_two_live_copies": doubles,
            "replicas_started_more_than_once": sorted(twice),
        }


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            s.listen()
            return True
        except OSError:
            return False


def verdict(result: dict[str, Any]) -> list[str]:
    failed = [f"error: {e}" for e in result["errors"]]
    failed += [f"problem: {p}" for p in result["problems"]]
    failed += [f"two live copies: {d}" for d in result["replicas_two_live_copies"]]
    left = result["leftovers"]
    for key in ("instance_processes", "cgroups", "instance_ports_in_use"):
        if left[key]:
            failed.append(f"left behind ({key}): {left[key][:10]}")
    if left["agent_alive"] or left["server_alive"]:
        failed.append("the agent or the server still runs after the server's stop")
    return failed


def markdown(result: dict[str, Any], failed: list[str], command: str) -> str:
    lines = [
        "# Soak (`bench/soak.py`)",
        "",
        f"Command: `{command}`; load (1, 5, 15 min) before/after: {result['load']['before']} / {result['load']['after']}.",
        "",
        f"- {result['jobs']} jobs over {result['minutes']:g} min ({json.dumps(result['jobs_by_kind'])}), "
        f"{result['cancel_requests']} cancel requests",
        f"- faults: {json.dumps(result['faults'])}",
        f"- what the client saw and retried: {json.dumps(result['client_retries'])}",
        f"- every job ended {result['drain_after_faults_s']:.0f} s after the last fault window closed",
        f"- outcomes: {json.dumps(result['outcomes'])}",
        f"- outcomes other than the kind expects: {len(result['unexpected_outcomes'])} "
        + ("" if not result["unexpected_outcomes"] else f"({'; '.join(result['unexpected_outcomes'][:10])})"),
        f"- replicas with two live copies at once: {len(result['replicas_two_live_copies'])}; "
        f"replicas started again after a fault (one after the other): {len(result['replicas_started_more_than_once'])}",
        f"- leftovers after the server's stop: {json.dumps(result['leftovers'])}",
        f"- store checks (stored once, ended, one terminal event, nothing after it, times in order): "
        f"{len(result['problems'])} problem(s)",
        "",
        "**Verdict: " + ("pass**" if not failed else "FAIL**: " + "; ".join(failed[:20])),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tm-soak-"))
    os.chmod(workdir, 0o755)
    result = Soak(args.minutes, args.seed, workdir).run()
    failed = verdict(result)
    result["verdict"] = "pass" if not failed else failed
    command = "nice -n 19 python bench/soak.py " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / "soak.md").write_text(markdown(result, failed, command))
    print(markdown(result, failed, command))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
