"""Simulated annealing over the greedy candidate list (the disclosure's algorithm).

Start: the greedy schedule, one candidate per job. Each step visits every job's candidate in
turn and perturbs it: replace one of its devices, picked at random, by a random device that
keeps the constraints (idle, unused by any job this round, eligible for the job). The
Metropolis rule decides (better: take it; worse: take it when u < exp(-delta/T)), then T cools
geometrically. Additions of ours, all optional: a second move type that swaps two devices
between jobs, several independent chains, and O(1) fairness updates (a replacement changes the
fairness variance by 2 (h_in - h_out) / K).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainmaster.flsched.cost import Assignment, CostModel
from trainmaster.flsched.model import Problem
from trainmaster.flsched.schedulers.base import Scheduler, metropolis_accept, register
from trainmaster.flsched.schedulers.baselines import greedy_assignment


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


@register("sa")
class AnnealingScheduler(Scheduler):
    """``steps`` sweeps over all jobs (None = sized from the problem), cooling from an initial
    temperature at which an average worsening move is accepted with probability ``accept0``
    down to ``final_ratio`` of it. ``temperature`` fixes T (no cooling) for experiments."""

    def __init__(self, seed: int | None = None, n_samples: int = 32, steps: int | None = None,
                 chains: int = 1, accept0: float = 0.5, final_ratio: float = 1e-3,
                 swap_prob: float = 0.2, temperature: float | None = None) -> None:
        super().__init__(seed, n_samples)
        self.steps, self.chains, self.accept0 = steps, chains, accept0
        self.final_ratio, self.swap_prob, self.temperature = final_ratio, swap_prob, temperature
        self.stats = AnnealingStats()

    def schedule(self, problem: Problem, cost: CostModel | None = None) -> Assignment:
        model = self.cost_model(problem, cost)
        initial = greedy_assignment(problem)
        self.stats = AnnealingStats(initial_cost=model.cost(initial))
        best, best_cost = initial, self.stats.initial_cost
        for _ in range(max(1, self.chains)):
            cand, cand_cost = self._chain(problem, model, initial)
            if cand_cost < best_cost:
                best, best_cost = cand, cand_cost
        self.stats.best_cost = best_cost
        return [np.sort(s) for s in best]

    # ------------------------------------------------------------------ one annealing chain
    def _chain(self, problem: Problem, model: CostModel, initial: Assignment) -> tuple[Assignment, float]:
        rng = self.rng
        M, K = problem.num_jobs, problem.num_devices
        wt, wf = problem.weight_time, problem.weight_fairness
        eligible = problem.eligible
        elig_idx = [np.flatnonzero(eligible[m]) for m in range(M)]
        sets = [s.copy() for s in initial]
        owner = np.full(K, -1)
        for m, s in enumerate(sets):
            owner[s] = m
        times = [model.job_time(m, s) for m, s in enumerate(sets)]
        fair = [model.job_fairness(m, s) for m, s in enumerate(sets)]
        current = sum(wt * t + wf * f for t, f in zip(times, fair))
        best_sets, best = [s.copy() for s in sets], current
        job_times = model.times
        n_samples = job_times.shape[1]
        history = problem.history

        def propose_replace(m: int) -> tuple[int, int, float, float] | None:
            s = sets[m]
            for _ in range(8):  # rejection-sample a free eligible device
                k_in = int(elig_idx[m][rng.integers(len(elig_idx[m]))])
                if owner[k_in] == -1:
                    break
            else:
                return None
            pos = int(rng.integers(len(s)))
            k_out = int(s[pos])
            trial = s.copy()
            trial[pos] = k_in
            t_new = float(job_times[m][:, trial].max(axis=1).sum()) / n_samples
            delta = wt * (t_new - times[m]) + wf * 2.0 * (history[m, k_in] - history[m, k_out]) / K
            return pos, k_in, t_new, delta

        steps = self.steps or int(np.clip(1000 // max(M, 1), 50, 200))
        temperature = self.temperature
        if temperature is None:
            probes = [p[3] for p in (propose_replace(int(rng.integers(M))) for _ in range(16)) if p]
            worse = [d for d in probes if d > 0]
            mean_worse = float(np.mean(worse)) if worse else max(abs(current), 1e-9) * 1e-3
            temperature = mean_worse / -np.log(self.accept0)
            cooling = self.final_ratio ** (1.0 / max(steps * M, 1))
        else:
            cooling = 1.0
        self.stats.initial_temperature = temperature
        for _ in range(steps):
            for m in range(M):  # every candidate (one per job) is perturbed once per step
                self.stats.steps += 1
                if M > 1 and rng.random() < self.swap_prob:
                    current = self._swap(problem, model, sets, owner, times, fair, current, temperature, m)
                else:
                    move = propose_replace(m)
                    if move is not None:
                        pos, k_in, t_new, delta = move
                        if self._accept(delta, temperature):
                            k_out = int(sets[m][pos])
                            sets[m][pos] = k_in
                            owner[k_out], owner[k_in] = -1, m
                            fair[m] += 2.0 * (history[m, k_in] - history[m, k_out]) / K
                            times[m] = t_new
                            current += delta
                if current < best - 1e-12:
                    best, best_sets = current, [s.copy() for s in sets]
                temperature *= cooling
        return best_sets, model.cost(best_sets)

    def _accept(self, delta: float, temperature: float) -> bool:
        u = float(self.rng.random())
        ok = metropolis_accept(delta, temperature, u)
        if delta > 0:
            self.stats.proposed_worse += 1
            self.stats.accepted_worse += int(ok)
        elif ok:
            self.stats.accepted_better += 1
        return ok

    def _swap(self, problem: Problem, model: CostModel, sets: list[np.ndarray], owner: np.ndarray,
              times: list[float], fair: list[float], current: float, temperature: float, m: int) -> float:
        """Exchange one device of job m with one device of another job, if both stay eligible."""
        rng, K = self.rng, problem.num_devices
        other = int(rng.integers(problem.num_jobs - 1))
        other += other >= m
        i, j = int(rng.integers(len(sets[m]))), int(rng.integers(len(sets[other])))
        a, b = int(sets[m][i]), int(sets[other][j])
        eligible = problem.eligible
        if not (eligible[m, b] and eligible[other, a]):
            return current
        h = problem.history
        sm, so = sets[m].copy(), sets[other].copy()
        sm[i], so[j] = b, a
        tm, to = model.job_time(m, sm), model.job_time(other, so)
        dfm, dfo = 2.0 * (h[m, b] - h[m, a]) / K, 2.0 * (h[other, a] - h[other, b]) / K
        wt, wf = problem.weight_time, problem.weight_fairness
        delta = wt * (tm - times[m] + to - times[other]) + wf * (dfm + dfo)
        if self._accept(delta, temperature):
            sets[m], sets[other] = sm, so
            owner[b], owner[a] = m, other
            times[m], times[other] = tm, to
            fair[m] += dfm
            fair[other] += dfo
            current += delta
        return current
