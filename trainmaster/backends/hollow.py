"""The hollow backend: simulated nodes that run no processes (Kubernetes' kubemark, KWOK).

A scale test must drive the real controller, store and API with far more instances than this
machine can run. A hollow node is the agent contract with the process left out: ``start``
records an attempt, ``observe`` answers RUNNING until the attempt's run time has passed and
then EXITED with its exit code, ``stop`` ends it with 143 as a TERM would. Everything above the
backend (admission, placement, restarts, events, the REST API) is the real code.

Each attempt's run time and exit code come from its job's annotations, as Kueue's scheduler
benchmark gives each workload its ``runtimeMs`` by label:

* ``hollow.trainmaster.dev/run-seconds``: seconds from start to exit (default 0: ends at once);
* ``hollow.trainmaster.dev/exit-code``: the exit code (default 0).

The cluster is ``NODES[xCPU[xMEMORY_GIB[xGPU]]]`` (``100x32x256``: 100 nodes of 32 CPUs and
256 GiB), from the backend's address option, else ``$TRAINMASTER_HOLLOW_NODES``, else
:data:`DEFAULT_CLUSTER`. Placement spreads attempts over the node with the most free CPU.

Attempts are journaled (one JSON line per started batch and per forgotten batch, in
``state_dir``), so a controller that restarts over the same store re-finds them, as the local
node agent's journal does; an attempt missing from the journal is LOST. A background timer
calls the controller's wake at each attempt's end, as the local agent's exit watch does.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trainmaster.backends.base import (
    Backend,
    BackendOptions,
    LaunchRequest,
    Observation,
    Placement,
    PlacementRequest,
    Resources,
    StartFailure,
)
from trainmaster.contract import InstanceHandle, InstancePhase
from trainmaster.errors import UserError
from trainmaster.store.db import home

RUN_SECONDS = "hollow.trainmaster.dev/run-seconds"
EXIT_CODE = "hollow.trainmaster.dev/exit-code"
NODES_ENV = "TRAINMASTER_HOLLOW_NODES"
DEFAULT_CLUSTER = "4x8x32"
GIB = 1 << 30
STOPPED_CODE = 143  # what a TERM'd process reports
_CLUSTER = re.compile(r"^\s*(\d+)(?:x(\d+(?:\.\d+)?))?(?:x(\d+(?:\.\d+)?))?(?:x(\d+))?\s*$")
MAX_NODES = 100_000


@dataclass(frozen=True)
class HollowCluster:
    """How many simulated nodes, and what each one offers."""

    nodes: int
    node: Resources

    @classmethod
    def parse(cls, text: str) -> HollowCluster:
        """``NODES[xCPU[xMEMORY_GIB[xGPU]]]``; a clear :class:`UserError` for anything else."""
        found = _CLUSTER.match(text)
        if not found or not 1 <= int(found[1]) <= MAX_NODES:
            raise UserError(
                f"hollow cluster '{text}': expected NODES[xCPU[xMEMORY_GIB[xGPU]]] with 1 to {MAX_NODES} nodes, "
                "e.g. 100x32x256 (100 nodes of 32 CPUs and 256 GiB); set it with "
                f"${NODES_ENV}"
            )
        cpu = float(found[2] or 8)
        memory = int(float(found[3] or 32) * GIB)
        return cls(int(found[1]), Resources(cpu, memory, int(found[4] or 0)))

    @property
    def capacity(self) -> Resources:
        return Resources(self.node.cpu * self.nodes, self.node.memory * self.nodes, self.node.gpu * self.nodes)


@dataclass
class _Attempt:
    node: str
    started: float  # epoch seconds
    run_seconds: float
    exit_code: int
    cpu: float
    ports: list[int]
    stopped_at: float | None = None
    freed: bool = False  # its node's CPU given back
    running: Observation | None = None  # what observe answers while it runs (made once)

    @property
    def ends(self) -> float:
        natural = self.started + self.run_seconds
        return natural if self.stopped_at is None else min(natural, self.stopped_at)

    def phase(self, now: float) -> Observation:
        if now < self.ends:
            if self.running is None:
                self.running = Observation(InstancePhase.RUNNING, command_started=self.started)
            return self.running
        if self.stopped_at is not None and self.stopped_at < self.started + self.run_seconds:
            return Observation(
                InstancePhase.EXITED,
                exit_code=STOPPED_CODE,
                reason="Killed",
                message="stopped",
                command_started=self.started,
            )
        return Observation(InstancePhase.EXITED, exit_code=self.exit_code, command_started=self.started)


def create(options: BackendOptions) -> HollowBackend:
    """The registry's factory (``--backend hollow``)."""
    text = options.address or os.environ.get(NODES_ENV) or DEFAULT_CLUSTER
    return HollowBackend(HollowCluster.parse(text))


