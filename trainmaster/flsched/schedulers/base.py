"""The one scheduler interface, the name registry, and the feasibility fallback all share.

A scheduler gets one round's ``Problem`` (which devices are idle, which jobs start a round now,
each job's participation history) and returns, per job, the device indices to train it.
Schedulers that score candidates optimise the exact cost (``ExactCost``, built from the problem
when none is passed; passing one lets a caller reuse it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from trainmaster.errors import UserError
from trainmaster.flsched.cost import Assignment, ExactCost, RoundCost
from trainmaster.flsched.fleet import Fleet, FleetState, subproblem
from trainmaster.flsched.model import Problem, check_feasible


class Scheduler(ABC):
    """Chooses devices for every job of one round. Instances own their random stream (``seed``)."""

    name: str = ""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)

    @abstractmethod
    def schedule(self, problem: Problem, cost: RoundCost | None = None) -> Assignment:
        """Devices per job (problem order) for this round; must satisfy every constraint."""

    def schedule_fleet(self, fleet: Fleet, state: FleetState, jobs: list[int]) -> list[np.ndarray]:
        """Devices (fleet indices) for each of ``jobs`` this round, among the free devices.

        This default builds the dense problem over every free device holding a waiting job's
        data and calls ``schedule``: right for pools of thousands. Schedulers meant for large
        fleets (``sa``, ``greedy``, ``random``) override it. Raises ``ProblemError`` when the
        round cannot be scheduled now."""
        free = state.free()
        candidates = [fleet.members[m][free[fleet.members[m]]] for m in jobs]
        return self.schedule_candidates(fleet, state, jobs, candidates)

    def schedule_candidates(
        self, fleet: Fleet, state: FleetState, jobs: list[int], candidates: list[np.ndarray]
    ) -> list[np.ndarray]:
        """``schedule`` on the dense problem over these candidate devices per job."""
        problem, union = subproblem(fleet, state, jobs, candidates)
        check_feasible(problem)
        return [union[np.asarray(s, dtype=int)] for s in self.schedule(problem)]

    def cost_model(self, problem: Problem, cost: RoundCost | None) -> RoundCost:
        """The cost to optimise: the caller's, else the exact one."""
        return cost if cost is not None else ExactCost(problem)


_REGISTRY: dict[str, Callable[..., Scheduler]] = {}


def register(name: str) -> Callable[[type[Scheduler]], type[Scheduler]]:
    """Class decorator: make a scheduler available by name (CLI ``--scheduler``, simulator)."""

    def wrap(cls: type[Scheduler]) -> type[Scheduler]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def names() -> list[str]:
    return sorted(_REGISTRY)


def make_scheduler(name: str, seed: int | None = None, **options: Any) -> Scheduler:
    """A fresh scheduler by registered name; unknown names are the user's mistake."""
    if name not in _REGISTRY:
        raise UserError(f"unknown scheduler {name!r}", [f"choose one of: {', '.join(names())}"])
    return _REGISTRY[name](seed=seed, **options)


def fill_in_order(problem: Problem, job_order: list[int], device_rank: Callable[[int], np.ndarray]) -> Assignment:
    """Give each job (in ``job_order``) its per_round best-ranked free eligible devices.

    ``device_rank(m)`` returns device indices best-first. When an early job takes devices a
    later job cannot do without, fall back to an exact min-rank assignment, so a schedule that
    exists is always found.
    """
    eligible = problem.eligible
    free = np.ones(problem.num_devices, dtype=bool)
    out: list[np.ndarray | None] = [None] * problem.num_jobs
    ranks: dict[int, np.ndarray] = {}
    for m in job_order:
        ranks[m] = order = device_rank(m)
        order = order[eligible[m, order] & free[order]]
        n = int(problem.per_round[m])
        if len(order) < n:
            return assign_by_rank(problem, ranks, device_rank)
        out[m] = np.sort(order[:n])
        free[out[m]] = False
    return [np.asarray(s, dtype=int) for s in out]


def assign_by_rank(
    problem: Problem, ranks: dict[int, np.ndarray], device_rank: Callable[[int], np.ndarray]
) -> Assignment:
    """Feasible assignment minimising the summed rank positions (Hungarian over job slots)."""
    from scipy.optimize import linear_sum_assignment

    M, K = problem.num_jobs, problem.num_devices
    eligible = problem.eligible
    rows, owners = [], []
    for m in range(M):
        order = ranks.get(m)
        if order is None:
            order = device_rank(m)
        position = np.empty(K)
        position[order] = np.arange(K)
        row = np.where(eligible[m], position, 1e9)
        for _ in range(int(problem.per_round[m])):
            rows.append(row)
            owners.append(m)
    r, c = linear_sum_assignment(np.array(rows))
    out: list[list[int]] = [[] for _ in range(M)]
    for slot, k in zip(r, c):
        out[owners[slot]].append(int(k))
    return [np.sort(np.array(s, dtype=int)) for s in out]


def metropolis_accept(delta: float, temperature: float, u: float) -> bool:
    """Simulated annealing's acceptance: always when not worse, else when u < exp(-delta/T)."""
    if delta <= 0.0:
        return True
    if temperature <= 0.0:
        return False
    return u < np.exp(-delta / temperature)
