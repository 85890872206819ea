"""Honest baselines: greedy (fastest first), random (FedAvg), round-robin (least served first),
FedCS (deadline-based) and an Oort-style utility sampler.

None of them looks at the cost function; each follows the rule its source describes, so the
benchmark compares against what those methods would really pick.
"""

from __future__ import annotations

import numpy as np

from trainmaster.flsched.cost import Assignment, RoundCost
from trainmaster.flsched.fleet import Fleet, FleetState
from trainmaster.flsched.model import Problem, ProblemError
from trainmaster.flsched.schedulers.base import Scheduler, fill_in_order, register


def greedy_order(problem: Problem) -> list[int]:
    """Jobs with the fewest eligible devices per wanted device choose first (least slack)."""
    slack = problem.eligible.sum(axis=1) / np.maximum(problem.per_round, 1)
    return [int(m) for m in np.argsort(slack, kind="stable")]


def greedy_assignment(problem: Problem) -> Assignment:
    """The disclosure's initial candidates: per job, score = estimated time + fluctuation, sort, take."""
    score = problem.expected_time() + problem.time_spread()
    return fill_in_order(problem, greedy_order(problem), lambda m: np.argsort(score[m], kind="stable"))


@register("greedy")
class GreedyScheduler(Scheduler):
    """Fastest expected devices (time + fluctuation) for every job, ignoring fairness."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._orders: dict[tuple[int, int], np.ndarray] = {}  # (fleet, job) -> devices fastest first

    def schedule(self, problem: Problem, cost: RoundCost | None = None) -> Assignment:
        return greedy_assignment(problem)

    def schedule_fleet(self, fleet: Fleet, state: FleetState, jobs: list[int]) -> list[np.ndarray]:
        """The same rule on a large fleet without a dense problem: each job's devices sorted
        once by estimated time + fluctuation, walked past busy and taken devices."""
        free = state.free()
        taken = np.zeros(fleet.num_devices, dtype=bool)
        slack = [int(free[fleet.members[m]].sum()) / int(fleet.per_round[m]) for m in jobs]
        out: dict[int, np.ndarray] = {}
        for row in np.argsort(slack, kind="stable"):
            m = jobs[int(row)]
            order = self._order(fleet, m)
            out[m] = _first_free(order, int(fleet.per_round[m]), free, taken, fleet.jobs[m].id)
            taken[out[m]] = True
        return [np.sort(out[m]) for m in jobs]

    def _order(self, fleet: Fleet, m: int) -> np.ndarray:
        key = (id(fleet), m)
        if key not in self._orders:
            score = fleet.mean[m] + fleet.scale[m]
            self._orders[key] = fleet.members[m][np.argsort(score, kind="stable")]
        return self._orders[key]


def _first_free(order: np.ndarray, n: int, free: np.ndarray, taken: np.ndarray, job: str) -> np.ndarray:
    """The first n devices of ``order`` that are free and not taken (scanned in growing chunks)."""
    got: list[np.ndarray] = []
    have, start, chunk = 0, 0, max(4 * n, 64)
    while have < n and start < len(order):
        part = order[start : start + chunk]
        part = part[free[part] & ~taken[part]]
        got.append(part[: n - have])
        have += len(got[-1])
        start += chunk
        chunk *= 2
    if have < n:
        raise ProblemError(f"job {job!r} wants {n} devices but only {have} free devices hold its data")
    return np.concatenate(got)


@register("random")
class RandomScheduler(Scheduler):
    """FedAvg's uniform sampling among idle eligible devices."""

    def schedule(self, problem: Problem, cost: RoundCost | None = None) -> Assignment:
        order = [int(m) for m in self.rng.permutation(problem.num_jobs)]
        return fill_in_order(problem, order, lambda m: self.rng.permutation(problem.num_devices))

    def schedule_fleet(self, fleet: Fleet, state: FleetState, jobs: list[int]) -> list[np.ndarray]:
        """Uniform among each job's free devices (jobs in random order), by rejection sampling:
        O(per_round) per job, not O(pool)."""
        free = state.free()
        taken = np.zeros(fleet.num_devices, dtype=bool)
        out: dict[int, np.ndarray] = {}
        for row in self.rng.permutation(len(jobs)):
            m = jobs[int(row)]
            members, n = fleet.members[m], int(fleet.per_round[m])
            chosen: list[int] = []
            for _ in range(64):  # each try draws 2n + 8 members; most are free in a large pool
                for k in members[self.rng.integers(0, len(members), 2 * n + 8)]:
                    if free[k] and not taken[k]:
                        taken[k] = True
                        chosen.append(int(k))
                        if len(chosen) == n:
                            break
                if len(chosen) == n:
                    break
            else:  # a crowded pool: draw among the free members directly
                rest = members[free[members] & ~taken[members]]
                if len(rest) < n - len(chosen):
                    raise ProblemError(
                        f"job {fleet.jobs[m].id!r} wants {n} devices but only "
                        f"{len(rest) + len(chosen)} free devices hold its data"
                    )
                extra = self.rng.choice(rest, size=n - len(chosen), replace=False)
                taken[extra] = True
                chosen.extend(int(k) for k in extra)
            out[m] = np.array(chosen, dtype=np.int64)
        return [np.sort(out[m]) for m in jobs]


