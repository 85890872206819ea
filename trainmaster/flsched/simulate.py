"""Event-driven simulation of many FL jobs sharing one device pool.

Jobs run concurrently and asynchronously: whenever jobs are waiting to start a round, the
scheduler is asked about exactly those jobs and the devices idle (and available) at that moment;
a chosen device stays busy for its own drawn time, and a job's round ends with its slowest
device. Availability is redrawn at every decision, as devices come and go.

Convergence is a per-job curve, ours (the source only says "a curve with parameters alpha, beta"):
  loss_m = alpha_m / (P_m + 1) + beta_m + gamma_m * (1 - coverage_m),   accuracy = max(0, 1 - loss).
P_m is effective progress: each round adds the mean over its devices of
1 / (1 + lam * max(0, q_k - mean q)), so re-using over-served devices teaches the model less
(non-IID data: the same few devices over and over overfit their local distributions).
coverage_m is the share of the job's samples that have taken part at least once. Hence the
trade-off of the source: fast-only schedules shorten rounds but need more of them, and may never
reach a target that needs most of the data.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from trainmaster.flsched.fleet import Fleet, FleetState
from trainmaster.flsched.model import Problem, ProblemError
from trainmaster.flsched.schedulers import Scheduler


@dataclass(frozen=True)
class ConvergenceCurve:
    """Per-job convergence parameters; ``target`` is the accuracy the job must reach."""

    alpha: float = 5.0
    beta: float = 0.05
    gamma: float = 0.3
    lam: float = 0.5
    target: float = 0.83

    def accuracy(self, progress: float, coverage: float) -> float:
        loss = self.alpha / (progress + 1.0) + self.beta + self.gamma * (1.0 - coverage)
        return max(0.0, 1.0 - loss)  # accuracy is a share: an early, large loss means 0, not negative


@dataclass
class JobTrace:
    """One job's course: per round its end time, accuracy and the devices it used."""

    job: str
    rounds: int = 0
    times: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    time_to_target: float | None = None
    participation: np.ndarray | None = None

    def final_accuracy(self) -> float:
        return self.accuracy[-1] if self.accuracy else 0.0


@dataclass
class SimulationResult:
    scheduler: str
    total_time: float | None  # when the last job reached its target (None: some never did)
    end_time: float
    jobs: list[JobTrace]
    decision_seconds: list[float]  # wall time of each decision
    decision_cpu_seconds: list[float] = field(default_factory=list)  # process CPU time of each decision
    devices: int = 0

    @property
    def mean_completion_time(self) -> float | None:
        """Mean over the jobs of the time each reached its target (None: some job never did)."""
        times = [tr.time_to_target for tr in self.jobs]
        return None if any(t is None for t in times) else float(np.mean([t for t in times if t is not None]))

    def to_dict(self, bins: int = 10) -> dict:
        out_jobs = {}
        for tr in self.jobs:
            counts = tr.participation if tr.participation is not None else np.zeros(0)
            out_jobs[tr.job] = {
                "rounds": tr.rounds,
                "time_to_target": tr.time_to_target,
                "final_accuracy": round(tr.final_accuracy(), 4),
                "participation_histogram": participation_histogram(counts, bins),
                "devices_never_used": int((counts == 0).sum()),
            }
        cpu = self.decision_cpu_seconds
        return {
            "scheduler": self.scheduler,
            "devices": self.devices,
            "total_time": self.total_time,
            "mean_completion_time": self.mean_completion_time,
            "end_time": self.end_time,
            "jobs": out_jobs,
            "decisions": len(self.decision_seconds),
            "decision_ms_median": 1000 * float(np.median(self.decision_seconds)) if self.decision_seconds else 0.0,
            "decision_cpu_ms_median": 1000 * float(np.median(cpu)) if cpu else 0.0,
            "decision_cpu_ms_max": 1000 * float(np.max(cpu)) if cpu else 0.0,
        }


def participation_histogram(counts: np.ndarray, bins: int = 10) -> dict:
    """How many devices served a job how many rounds, in labelled bins of whole rounds:
    ``{"bins": [{"rounds": "0", "devices": 12}, {"rounds": "1-2", "devices": 5}, ...],
    "counts": [...], "edges": [...]}`` (edges: the bins' lower bounds, then one past the last)."""
    top = int(counts.max(initial=0))
    width = max(1, int(np.ceil((top + 1) / bins)))
    edges = list(range(0, top + 1, width)) + [top + 1 if (top + 1) % width == 0 else (top // width + 1) * width]
    hist, _ = np.histogram(counts, bins=edges)
    labels = [str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:])]
    return {
        "bins": [{"rounds": lab, "devices": int(c)} for lab, c in zip(labels, hist)],
        "counts": hist.tolist(),
        "edges": edges,
    }


