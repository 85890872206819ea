"""STAND-IN node agent for the Ray backend, until ``trainmaster.agent.NodeAgent`` lands.

The lead swaps this for the real agent core at merge: the only seam is the one constructor call
in :func:`trainmaster.backends.ray_agent.make_node_agent`. Until then this is a minimal,
in-memory implementation of :class:`~trainmaster.agent.contract.NodeAgentAPI` so the Ray side
(one agent actor per node, batched starts, node loss) can be built and tested against the
contract alone.

What it does: each instance is spawned directly (``Popen(start_new_session=True)``: its own
session and process group, no shell wrapper), stopped by signalling the whole group (TERM, then
KILL after the grace), and its exit is taken from ``waitpid`` (the agent is the parent).
What it does NOT do (the real agent does): cgroups, a durable exit journal, re-adoption after
an agent restart, CPU/RSS accounting. Its exits live in memory, so when the agent dies its
instances must die with it, or a replacement would run beside an orphan: a small guard process
(:class:`GroupGuard`) holds the list of live process groups and kills them all when the
agent's end of its pipe closes, however the agent died (kill -9 included).
"""

from __future__ import annotations

import builtins
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from trainmaster.agent.contract import (InstanceHandle, InstancePhase, InstanceStatus, LaunchSpec,
                                        StartResult)
from trainmaster.runtime.files import InstanceFiles

STOP_KILL_WAIT = 5.0  # after SIGKILL, how long stop waits for a tree to be gone

