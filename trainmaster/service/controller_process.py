"""The reconcile loop in a process of its own, beside the server's API process.

One Python process serving the REST API and reconciling shares one interpreter lock: under load
the reconcile pass and uvicorn's request handling each wait for the other (a profile of the Kueue
replay, ``bench/scale.py``: reconcile 48 %, the event loop 41 %, routes 11 % of one process), so a
status read waits behind a pass and admissions wait behind requests. ``trainmaster server``
therefore starts its controller as a child process (:func:`main`) that builds the backend,
the :class:`~trainmaster.controller.Controller` and, on a shared database, the leader election,
and runs the :class:`~trainmaster.service.reconciler.Reconciler`; the server process keeps a
controller object only to read the store and record intents, as the API always did.

The two talk over a socketpair of datagrams (:class:`ControllerProcess` on the server's side):

* ``w``: wake the loop (a submit, cancel or scale was committed); no answer;
* ``s``: the loop's state (last error, leadership), polled by the server every
  :data:`STATE_EVERY` s so that ``/healthz`` and every status answer read it without a round trip;
* ``r<id>``: take over (resume) a job: it re-adopts the job's instances, so it must run where the
  backend lives; answered ``ok`` or with the refusal;
* ``m``: the controller's Prometheus families (pass durations, launches, restarts), for
  ``/metrics``.

The first controller process is forked from the server while the server is still one thread
(after its imports, before uvicorn starts): it starts in milliseconds, not in the seconds a fresh
interpreter takes to import the controller again, so the loop is up as soon as the API is (a
``resume`` right after the server started used to wait for those imports while the job's
instances ran on unwatched). One started again after a crash is a fresh interpreter (``python -m
trainmaster.service.controller_process``): by then the server runs threads, and a fork would copy
whatever they held at that instant.

Crash safety is the single process's: every intent is committed to the store before the API
answers, and the loop's state is the store's. The child holds the server's SQLite lock (the very
lock file description, inherited), so no second server can start while it lives; it ends its pass
and exits when the server's end of the socket closes, which is how it learns of a server killed
with SIGKILL. A child that dies (killed, crashed) is started again by the server after
:data:`RESTART_AFTER` s and recovers as a restarted server does: live instances re-adopted, none
started twice (``tests/service/test_controller_process.py``).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.backends.base import Backend, BackendOptions
from trainmaster.backends.registry import make_backend
from trainmaster.controller import Controller, metrics
from trainmaster.controller.controller import NotResumable
from trainmaster.controller.leader import LeaderElector
from trainmaster.errors import BackendError
from trainmaster.service.reconciler import Reconciler
from trainmaster.store.db import make_engine, session_factory

log = logging.getLogger("trainmaster.service")

STATE_EVERY = 0.5  # seconds between the server's reads of the loop's state
RESTART_AFTER = 1.0  # seconds before a dead controller process is started again
ANSWER_TIMEOUT = 60.0  # seconds the server waits for an answer (a resume re-adopts instances)
DATAGRAM = 1 << 20  # the largest message (a /metrics answer with many instances' gauges)
#: the Prometheus families the reconcile loop writes (served by the server from the child's)
CONTROLLER_FAMILIES = frozenset(
    {
        "trainmaster_reconcile_seconds",
        "trainmaster_instance_launch_seconds",
        "trainmaster_instance_restarts",
        "trainmaster_instance_cpu_seconds",
        "trainmaster_instance_peak_rss_bytes",
    }
)


@dataclass(frozen=True)
class ControllerConfig:
    """What the controller process builds its controller from (the ``server`` flags); sent on
    its stdin, never on its command line or in its environment (the store URL may hold a password)."""

    db_url: str
    backend: str
    cpus: float | None = None
    ray_address: str | None = None
    interval: float = 1.0
    grace: float = 5.0
    max_jobs: int = 8
    queue_weights: dict[str, float] = field(default_factory=dict)
    identity: str | None = None  # on a shared database: the lease holder's name (None: SQLite, no election)

    def api_controller(self, sessions: sessionmaker[Session]) -> Controller:
        """The server process's controller beside this loop: it reads the store and records
        intents (submit, cancel, scale) and never runs a pass, so it keeps nothing per job
        (``reconciles=False``): what it kept would live as long as the server, and every full
        garbage collection of the API process would walk it while requests wait."""
        return Controller(
            sessions,
            BackendElsewhere(self.backend),
            self.db_url,
            interval=self.interval,
            grace=self.grace,
            reconciles=False,
        )


class BackendElsewhere(Backend):
    """The server process's stand-in for the backend the controller process drives: it has the
    backend's name (a submitted job records it) and refuses every instance operation, which only
    the reconcile loop performs. The server must not open the backend itself: some keep state a
    second opener would rewrite (the hollow nodes' journal) or hold a connection (Ray)."""

    def __init__(self, name: str):
        self.name = name

    def _elsewhere(self) -> BackendError:
        return BackendError(f"the {self.name} backend is driven by the controller process, not the server's")

    def capacity(self) -> Any:
        raise self._elsewhere()

    def place(self, request: Any) -> Any:
        raise self._elsewhere()

    def release(self, placement: Any) -> None:
        raise self._elsewhere()

    def start(self, requests: Any) -> Any:
        raise self._elsewhere()

    def observe(self, handles: Any) -> Any:
        raise self._elsewhere()

    def stop(self, handles: Any, grace: float) -> None:
        raise self._elsewhere()


class ControllerProcess:
    """The server's side: starts the controller process, starts it again if it dies, forwards
    wakes, and answers for it (``error``, :meth:`leadership`, :meth:`take_over`, :meth:`families`)."""

    def __init__(
        self,
        controller: Controller,
        config: ControllerConfig,
        engine: Engine,
        inherit: tuple[int, ...] = (),
    ):
        self.controller = controller  # the server's: wakes recorded on it are forwarded
        self.config = config
        self.engine = engine  # the server's: no connection of it may be open across a fork
        self.inherit = inherit  # descriptors the child holds too (the SQLite store's server lock)
        self.error: str | None = None  # the loop's last error, as last read
        self._state: dict[str, Any] = {"leading": config.identity is None, "leader": None}
        self._stopping = threading.Event()
        self._asking = threading.Lock()  # one question at a time: answers come in order
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | ForkedChild | None = None
        self._threads = [
            threading.Thread(target=self._supervise, name="controller-process", daemon=True),
            threading.Thread(target=self._forward_wakes, name="controller-wakes", daemon=True),
        ]
        self.restarts = 0

    # ---- what the routes read ----------------------------------------------------------------
    def leadership(self) -> dict[str, Any]:
        if self.config.identity is None:
            return {"leading": True, "leader": None}
        return {**self._state, "server": self.config.identity}

    def take_over(self, job_id: int) -> None:
        answer = self._ask(f"r{job_id}".encode())
        if answer != b"ok":
            raise NotResumable(answer.decode(errors="replace"))

    def families(self) -> list[Any]:
        """The controller's Prometheus metric families, as the child last recorded them."""
        try:
            return list(pickle.loads(self._ask(b"m")))  # our own child's answer: trusted
        except (OSError, TimeoutError):
            return []

    # ---- life --------------------------------------------------------------------------------
    def start(self, listener: socket.socket | None = None) -> None:
        """Start the controller process (once: the server starts it right after binding its port,
        while it is one thread, and the app's start-up calls this again): forked from this process
        when it runs no other thread, else a fresh interpreter. ``listener``: the server's
        listening socket, which a forked child must not keep open (a server killed with SIGKILL
        would leave its port held)."""
        if self._proc is not None:
            return
        if threading.active_count() == 1:
            self._fork(listener)
        else:
            self._spawn()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Ask the child to end its pass and exit (SIGTERM); :meth:`join` waits for it."""
        self._stopping.set()
        self.controller.wake()  # the forwarder looks at `_stopping`
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def join(self, timeout: float | None = None) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the controller process did not end its pass within %ss: killed", timeout)
            proc.kill()
            proc.wait(10)
        if self._sock is not None:
            self._sock.close()

    def _fork(self, listener: socket.socket | None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # SQLite's locks are per process and its open files are tracked per process: a connection
        # open across a fork is one the child's SQLite would believe it holds; the pool opens
        # new ones on demand
        self.engine.dispose()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the server's code
            try:
                ours.close()
                if listener is not None:
                    listener.close()
                run(theirs, self.config)
            finally:
                os._exit(1)
        theirs.close()
        self._sock, self._proc = ours, ForkedChild(pid)

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainmaster.service.controller_process", str(theirs.fileno())],
            stdin=subprocess.PIPE,
            pass_fds=(theirs.fileno(), *self.inherit),
        )
        theirs.close()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(asdict(self.config)).encode())
        proc.stdin.close()
        old, self._sock, self._proc = self._sock, ours, proc
        if old is not None:
            old.close()

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            proc = self._proc
            assert proc is not None
            try:
                proc.wait(STATE_EVERY)
            except subprocess.TimeoutExpired:
                self._read_state()
                continue
            if self._stopping.is_set():
                return
            self.error = f"the controller process exited with code {proc.returncode}; starting it again"
            log.error("%s", self.error)
            self._stopping.wait(RESTART_AFTER)
            if not self._stopping.is_set():
                with self._asking:
                    self._spawn()
                self.restarts += 1

    def _read_state(self) -> None:
        try:
            state = json.loads(self._ask(b"s"))
        except (OSError, TimeoutError, ValueError):
            return  # the child is starting or dying: the supervisor says so
        self.error = state.pop("error")
        self._state = state

    def _forward_wakes(self) -> None:
        while not self._stopping.is_set():
            if self.controller.wait_for_work(1.0) and not self._stopping.is_set():
                sock = self._sock
                try:
                    if sock is not None:
                        sock.send(b"w", socket.MSG_DONTWAIT)  # a full buffer: wakes are pending already
                except OSError:
                    pass  # the child is away; its successor's first pass looks at every job

    def _ask(self, question: bytes) -> bytes:
        with self._asking:
            sock = self._sock
            if sock is None:
                raise OSError("no controller process")
            sock.send(question)
            sock.settimeout(ANSWER_TIMEOUT)
            try:
                answer = sock.recv(DATAGRAM)
            finally:
                sock.settimeout(None)
            if not answer:
                raise OSError("the controller process exited")
            return answer


class ForkedChild:
    """A forked controller process, waited for as :class:`subprocess.Popen` waits for a spawned one
    (the part of its interface the supervisor uses), through a pidfd: no polling."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        # open as long as the server runs (one: only the first controller process is forked),
        # so that no thread ever waits on a descriptor another closed
        self._pidfd = os.pidfd_open(pid)
        self._reaping = threading.Lock()  # the supervisor and the server's stop may both wait

    def poll(self) -> int | None:
        with self._reaping:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"controller process {self.pid}", timeout or 0)
            select.select([self._pidfd], [], [], left)  # readable once the child has exited
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)  # not yet waited for: the pid is still this child's

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---- the child ---------------------------------------------------------------------------------
def main() -> None:
    """A controller process started again: ``python -m trainmaster.service.controller_process FD``
    with its :class:`ControllerConfig` as JSON on stdin and FD its end of the server's socketpair."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    config = ControllerConfig(**json.loads(sys.stdin.buffer.read()))
    run(sock, config)


def run(sock: socket.socket, config: ControllerConfig) -> NoReturn:
    """The controller process's life: reconcile and answer the server until it stops us or dies."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # the server upgraded and checked the store before starting us: open it as it is
    sessions = session_factory(make_engine(config.db_url, create=False))
    elector = LeaderElector(sessions, identity=config.identity) if config.identity else None
    controller = Controller(
        sessions,
        make_backend(config.backend, BackendOptions(cpus=config.cpus, address=config.ray_address)),
        config.db_url,
        interval=config.interval,
        grace=config.grace,
        max_jobs=config.max_jobs,
        queue_weights=config.queue_weights,
        fence=elector.fence if elector else None,
    )
    reconciler = Reconciler(controller, elector)
    ended = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ended.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the server, which stops us
    if elector is not None:
        elector.start()
    reconciler.start()
    threading.Thread(target=_serve, args=(sock, controller, reconciler, ended), daemon=True).start()
    gc.freeze()  # as the server does: start-up's objects are never scanned again
    ended.wait()
    reconciler.stop()
    reconciler.join(timeout=controller.grace + 30)  # the pass in flight ends before the lease goes
    if elector is not None:
        elector.stop()
    os._exit(0)