def simulate(
    problem: Problem | Fleet,
    scheduler: Scheduler,
    curves: list[ConvergenceCurve] | None = None,
    seed: int = 0,
    availability: float = 0.9,
    rounds: int | None = None,
    max_rounds: int = 2000,
    dropout: float = 0.0,
) -> SimulationResult:
    """Run every job until its target (or exactly ``rounds`` rounds each, when given).

    ``problem`` is a dense ``Problem`` or a ``Fleet`` (100,000 devices and more): the simulation
    runs on the fleet's sparse form either way, and every step after a decision costs
    O(devices of the round), so a fleet's simulation is as fast per round as a small pool's
    (the per-decision availability draw is the one O(pool) step). ``availability`` is each
    device's chance to be reachable at a decision; ``dropout`` the chance that a chosen device
    fails mid-round (its update is lost, its time still spent).
    """
    if isinstance(problem, Fleet):
        fleet, state = problem, FleetState(problem)
    else:
        fleet, state = Fleet.from_problem(problem)
    start_history = [h.copy() for h in state.history]
    state.prepare()
    rng = np.random.default_rng(seed)
    M, K = fleet.num_jobs, fleet.num_devices
    curves = curves or [ConvergenceCurve() for _ in range(M)]
    busy_until = np.zeros(K)  # each device is busy until its own part of a round is done
    progress = np.zeros(M)
    seen = [np.zeros(len(k), dtype=bool) for k in fleet.members]
    covered = np.zeros(M)
    total_samples = np.array([d.sum() for d in fleet.samples])
    traces = [JobTrace(job=j.id) for j in fleet.jobs]
    finished = np.zeros(M, dtype=bool)
    waiting = list(range(M))
    events: list[tuple[float, int, int, np.ndarray, np.ndarray]] = []  # (end, seq, job, devices, survived)
    decisions: list[float] = []
    cpu: list[float] = []
    now, seq = 0.0, 0

    while True:
        if waiting:
            state.available = rng.random(K) < availability
            state.busy = busy_until > now + 1e-12
            try:
                t0, c0 = time.perf_counter(), time.process_time()
                assignment = scheduler.schedule_fleet(fleet, state, waiting)
                decisions.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            except ProblemError:
                assignment = None  # too few devices reachable now: wait for a round to end
            if assignment is not None:
                for m, devs in zip(waiting, assignment):
                    devs = np.asarray(devs, dtype=np.int64)
                    pos = fleet.positions(m, devs)
                    x = rng.exponential(1.0, len(devs))
                    dur = fleet.shift[m][pos] + fleet.scale[m][pos] * x
                    busy_until[devs] = now + dur
                    state.busy[devs] = True  # taken for the rest of this decision's jobs
                    survived = rng.random(len(devs)) >= dropout
                    heapq.heappush(events, (now + float(dur.max()), seq, m, devs, survived))
                    seq += 1
                waiting = []
        if not events:
            if waiting:  # nothing running and no feasible round: wait for availability to change
                now += 1.0
                continue
            break
        end, _, m, devs, survived = heapq.heappop(events)
        now = end
        tr = traces[m]
        pos = fleet.positions(m, devs)
        used = pos[survived]
        if len(used):
            q = state.history[m]
            excess = np.maximum(0.0, q[used] - state.h_sum[m] / K)
            progress[m] += float(np.mean(1.0 / (1.0 + curves[m].lam * excess)))
        state.record(m, devs)
        fresh = used[~seen[m][used]]
        seen[m][fresh] = True
        covered[m] += float(fleet.samples[m][fresh].sum())
        acc = curves[m].accuracy(progress[m], float(covered[m] / total_samples[m]))
        tr.rounds += 1
        tr.times.append(now)
        tr.accuracy.append(acc)
        if tr.time_to_target is None and acc >= curves[m].target:
            tr.time_to_target = now
        done = (tr.rounds >= rounds) if rounds is not None else (tr.time_to_target is not None)
        if done or tr.rounds >= max_rounds:
            finished[m] = True
        else:
            waiting.append(m)
        if finished.all():
            break
    for m, tr in enumerate(traces):
        counts = np.zeros(K)
        counts[fleet.members[m]] = state.history[m] - start_history[m]
        tr.participation = counts
    reached = [tr.time_to_target for tr in traces if tr.time_to_target is not None]
    total = max(reached) if len(reached) == len(traces) else None
    return SimulationResult(
        scheduler=scheduler.name,
        total_time=total,
        end_time=now,
        jobs=traces,
        decision_seconds=decisions,
        decision_cpu_seconds=cpu,
        devices=K,
    )