# Reads "+pgid"/"-pgid" lines from the agent; at EOF (the agent is gone) kills every group left.
# It detaches first (forks, and the parent exits): when a Ray worker dies, Ray SIGKILLs the
# worker's direct children, which would take the guard with them and leave the instances'
# grandchildren running (measured: a node killed outright left them). SIGTERM/SIGINT/SIGHUP are
# ignored so a polite shutdown of the agent's worker cannot end the guard before its one job.
_GUARD_CODE = """
import os, signal, sys
if os.fork():
    os._exit(0)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    op, pgid = line[:1], int(line[1:])
    (groups.add if op == "+" else groups.discard)(pgid)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class GroupGuard:
    """Kills the agent's instance process groups when the agent process ends (see module doc)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-S", "-c", _GUARD_CODE], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        assert self._proc.stdin is not None
        self._pipe: IO[bytes] = self._proc.stdin
        self._lock = threading.Lock()
        self._proc.wait(timeout=30)  # the first process only forks the guard off and exits

    def add(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def remove(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        with self._lock:
            self._pipe.write(line.encode())
            self._pipe.flush()


@dataclass
class _Attempt:
    spec: LaunchSpec
    node: str
    proc: subprocess.Popen[bytes] | None
    started_at: float
    error: str = ""
    final: InstanceStatus | None = None  # set once the whole group is gone

    @property
    def handle(self) -> InstanceHandle:
        return InstanceHandle(self.node, self.spec.instance_id, self.proc.pid if self.proc else None)


def launcher_argv(instance_dir: str) -> list[str]:
    """The instance runtime (dependency wait step, then the role command) for a gated instance."""
    return [sys.executable, "-S", "-m", "trainmaster.runtime.launch", str(InstanceFiles(instance_dir).launch)]


class ProcessGroupAgent:
    """STAND-IN :class:`~trainmaster.agent.contract.NodeAgentAPI`: process groups, exits in memory."""

    def __init__(self, node: str, guard: GroupGuard | None = None):
        self.node = node
        self._guard = guard or GroupGuard()
        self._attempts: dict[str, _Attempt] = {}
        self._lock = threading.Lock()  # Ray runs calls on several threads (observe during a stop)

    # ---- NodeAgentAPI --------------------------------------------------------------------------
    def start(self, specs: builtins.list[LaunchSpec]) -> builtins.list[StartResult]:
        results = []
        with self._lock:
            for spec in specs:
                attempt = self._attempts.get(spec.instance_id) or self._spawn(spec)
                self._attempts[spec.instance_id] = attempt
                results.append(StartResult(spec.instance_id, None if attempt.error else attempt.handle,
                                           attempt.error))
        return results

    def stop(self, instance_ids: builtins.list[str], grace: float) -> builtins.list[InstanceStatus]:
        with self._lock:
            live = [a for i in instance_ids if (a := self._attempts.get(i)) and a.proc and a.final is None]
        groups = {a.proc.pid for a in live if a.proc}
        _signal_groups(groups, signal.SIGTERM)
        left = self._wait_gone(live, groups, time.monotonic() + grace)
        if left:
            _signal_groups(left, signal.SIGKILL)
            self._wait_gone(live, left, time.monotonic() + STOP_KILL_WAIT)
        return self.observe(instance_ids)

    def observe(self, instance_ids: builtins.list[str]) -> builtins.list[InstanceStatus]:
        with self._lock:
            return [self._status(i) for i in instance_ids]

    def list(self) -> builtins.list[InstanceStatus]:
        with self._lock:
            return [self._status(i) for i in self._attempts]

    def forget(self, instance_ids: builtins.list[str]) -> None:
        with self._lock:
            for instance_id in instance_ids:
                attempt = self._attempts.get(instance_id)
                if attempt is not None and (attempt.error or attempt.final is not None):
                    del self._attempts[instance_id]

    # ---- inside ----------------------------------------------------------------------------------
    def _spawn(self, spec: LaunchSpec) -> _Attempt:
        if spec.depends:  # the wait step runs in the instance runtime, which then runs the command
            argv, env = launcher_argv(spec.instance_dir), _launcher_env()
        else:
            argv, env = spec.argv, spec.env
        log_path = Path(spec.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        with open(log_path, "ab") as log:
            log.write(f"--- attempt {spec.attempt} of {spec.role}-{spec.index} on node {self.node[:12]} "
                      f"at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(argv, env=env, cwd=spec.cwd or None, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        close_fds=True)
            except OSError as exc:
                return _Attempt(spec, self.node, None, now, error=f"could not start {argv[0]!r}: {exc}")
        self._guard.add(proc.pid)
        return _Attempt(spec, self.node, proc, now)

    def _status(self, instance_id: str) -> InstanceStatus:
        attempt = self._attempts.get(instance_id)
        if attempt is None:
            return InstanceStatus(InstanceHandle(self.node, instance_id), InstancePhase.LOST, reason="Unknown",
                                  message=f"the agent of node {self.node[:12]} holds no record of {instance_id}")
        if attempt.error:
            return InstanceStatus(attempt.handle, InstancePhase.START_FAILED, exit_code=127,
                                  reason="StartFailed", message=attempt.error, started_at=attempt.started_at)
        if attempt.final is not None:
            return attempt.final
        assert attempt.proc is not None
        files = InstanceFiles(attempt.spec.instance_dir)
        code = attempt.proc.poll()
        if code is None:
            if attempt.spec.depends and not files.ready.exists():
                return InstanceStatus(attempt.handle, InstancePhase.WAITING, reason="WaitingForDependencies",
                                      started_at=attempt.started_at)
            return InstanceStatus(attempt.handle, InstancePhase.RUNNING, started_at=attempt.started_at,
                                  command_started_at=_command_started(attempt, files))
        # The group leader is gone: what is left of its group goes with it (as a container's
        # processes end with it), so nothing of the instance outlives its recorded exit.
        _signal_groups({attempt.proc.pid}, signal.SIGKILL)
        self._guard.remove(attempt.proc.pid)
        recorded = files.read_exit_code() if attempt.spec.depends else None
        code = recorded if recorded is not None else (code if code >= 0 else 128 - code)
        reason, message = files.read_reason() if attempt.spec.depends else ("", "")
        attempt.final = InstanceStatus(attempt.handle, InstancePhase.EXITED, exit_code=code, reason=reason,
                                       message=message, started_at=attempt.started_at,
                                       command_started_at=_command_started(attempt, files),
                                       ended_at=time.time())
        return attempt.final

    def _wait_gone(self, attempts: builtins.list[_Attempt], groups: set[int], deadline: float) -> set[int]:
        """Sleep (backing off, never spinning) until none of ``groups`` holds a live process;
        returns those that still do at ``deadline``."""
        delay = 0.005
        while True:
            for attempt in attempts:
                if attempt.proc is not None:
                    attempt.proc.poll()  # reap the leader
            groups = _live_groups(groups)
            if not groups or time.monotonic() >= deadline:
                return groups
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.1)


def _command_started(attempt: _Attempt, files: InstanceFiles) -> float | None:
    if not attempt.spec.depends:
        return attempt.started_at
    try:
        return files.ready.stat().st_mtime
    except FileNotFoundError:
        return None


def _launcher_env() -> dict[str, str]:
    """The runtime finds this package through PYTHONPATH (it starts with ``-S``)."""
    import trainmaster

    root = str(Path(trainmaster.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def _signal_groups(groups: set[int], sig: signal.Signals) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _live_groups(groups: set[int]) -> set[int]:
    """Those of ``groups`` that still hold a process that is not a zombie."""
    existing = set()
    for pgid in groups:
        try:
            os.killpg(pgid, 0)
            existing.add(pgid)
        except (ProcessLookupError, PermissionError):
            continue
    if not existing:
        return set()
    alive = set()
    for proc in psutil.process_iter(["status"]):
        try:
            pgid = os.getpgid(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
        if pgid in existing and proc.info["status"] != psutil.STATUS_ZOMBIE:
            alive.add(pgid)
    return alive
