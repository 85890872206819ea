"""Multi-job FedAvg in real wall-clock time: devices are processes that take their drawn time.

``runtime.run_multijob`` advances a simulated clock, so every scheduler there takes the same
wall time. Here each device is an OS process (forked, so it shares the loaded datasets) that
really trains its shard (PyTorch) and then *sleeps* until its drawn compute time has passed:
tau_m d_mk (a_k + X / mu_k) / speedup, X ~ Exp(1). The model travels to and from the device over
a pipe through a token bucket (``TokenBucket``) at the device's bandwidth: each real byte of the
model counts as model_bytes / payload bytes emulated bytes, so a round trip takes
model_bytes / bandwidth / speedup seconds like the cost model's communication term. (A testbed
with real capped links is another project; a rate limiter in the transport is the stated
fallback.)

The server (this process) runs every job asynchronously, as the simulator does: whenever jobs
wait for a round, the scheduler is asked about exactly those jobs and the devices idle (and
available, drawn with probability ``availability``) at that moment; a job's round ends when its
slowest device has returned its update; FedAvg, then the job's test accuracy is recorded
against wall time. Reader threads (one per device) receive updates, so a slow upload never
holds up another job. Every wait has a timeout; device processes exit when their pipe closes,
and are terminated at the end if they have not, so nothing is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from trainmaster.flsched.model import ProblemError, check_feasible
from trainmaster.flsched.runtime import FLJob, PoolOptions
from trainmaster.flsched.schedulers import Scheduler
from trainmaster.flsched.synthetic import make_pool, make_straggler_pool

CHUNK = 16 * 1024
"""Bytes per pipe message: the token bucket meters the model in pieces of this size."""
JOBS = (("digits", 2, 0.85), ("wine", 1, 0.92), ("breast-cancer", 1, 0.93))
"""The three real FL jobs: dataset, local epochs, target accuracy."""


class TokenBucket:
    """A link of ``rate`` bytes per second with a burst of ``burst`` bytes: ``take(n)`` returns
    once n bytes may pass, sleeping (never spinning) for the tokens that are missing."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self.tokens, self.last = float(burst), time.monotonic()

    def take(self, n: float) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < n:
            time.sleep((n - self.tokens) / self.rate)
            self.last = time.monotonic()
            self.tokens = 0.0
        else:
            self.tokens -= n


def send_message(conn: Connection, obj: object, bucket: TokenBucket | None = None, weight: float = 1.0) -> None:
    """Pickle ``obj`` and send it in CHUNK pieces, each metered by ``bucket`` (weight = emulated
    bytes per real byte)."""
    data = pickle.dumps(obj)
    conn.send_bytes(len(data).to_bytes(8, "little"))
    for i in range(0, len(data), CHUNK):
        piece = data[i : i + CHUNK]
        if bucket is not None:
            bucket.take(len(piece) * weight)
        conn.send_bytes(piece)


def receive_message(
    conn: Connection, bucket: TokenBucket | None = None, weight_of: Callable[[int], float] | None = None
) -> object:
    """The inverse of ``send_message``; ``weight_of(size)`` gives the weight once the size is known."""
    size = int.from_bytes(conn.recv_bytes(), "little")
    weight = weight_of(size) if weight_of is not None else 1.0
    parts, got = [], 0
    while got < size:
        piece = conn.recv_bytes()
        if bucket is not None:
            bucket.take(len(piece) * weight)
        parts.append(piece)
        got += len(piece)
    return pickle.loads(b"".join(parts))


Weights = dict[str, Any]
"""A model's state dict (parameter name -> torch tensor)."""


@dataclass(frozen=True)
class TrainTask:
    """Server -> device: train ``job``'s model from ``weights`` for round ``round``, taking
    ``compute_seconds`` in all; the model counts as ``model_bytes`` on the link."""

    job: int
    round: int
    weights: Weights
    compute_seconds: float
    model_bytes: float
    seed: int


