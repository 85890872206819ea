"""Reaching the local node agent: :class:`AgentClient` (``NodeAgentAPI`` over the agent's Unix
socket, with timeouts) and :func:`ensure_agent` (start the daemon when none answers).

Every call is idempotent (``start`` per instance id), so a call whose connection broke (the
agent was killed) is sent once more to a freshly started agent, which first kills and journals
whatever its predecessor left running (``AgentRestarted``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import trainmaster
from trainmaster.contract import InstanceHandle, InstanceStatus, LaunchSpec, StartResult, without_secrets
from trainmaster.agent.protocol import ALREADY_RUNNING_EXIT, LOG_NAME, PID_NAME, connect
from trainmaster.errors import BackendError

log = logging.getLogger(__name__)
_PACKAGE_ROOT = str(Path(trainmaster.__file__).resolve().parents[1])


_spawned: list[subprocess.Popen[bytes]] = []  # daemons this process started (reaped when they exit)


class AgentUnavailable(BackendError):
    """The node agent could not be reached or started, or refused a request."""


def agent_pid(state_dir: Path) -> int | None:
    try:
        return int((state_dir / PID_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None


def answers(state_dir: Path, timeout: float = 2.0) -> bool:
    """Whether an agent serves ``state_dir`` now: a ping round trip, not a bare connect (a
    killed agent's threads can still hold its listening socket for a moment)."""
    try:
        sock = connect(state_dir, timeout)
    except OSError:
        return False
    try:
        sock.sendall(b'{"op": "ping"}\n')
        return sock.makefile("rb").readline().startswith(b'{"ok": true')
    except OSError:
        return False
    finally:
        sock.close()


def ensure_agent(
    state_dir: Path, node: str = "local", linger: float = 10.0, timeout: float = 20.0, extra_args: tuple[str, ...] = ()
) -> None:
    """Return once an agent answers on ``state_dir``; start one (detached, its own session) if
    none does. Two callers racing both spawn; the state dir's lock lets only one serve. A daemon
    that found the lock held (a dying agent) is started again until one serves."""
    if answers(state_dir):
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    _spawned[:] = [d for d in _spawned if d.poll() is None]  # reap daemons that have exited
    env = {
        **without_secrets(dict(os.environ)),  # the store's URL and the server's token stay with the controller
        "PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    argv = [
        sys.executable,
        "-m",
        "trainmaster.agent",
        "--state-dir",
        str(state_dir),
        "--node",
        node,
        "--linger",
        str(linger),
        *extra_args,
    ]
    deadline = time.monotonic() + timeout
    delay = 0.005
    daemon: subprocess.Popen[bytes] | None = None
    while True:
        if daemon is None or daemon.poll() is not None:
            if daemon is not None and daemon.returncode != ALREADY_RUNNING_EXIT:
                raise AgentUnavailable(
                    f"the node agent exited with code {daemon.returncode} at start; see {state_dir / LOG_NAME}"
                )
            with open(state_dir / LOG_NAME, "ab") as out:
                daemon = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                    env=env,
                )
            _spawned.append(daemon)
        if answers(state_dir):
            return
        if time.monotonic() >= deadline:
            raise AgentUnavailable(
                f"no node agent answered on {state_dir} within {timeout:g}s; see {state_dir / LOG_NAME}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


class AgentClient:
    """``NodeAgentAPI`` of the agent serving ``state_dir``: one connection, one call at a time."""

    def __init__(
        self, state_dir: Path, node: str = "local", timeout: float = 60.0, linger: float = 10.0, start: bool = True
    ):
        self.state_dir = state_dir
        self.node = node
        self.timeout = timeout
        self.linger = linger
        self.start_agent = start
        self._sock: socket.socket | None = None
        self._reader: Any = None
        self._lock = threading.Lock()
        self._unread = 0  # answers of requests sent without waiting (prepare), read before the next call's

    def _connect(self) -> None:
        if self.start_agent:
            ensure_agent(self.state_dir, self.node, self.linger)
        try:
            self._sock = connect(self.state_dir, self.timeout)
        except OSError as exc:
            raise AgentUnavailable(f"the node agent on {self.state_dir} does not answer: {exc}") from None
        self._reader = self._sock.makefile("rb")

    def _drop(self) -> None:
        if self._sock is not None:
            self._reader.close()
            self._sock.close()
        self._sock = self._reader = None
        self._unread = 0

    def _socket(self, timeout: float) -> socket.socket:
        """The connection to the agent, made (and the agent started) where there is none."""
        if self._sock is None:
            self._connect()
        assert self._sock is not None
        self._sock.settimeout(timeout)
        return self._sock

    def call(self, op: str, timeout: float | None = None, **args: Any) -> Any:
        """One request; reconnects (starting a new agent) once if the connection broke."""
        payload = _request(op, **args)
        with self._lock:
            for attempt in (1, 2, 3):
                try:
                    sock = self._socket(timeout or self.timeout)
                    while self._unread:  # a prepare's answer (it answers at once; nothing in it matters)
                        if not self._reader.readline():
                            raise ConnectionResetError("the node agent closed the connection")
                        self._unread -= 1
                    sock.sendall(payload)
                    line = self._reader.readline()
                    if not line:
                        raise ConnectionResetError("the node agent closed the connection")
                    break
                except socket.timeout:
                    self._drop()
                    raise AgentUnavailable(
                        f"the node agent did not answer '{op}' within {timeout or self.timeout:g}s"
                    ) from None
                except (ConnectionError, FileNotFoundError, BrokenPipeError) as exc:
                    self._drop()
                    if attempt == 3:
                        raise AgentUnavailable(f"lost the node agent on {self.state_dir}: {exc}") from None
                    log.warning("connection to the node agent broke during '%s' (%s); reconnecting", op, exc)
        answer = json.loads(line)
        if not answer["ok"]:
            raise AgentUnavailable(f"the node agent refused '{op}': {answer['error']}")
        return answer["result"]

    # ---- NodeAgentAPI --------------------------------------------------------------------------
    def start(self, specs: list[LaunchSpec]) -> list[StartResult]:
        """A spec without dependencies goes without its ``env_inputs``: its environment is
        resolved, and only a wait step reads them (half the request a gang's agent reads before
        its first spawn)."""
        wire = [s.to_dict() for s in specs]
        for spec, data in zip(specs, wire):
            if not spec.depends:
                data["env_inputs"] = {}
        results = self.call("start", specs=wire)
        return [
            StartResult(r["instance_id"], InstanceHandle.from_dict(r["handle"]) if r["handle"] else None, r["error"])
            for r in results
        ]

    def prepare(self, log_paths: list[str]) -> None:
        """Ask the agent to create these log files ahead of a start, without waiting for its
        answer (read before the next call's): the caller is a pass about to commit, which a
        round trip would only delay."""
        payload = _request("prepare", logs=log_paths)
        with self._lock:
            try:
                self._socket(self.timeout).sendall(payload)
                self._unread += 1
            except OSError as exc:
                self._drop()
                raise AgentUnavailable(f"the node agent on {self.state_dir} did not take 'prepare': {exc}") from None

    def stop(self, instance_ids: list[str], grace: float) -> list[InstanceStatus]:
        return [
            InstanceStatus.from_dict(s) for s in self.call("stop", timeout=grace + 60, ids=instance_ids, grace=grace)
        ]

    def observe(self, instance_ids: list[str]) -> list[InstanceStatus]:
        return [InstanceStatus.from_dict(s) for s in self.call("observe", ids=instance_ids)]

    def forget(self, instance_ids: list[str]) -> None:
        self.call("forget", ids=instance_ids)

    def wait_exit(self, after: int, seconds: float) -> int:
        """Block (this connection) until more than ``after`` instances have ended, or ``seconds``."""
        return int(self.call("wait_exit", timeout=seconds + 30, after=after, seconds=seconds))

    def ping(self) -> dict[str, Any]:
        return dict(self.call("ping"))

    def close(self) -> None:
        with self._lock:
            self._drop()

    def list(self) -> list[InstanceStatus]:
        return [InstanceStatus.from_dict(s) for s in self.call("list")]


def _request(op: str, **args: Any) -> bytes:
    """One request line of the agent's protocol."""
    return json.dumps({"op": op, **args}).encode() + b"\n"
