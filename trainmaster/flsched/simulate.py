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
from dataclasses import dataclass, field

import numpy as np

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
    decision_seconds: list[float]

    def to_dict(self, bins: int = 10) -> dict:
        out_jobs = {}
        for tr in self.jobs:
            counts = tr.participation if tr.participation is not None else np.zeros(0)
            hist, edges = np.histogram(counts, bins=min(bins, max(1, int(counts.max(initial=0)) + 1)))
            out_jobs[tr.job] = {
                "rounds": tr.rounds,
                "time_to_target": tr.time_to_target,
                "final_accuracy": round(tr.final_accuracy(), 4),
                "participation_histogram": {"counts": hist.tolist(), "edges": [round(e, 2) for e in edges]},
                "devices_never_used": int((counts == 0).sum()),
            }
        return {
            "scheduler": self.scheduler,
            "total_time": self.total_time,
            "end_time": self.end_time,
            "jobs": out_jobs,
            "decision_ms_median": 1000 * float(np.median(self.decision_seconds)) if self.decision_seconds else 0.0,
        }


def simulate(
    problem: Problem,
    scheduler: Scheduler,
    curves: list[ConvergenceCurve] | None = None,
    seed: int = 0,
    availability: float = 0.9,
    rounds: int | None = None,
    max_rounds: int = 2000,
    dropout: float = 0.0,
) -> SimulationResult:
    """Run every job until its target (or exactly ``rounds`` rounds each, when given).

    ``availability`` is each device's chance to be reachable at a decision; ``dropout`` the
    chance that a chosen device fails mid-round (its update is lost, its time still spent).
    """
    import time as _time

    rng = np.random.default_rng(seed)
    M, K = problem.num_jobs, problem.num_devices
    curves = curves or [ConvergenceCurve() for _ in range(M)]
    history = problem.history.copy()
    busy_until = np.zeros(K)
    progress = np.zeros(M)
    seen = np.zeros((M, K), dtype=bool)
    traces = [JobTrace(job=j.id) for j in problem.jobs]
    finished = np.zeros(M, dtype=bool)
    waiting = list(range(M))
    events: list[tuple[float, int, np.ndarray, np.ndarray]] = []  # (end, job, devices, survived)
    decisions: list[float] = []
    now = 0.0
    total_samples = problem.samples.sum(axis=1)

    while True:
        if waiting:
            idle = busy_until <= now + 1e-12
            avail = idle & (rng.random(K) < availability)
            state = problem.subset_jobs(waiting).with_history(history[waiting], avail)
            try:
                from trainmaster.flsched.model import check_feasible

                check_feasible(state)
                ok = True
            except ProblemError:
                ok = False
            if ok:
                t0 = _time.perf_counter()
                assignment = scheduler.schedule(state)
                decisions.append(_time.perf_counter() - t0)
                for row, m in enumerate(waiting):
                    devs = np.asarray(assignment[row], dtype=int)
                    x = rng.exponential(1.0, len(devs))
                    work = problem.tau[m] * problem.samples[m, devs]
                    dur = (
                        work * (problem.a[devs] + x / problem.mu[devs])
                        + problem.model_bytes[m] / problem.bandwidth[devs]
                    )
                    busy_until[devs] = now + dur
                    survived = rng.random(len(devs)) >= dropout
                    heapq.heappush(events, (now + float(dur.max()), m, devs, survived))
                waiting = []
        if not events:
            if waiting:  # nothing running and no feasible round: wait for availability to change
                now += 1.0
                continue
            break
        end, m, devs, survived = heapq.heappop(events)
        now = end
        tr = traces[m]
        q = history[m]
        used = devs[survived]
        if len(used):
            excess = np.maximum(0.0, q[used] - q.mean())
            progress[m] += float(np.mean(1.0 / (1.0 + curves[m].lam * excess)))
        history[m, devs] += 1.0
        seen[m, used] = True
        coverage = float(problem.samples[m, seen[m]].sum() / total_samples[m])
        acc = curves[m].accuracy(progress[m], coverage)
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
        tr.participation = history[m] - problem.history[m]
    reached = [tr.time_to_target for tr in traces if tr.time_to_target is not None]
    total = max(reached) if len(reached) == len(traces) else None
    return SimulationResult(
        scheduler=scheduler.name, total_time=total, end_time=now, jobs=traces, decision_seconds=decisions
    )