@dataclass(frozen=True)
class StopDevice:
    """Server -> device: exit."""


@dataclass(frozen=True)
class DeviceUpdate:
    """Device -> server: the model ``device`` trained for ``job`` in ``round``, on
    ``samples`` samples (its FedAvg weight)."""

    device: int
    job: int
    round: int
    weights: Weights
    samples: int


@dataclass(frozen=True, kw_only=True)
class WallClockOptions(PoolOptions):
    """How ``run_wallclock`` runs: each job stops at its target, after ``max_rounds`` rounds or
    at ``time_limit`` wall seconds; device time runs ``speedup`` times faster than the model's
    seconds; ``stragglers``: share of the devices ``straggler_factor`` times slower
    (``synthetic.make_straggler_pool``; 0 = ``make_pool``)."""

    max_rounds: int = 60
    speedup: float = 100.0
    time_limit: float = 120.0
    stragglers: float = 0.0
    straggler_factor: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be at least 1, got {self.max_rounds}")
        if self.speedup <= 0.0:
            raise ValueError(f"speedup must be positive, got {self.speedup}")
        if self.time_limit <= 0.0:
            raise ValueError(f"time_limit must be positive, got {self.time_limit} s")


@dataclass
class WallJob:
    """One job's course in wall time: (seconds since start, test accuracy) after each round."""

    name: str
    target: float
    curve: list[tuple[float, float]] = field(default_factory=list)
    time_to_target: float | None = None
    rounds: int = 0


@dataclass
class WallClockResult:
    scheduler: str
    jobs: list[WallJob]
    wall_seconds: float
    speedup: float

    @property
    def time_to_all_targets(self) -> float | None:
        """Wall seconds until the last job reached its target (None: some job never did)."""
        times = [j.time_to_target for j in self.jobs if j.time_to_target is not None]
        return max(times) if len(times) == len(self.jobs) else None


def _device_main(conn: Connection, index: int, jobs: list[FLJob], bandwidth: float, speedup: float) -> None:
    """A device process: per task, download (metered), train, sleep the rest of the drawn
    compute time, upload (metered); exit when the server closes the pipe or says stop."""
    import torch

    from trainmaster.flsched.runtime import _local_update

    torch.set_num_threads(1)
    link = TokenBucket(rate=2.0 * bandwidth * speedup, burst=CHUNK)  # both ways: bytes / bw / speedup in all
    while True:
        try:
            task = receive_message(conn)
        except (EOFError, OSError):
            return
        if not isinstance(task, TrainTask):  # StopDevice
            return
        payload = len(pickle.dumps(task.weights))
        weight = task.model_bytes / max(payload, 1)  # emulated bytes per real byte of the model
        for i in range(0, payload, CHUNK):  # the download, metered as it would arrive
            link.take(min(CHUNK, payload - i) * weight)
        started = time.monotonic()
        job = jobs[task.job]
        new = _local_update(task.weights, job, job.shards[index], task.seed)
        rest = task.compute_seconds - (time.monotonic() - started)
        if rest > 0:
            time.sleep(rest)
        try:
            update = DeviceUpdate(index, task.job, task.round, new, int(len(job.shards[index])))
            send_message(conn, update, link, weight)
        except (BrokenPipeError, OSError):
            return


