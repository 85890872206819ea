"""The exact makespan optimum on small graphs: branch and bound over the simulator's order.

The heuristics are judged by the simulated makespan (simulate.py); the ILP (ilp.py) gives the
exact minimum critical cut, which is a different objective. This module gives the exact minimum
makespan within the load cap, the memory cap (where enforced) and the co-location classes, on
graphs small enough to search (tens of operators), so that every decision of ours can be checked
against what was possible (bench/partition.py --fresh, tests/partition/test_partition_exact.py).

Why branch and bound works here: when the simulator's priority order is topological (the usual
case, ``simulate.static_order``), every device runs its operators in that order, so an
operator's finish time depends only on the devices of the operators before it. Assigning devices
in that order fixes the schedule prefix by prefix, and every prefix bounds all its completions
from below: an assigned operator's start plus its compute-only bottom level (what must still run
after it starts, transfers aside), and the devices' busy time to come, (sum of the devices' free
times + the unassigned work) / k, since an operator later in the order starts on its device no
earlier than the device is free. Devices are identical, so a new device is opened only as the
next unused label. The search starts from an incumbent (e.g. ours's partition) and proves it
optimal or finds a better one; ``node_limit`` bounds the work (then ``optimal`` is False).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from trainmaster.partition.graph import Graph, clusters_of
from trainmaster.partition.simulate import load_cap, makespan, memory_cap_enforced, sim_plan

__all__ = ["ExactResult", "exhaustive_makespan", "optimal_makespan"]


@dataclass
class ExactResult:
    """The best partition found within the caps and its simulated makespan; ``optimal`` True
    when the search finished (no partition within the caps is faster), False when it stopped at
    ``node_limit``; ``nodes``: search nodes expanded. ``assignment`` is None (and ``makespan``
    inf) when no partition meets the caps."""

    assignment: np.ndarray | None
    makespan: float
    optimal: bool
    nodes: int


def optimal_makespan(
    graph: Graph,
    k: int,
    imbalance: float = 0.05,
    incumbent: np.ndarray | None = None,
    node_limit: int = 2_000_000,
) -> ExactResult:
    """The minimum simulated makespan over every partition of ``graph`` into ``k`` devices within
    the load cap (``imbalance``), the enforced memory cap and the co-location classes (module
    docstring). ``incumbent``: a partition to beat (its makespan prunes from the start; it is
    returned when nothing within the caps is faster). Raises ValueError where the simulator's
    order is not static (then only ``exhaustive_makespan`` is exact)."""
    plan = sim_plan(graph)
    if plan.order is None or plan.steps is None:
        raise ValueError("the simulator's priority order is not topological here: use exhaustive_makespan")
    n = graph.n
    cluster = clusters_of(graph)
    cap = load_cap(graph, k, imbalance, cluster) * (1 + 1e-9)
    mem_cap = memory_cap_enforced(graph, k)
    cw = np.bincount(cluster, weights=graph.cost).tolist()
    cm = np.bincount(cluster, weights=graph.memory).tolist()
    of = cluster.tolist()
    steps = plan.steps
    bottom = _compute_bottom(plan)
    # unassigned work after position i of the order, and unplaced cluster load / memory
    in_order = np.asarray([plan.cost[v] for v in plan.order], dtype=float)
    rem_work = np.concatenate([np.cumsum(in_order[::-1])[::-1], [0.0]]).tolist()
    first_at: dict[int, int] = {}
    for i, (v, _, _) in enumerate(steps):
        first_at.setdefault(of[v], i)
    unplaced_load = [0.0] * (n + 1)
    unplaced_mem = [0.0] * (n + 1)
    for c, i in first_at.items():
        unplaced_load[i] += cw[c]
        unplaced_mem[i] += cm[c]
    for i in range(n - 1, -1, -1):
        unplaced_load[i] += unplaced_load[i + 1]
        unplaced_mem[i] += unplaced_mem[i + 1]

    best_span = float("inf")
    best_part: list[int] | None = None
    if incumbent is not None:
        inc = np.asarray(incumbent, dtype=np.int64)
        if _within_caps(graph, inc, k, cap, mem_cap, cluster):
            best_span, best_part = makespan(graph, inc), inc.tolist()

    part = [-1] * n
    cpart = [-1] * len(cw)
    load = [0.0] * k
    mem = [0.0] * k
    free = [0.0] * k
    finish = [0.0] * n
    expanded = 0
    stopped = False

    def dfs(i: int, used: int, bound: float, span: float) -> None:
        nonlocal best_span, best_part, expanded, stopped
        if i == n:
            if span < best_span - 1e-12 * max(span, 1.0):
                best_span, best_part = span, list(part)
            return
        expanded += 1
        if expanded > node_limit:
            stopped = True
            return
        v, pv, wv = steps[i]
        c = of[v]
        fixed = cpart[c]
        options = [fixed] if fixed >= 0 else list(range(min(used + 1, k)))
        tries = []
        for d in options:
            if fixed < 0:
                if load[d] + cw[c] > cap or mem[d] + cm[c] > mem_cap:
                    continue
            s = free[d]
            for u, cu in pv:
                t = finish[u] + cu if part[u] != d else finish[u]
                if t > s:
                    s = t
            tries.append((s + wv, s, d))
        tries.sort()
        for f, s, d in tries:
            new_bound = max(bound, s + bottom[v])
            busy = sum(free) - free[d] + f + rem_work[i + 1]
            if max(new_bound, busy / k) >= best_span - 1e-12 * max(best_span, 1.0):
                continue
            opened = fixed < 0
            if opened:
                room = sum(cap - x for x in load) - cw[c]
                if unplaced_load[i] - cw[c] > room + 1e-12 * cap:
                    continue
                if mem_cap != float("inf"):
                    mroom = sum(mem_cap - x for x in mem) - cm[c]
                    if unplaced_mem[i] - cm[c] > mroom:
                        continue
                cpart[c] = d
                load[d] += cw[c]
                mem[d] += cm[c]
            old_free = free[d]
            part[v], finish[v], free[d] = d, f, f
            dfs(i + 1, max(used, d + 1), new_bound, max(span, f))
            part[v], free[d] = -1, old_free
            if opened:
                cpart[c] = -1
                load[d] -= cw[c]
                mem[d] -= cm[c]
            if stopped:
                return

    dfs(0, 0, 0.0, 0.0)
    assignment = None if best_part is None else np.asarray(best_part, dtype=np.int64)
    return ExactResult(assignment, best_span, not stopped, expanded)


def _compute_bottom(plan) -> list[float]:
    """Per operator, the compute-only bottom level, its own cost included (no transfers)."""
    bottom = list(plan.cost)
    for v, pv, _ in reversed(plan.steps):
        for u, _ in pv:
            t = plan.cost[u] + bottom[v]
            if t > bottom[u]:
                bottom[u] = t
    return bottom


def _within_caps(graph: Graph, a: np.ndarray, k: int, cap: float, mem_cap: float, cluster: np.ndarray) -> bool:
    if np.bincount(a, weights=graph.cost, minlength=k).max() > cap:
        return False
    if np.bincount(a, weights=graph.memory, minlength=k).max() > mem_cap:
        return False
    first = np.full(int(cluster.max()) + 1, -1, dtype=np.int64)
    first[cluster] = a
    return bool(np.all(first[cluster] == a))


def exhaustive_makespan(graph: Graph, k: int, imbalance: float = 0.05) -> ExactResult:
    """The same optimum by trying every assignment (k^n simulations: a handful of operators
    only); the reference the branch and bound is tested against, and exact for any
    simulator order."""
    cluster = clusters_of(graph)
    cap = load_cap(graph, k, imbalance, cluster) * (1 + 1e-9)
    mem_cap = memory_cap_enforced(graph, k)
    best, best_a, count = float("inf"), None, 0
    for combo in itertools.product(range(k), repeat=graph.n):
        a = np.asarray(combo, dtype=np.int64)
        if combo and combo[0] != 0:
            break  # devices are identical: the first operator on device 0 loses nothing
        if not _within_caps(graph, a, k, cap, mem_cap, cluster):
            continue
        count += 1
        span = makespan(graph, a)
        if span < best - 1e-12 * max(span, 1.0):
            best, best_a = span, a
    return ExactResult(best_a, best, True, count)