def default_state_dir() -> Path:
    """The hollow nodes' journal folder in the Trainmaster home."""
    return home() / "hollow"


class HollowBackend(Backend):
    """Simulated nodes behind the real backend contract (see the module's note)."""

    name = "hollow"
    running_at_start = True
    runs_processes = False  # the controller makes no run folders for its jobs (outputs only where asked)
    instance_channel = "unix"

    def __init__(self, cluster: HollowCluster | None = None, state_dir: Path | None = None):
        self.cluster = cluster or HollowCluster.parse(DEFAULT_CLUSTER)
        self._lock = threading.Lock()
        self._used = {f"hollow-{n}": 0.0 for n in range(self.cluster.nodes)}  # node -> CPU placed there
        self._attempts: dict[str, _Attempt] = {}
        self._next_port = 20000
        self._ends: list[float] = []  # a heap of attempt end times, for the exit watch
        self._woken = threading.Condition(self._lock)
        self._wakes: list[Callable[[], None]] = []
        self._watcher: threading.Thread | None = None
        self._closing = False
        self._journal_path = (state_dir or default_state_dir()) / "journal.jsonl"
        self._journal_path.parent.mkdir(parents=True, exist_ok=True)
        self._load_journal()
        self._journal = self._journal_path.open("a", encoding="utf-8")

    # ---- the journal --------------------------------------------------------------------------
    def _load_journal(self) -> None:
        """Attempts a previous backend on this state folder started and the controller has not
        forgotten; the file is rewritten with just those (compacted)."""
        if not self._journal_path.exists():
            return
        for line in self._journal_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill -9 mid-write
            for item in record.get("start", []):
                self._attempts[item["id"]] = _Attempt(
                    item["node"],
                    item["started"],
                    item["run"],
                    item["code"],
                    item["cpu"],
                    item.get("ports", []),
                    item.get("stopped"),
                )
            for iid, stopped in record.get("stop", {}).items():
                if iid in self._attempts:
                    self._attempts[iid].stopped_at = stopped
            for iid in record.get("forget", []):
                self._attempts.pop(iid, None)
        for attempt in self._attempts.values():
            if attempt.node in self._used and time.time() < attempt.ends:
                self._used[attempt.node] += attempt.cpu
            else:
                attempt.freed = True
        tmp = self._journal_path.with_suffix(".tmp")
        tmp.write_text(
            "".join(json.dumps({"start": [_record(iid, a)]}) + "\n" for iid, a in self._attempts.items()),
            encoding="utf-8",
        )
        os.replace(tmp, self._journal_path)

    def _write(self, record: dict[str, object]) -> None:
        self._journal.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._journal.flush()

    # ---- the contract ---------------------------------------------------------------------------
    def capacity(self) -> Resources:
        return self.cluster.capacity

    def place(self, request: PlacementRequest) -> Placement:
        """The node with the most free CPU; ports are numbered per backend (nothing listens)."""
        with self._lock:
            node = min(self._used, key=self._used.__getitem__)
            self._used[node] += request.resources.cpu
            ports = list(range(self._next_port, self._next_port + request.ports))
            self._next_port += request.ports
            if self._next_port > 60000:
                self._next_port = 20000
        return Placement(node, ports)

    def release(self, placement: Placement) -> None:
        """Nothing to free: an attempt's CPU goes back to its node when it ends."""

    def start(self, requests: list[LaunchRequest]) -> Iterator[InstanceHandle | StartFailure]:
        now = time.time()
        handles: list[InstanceHandle | StartFailure] = []
        records = []
        with self._lock:
            for request in requests:
                spec = request.spec
                try:
                    run, code = _timing(spec.annotations)
                except ValueError as exc:
                    handles.append(StartFailure(f"hollow node {spec.host}: {exc}"))
                    continue
                iid = spec.instance_id
                attempt = self._attempts.get(iid)
                if attempt is None:  # a repeated start returns the first handle (the agents' rule)
                    attempt = _Attempt(spec.host, now, run, code, request.resources.cpu, list(spec.ports))
                    if spec.host not in self._used:
                        self._used[min(self._used, key=self._used.__getitem__)] += attempt.cpu
                    self._attempts[iid] = attempt
                    records.append(_record(iid, attempt))
                    heapq.heappush(self._ends, attempt.ends)
                handles.append(InstanceHandle(attempt.node, iid, None, attempt.ports))
            if records:
                self._write({"start": records})
                self._woken.notify()
        yield from handles

    def observe(self, handles: list[InstanceHandle]) -> list[Observation]:
        now = time.time()
        out = []
        attempts = self._attempts
        with self._lock:
            for handle in handles:
                attempt = attempts.get(handle.instance_id)
                if attempt is not None and now < attempt.ends and attempt.running is not None:
                    out.append(attempt.running)  # the common case, kept cheap: thousands a pass
                    continue
                if attempt is None:
                    out.append(
                        Observation(InstancePhase.LOST, reason="Lost", message="no hollow node holds this attempt")
                    )
                    continue
                obs = attempt.phase(now)
                if obs.phase == InstancePhase.EXITED:
                    self._free(attempt)
                out.append(obs)
        return out

    def stop(self, handles: list[InstanceHandle], grace: float) -> None:
        now = time.time()
        stopped = {}
        with self._lock:
            for handle in handles:
                attempt = self._attempts.get(handle.instance_id)
                if attempt is not None and attempt.stopped_at is None and now < attempt.ends:
                    attempt.stopped_at = now
                    stopped[handle.instance_id] = now
                    self._free(attempt)
            if stopped:
                self._write({"stop": stopped})

    def forget(self, handles: list[InstanceHandle]) -> None:
        with self._lock:
            gone = [h.instance_id for h in handles if self._attempts.pop(h.instance_id, None) is not None]
            if gone:
                self._write({"forget": gone})

    def recover(self, instance_id: str, instance_dir: str) -> InstanceHandle | None:
        with self._lock:
            attempt = self._attempts.get(instance_id)
        return None if attempt is None else InstanceHandle(attempt.node, instance_id, None, attempt.ports)

    def watch_exits(self, wake: Callable[[], None]) -> None:
        """A timer thread calls ``wake`` at every attempt's end (the next pass observes it)."""
        with self._lock:
            if wake not in self._wakes:
                self._wakes.append(wake)
            if self._watcher is None:
                self._ends = sorted(a.ends for a in self._attempts.values() if a.ends > time.time())
                self._watcher = threading.Thread(target=self._watch, name="hollow-exits", daemon=True)
                self._watcher.start()

    def _watch(self) -> None:
        while True:
            with self._lock:
                while not self._closing:
                    now = time.time()
                    due = False
                    while self._ends and self._ends[0] <= now:
                        heapq.heappop(self._ends)
                        due = True
                    if due:
                        break
                    self._woken.wait(None if not self._ends else self._ends[0] - now)
                if self._closing:
                    return
                wakes = list(self._wakes)
            for wake in wakes:
                wake()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._woken.notify_all()
            self._journal.close()

    # ---- for tests and benchmarks ---------------------------------------------------------------
    def node_usage(self) -> dict[str, float]:
        """CPU in use per node (attempts started or placed and not yet ended)."""
        with self._lock:
            for attempt in self._attempts.values():
                if not attempt.freed and time.time() >= attempt.ends:
                    self._free(attempt)
            return dict(self._used)

    def _free(self, attempt: _Attempt) -> None:
        if not attempt.freed:
            attempt.freed = True
            if attempt.node in self._used:
                self._used[attempt.node] = max(0.0, self._used[attempt.node] - attempt.cpu)


def _timing(annotations: dict[str, str]) -> tuple[float, int]:
    """The attempt's run time and exit code from its job's annotations."""
    run_text = annotations.get(RUN_SECONDS, "0")
    code_text = annotations.get(EXIT_CODE, "0")
    try:
        run = float(run_text)
    except ValueError:
        raise ValueError(f"annotation {RUN_SECONDS}={run_text!r} is not a number of seconds") from None
    if not 0 <= run <= 10**7:
        raise ValueError(f"annotation {RUN_SECONDS}={run_text!r} must be between 0 and 1e7 seconds")
    try:
        code = int(code_text)
    except ValueError:
        raise ValueError(f"annotation {EXIT_CODE}={code_text!r} is not an integer") from None
    if not 0 <= code <= 255:
        raise ValueError(f"annotation {EXIT_CODE}={code_text!r} must be between 0 and 255")
    return run, code


def _record(iid: str, attempt: _Attempt) -> dict[str, object]:
    return {
        "id": iid,
        "node": attempt.node,
        "started": attempt.started,
        "run": attempt.run_seconds,
        "code": attempt.exit_code,
        "cpu": attempt.cpu,
        "ports": attempt.ports,
        "stopped": attempt.stopped_at,
    }
