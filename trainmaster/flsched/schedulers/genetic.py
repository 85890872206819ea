"""A genetic algorithm over whole-round schedules, scored by the same cost model as ``sa``.

Individuals are assignments; crossover takes each job's device set from one parent or the other
and repairs clashes (a device claimed twice goes to the first job, the second refills with
free eligible devices); mutation replaces one device. Tournament selection, elitism.
"""

from __future__ import annotations

import numpy as np

from trainmaster.flsched.cost import Assignment, RoundCost
from trainmaster.flsched.model import Problem
from trainmaster.flsched.schedulers.base import Scheduler, register
from trainmaster.flsched.schedulers.baselines import RandomScheduler, greedy_assignment


@register("genetic")
class GeneticScheduler(Scheduler):
    def __init__(
        self,
        seed: int | None = None,
        population: int = 12,
        generations: int = 10,
        mutation: float = 0.3,
        elite: int = 2,
    ) -> None:
        super().__init__(seed)
        self.population, self.generations = population, generations
        self.mutation, self.elite = mutation, elite

    def schedule(self, problem: Problem, cost: RoundCost | None = None) -> Assignment:
        model = self.cost_model(problem, cost)
        rng = self.rng
        seeder = RandomScheduler(seed=int(rng.integers(2**31)))
        pop = [greedy_assignment(problem)] + [seeder.schedule(problem) for _ in range(self.population - 1)]
        fitness = np.array([model.cost(ind) for ind in pop])
        for _ in range(self.generations):
            order = np.argsort(fitness)
            nxt = [pop[i] for i in order[: self.elite]]
            while len(nxt) < self.population:
                child = self._crossover(problem, self._pick(pop, fitness), self._pick(pop, fitness))
                if rng.random() < self.mutation:
                    child = self._mutate(problem, child)
                nxt.append(child)
            pop = nxt
            fitness = np.array([model.cost(ind) for ind in pop])
        return [np.sort(s) for s in pop[int(np.argmin(fitness))]]

    def _pick(self, pop: list[Assignment], fitness: np.ndarray, size: int = 3) -> Assignment:
        idx = self.rng.choice(len(pop), size=min(size, len(pop)), replace=False)
        return pop[int(idx[np.argmin(fitness[idx])])]

    def _crossover(self, problem: Problem, a: Assignment, b: Assignment) -> Assignment:
        eligible = problem.eligible
        taken = np.zeros(problem.num_devices, dtype=bool)
        child: list[np.ndarray] = []
        for m in range(problem.num_jobs):
            src = a[m] if self.rng.random() < 0.5 else b[m]
            keep = [int(k) for k in src if not taken[k]]
            taken[keep] = True
            child.append(np.array(keep, dtype=int))
        for m in range(problem.num_jobs):
            need = int(problem.per_round[m]) - len(child[m])
            if need > 0:
                free = np.flatnonzero(eligible[m] & ~taken)
                if len(free) < need:  # cannot repair: fall back to a parent, which is valid
                    return a
                add = self.rng.choice(free, size=need, replace=False)
                taken[add] = True
                child[m] = np.concatenate([child[m], add]).astype(int)
        return child

    def _mutate(self, problem: Problem, ind: Assignment) -> Assignment:
        m = int(self.rng.integers(problem.num_jobs))
        used = np.zeros(problem.num_devices, dtype=bool)
        for s in ind:
            used[s] = True
        free = np.flatnonzero(problem.eligible[m] & ~used)
        if len(free) == 0:
            return ind
        out = [s.copy() for s in ind]
        out[m][int(self.rng.integers(len(out[m])))] = int(self.rng.choice(free))
        return out
