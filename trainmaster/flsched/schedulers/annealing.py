"""Simulated annealing over the greedy candidate list (the disclosure's algorithm) on the exact cost.

The spec's steps, as they appear below:

1. **Greedy start** (``greedy_assignment``): per job, devices sorted by estimated time plus
   fluctuation, the job's per_round first: one candidate schedule per job. A second start of
   ours, the *pace* schedule (``pace_assignment``), is taken instead when it is cheaper.
2. **Perturbation** (``_Chain._propose_replace``): replace one device of a job's candidate,
   picked at random, by a random device that keeps the constraints (idle, unused by any job
   this round, eligible for the job). Ours besides: a swap of two devices between jobs.
3. **Acceptance** (``metropolis_accept``): better is taken; worse when u < exp(-delta / T).
4. **Cooling**: T falls geometrically from a temperature at which an average worsening move is
   taken with probability ``accept0`` to ``final_ratio`` of it, over the whole move budget.
5. **Best schedule** seen is returned, after a final best-improvement local search (ours).

Every move is priced on the exact objective (``ExactCost``: E[max] of the job's shifted
exponentials by quadrature), *incrementally*: a replacement re-prices only its job, a swap only
its two jobs, each from the job's cached shift/scale arrays (O(per_round x nodes)); the
fairness change is O(1) (``cost.py``). Nothing is estimated from samples, so a schedule that
looks better to the annealer is better.

Scaling. The move budget grows with devices x jobs (``MOVES_PER_SLOT``), the cooling schedule
stretches over it, and ``time_limit`` cuts it short (then the result depends on the machine's
speed; without it the result depends only on the seed). On large pools most random arrivals
are hopeless (a device slower than the job's whole round cannot shorten it unless it is much
less served), so 90% of arrivals are drawn from the job's *useful* devices: those for which the
lower bound w_t (E[T_k] - E[round]) + w_f 2 (h_k - max h in the set) / K on the move's cost
change is negative. The other 10% are drawn from all eligible devices, the spec's move as is.

The pace start exists because the round time is a maximum: a schedule is only as fast as its
slowest device, so devices of similar speed belong together, and the fairness term prefers the
least-served devices. For each candidate "pace" device (in order of expected time) it takes the
n - 1 least-served devices that are not slower, and keeps the cheapest such set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from trainmaster.flsched.cost import Assignment, ExactCost, RoundCost
from trainmaster.flsched.fleet import SHORTLIST_FACTOR, Fleet, FleetState, candidate_count, quick_feasible, subproblem
from trainmaster.flsched.model import Problem, ProblemError, check_feasible
from trainmaster.flsched import pricing
from trainmaster.flsched.pricing import expected_max, expected_max_many
from trainmaster.flsched.schedulers.base import Scheduler, metropolis_accept, register
from trainmaster.flsched.schedulers.baselines import greedy_assignment, greedy_order

PACE_GRID = 64
"""At most this many pace candidates per job (all of them on pools up to this size)."""
MOVES_PER_SLOT = 1.2
"""Default move budget: this many moves per (device, job) pair, within [MIN_MOVES, MAX_MOVES]."""
MIN_MOVES, MAX_MOVES = 300, 60_000
EXPLORE = 0.1
"""Share of arrivals drawn from all eligible devices (the spec's move) rather than useful ones."""
LOCAL_SEARCH_CANDIDATES = 48
"""Local search prices at most this many arrivals per position (those with the lowest bound)."""
LARGE_SET_CANDIDATES = 4
"""The same for jobs of more than SUBSET_MAX devices, priced one by one (quadrature)."""
PACE_GRID_LARGE = 16
"""Pace candidates per job for jobs of more than SUBSET_MAX devices."""
FLEET_CPU_BUDGET = 0.02
"""CPU seconds per decision on a fleet when neither ``time_limit`` nor ``cpu_limit`` is set."""


class Budget:
    """A decision's time budget: wall seconds (``time_limit``) and/or CPU seconds of this
    process (``cpu_limit``), from now; ``over()`` once either is spent."""

    def __init__(self, wall: float | None = None, cpu: float | None = None) -> None:
        self.wall = None if wall is None else time.perf_counter() + float(wall)
        self.cpu = None if cpu is None else time.process_time() + float(cpu)

    def over(self) -> bool:
        return (self.wall is not None and time.perf_counter() > self.wall) or (
            self.cpu is not None and time.process_time() > self.cpu
        )


@dataclass
class AnnealingStats:
    """What the last ``schedule`` call did (for tests and tuning)."""

    steps: int = 0
    proposed_worse: int = 0
    accepted_worse: int = 0
    accepted_better: int = 0
    initial_temperature: float = 0.0
    initial_cost: float = 0.0
    annealed_cost: float = 0.0
    best_cost: float = 0.0
    local_search_moves: int = 0
    stopped_by_time_limit: bool = False


def pace_assignment(model: ExactCost, grid: int = PACE_GRID) -> Assignment | None:
    """Jobs (least slack first) each take their cheapest "pace" set: a device d and the n - 1
    least-served free devices expected no slower than d (speed breaks ties). None when an early
    job leaves a later one short (the caller then starts from greedy alone)."""
    problem = model.problem
    K = problem.num_devices
    wt, wf = problem.weight_time, problem.weight_fairness
    free = np.ones(K, dtype=bool)
    out: list[np.ndarray] = [np.zeros(0, dtype=int)] * problem.num_jobs
    eligible = problem.eligible
    mean_time = problem.expected_time()
    for m in greedy_order(problem):
        n = int(problem.per_round[m])
        cand = np.flatnonzero(eligible[m] & free)
        if len(cand) < n:
            return None
        order = cand[np.argsort(mean_time[m, cand], kind="stable")]
        h = problem.history[m, order]
        key = h + np.arange(len(order)) / (len(order) * 1e3)  # least served first, then faster
        picks = []
        points = grid if n <= pricing.SUBSET_MAX else min(grid, PACE_GRID_LARGE)
        for j in np.unique(np.linspace(n - 1, len(order) - 1, points).astype(int)):
            if n > 1 and j > n - 1:
                picks.append(np.append(order[np.argpartition(key[:j], n - 2)[: n - 1]], order[j]))
            else:
                picks.append(order[j - n + 1 : j + 1])
        rows = np.array(picks)
        times = _price_rows(model.shift[m, rows], model.scale[m, rows])
        costs = wt * times + wf * 2.0 * problem.history[m, rows].sum(axis=1) / K
        best = rows[int(np.argmin(costs))]
        out[m] = np.sort(best)
        free[best] = False
    return out


@register("sa")
class AnnealingScheduler(Scheduler):
    """Simulated annealing on the exact cost.

    ``moves``: total move budget (None = MOVES_PER_SLOT x devices x jobs, clipped); ``chains``:
    independent restarts from the best start, the best chain wins; ``time_limit`` (seconds):
    stop annealing when reached (the local search then gets what is left, if anything);
    ``cpu_limit`` (seconds of this process's CPU time) the same on the CPU clock;
    ``temperature`` fixes T (no cooling) for experiments; ``pace=False`` starts from the
    disclosure's greedy candidates only; ``local_search=False`` returns the annealed schedule.

    It always optimises the exact cost: an ``ExactCost`` passed in is reused, any other cost
    (a ``SampledCost``) is not what this scheduler optimises and is ignored."""

    def __init__(
        self,
        seed: int | None = None,
        moves: int | None = None,
        chains: int = 1,
        accept0: float = 0.5,
        final_ratio: float = 1e-3,
        swap_prob: float = 0.2,
        temperature: float | None = None,
        pace: bool = True,
        local_search: bool = True,
        time_limit: float | None = None,
        cpu_limit: float | None = None,
    ) -> None:
        super().__init__(seed)
        self.moves, self.chains, self.accept0 = moves, chains, accept0
        self.final_ratio, self.swap_prob, self.temperature = final_ratio, swap_prob, temperature
        self.pace, self.local_search, self.time_limit = pace, local_search, time_limit
        self.cpu_limit = cpu_limit
        self.stats = AnnealingStats()

    def move_budget(self, problem: Problem) -> int:
        """The default budget grows with the number of (device, job) pairs."""
        if self.moves is not None:
            return int(self.moves)
        slots = int(problem.eligible.sum())
        return int(np.clip(MOVES_PER_SLOT * slots, MIN_MOVES, MAX_MOVES))

    def schedule(self, problem: Problem, cost: RoundCost | None = None) -> Assignment:
        budget = None if self.time_limit is None and self.cpu_limit is None else Budget(self.time_limit, self.cpu_limit)
        return self._decide(problem, cost, budget)

    def schedule_fleet(self, fleet: Fleet, state: FleetState, jobs: list[int]) -> list[np.ndarray]:
        """One decision on a large fleet within a time budget (``time_limit``/``cpu_limit``,
        else FLEET_CPU_BUDGET of CPU): each job's candidates are its free devices of lowest
        key (``fleet.Shortlist``: incremental, exact top keys), the annealer runs on the dense
        problem over their union (fairness weight rescaled so that every move costs what it
        costs on the fleet), and the result maps back to fleet indices. A candidate set too
        tight for all jobs at once is doubled, and at last every free device is offered."""
        budget = Budget(
            self.time_limit, self.cpu_limit if self.cpu_limit is not None or self.time_limit else FLEET_CPU_BUDGET
        )
        free = state.free()
        factor = SHORTLIST_FACTOR
        for _ in range(3):
            candidates = [state.shortlist(m).best(candidate_count(int(fleet.per_round[m]), factor), free) for m in jobs]
            problem, union = subproblem(fleet, state, jobs, candidates)
            if not quick_feasible(fleet, jobs, candidates):
                try:
                    check_feasible(problem)
                except ProblemError:
                    factor *= 2
                    continue
            decided = self._decide(problem, None, budget, pace_grid=PACE_GRID_LARGE)
            return [union[np.asarray(s, dtype=int)] for s in decided]
        return super().schedule_fleet(fleet, state, jobs)

    def _decide(
        self, problem: Problem, cost: RoundCost | None, deadline: Budget | None, pace_grid: int = PACE_GRID
    ) -> Assignment:
        model = cost if isinstance(cost, ExactCost) else ExactCost(problem)
        tables = _Tables.build(model)
        initial = greedy_assignment(problem)
        initial_cost = model.cost(initial)
        self.stats = AnnealingStats(initial_cost=initial_cost)
        if self.pace and not (deadline is not None and deadline.over()):
            paced = pace_assignment(model, pace_grid)
            if paced is not None and (paced_cost := model.cost(paced)) < initial_cost:
                initial, initial_cost = paced, paced_cost
        best, best_cost = initial, initial_cost
        budget = self.move_budget(problem)
        for _ in range(max(1, self.chains)):
            chain = _Chain(self, tables, initial)
            cand, cand_cost = chain.anneal(budget, deadline)
            if cand_cost < best_cost:
                best, best_cost = cand, cand_cost
        self.stats.annealed_cost = best_cost
        if self.local_search:
            chain = _Chain(self, tables, best)
            chain.descend(deadline)
            best, best_cost = chain.sets, chain.current
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


@dataclass
class _Tables:
    """What every chain of one decision reads and none changes (built once per decision):
    eligibility, mean times, per job its eligible devices, and the closed form's per-device
    terms as Python lists for scalar access (1/s_k, c_k/s_k, c_k). Per-job subset sums are
    kept only for jobs whose eligible devices all have a positive scale and moderate c/s."""

    model: ExactCost
    eligible: np.ndarray
    mean: np.ndarray
    elig_idx: list[np.ndarray]
    inv_l: list[list[float]]
    ratio_l: list[list[float]]
    shift_l: list[list[float]]
    closed_ok: list[bool]

    @classmethod
    def build(cls, model: ExactCost) -> _Tables:
        problem = model.problem
        eligible = problem.eligible
        elig_idx = [np.flatnonzero(eligible[m]) for m in range(problem.num_jobs)]
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(model.scale > 0.0, 1.0 / model.scale, np.inf)
            ratio = model.shift * inv
        closed_ok = [
            int(problem.per_round[m]) <= pricing.SUBSET_MAX
            and bool(np.all(np.isfinite(inv[m, idx])))
            and float(np.abs(ratio[m, idx]).max(initial=0.0)) < 1e6
            for m, idx in enumerate(elig_idx)
        ]

        def rows(a: np.ndarray) -> list[list[float]]:  # Python lists only where the closed form reads them
            return [a[m].tolist() if ok else [] for m, ok in enumerate(closed_ok)]

        return cls(
            model, eligible, problem.expected_time(), elig_idx, rows(inv), rows(ratio), rows(model.shift), closed_ok
        )


class _Chain:
    """One annealing chain with incremental state: per job its devices, their shift and scale
    (the exact cost's parameters), its priced round time, and its useful arrivals."""

    def __init__(self, owner: AnnealingScheduler, tables: _Tables, initial: Assignment) -> None:
        model = tables.model
        problem = model.problem
        self.sa, self.model = owner, model
        self.M, self.K = problem.num_jobs, problem.num_devices
        self.wt, self.wf = problem.weight_time, problem.weight_fairness
        self.history = problem.history
        self.eligible, self.mean, self.elig_idx = tables.eligible, tables.mean, tables.elig_idx
        self.inv_l, self.ratio_l, self.shift_l = tables.inv_l, tables.ratio_l, tables.shift_l
        self.sets = [np.array(s, dtype=int) for s in initial]
        self.owner = np.full(self.K, -1)
        for m, s in enumerate(self.sets):
            self.owner[s] = m
        self.times = [model.job_time(m, s) for m, s in enumerate(self.sets)]
        self.useful: list[np.ndarray | None] = [None] * self.M
        self.current = float(
            sum(self.wt * t + self.wf * model.job_fairness(m, s) for m, (t, s) in enumerate(zip(self.times, self.sets)))
        )
        self.closed = [tables.closed_ok[m] and 0 < len(s) <= pricing.SUBSET_MAX for m, s in enumerate(self.sets)]
        self.r_sub: list[np.ndarray] = [np.zeros(0)] * self.M
        self.p_sub: list[np.ndarray] = [np.zeros(0)] * self.M
        self.top_without: list[list[float]] = [[] for _ in range(self.M)]  # per position: max shift of the others
        self.floors: list[list[float] | None] = [None] * self.M  # per position: max mean time of the others
        self.cols: list[list[np.ndarray]] = [[] for _ in range(self.M)]
        self.sign: list[np.ndarray] = [np.zeros(0)] * self.M
        for m in range(self.M):
            if self.closed[m]:
                member, self.sign[m] = pricing._subsets(len(self.sets[m]))
                self.cols[m] = [np.ascontiguousarray(member[:, p]) for p in range(member.shape[1])]
                self._refresh(m)

    def _refresh(self, m: int) -> None:
        """Recompute job m's subset sums from its current devices (after any change of its set)."""
        self.floors[m] = None
        if self.closed[m]:
            member, _ = pricing._subsets(len(self.sets[m]))
            s = self.sets[m]
            self.r_sub[m] = np.asarray([self.inv_l[m][k] for k in s]) @ member.T
            self.p_sub[m] = np.asarray([self.ratio_l[m][k] for k in s]) @ member.T
            shifts = [self.shift_l[m][k] for k in s.tolist()]
            self.top_without[m] = [max(shifts[:i] + shifts[i + 1 :], default=-np.inf) for i in range(len(shifts))]

    # ---------------------------------------------------------------- incremental pricing
    def _time_after(self, m: int, pos: int, k_in: int) -> float:
        """Job m's exact expected round time with the device at ``pos`` replaced by k_in."""
        if self.closed[m]:  # the closed form, from the job's subset sums: a few numpy calls
            s = self.sets[m]
            k_out = int(s[pos])
            col = self.cols[m][pos]
            r = self.r_sub[m] + (self.inv_l[m][k_in] - self.inv_l[m][k_out]) * col
            p = self.p_sub[m] + (self.ratio_l[m][k_in] - self.ratio_l[m][k_out]) * col
            top = max(self.shift_l[m][k_in], self.top_without[m][pos])
            return top + float((np.exp(p - top * r) / r) @ self.sign[m])
        s = self.sets[m].copy()
        s[pos] = k_in
        return expected_max(self.model.shift[m, s], self.model.scale[m, s])

    def _fair_delta(self, m: int, k_out: int, k_in: int) -> float:
        return self.wf * 2.0 * (self.history[m, k_in] - self.history[m, k_out]) / self.K

    def _useful(self, m: int) -> np.ndarray:
        """Eligible devices whose arrival might lower job m's cost (see the module docstring)."""
        useful = self.useful[m]
        if useful is None:
            idx = self.elig_idx[m]
            h_max = self.history[m, self.sets[m]].max()
            bound = (
                self.wt * (self.mean[m, idx] - self.times[m]) + self.wf * 2.0 * (self.history[m, idx] - h_max) / self.K
            )
            useful = self.useful[m] = idx[bound < 0.0]
        return useful

    def _apply_replace(self, m: int, pos: int, k_in: int, t_new: float, delta: float) -> None:
        k_out = int(self.sets[m][pos])
        self.sets[m][pos] = k_in
        self.owner[k_out], self.owner[k_in] = -1, m
        self.times[m] = t_new
        self.current += delta
        self.useful[m] = None
        self._refresh(m)

    # ---------------------------------------------------------------- annealing
    def _hopeless(self, lower_bound: float, temperature: float | None, u: float) -> bool:
        """True when Metropolis would reject a move whatever its exact delta: delta >= the
        lower bound > 0, so u >= exp(-bound / T) >= exp(-delta / T). Such moves are rejected
        without pricing; the chain takes exactly the steps it would have taken."""
        bound = lower_bound - 1e-9 * max(abs(self.current), 1.0)  # rounding of the exact price
        if temperature is None or bound <= 0.0:
            return False
        if temperature > 0.0 and u < np.exp(-bound / temperature):
            return False
        self.sa.stats.proposed_worse += 1
        return True

    def _floor_of(self, m: int) -> list[float]:
        if self.floors[m] is None:
            self.floors[m] = self._floor(m).tolist()
        return self.floors[m]  # type: ignore[return-value]

    def _propose_replace(
        self, m: int, d: np.ndarray, r_dev: np.ndarray, temperature: float | None = None
    ) -> tuple[int, int, float, float] | None:
        """Step 2 (perturbation): a random position of job m, a random free eligible arrival.
        With ``temperature``, a move Metropolis would surely reject (``_hopeless``) is None."""
        idx = self.elig_idx[m] if d[5] < EXPLORE else self._useful(m)
        if len(idx) == 0:
            idx = self.elig_idx[m]
        for r in r_dev:  # rejection-sample a free device
            k_in = int(idx[int(r * len(idx))])
            if self.owner[k_in] == -1:
                break
        else:
            return None
        pos = int(d[1] * len(self.sets[m]))
        k_out = int(self.sets[m][pos])
        if temperature is not None:
            bound = self.wt * (max(self._floor_of(m)[pos], self.mean[m, k_in]) - self.times[m]) + self._fair_delta(
                m, k_out, k_in
            )
            if self._hopeless(bound, temperature, d[4]):
                return None
        t_new = self._time_after(m, pos, k_in)
        delta = self.wt * (t_new - self.times[m]) + self._fair_delta(m, k_out, k_in)
        return pos, k_in, t_new, delta

    def _swap(self, m: int, d: np.ndarray, temperature: float) -> None:
        """Exchange one device of job m with one device of another job, if both stay eligible."""
        other = int(d[2] * (self.M - 1))
        other += other >= m
        sm, so = self.sets[m], self.sets[other]
        i, j = int(d[1] * len(sm)), int(d[3] * len(so))
        a, b = int(sm[i]), int(so[j])
        if not (self.eligible[m, b] and self.eligible[other, a]):
            return
        bound = (
            self.wt
            * (
                max(self._floor_of(m)[i], self.mean[m, b])
                - self.times[m]
                + max(self._floor_of(other)[j], self.mean[other, a])
                - self.times[other]
            )
            + self._fair_delta(m, a, b)
            + self._fair_delta(other, b, a)
        )
        if self._hopeless(bound, temperature, d[4]):
            return
        tm, to = self._time_after(m, i, b), self._time_after(other, j, a)
        delta = (
            self.wt * (tm - self.times[m] + to - self.times[other])
            + self._fair_delta(m, a, b)
            + self._fair_delta(other, b, a)
        )
        if self.sa.accept(delta, temperature, d[4]):
            sm[i], so[j] = b, a
            self.owner[b], self.owner[a] = m, other
            self.times[m], self.times[other] = tm, to
            self.useful[m] = self.useful[other] = None
            self._refresh(m)
            self._refresh(other)
            self.current += delta

    def anneal(self, budget: int, deadline: Budget | None) -> tuple[Assignment, float]:
        """Steps 2-5: ``budget`` moves, jobs in turn (every candidate perturbed once per sweep)."""
        sa, M = self.sa, self.M
        rng = sa.rng
        draws = rng.random((budget + 16, 6))  # move type, position, other job, other position, u, explore
        dev_draws = rng.random((budget + 16, 8))  # rejection sampling of the arriving device
        best, best_sets = self.current, [s.copy() for s in self.sets]
        temperature = sa.temperature
        if temperature is None:
            probes = [
                self._propose_replace(int(draws[i, 2] * M), draws[budget + i], dev_draws[budget + i]) for i in range(16)
            ]
            worse = [p[3] for p in probes if p is not None and p[3] > 0]
            mean_worse = float(np.mean(worse)) if worse else max(abs(self.current), 1e-9) * 1e-3
            temperature = mean_worse / -np.log(sa.accept0)
            cooling = sa.final_ratio ** (1.0 / max(budget, 1))
        else:
            cooling = 1.0
        sa.stats.initial_temperature = max(sa.stats.initial_temperature, temperature)
        for i in range(budget):
            if deadline is not None and i % 8 == 0 and deadline.over():
                sa.stats.stopped_by_time_limit = True
                break
            m = i % M
            sa.stats.steps += 1
            d = draws[i]
            if M > 1 and d[0] < sa.swap_prob:
                self._swap(m, d, temperature)
            else:
                move = self._propose_replace(m, d, dev_draws[i], temperature)
                if move is not None and sa.accept(move[3], temperature, d[4]):
                    self._apply_replace(m, *move)
            if self.current < best - 1e-12:
                best, best_sets = self.current, [s.copy() for s in self.sets]
            temperature *= cooling
        return best_sets, self.model.cost(best_sets)

    # ---------------------------------------------------------------- final local search
    def descend(self, deadline: Budget | None, max_passes: int = 20) -> None:
        """Step 5 (ours): best-improvement moves until none lowers the cost. Per job, every
        (position, free arrival with a negative lower bound) pair, at most
        LOCAL_SEARCH_CANDIDATES arrivals per position, is priced in one vectorised batch and the
        best is made; then the same for exchanges between every pair of jobs. One batch per job
        (not per position) because a call's numpy overhead, not its arithmetic, is the cost."""
        for _ in range(max_passes):
            improved = False
            for m in range(self.M):
                if deadline is not None and deadline.over():
                    return
                if self._descend_replace(m, deadline):
                    improved = True
            if self.M > 1 and self._descend_swaps(deadline):
                improved = True
            if not improved:
                return

    def _descend_replace(self, m: int, deadline: Budget | None = None) -> bool:
        """The best single replacement in job m, if it lowers the cost; True if made."""
        s = self.sets[m]
        idx = self.elig_idx[m]
        free = idx[self.owner[idx] == -1]
        n = len(s)
        if len(free) == 0 or n == 0:
            return False
        keep = ~np.eye(n, dtype=bool)  # row p: every position but p
        rest = np.broadcast_to(s, (n, n))[keep].reshape(n, n - 1)
        floor = self.mean[m, rest].max(axis=1) if n > 1 else np.zeros(1)
        bound = (
            self.wt * (np.maximum(self.mean[m, free][None, :], floor[:, None]) - self.times[m])
            + self.wf * 2.0 * (self.history[m, free][None, :] - self.history[m, s][:, None]) / self.K
        )
        pos, col = np.nonzero(bound < 0.0)
        if len(pos) == 0:
            return False
        per_position = LOCAL_SEARCH_CANDIDATES if n <= pricing.SUBSET_MAX else LARGE_SET_CANDIDATES
        if len(pos) > per_position * n:  # per position, the arrivals with the lowest bound
            rank = np.argsort(np.where(bound < 0.0, bound, np.inf), axis=1, kind="stable")[:, :per_position]
            pos = np.repeat(np.arange(n), rank.shape[1])
            col = rank.ravel()
            ok = bound[pos, col] < 0.0
            pos, col = pos[ok], col[ok]
        cand = free[col]
        rows = np.empty((len(cand), n), dtype=int)
        rows[:, :-1] = rest[pos]
        rows[:, -1] = cand
        t_new = _price_rows(self.model.shift[m, rows], self.model.scale[m, rows])
        delta = (
            self.wt * (t_new - self.times[m])
            + self.wf * 2.0 * (self.history[m, cand] - self.history[m, s[pos]]) / self.K
        )
        j = int(np.argmin(delta))
        if delta[j] >= -1e-12 * max(abs(self.current), 1.0):
            return False
        self._apply_replace(m, int(pos[j]), int(cand[j]), float(t_new[j]), float(delta[j]))
        self.sa.stats.local_search_moves += 1
        return True

    def _floor(self, m: int) -> np.ndarray:
        """Per position of job m: the largest mean time among the job's other devices (0 alone)."""
        vals = self.mean[m, self.sets[m]]
        out = np.full(len(vals), float(vals.max()))
        top = int(np.argmax(vals))
        out[top] = float(np.delete(vals, top).max()) if len(vals) > 1 else 0.0
        return out

    def _descend_swaps(self, deadline: Budget | None = None) -> bool:
        """Best-improvement exchanges of one device between two jobs: per pair of jobs every
        exchange that keeps both eligible is priced in one batch per side, and the best made;
        True if any was made."""
        model, improved, h = self.model, False, self.history
        for m in range(self.M):
            for o in range(m + 1, self.M):
                sm, so = self.sets[m], self.sets[o]
                ok = self.eligible[m][so][None, :] & self.eligible[o][sm][:, None]  # (i in m, j in o)
                ii, jj = np.nonzero(ok)
                if len(ii) == 0:
                    continue
                a, b = sm[ii], so[jj]
                # E[max] >= the largest member's mean: exchanges whose lower bound on the cost
                # change is not negative cannot improve and are not priced
                bound = (
                    self.wt
                    * (
                        np.maximum(self._floor(m)[ii], self.mean[m, b])
                        - self.times[m]
                        + np.maximum(self._floor(o)[jj], self.mean[o, a])
                        - self.times[o]
                    )
                    + self.wf * 2.0 * (h[m, b] - h[m, a] + h[o, a] - h[o, b]) / self.K
                )
                hopeful = bound < 0.0
                if not hopeful.any():
                    continue
                ii, jj, a, b = ii[hopeful], jj[hopeful], a[hopeful], b[hopeful]
                if max(len(sm), len(so)) > pricing.SUBSET_MAX and len(ii) > LARGE_SET_CANDIDATES * 16:
                    keep = np.argsort(bound[hopeful], kind="stable")[: LARGE_SET_CANDIDATES * 16]
                    ii, jj, a, b = ii[keep], jj[keep], a[keep], b[keep]
                rows_m = np.repeat(sm[None, :], len(ii), axis=0)
                rows_m[np.arange(len(ii)), ii] = b
                rows_o = np.repeat(so[None, :], len(ii), axis=0)
                rows_o[np.arange(len(ii)), jj] = a
                tm = _price_rows(model.shift[m, rows_m], model.scale[m, rows_m])
                to = _price_rows(model.shift[o, rows_o], model.scale[o, rows_o])
                delta = (
                    self.wt * (tm - self.times[m] + to - self.times[o])
                    + self.wf * 2.0 * (h[m, b] - h[m, a] + h[o, a] - h[o, b]) / self.K
                )
                best = int(np.argmin(delta))
                if delta[best] < -1e-12 * max(abs(self.current), 1.0):
                    i, j, ka, kb = int(ii[best]), int(jj[best]), int(a[best]), int(b[best])
                    sm[i], so[j] = kb, ka
                    self.owner[kb], self.owner[ka] = m, o
                    self.times[m], self.times[o] = float(tm[best]), float(to[best])
                    self.useful[m] = self.useful[o] = None
                    self._refresh(m)
                    self._refresh(o)
                    self.current += float(delta[best])
                    self.sa.stats.local_search_moves += 1
                    improved = True
                if deadline is not None and deadline.over():
                    return improved
        return improved


def _price_rows(shift: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """E[max] of each row: one vectorised pass for small sets (closed form); one call per row
    for larger ones, whose quadrature adapts its nodes to the row (a shared node set over a
    batch spans every row's scales and costs several times more per row)."""
    if shift.shape[1] <= pricing.SUBSET_MAX:
        return expected_max_many(shift, scale)
    return np.array([expected_max(c, s) for c, s in zip(shift, scale)])