@register("roundrobin")
class RoundRobinScheduler(Scheduler):
    """Least-served devices first (perfect data balance, blind to speed): the fair baseline."""

    def schedule(self, problem: Problem, cost: RoundCost | None = None) -> Assignment:
        jitter = self.rng.random(problem.history.shape)  # random tie-breaks
        key = problem.history + jitter
        return fill_in_order(problem, greedy_order(problem), lambda m: np.argsort(key[m], kind="stable"))


@register("fedcs")
class FedCSScheduler(Scheduler):
    """FedCS (Nishio & Yonetani): from a random pool of candidates, keep those whose estimated
    round time meets the deadline, fastest first; fill from the rest of the pool if short.

    ``deadline_quantile`` sets the deadline as that quantile of the eligible devices' expected
    times; ``pool_factor`` sizes the random pool relative to per_round.
    """

    def __init__(self, seed: int | None = None, deadline_quantile: float = 0.5, pool_factor: float = 3.0) -> None:
        super().__init__(seed)
        self.deadline_quantile = deadline_quantile
        self.pool_factor = pool_factor

    def schedule(self, problem: Problem, cost: RoundCost | None = None) -> Assignment:
        expected = problem.expected_time()
        eligible = problem.eligible

        def rank(m: int) -> np.ndarray:
            cand = np.flatnonzero(eligible[m])
            deadline = np.quantile(expected[m, cand], self.deadline_quantile)
            pool_size = min(len(cand), int(np.ceil(self.pool_factor * problem.per_round[m])))
            pool = self.rng.choice(cand, size=pool_size, replace=False)
            meets = pool[expected[m, pool] <= deadline]
            late = pool[expected[m, pool] > deadline]
            meets = meets[np.argsort(expected[m, meets], kind="stable")]
            late = late[np.argsort(expected[m, late], kind="stable")]
            rest = np.setdiff1d(np.arange(problem.num_devices), pool)
            rest = rest[np.argsort(expected[m, rest], kind="stable")]
            return np.concatenate([meets, late, rest]).astype(int)

        return fill_in_order(problem, greedy_order(problem), rank)


@register("oort")
class OortScheduler(Scheduler):
    """Oort-style guided sampling (Lai et al., OSDI'21) without loss feedback.

    Utility = statistical utility (the device's sample count, for lack of per-sample losses)
    x system penalty (T_pref / t)^alpha for devices slower than the preferred round duration,
    plus a staleness bonus for devices not picked for a while; an ``explore`` share of each
    round goes to never-tried devices, fastest first. Exploitation samples from the top
    utilities in proportion to utility.
    """

    def __init__(
        self, seed: int | None = None, alpha: float = 2.0, explore: float = 0.1, pace_quantile: float = 0.5
    ) -> None:
        super().__init__(seed)
        self.alpha, self.explore, self.pace_quantile = alpha, explore, pace_quantile
        self.round = 0
        self.last_round: dict[tuple[str, str], int] = {}

    def schedule(self, problem: Problem, cost: RoundCost | None = None) -> Assignment:
        self.round += 1
        expected = problem.expected_time()
        eligible = problem.eligible

        def rank(m: int) -> np.ndarray:
            job = problem.jobs[m].id
            cand = np.flatnonzero(eligible[m])
            t = expected[m, cand]
            t_pref = np.quantile(t, self.pace_quantile)
            util = problem.samples[m, cand] * np.where(t > t_pref, (t_pref / t) ** self.alpha, 1.0)
            last = np.array([self.last_round.get((job, problem.devices[k].id), 0) for k in cand])
            tried = last > 0
            stale = np.sqrt(0.1 * np.log(self.round + 1) / np.maximum(last, 1))
            util = util * (1.0 + np.where(tried, stale, 0.0))
            n = int(problem.per_round[m])
            n_explore = min(int(round(self.explore * n)), int((~tried).sum()))
            explore = cand[~tried][np.argsort(t[~tried], kind="stable")][:n_explore]
            pool = cand[tried] if tried.sum() >= n - n_explore else cand
            pool_util = util[np.isin(cand, pool)]
            top = np.argsort(-pool_util, kind="stable")[: max(2 * n, 1)]
            p = pool_util[top] / pool_util[top].sum() if pool_util[top].sum() > 0 else None
            exploit = self.rng.choice(pool[top], size=min(len(top), n), replace=False, p=p)
            exploit = exploit[~np.isin(exploit, explore)]
            rest = np.setdiff1d(np.arange(problem.num_devices), np.concatenate([explore, exploit]))
            rest = rest[np.argsort(-np.where(eligible[m, rest], problem.samples[m, rest], 0), kind="stable")]
            return np.concatenate([explore, exploit, rest]).astype(int)

        assignment = fill_in_order(problem, greedy_order(problem), rank)
        for m, chosen in enumerate(assignment):
            for k in chosen:
                self.last_round[(problem.jobs[m].id, problem.devices[int(k)].id)] = self.round
        return assignment
