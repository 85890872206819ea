"""Exact optimum of one round's schedule, for tiny instances (tests, the benchmark's gap).

Two independent methods, so each checks the other: brute-force enumeration of every feasible
assignment, and a mixed-integer program solved by HiGHS through ``scipy.optimize.milp``.
The MILP is exact for a *sampled* cost (``SampledCost``: the mean over S drawn rows), because
the fairness term is linear in the choice (see ``cost.py``) and the maximum over a job's devices
is linearised with one variable z_ms >= T_msk x_mk per job and sample. It optimises a
sample-average approximation of the exact objective; the benchmark prices its schedule exactly
like every other scheduler's, so the MILP is a strong reference, not a proven exact optimum.
"""

from __future__ import annotations

import itertools

import numpy as np

from trainmaster.errors import UserError
from trainmaster.flsched.cost import Assignment, RoundCost, SampledCost
from trainmaster.flsched.model import Problem
from trainmaster.flsched.schedulers.base import Scheduler, register


def brute_force(model: RoundCost, limit: int = 2_000_000) -> tuple[Assignment, float]:
    """Enumerate all feasible schedules (jobs pick disjoint eligible subsets); refuse big ones."""
    problem = model.problem
    eligible = problem.eligible
    M = problem.num_jobs
    job_costs: list[dict[tuple[int, ...], float]] = [{} for _ in range(M)]
    best: tuple[Assignment, float] = ([], float("inf"))
    visited = 0

    def recurse(m: int, used: frozenset[int], chosen: list[tuple[int, ...]], partial: float) -> None:
        nonlocal best, visited
        if m == M:
            visited += 1
            if visited > limit:
                raise UserError(f"instance too large for brute force (> {limit} schedules)")
            if partial < best[1]:
                best = ([np.array(c, dtype=int) for c in chosen], partial)
            return
        cand = [int(k) for k in np.flatnonzero(eligible[m]) if k not in used]
        for combo in itertools.combinations(cand, int(problem.per_round[m])):
            c = job_costs[m].get(combo)
            if c is None:
                c = job_costs[m][combo] = model.job_cost(m, np.array(combo, dtype=int))
            recurse(m + 1, used | set(combo), chosen + [combo], partial + c)

    recurse(0, frozenset(), [], 0.0)
    return best[0], model.cost(best[0])


def milp_optimum(model: SampledCost, time_limit: float = 30.0) -> tuple[Assignment, float]:
    """Solve the round exactly as a MILP (HiGHS); returns the schedule and its model cost."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    p = model.problem
    M, K = p.num_jobs, p.num_devices
    S = model.times.shape[1]
    nx, nz = M * K, M * S
    eligible = p.eligible
    c = np.zeros(nx + nz)
    c[:nx] = (p.weight_fairness / K * (2.0 * p.history + 1.0)).ravel()
    c[nx:] = p.weight_time / S
    pairs = [(m, k) for m in range(M) for k in range(K) if eligible[m, k]]
    n_rows = M + K + len(pairs) * S
    A = lil_matrix((n_rows, nx + nz))
    lo, hi = np.zeros(n_rows), np.zeros(n_rows)
    for m in range(M):  # exactly per_round devices per job
        A[m, m * K : (m + 1) * K] = 1.0
        lo[m] = hi[m] = p.per_round[m]
    for k in range(K):  # one job per device
        for m in range(M):
            A[M + k, m * K + k] = 1.0
        lo[M + k], hi[M + k] = 0.0, 1.0
    row = M + K
    for m, k in pairs:  # z_ms >= T_msk x_mk
        for s in range(S):
            A[row, nx + m * S + s] = 1.0
            A[row, m * K + k] = -model.times[m, s, k]
            lo[row], hi[row] = 0.0, np.inf
            row += 1
    upper = np.concatenate([eligible.ravel().astype(float), np.full(nz, np.inf)])
    integrality = np.concatenate([np.ones(nx), np.zeros(nz)])
    res = milp(
        c,
        constraints=LinearConstraint(A.tocsr(), lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(nx + nz), upper),
        options={"time_limit": time_limit},
    )
    if res.x is None:
        raise UserError(f"MILP found no schedule: {res.message}")
    x = np.round(res.x[:nx]).reshape(M, K)
    assignment = [np.flatnonzero(x[m] > 0.5).astype(int) for m in range(M)]
    return assignment, model.cost(assignment)


@register("exact")
class ExactScheduler(Scheduler):
    """The MILP optimum of each round on ``n_samples`` drawn rows (slow beyond a few dozen
    devices; for reference). A ``SampledCost`` passed in is used as is."""

    def __init__(self, seed: int | None = None, n_samples: int = 64, time_limit: float = 30.0) -> None:
        super().__init__(seed)
        self.n_samples, self.time_limit = n_samples, time_limit

    def schedule(self, problem: Problem, cost: RoundCost | None = None) -> Assignment:
        sampled = cost if isinstance(cost, SampledCost) else SampledCost.draw(problem, self.rng, self.n_samples)
        return milp_optimum(sampled, self.time_limit)[0]
