"""The pre-agent subprocess spawner, kept for the testbed backend's per-host launcher until each
testbed host runs its own node agent; the local
backend is a client of the node agent (``backends/local.py``). Every instance is a subprocess, in
its own process group.

Each attempt runs the instance runtime (``python -m trainmaster.runtime.launch``), which waits
for dependencies, runs the role's command, and records the exit code in the instance folder,
so a restarted controller learns how an instance it did not spawn ended. A handle names the
process by pid *and* start time, so a recycled pid is never mistaken for our instance.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

import trainmaster

from trainmaster.backends.ports import PortPool
from trainmaster.backends.base import Backend, Capacity, LaunchRequest, Observation, Phase, Placement
from trainmaster.runtime.files import InstanceFiles


# The instance runtime starts without site processing (-S; about 30 ms less CPU per instance,
# which adds up when 64 start at once on 2 cores) and finds our package through PYTHONPATH.
# It runs site.main() itself before it needs third-party packages (the dependency wait step).
_PACKAGE_ROOT = str(Path(trainmaster.__file__).resolve().parents[1])
LAUNCHER_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}


# Attempts are spawned one after another (Backend.start_all): spawning from several threads
# measured no faster (64 shells: 46 ms from one thread, 44 ms from four; a spawn is the kernel's
# CPU work, and the cores also run the children spawned just before).

# An instance without dependencies has no wait step, so it does not need the Python runtime:
# this POSIX-shell recorder does the rest of its job (run, record the exit code) for about
# 1 ms of CPU instead of ~40 ms, which is what lets 64 replicas start at once. It writes no
# ``ready`` file: only a gated instance's readiness is judged by one (see ``poll``).
_EXIT_RECORDER = ('"$@"; c=$?; '
                  'printf %s "$c" > "$0/exit_code.tmp" && mv "$0/exit_code.tmp" "$0/exit_code"; exit $c')


def launcher_argv(launch_file: str) -> list[str]:
    return [sys.executable, "-S", "-m", "trainmaster.runtime.launch", launch_file]


def _spawn_spec(request: LaunchRequest) -> tuple[list[str], dict[str, str], str | None]:
    """What to exec for one attempt: the Python runtime when there is a wait step, else the
    shell recorder around the role's command with its environment (already complete)."""
    if request.gated:
        return launcher_argv(request.launch_file), LAUNCHER_ENV, request.cwd
    return ["/bin/sh", "-c", _EXIT_RECORDER, request.instance_dir, *request.argv], request.env, request.cwd


