"""The local agent daemon: ``python -m trainmaster.agent --state-dir DIR``.

One agent per state dir, enforced by an ``fcntl.flock`` held for the agent's whole life (a
second daemon exits at once with :data:`ALREADY_RUNNING_EXIT`; a dead agent's lock goes with
it). It serves :class:`NodeAgentAPI` on a Unix socket in the state dir and logs to
``agent.log`` there. It exits by itself once no controller has been connected and no instance
has been live for ``linger`` seconds, so ``trainmaster run`` / ``server`` start it and it goes
when they are done; SIGTERM stops every live instance (grace, then KILL) and exits.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import signal
import socketserver
import threading
import time
from pathlib import Path
from typing import Any

from trainmaster.contract import LaunchSpec
from trainmaster.agent.core import AgentOptions, NodeAgent
from trainmaster.agent.netns import enter as enter_network_namespace
from trainmaster.agent.protocol import ALREADY_RUNNING_EXIT, LOCK_NAME, LOG_NAME, PID_NAME, socket_address

log = logging.getLogger("trainmaster.agent")
MAX_WAIT_EXIT = 60.0  # seconds one wait_exit request may block its connection


def handle_request(agent: NodeAgent, request: dict[str, Any]) -> Any:
    op = request.get("op")
    if op == "start":
        return [r.to_dict() for r in agent.start([LaunchSpec.from_dict(s) for s in request["specs"]])]
    if op == "prepare":
        agent.prepare([str(path) for path in request["logs"]])
        return None
    if op == "stop":
        return [s.to_dict() for s in agent.stop(list(request["ids"]), float(request["grace"]))]
    if op == "observe":
        return [s.to_dict() for s in agent.observe(list(request["ids"]))]
    if op == "list":
        return [s.to_dict() for s in agent.list()]
    if op == "forget":
        agent.forget(list(request["ids"]))
        return None
    if op == "wait_exit":
        return agent.wait_exit(int(request["after"]), min(float(request["seconds"]), MAX_WAIT_EXIT))
    if op == "ping":
        return {"pid": os.getpid(), "node": agent.node, "trees": agent.trees.kind}
    raise ValueError(f"unknown operation {op!r} (prepare, start, stop, observe, list, forget, wait_exit, ping)")


class _Daemon:
    def __init__(self, agent: NodeAgent, linger: float):
        self.agent = agent
        self.linger = linger
        self.connections = 0
        self.idle_since = time.monotonic()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def connected(self, delta: int) -> None:
        with self.lock:
            self.connections += delta
            self.idle_since = time.monotonic()

    def watch_idle(self) -> None:
        """Ask the daemon to exit once idle (no controller, no live instance) for ``linger`` s."""
        while not self.stop.wait(min(1.0, max(self.linger / 4, 0.05))):
            with self.lock:
                busy = self.connections > 0 or self.agent.live_count() > 0
                if busy:
                    self.idle_since = time.monotonic()
                elif time.monotonic() - self.idle_since >= self.linger:
                    log.info("idle for %.1fs (no controller connected, no live instance): exiting", self.linger)
                    self.stop.set()


def _handler(daemon: _Daemon) -> type[socketserver.StreamRequestHandler]:
    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            daemon.connected(+1)
            try:
                for line in self.rfile:
                    try:
                        answer = {"ok": True, "result": handle_request(daemon.agent, json.loads(line))}
                    except Exception as exc:  # the caller gets the error; the log the traceback
                        log.exception("request failed: %.200s", line)
                        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                    self.wfile.write(json.dumps(answer).encode() + b"\n")
                    self.wfile.flush()
            except (ConnectionError, OSError):
                pass
            finally:
                daemon.connected(-1)

    return Handler


def serve(options: AgentOptions, linger: float, grace: float) -> int:
    state_dir = options.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = open(state_dir / LOCK_NAME, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("another node agent holds %s; this one exits", state_dir / LOCK_NAME)
        return ALREADY_RUNNING_EXIT
    (state_dir / PID_NAME).write_text(str(os.getpid()))
    agent = NodeAgent(options)
    daemon = _Daemon(agent, linger)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: daemon.stop.set())
    address, fd = socket_address(state_dir)
    try:
        os.unlink(state_dir / "agent.sock")  # a dead agent's; we hold the lock
    except FileNotFoundError:
        pass
    server = socketserver.ThreadingUnixStreamServer(address, _handler(daemon))
    server.daemon_threads = True
    if fd is not None:
        os.close(fd)
    threading.Thread(target=server.serve_forever, name="serve", daemon=True).start()
    threading.Thread(target=daemon.watch_idle, name="idle", daemon=True).start()
    log.info("serving on %s", state_dir / "agent.sock")
    daemon.stop.wait()
    server.shutdown()
    server.server_close()
    agent.shutdown(grace)
    log.info("node agent stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainmaster.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--node", default="local")
    parser.add_argument(
        "--linger", type=float, default=10.0, help="seconds idle (no controller, no live instance) before exiting"
    )
    parser.add_argument("--grace", type=float, default=5.0, help="SIGTERM to SIGKILL when the agent stops")
    parser.add_argument("--no-cgroups", action="store_true", help="track trees by environment marker only")
    parser.add_argument(
        "--spawn-threads", type=int, default=AgentOptions.spawn_threads, help="threads spawning one start batch"
    )
    parser.add_argument(
        "--warm-slots",
        type=int,
        default=AgentOptions.warm_slots,
        help="most spawning threads kept waiting in fresh cgroups (0: none; see trainmaster.agent.warm)",
    )
    parser.add_argument(
        "--netns", default="", help="run inside this named network namespace (a testbed host; needs root)"
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.netns:
        # setns(2), not `ip netns exec`: that remounts /sys in a private mount namespace, hiding
        # the cgroup hierarchies the agent tracks process trees with. Before any thread starts
        # (setns moves only the calling thread), so every thread and child lives on that host.
        enter_network_namespace(args.netns)
    args.state_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=args.state_dir / LOG_NAME,
        level=args.log_level.upper(),
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )
    try:
        return serve(
            AgentOptions(
                args.state_dir.resolve(),
                args.node,
                use_cgroups=not args.no_cgroups,
                spawn_threads=args.spawn_threads,
                warm_slots=args.warm_slots,
            ),
            args.linger,
            args.grace,
        )
    except Exception:
        log.exception("the node agent failed")
        raise
