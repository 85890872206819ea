"""Simulated annealing over the greedy candidate list (the disclosure's algorithm), made fast.

Start: the greedy schedule, one candidate per job (the disclosure's), and a second start of ours,
the *pace* schedule (below); the cheaper one seeds the chains. Each step visits every job's
candidate in turn and perturbs it: replace one of its devices, picked at random, by a random
device that keeps the constraints (idle, unused by any job this round, eligible for the job).
The Metropolis rule decides (better: take it; worse: take it when u < exp(-delta/T)), then T
cools geometrically. Additions of ours: a second move type that swaps two devices between
jobs, several independent chains, and incremental cost updates:

- fairness: a replacement changes the variance by 2 (h_in - h_out) / K, O(1);
- time: per job and per common-random-number sample the chain keeps the largest and the
  second-largest chosen time and which device holds the largest, so the round time after a
  replacement is max(largest without the leaving device, the arriving device's time): O(S)
  instead of O(S x per_round), with no copies;
- random numbers are drawn in one block per chain instead of one generator call per draw.

The pace start exists because the round time is a maximum: a schedule is only as fast as its
slowest device, so devices of similar speed belong together, and the fairness term prefers the
least-served devices. For each candidate "pace" device (in order of expected time) it takes the
n - 1 least-served devices that are not slower, and keeps the cheapest such set; this finds the
rounds of the round-robin-by-speed kind that random single-device moves reach only slowly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainmaster.flsched.cost import Assignment, CostModel
from trainmaster.flsched.model import Problem
from trainmaster.flsched.schedulers.base import Scheduler, metropolis_accept, register
from trainmaster.flsched.schedulers.baselines import greedy_assignment, greedy_order

PACE_GRID = 64
"""At most this many pace candidates per job (all of them on pools up to this size)."""


@dataclass
class AnnealingStats:
    """What the last ``schedule`` call did (for tests and tuning)."""

    steps: int = 0
    proposed_worse: int = 0
    accepted_worse: int = 0
    accepted_better: int = 0
    initial_temperature: float = 0.0
    initial_cost: float = 0.0
    best_cost: float = 0.0


def pace_assignment(model: CostModel) -> Assignment | None:
    """Jobs (least slack first) each take their cheapest "pace" set: a device d and the n - 1
    least-served free devices expected no slower than d (speed breaks ties). None when an early
    job leaves a later one short (the caller then starts from greedy alone)."""
    problem = model.problem
    K = problem.num_devices
    wt, wf = problem.weight_time, problem.weight_fairness
    free = np.ones(K, dtype=bool)
    out: list[np.ndarray] = [np.zeros(0, dtype=int)] * problem.num_jobs
    eligible = problem.eligible
    mean_time = model.times.mean(axis=1)  # (M, K)
    for m in greedy_order(problem):
        n = int(problem.per_round[m])
        cand = np.flatnonzero(eligible[m] & free)
        if len(cand) < n:
            return None
        order = cand[np.argsort(mean_time[m, cand], kind="stable")]
        h = problem.history[m, order]
        key = h + np.arange(len(order)) / (len(order) * 1e3)  # least served first, then faster
        samples = model.times[m]
        best, best_cost = order[:n], np.inf
        for j in np.unique(np.linspace(n - 1, len(order) - 1, PACE_GRID).astype(int)):
            if n > 1 and j > n - 1:
                pick = np.append(order[np.argpartition(key[:j], n - 2)[: n - 1]], order[j])
            else:
                pick = order[j - n + 1 : j + 1]
            c = wt * float(samples[:, pick].max(axis=1).mean()) + wf * 2.0 * float(problem.history[m, pick].sum()) / K
            if c < best_cost:
                best, best_cost = pick, c
        out[m] = np.sort(best)
        free[best] = False
    return out


@register("sa")
class AnnealingScheduler(Scheduler):
    """``steps`` sweeps over all jobs (None = sized from the problem), cooling from an initial
    temperature at which an average worsening move is accepted with probability ``accept0``
    down to ``final_ratio`` of it. ``temperature`` fixes T (no cooling) for experiments;
    ``pace=False`` starts from the disclosure's greedy candidates only."""

    def __init__(self, seed: int | None = None, n_samples: int = 32, steps: int | None = None,
                 chains: int = 1, accept0: float = 0.5, final_ratio: float = 1e-3,
                 swap_prob: float = 0.2, temperature: float | None = None, pace: bool = True) -> None:
        super().__init__(seed, n_samples)
        self.steps, self.chains, self.accept0 = steps, chains, accept0
        self.final_ratio, self.swap_prob, self.temperature = final_ratio, swap_prob, temperature
        self.pace = pace
        self.stats = AnnealingStats()

    def schedule(self, problem: Problem, cost: CostModel | None = None) -> Assignment:
        model = self.cost_model(problem, cost)
        initial = greedy_assignment(problem)
        initial_cost = model.cost(initial)
        self.stats = AnnealingStats(initial_cost=initial_cost)
        if self.pace:
            paced = pace_assignment(model)
            if paced is not None and (paced_cost := model.cost(paced)) < initial_cost:
                initial, initial_cost = paced, paced_cost
        best, best_cost = initial, initial_cost
        by_device = np.ascontiguousarray(model.times.transpose(0, 2, 1))  # (M, K, S): a device's samples contiguous
        for _ in range(max(1, self.chains)):
            cand, cand_cost = _Chain(self, model, initial, by_device).run()
            if cand_cost < best_cost:
                best, best_cost = cand, cand_cost
        self.stats.best_cost = best_cost
        return [np.sort(s) for s in best]

    def accept(self, delta: float, temperature: float, u: float) -> bool:
        ok = metropolis_accept(delta, temperature, u)
        if delta > 0:
            self.stats.proposed_worse += 1
            self.stats.accepted_worse += int(ok)
        elif ok:
            self.stats.accepted_better += 1
        return ok