def run_wallclock(scheduler: Scheduler, options: WallClockOptions | None = None) -> WallClockResult:
    """Train the three jobs concurrently on ``options.num_devices`` device processes until each
    reaches its target (or ``max_rounds``, or ``time_limit`` wall seconds)."""
    import torch

    from trainmaster.flsched.runtime import _accuracy, _local_update, _model, fl_problem, load_job

    opts = options or WallClockOptions()
    num_devices, seed, speedup, time_limit = opts.num_devices, opts.seed, opts.speedup, opts.time_limit
    torch.set_num_threads(1)
    fl_jobs = [load_job(name, num_devices, seed, target, tau=tau) for name, tau, target in JOBS]
    pool = (
        make_straggler_pool(num_devices, seed, opts.stragglers, opts.straggler_factor)
        if opts.stragglers
        else make_pool(num_devices, seed)
    )
    base = fl_problem(fl_jobs, pool, opts.per_round, opts.fairness_weight)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    states = [{k: v.clone() for k, v in _model(j.x_train.shape[1], j.classes).state_dict().items()} for j in fl_jobs]
    # one local update here first: torch imports its optimiser machinery lazily (seconds), and
    # forked devices then inherit it instead of each importing it during its first round
    _local_update(states[0], fl_jobs[0], fl_jobs[0].shards[0], seed)
    ctx = mp.get_context("fork")
    conns, procs = [], []
    for k in range(num_devices):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_device_main, args=(child, k, fl_jobs, pool[k].bandwidth, speedup), daemon=True)
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    inbox: queue.Queue[DeviceUpdate] = queue.Queue()

    def reader(k: int) -> None:
        while True:
            try:
                msg = receive_message(conns[k])
            except (EOFError, OSError):
                return
            if isinstance(msg, DeviceUpdate):
                inbox.put(msg)

    for k in range(num_devices):
        threading.Thread(target=reader, args=(k,), daemon=True).start()
    jobs = [WallJob(name=j.name, target=j.target) for j in fl_jobs]
    history = np.zeros_like(base.history)
    busy = np.zeros(num_devices, dtype=bool)
    waiting = list(range(len(jobs)))
    pending: dict[int, set[int]] = {}
    updates: dict[int, list[tuple[Weights, int]]] = {m: [] for m in range(len(jobs))}
    start = time.monotonic()
    try:
        while waiting or pending:
            elapsed = time.monotonic() - start
            if elapsed > time_limit:
                break
            if waiting:
                avail = ~busy & (rng.random(num_devices) < opts.availability)
                state = base.subset_jobs(waiting).with_history(history[waiting], avail)
                try:
                    check_feasible(state)
                    assignment = scheduler.schedule(state)
                except ProblemError:
                    assignment = None  # too few idle devices: wait for one to return
                if assignment is not None:
                    for row, m in enumerate(waiting):
                        devs = [int(k) for k in assignment[row]]
                        x = rng.exponential(1.0, len(devs))
                        for k, xk in zip(devs, x):
                            compute = base.tau[m] * base.samples[m, k] * (base.a[k] + xk / base.mu[k]) / speedup
                            task = TrainTask(
                                job=m,
                                round=jobs[m].rounds,
                                weights=states[m],
                                compute_seconds=float(compute),
                                model_bytes=float(base.model_bytes[m]),
                                seed=seed * 100_003 + jobs[m].rounds * 131 + k,
                            )
                            send_message(conns[k], task)
                            busy[k] = True
                        history[m, devs] += 1
                        pending[m] = set(devs)
                    waiting = []
            try:
                msg = inbox.get(timeout=0.05 if waiting and not pending else max(0.01, time_limit - elapsed))
            except queue.Empty:
                continue
            m, k = msg.job, msg.device
            busy[k] = False
            pending[m].discard(k)
            updates[m].append((msg.weights, msg.samples))
            if pending[m]:
                continue
            del pending[m]
            total = sum(n for _, n in updates[m])
            states[m] = {key: sum((n / total) * w[key] for w, n in updates[m]) for key in states[m]}
            updates[m] = []
            job = jobs[m]
            job.rounds += 1
            acc = _accuracy(states[m], fl_jobs[m])
            now = time.monotonic() - start
            job.curve.append((now, acc))
            if acc >= job.target:
                job.time_to_target = now
            elif job.rounds < opts.max_rounds:
                waiting.append(m)
    finally:
        for conn in conns:
            try:
                send_message(conn, StopDevice())
            except OSError:
                pass
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
        for conn in conns:
            conn.close()
    return WallClockResult(scheduler=scheduler.name, jobs=jobs, wall_seconds=time.monotonic() - start, speedup=speedup)