class LegacySubprocessBackend(Backend):
    name = "local"

    def __init__(self, capacity: Capacity | None = None, host: str = "127.0.0.1"):
        self._capacity = capacity or Capacity(
            cpu=float(os.cpu_count() or 1), memory=psutil.virtual_memory().total, gpu=0)
        self._host = host
        self._ports = PortPool(host)
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def capacity(self) -> Capacity:
        return self._capacity

    def place(self, ports: int, resources: dict[str, Any]) -> Placement:
        return Placement(self._host, self._ports.take(ports))

    def release(self, placement: Placement) -> None:
        self._ports.release(placement.ports)

    def reserve_ports(self, ports: list[int]) -> None:
        self._ports.hold(ports)

    def spawn_spec(self, request: LaunchRequest) -> tuple[list[str], dict[str, str], str | None]:
        """What to exec for one attempt (the testbed backend runs it inside a host)."""
        return _spawn_spec(request)

    def start(self, request: LaunchRequest) -> dict[str, Any]:
        log_path = Path(request.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"--- attempt {request.attempt} of {request.role}-{request.index} "
                      f"at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode())
            log.flush()
            argv, env, cwd = self.spawn_spec(request)
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=cwd or None, start_new_session=True,
                                    close_fds=True)
        self._children[proc.pid] = proc
        # pid *and* start time: a recycled pid is never taken for this attempt
        return {"backend": self.name, "pid": proc.pid, "create_time": _create_time(proc.pid),
                "instance_dir": request.instance_dir, "gated": request.gated,
                "host": request.placement.host, "ports": request.placement.ports}

    def _alive(self, handle: dict[str, Any]) -> bool | None:
        """True/False for a process we can judge; exit handled through the Popen for children."""
        pid = handle["pid"]
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - handle["create_time"]) > 0.01:
                return False  # the pid was recycled: our instance is gone
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def poll(self, handle: dict[str, Any]) -> Observation:
        files = InstanceFiles(handle["instance_dir"])
        child = self._children.get(handle["pid"])
        if child is not None:
            code = child.poll()
            alive = code is None
            if not alive:
                del self._children[handle["pid"]]
        else:
            alive = bool(self._alive(handle))
            code = None
        if alive:
            if handle.get("gated") and not files.ready.exists():
                return Observation(Phase.STARTING, reason="WaitingForDependencies")
            return Observation(Phase.RUNNING)
        recorded = files.read_exit_code()
        code = recorded if recorded is not None else code
        reason, message = files.read_reason()
        if code is None:
            return Observation(Phase.LOST, reason="Lost", message="the process vanished without an exit code")
        return Observation(Phase.EXITED, exit_code=code, reason=reason, message=message,
                           command_started=_mtime(files.ready) if handle.get("gated") else None)

    def stop(self, handles: list[dict[str, Any]], grace: float) -> None:
        live = [h for h in handles if self.poll(h).phase in (Phase.STARTING, Phase.RUNNING)]
        for handle in live:
            _signal_group(handle["pid"], signal.SIGTERM)
        left = self._wait_gone(live, time.monotonic() + grace)
        for handle in left:
            _signal_group(handle["pid"], signal.SIGKILL)
        self._wait_gone(left, time.monotonic() + 5)

    def _wait_gone(self, handles: list[dict[str, Any]], deadline: float) -> list[dict[str, Any]]:
        """Wait (sleeping, not spinning) until no live process of each handle's group is left;
        returns the handles whose group still has one at ``deadline``. One scan of the process
        table per wait step serves every group, so stopping many instances stays cheap."""
        delay = 0.005
        while True:
            for handle in handles:  # reap our own children, so they do not linger as zombies
                child = self._children.get(handle["pid"])
                if child is not None and child.poll() is not None:
                    del self._children[handle["pid"]]
            alive = _live_groups({h["pid"] for h in handles})
            handles = [h for h in handles if h["pid"] in alive]
            if not handles or time.monotonic() >= deadline:
                return handles
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.2)

    def adopt(self, handle: dict[str, Any]) -> bool:
        alive = self.poll(handle).phase in (Phase.STARTING, Phase.RUNNING)
        if alive:
            self.reserve_ports(handle.get("ports", []))
        return alive

    def find(self, instance_dir: str) -> dict[str, Any] | None:
        files = InstanceFiles(instance_dir)
        launch_file = str(files.launch)
        for proc in psutil.process_iter(["cmdline", "create_time"]):
            cmdline = proc.info["cmdline"] or []
            python_runtime = "trainmaster.runtime.launch" in cmdline and launch_file in cmdline
            shell_recorder = cmdline[:3] == ["/bin/sh", "-c", _EXIT_RECORDER] and cmdline[3:4] == [instance_dir]
            if python_runtime or shell_recorder:
                launch = files.read_launch()
                return {"backend": self.name, "pid": proc.pid, "create_time": proc.info["create_time"],
                        "instance_dir": instance_dir, "gated": bool(launch["depends"]),
                        "host": launch["context"]["host"], "ports": launch["context"]["ports"]}
        return None

    def close(self) -> None:
        for proc in self._children.values():
            proc.poll()


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return 0.0


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _live_groups(pgids: set[int]) -> set[int]:
    """Those of ``pgids`` that still hold a non-zombie process (zombies wait for their reaper)."""
    pgids = {pgid for pgid in pgids if _group_exists(pgid)}  # one cheap syscall each first
    if not pgids:
        return set()
    alive: set[int] = set()
    for proc in psutil.process_iter(["status"]):
        try:
            pgid = os.getpgid(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
        if pgid in pgids and proc.info["status"] != psutil.STATUS_ZOMBIE:
            alive.add(pgid)
    return alive


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