class _Chain:
    """One annealing chain with incremental state (see the module docstring)."""

    def __init__(self, owner: AnnealingScheduler, model: CostModel, initial: Assignment, by_device: np.ndarray) -> None:
        problem = model.problem
        self.sa = owner
        self.M, self.K = problem.num_jobs, problem.num_devices
        self.wt, self.wf = problem.weight_time, problem.weight_fairness
        self.samples_by_device = by_device
        self.n_samples = model.times.shape[1]
        self.history = problem.history
        self.eligible = problem.eligible
        self.elig_idx = [np.flatnonzero(self.eligible[m]) for m in range(self.M)]
        self.sets = [np.array(s, dtype=int) for s in initial]
        self.owner = np.full(self.K, -1)
        for m, s in enumerate(self.sets):
            self.owner[s] = m
        self.inv_s = 1.0 / self.n_samples
        self.buf = np.empty(self.n_samples)
        self.loo: list[np.ndarray] = [np.zeros(0)] * self.M
        self.times = [0.0] * self.M
        for m in range(self.M):
            self._refresh(m)
        fair = [model.job_fairness(m, s) for m, s in enumerate(self.sets)]
        self.current = sum(self.wt * t + self.wf * f for t, f in zip(self.times, fair))
        self.model = model

    def _refresh(self, m: int) -> None:
        """Recompute job m's per-sample largest and second-largest chosen time after a move, and
        from them the leave-one-out maxima: row p = the round's per-sample time without position p."""
        cols = self.samples_by_device[m][self.sets[m]]  # (n, S)
        rows = np.arange(cols.shape[1])
        pos = cols.argmax(axis=0)
        first = cols[pos, rows]
        if cols.shape[0] > 1:
            masked = cols.copy()
            masked[pos, rows] = -np.inf
            second = masked.max(axis=0)
        else:
            second = np.zeros_like(first)
        self.loo[m] = np.where(pos[None, :] == np.arange(cols.shape[0])[:, None], second[None, :], first[None, :])
        self.times[m] = float(first.sum()) * self.inv_s

    def _time_after(self, m: int, pos: int, k_in: int) -> float:
        """Job m's expected round time with its device at position ``pos`` replaced by k_in: O(S)."""
        np.maximum(self.loo[m][pos], self.samples_by_device[m, k_in], out=self.buf)
        return float(self.buf.sum()) * self.inv_s

    def _propose_replace(self, m: int, r_dev: np.ndarray, r_pos: float) -> tuple[int, int, float, float] | None:
        idx = self.elig_idx[m]
        for r in r_dev:  # rejection-sample a free eligible device
            k_in = int(idx[int(r * len(idx))])
            if self.owner[k_in] == -1:
                break
        else:
            return None
        s = self.sets[m]
        pos = int(r_pos * len(s))
        k_out = int(s[pos])
        t_new = self._time_after(m, pos, k_in)
        delta = self.wt * (t_new - self.times[m]) + self.wf * 2.0 * (self.history[m, k_in] - self.history[m, k_out]) / self.K
        return pos, k_in, t_new, delta

    def run(self) -> tuple[Assignment, float]:
        sa, M = self.sa, self.M
        steps = sa.steps or int(np.clip(1500 // max(M, 1), 60, 300))
        n_moves = steps * M
        rng = sa.rng
        draws = rng.random((n_moves + 16, 6))  # move type, position, other job, other position, accept u, spare
        dev_draws = rng.random((n_moves + 16, 8))  # rejection sampling of the arriving device
        best, best_sets = self.current, [s.copy() for s in self.sets]
        temperature = sa.temperature
        if temperature is None:
            probes = [self._propose_replace(int(draws[i, 2] * M), dev_draws[n_moves + i], draws[i, 1]) for i in range(16)]
            worse = [p[3] for p in probes if p is not None and p[3] > 0]
            mean_worse = float(np.mean(worse)) if worse else max(abs(self.current), 1e-9) * 1e-3
            temperature = mean_worse / -np.log(sa.accept0)
            cooling = sa.final_ratio ** (1.0 / max(n_moves, 1))
        else:
            cooling = 1.0
        sa.stats.initial_temperature = max(sa.stats.initial_temperature, temperature)
        i = 0
        for _ in range(steps):
            for m in range(M):  # every candidate (one per job) is perturbed once per step
                sa.stats.steps += 1
                d = draws[i]
                if M > 1 and d[0] < sa.swap_prob:
                    self._swap(m, d, temperature)
                else:
                    move = self._propose_replace(m, dev_draws[i], d[1])
                    if move is not None and sa.accept(move[3], temperature, d[4]):
                        pos, k_in, _t_new, delta = move
                        s = self.sets[m]
                        k_out = int(s[pos])
                        s[pos] = k_in
                        self.owner[k_out], self.owner[k_in] = -1, m
                        self._refresh(m)
                        self.current += delta
                if self.current < best - 1e-12:
                    best, best_sets = self.current, [s.copy() for s in self.sets]
                temperature *= cooling
                i += 1
        return best_sets, self.model.cost(best_sets)

    def _swap(self, m: int, d: np.ndarray, temperature: float) -> None:
        """Exchange one device of job m with one device of another job, if both stay eligible."""
        other = int(d[2] * (self.M - 1))
        other += other >= m
        sm, so = self.sets[m], self.sets[other]
        i, j = int(d[1] * len(sm)), int(d[3] * len(so))
        a, b = int(sm[i]), int(so[j])
        if not (self.eligible[m, b] and self.eligible[other, a]):
            return
        h, K = self.history, self.K
        tm, to = self._time_after(m, i, b), self._time_after(other, j, a)
        delta = (self.wt * (tm - self.times[m] + to - self.times[other])
                 + self.wf * 2.0 * (h[m, b] - h[m, a] + h[other, a] - h[other, b]) / K)
        if self.sa.accept(delta, temperature, d[4]):
            sm[i], so[j] = b, a
            self.owner[b], self.owner[a] = m, other
            self._refresh(m)
            self._refresh(other)
            self.current += delta