def _serve(
    sock: socket.socket,
    controller: Controller,
    reconciler: Reconciler,
    ended: threading.Event,
) -> None:
    """Answer the server's messages until its end closes (the server stopped or died)."""
    while True:
        try:
            message = sock.recv(DATAGRAM)
        except OSError:
            message = b""
        if not message:
            ended.set()
            return
        kind, rest = message[:1], message[1:]
        if kind == b"w":
            controller.wake()
            continue
        if kind == b"s":
            answer = json.dumps({"error": reconciler.error, **reconciler.leadership()}).encode()
        elif kind == b"r":
            answer = _take_over(reconciler, int(rest))
        elif kind == b"m":
            families = [f for f in metrics.REGISTRY.collect() if f.name in CONTROLLER_FAMILIES]
            answer = pickle.dumps(families)
        else:
            answer = b"unknown question"
        try:
            sock.send(answer)
        except OSError:
            ended.set()
            return


def _take_over(reconciler: Reconciler, job_id: int) -> bytes:
    """:meth:`Reconciler.take_over` (a standby refuses) where the backend lives, its refusal as the answer."""
    try:
        reconciler.take_over(job_id)
    except NotResumable as exc:
        return exc.message.encode()
    except Exception as exc:  # noqa: BLE001  (said to the client as a refusal, logged here)
        log.exception("resume of job %s failed", job_id)
        return f"the resume failed: {type(exc).__name__}: {exc}".encode()
    return b"ok"


if __name__ == "__main__":
    main()
