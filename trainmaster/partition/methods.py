"""The partitioning methods by name: ``trainmaster`` (ours), ``patent``, ``metis``, ``kahip``, ``ilp``.

``trainmaster``: coarsen along heavy/critical chain links; build several initial partitions (the
exact acyclic split of the topological order, capped earliest-finish list scheduling that
charges cut critical edges a penalty, the same with the critical path pinned to as few devices
as the cap allows (CPOP), METIS on the critical-weighted coarse graph, plain METIS); refine the
METIS starts with k-way FM on the cost-weighted critical cut plus the total cut under the
balance and memory caps; repair starts over the caps by moving clusters out of the fullest
device, or swapping one for a smaller one where nothing fits (nearly full devices), then FM;
bin-packed starts only when no start can be repaired; keep the candidate with the lowest
simulated makespan plus a penalty on the static critical cut, never slower than METIS's own
partition; finish with a makespan descent along the schedule's critical chain that never cuts
more critical transfer cost (and, where the caps are tight, may swap a cluster back).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from trainmaster.errors import UserError
from trainmaster.partition.coarse import ClusterGraph, cluster_graph, coarsen_chains
from trainmaster.partition.critical import Levels, critical_edges, levels
from trainmaster.partition.graph import Graph, clusters_of
from trainmaster.partition.initial import (acyclic_split, capped_list_schedule,
                                           critical_path_pins, kahip_parts, metis_parts, packed)
from trainmaster.partition.refine import fm_refine, rebalance
from trainmaster.partition.search import makespan_descent
from trainmaster.partition.simulate import device_graph_acyclic, finish_times, load_cap

METHODS = ("trainmaster", "patent", "metis", "kahip", "ilp")
CRITICAL_WEIGHT = 4.0  # a cut critical edge counts (1 + this) times its transfer cost


@dataclass
class Partition:
    """A node -> device assignment (dense indices; ``graph.node_ids`` names them)."""

    assignment: np.ndarray
    method: str
    k: int
    seconds: float
    notes: dict = field(default_factory=dict)

    def by_node_id(self, graph: Graph) -> dict:
        return {str(nid): int(d) for nid, d in zip(graph.node_ids, self.assignment.tolist())}


def check_request(graph: Graph, k: int, imbalance: float, method: str) -> None:
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}", details=[f"choose one of {', '.join(METHODS)}"])
    if k < 1:
        raise UserError(f"--devices must be at least 1, got {k}")
    if k > graph.n:
        raise UserError(f"--devices {k} is larger than the graph's {graph.n} nodes")
    if not 0 <= imbalance <= 10:
        raise UserError(f"--imbalance must be between 0 and 10, got {imbalance}")


def memory_cap_enforced(graph: Graph, k: int) -> float:
    """Enforce the per-device memory cap only when k devices can hold the graph at all."""
    if np.isfinite(graph.memory_cap) and graph.memory.sum() <= k * graph.memory_cap:
        return graph.memory_cap
    return float("inf")


def partition(graph: Graph, k: int, method: str = "trainmaster", imbalance: float = 0.05,
              seed: int = 0, delta: float = 0.0, acyclic: bool = False) -> Partition:
    """Split ``graph`` over ``k`` devices with ``method``. ``acyclic`` (ours only) keeps the
    device graph a DAG, as a pipeline of stages streaming samples needs."""
    check_request(graph, k, imbalance, method)
    t0 = time.perf_counter()
    notes: dict = {}
    if k == 1:
        assignment = np.zeros(graph.n, dtype=np.int64)
    elif method == "trainmaster":
        assignment, notes = _trainmaster(graph, k, imbalance, seed, delta, acyclic)
    elif method == "patent":
        from trainmaster.partition.patent import patent_partition

        cap = load_cap(graph, k, imbalance, clusters_of(graph))
        assignment = patent_partition(graph, k, cap, critical_edges(graph, delta), seed)
    elif method in ("metis", "kahip"):
        cg = cluster_graph(graph, clusters_of(graph), graph.edge_cost)
        fn = metis_parts if method == "metis" else kahip_parts
        assignment = cg.expand(fn(cg, k, imbalance, seed))
    else:
        from trainmaster.partition.ilp import ilp_partition

        assignment, notes = ilp_partition(graph, k, imbalance, delta=delta)
    return Partition(np.asarray(assignment, dtype=np.int64), method, k,
                     time.perf_counter() - t0, notes)


def _objective_weights(graph: Graph, static_crit: np.ndarray, assignment: np.ndarray | None,
                       delta: float) -> np.ndarray:
    crit = static_crit
    if assignment is not None:
        crit = crit | critical_edges(graph, delta, assignment=assignment)
    return graph.edge_cost * (1.0 + CRITICAL_WEIGHT * crit)


def _refine(graph: Graph, base: np.ndarray, part: np.ndarray, k: int, cap: float,
            mem_cap: float, static_crit: np.ndarray, delta: float,
            coarse: ClusterGraph | None = None, wake_all: bool = True) -> np.ndarray:
    """Coarse-level FM (whole coarse clusters move) then base-level FM with partition-aware weights."""
    if coarse is not None:
        cpart = np.zeros(coarse.size, dtype=np.int64)
        cpart[coarse.of] = part
        cpart = fm_refine(coarse, cpart, k, cap, mem_cap)
        part = coarse.expand(cpart)
    cg = cluster_graph(graph, base, _objective_weights(graph, static_crit, part, delta))
    bpart = np.zeros(cg.size, dtype=np.int64)
    bpart[base] = part
    bpart = rebalance(cg, bpart, k, cap, mem_cap)
    if _over_caps(cg, bpart, k, cap, mem_cap):
        return cg.expand(bpart)  # still over: FM keeps the caps as they are, it cannot fix this
    bpart = fm_refine(cg, bpart, k, cap, mem_cap, wake_all=wake_all)
    return cg.expand(bpart)


def _over_caps(cg: ClusterGraph, part: np.ndarray, k: int, cap: float, mem_cap: float) -> bool:
    if np.bincount(part, weights=cg.weight, minlength=k).max() > cap:
        return True
    return bool(np.bincount(part, weights=cg.memory, minlength=k).max() > mem_cap)


DESCENT_WORK = 40_000  # makespan-descent budget in (nodes + edges) simulated, i.e. simulations
DESCENT_SIMULATIONS = (4, 40)  # ... = DESCENT_WORK / (n + m), clipped to this range
# where no cut-driven start met the caps (they are tight), a descent move the caps refuse may
# swap a co-location cluster back instead (elsewhere swaps only spend the budget: measured)
DESCENT_SWAPS = True


def _trainmaster(graph: Graph, k: int, imbalance: float, seed: int,
                 delta: float, acyclic: bool = False) -> tuple[np.ndarray, dict]:
    lv = levels(graph)
    static_crit = critical_edges(graph, delta, lv=lv)
    base = clusters_of(graph)
    cap = load_cap(graph, k, imbalance, base)
    mem_cap = memory_cap_enforced(graph, k)
    weights = _objective_weights(graph, static_crit, None, delta)
    base_cg = cluster_graph(graph, base, weights)
    coarse_of = coarsen_chains(graph, weights, max_weight=cap / 4.0)
    coarse_cg = cluster_graph(graph, coarse_of, weights)
    candidates = _candidates(graph, k, imbalance, seed, cap, mem_cap, lv, static_crit, base_cg,
                             coarse_cg, acyclic)

    simulated: dict[bytes, list] = {}  # finish times by assignment: equal candidates share one

    def span_of(a: np.ndarray) -> float:
        key = np.asarray(a, dtype=np.int64).tobytes()
        if key not in simulated:
            simulated[key] = finish_times(graph, a)
        return max(simulated[key], default=0.0)

    scored = [(_overload(graph, a, k, cap, mem_cap), span_of(a), name, a)
              for name, a in candidates.items()]
    tight = all(s[0] > 0 for s in scored)
    # FM refines the cut-driven starts; any start over the caps is rebalanced (moves, then
    # swaps where moves get stuck) and refined too
    for over, span, name, part in [s for s in scored if s[2] in REFINED or s[0] > 0]:
        refined = _refine(graph, base, part, k, cap, mem_cap, static_crit, delta,
                          coarse_cg if name == "metis" else None)
        scored.append((_overload(graph, refined, k, cap, mem_cap), span_of(refined),
                       name + "+fm", refined))
    if all(s[0] > 0 for s in scored):  # no start could be repaired: bin-packed starts
        for by_memory in (False, True) if np.isfinite(mem_cap) else (False,):
            a = _refine(graph, base, base_cg.expand(packed(base_cg, k, cap, mem_cap, by_memory)),
                        k, cap, mem_cap, static_crit, delta, wake_all=False)
            if _overload(graph, a, k, cap, mem_cap) == 0.0:
                scored.append((0.0, span_of(a), "packed+fm", a))
    if np.isfinite(mem_cap) and all(_memory_over(graph, s[3], k, mem_cap) for s in scored):
        # no candidate meets the memory cap (it and the load cap may not both be satisfiable):
        # rank on the load cap and makespan, as for a graph whose memory cannot fit at all
        mem_cap = float("inf")
        scored = [(_overload(graph, s[3], k, cap, mem_cap), s[1], s[2], s[3]) for s in scored]
    if acyclic:  # may be impossible when a co-location class spans a path; then fall back
        dag = [s for s in scored if device_graph_acyclic(graph, s[3], k)]
        scored = dag or scored
    guarded = graph.edge_cost * static_crit
    cut_costs: dict[bytes, float] = {}  # by assignment: the choice and the notes share them

    def cut_of(s: tuple) -> float:
        key = np.asarray(s[3], dtype=np.int64).tobytes()
        if key not in cut_costs:
            cut_costs[key] = _cut_cost(graph, guarded, s[3])
        return cut_costs[key]

    over, span, label, best = _choose(graph, scored, guarded, cut_of)
    used = 0
    if over == 0.0:
        budget = int(np.clip(DESCENT_WORK / max(graph.n + graph.m, 1), *DESCENT_SIMULATIONS))

        def descend(start: np.ndarray, budget: int) -> tuple[np.ndarray, float, int]:
            return makespan_descent(
                graph, start, k, cap, mem_cap, [base, coarse_of], budget,
                acyclic=acyclic and device_graph_acyclic(graph, start, k), guarded=guarded,
                swaps=DESCENT_SWAPS and tight,
                finish=simulated.get(np.asarray(start, dtype=np.int64).tobytes()))

        best, span, used = descend(best, budget)
        metis = [s for s in scored if s[2] == "metis-plain"]
        low = _low_cut_start(scored, cut_of, metis, cut_of((0.0, span, label, best)))
        if low is not None:
            other, other_span, more = descend(low[3], max(budget // LOW_CUT_SHARE, 1))
            used += more
            if other_span <= min(metis[0][1], (1.0 + CUT_SLACK) * span) + 1e-9:
                best, span, label = other, other_span, low[2] + "+low-cut"
    candidates = {s[2]: {"overload": s[0], "makespan": s[1],
                         "critical_cut": cut_of(s)}
                  for s in scored}
    return best, {"chosen": label, "descent_simulations": used, "makespan": span,
                  "candidates": candidates}


# FM refines the critical-weighted METIS start (it would undo a schedule-driven start's work;
# refining METIS's own partition too won 5 of 168 cases and changed no goal figure)
REFINED = ("metis",)
CUT_PENALTY = 1.0  # final choice: makespan + this x cost of the static critical edges cut
# the final choice gives up at most this share of simulated makespan for a partition that cuts
# less static critical cost than METIS's own (and is never slower than it); see _low_cut_start
CUT_SLACK = 0.03
# ... whose descent gets 1/this of the main descent's budget: an eighth won the same cases as
# the full budget on synthetic seeds 0-10; the full one took transformer-1 k = 4 past 10x METIS
LOW_CUT_SHARE = 8


def _low_cut_start(scored: list, cut_of, metis: list, chosen_cut: float) -> tuple | None:
    """Where the chosen partition (after its descent) cuts no less static critical cost than
    METIS's own partition (``metis``: its scored entry, when run), the fastest candidate within
    the caps that cuts less, to be descended too; else None. Why: the critical cut is the
    disclosure's objective and a cut critical transfer costs more in a real run than the
    simulator prices it (docs/partition.md), so a partition at most ``CUT_SLACK`` slower in
    simulation that cuts less of the critical path than METIS is the better buy. On the
    synthetic DAGs the makespan-first choice cut more than METIS in 7 of 27 cases (24 of 72 on
    held-out seeds 3-10); this start and its descent win 3 (7) of them back, with the median
    makespan excess unchanged."""
    if not metis or chosen_cut < cut_of(metis[0]) - 1e-12:
        return None
    limit = cut_of(metis[0]) - 1e-12
    low = [s for s in scored if s[0] == 0.0 and cut_of(s) < limit]
    return min(low, key=lambda s: s[1]) if low else None


def _candidates(graph: Graph, k: int, imbalance: float, seed: int, cap: float, mem_cap: float,
                lv: Levels, static_crit: np.ndarray, base_cg: ClusterGraph,
                coarse_cg: ClusterGraph, acyclic: bool) -> dict[str, np.ndarray]:
    """Initial partitions, named. Contiguous splits of the topological order (a chain of
    stages; with ``acyclic`` also by earliest start, so branches that run at the same time share
    a stage), capped list scheduling (charging a cut critical edge the final choice's penalty)
    and with the critical path pinned (CPOP), METIS on the critical-weighted coarse graph, and
    METIS as the baseline runs it (so ours can always fall back to METIS's partition)."""
    out: dict[str, np.ndarray] = {}
    orders = [("acyclic", None)]
    if acyclic:
        orders.append(("acyclic-est", np.lexsort((np.arange(graph.n), lv.est))))
    for name, order in orders:
        split = acyclic_split(graph, base_cg, k, cap, order)
        if split is not None:
            out[name] = base_cg.expand(split)
    pins = critical_path_pins(graph, base_cg, k, cap, lv.est, static_crit)
    penalty = CUT_PENALTY * graph.edge_cost * static_crit
    out["list"] = base_cg.expand(capped_list_schedule(graph, base_cg, k, cap, lv.blevel,
                                                      mem_cap=mem_cap, penalty=penalty))
    out["cpop"] = base_cg.expand(
        capped_list_schedule(graph, base_cg, k, cap, lv.blevel, pins, mem_cap))
    out["metis"] = coarse_cg.expand(metis_parts(coarse_cg, k, imbalance, seed))
    plain = cluster_graph(graph, base_cg.of, graph.edge_cost)
    out["metis-plain"] = plain.expand(metis_parts(plain, k, imbalance, seed))
    return out


def _choose(graph: Graph, scored: list, guarded: np.ndarray, cut_of=None) -> tuple:
    """The final choice among (overload, makespan, name, assignment) candidates: the least
    overloaded; among those, none slower than METIS's own partition (``metis-plain``, when it is
    as little overloaded); then the lowest makespan + CUT_PENALTY x critical cut cost. Why not
    makespan alone: the simulator prices a cut critical edge at its modelled transfer time, and
    real messages cost more (docs/partition.md, the pipeline run), so among partitions of
    near-equal simulated makespan the one that cuts less of the critical path is the safer.
    ``cut_of`` (a candidate -> its critical cut cost, memoised by the caller) saves computing it
    again."""
    if cut_of is None:
        def cut_of(s: tuple) -> float:
            return _cut_cost(graph, guarded, s[3])
    least = min(s[0] for s in scored)
    pool = [s for s in scored if s[0] == least]
    metis = [s for s in pool if s[2] == "metis-plain"]
    if metis:
        pool = [s for s in pool if s[1] <= metis[0][1]]

    def score(s: tuple) -> tuple[float, float]:
        return s[1] + CUT_PENALTY * cut_of(s), s[1]

    return min(pool, key=score)


def _cut_cost(graph: Graph, edge_cost: np.ndarray, assignment: np.ndarray) -> float:
    """Total ``edge_cost`` of the edges ``assignment`` cuts."""
    return float(edge_cost[assignment[graph.src] != assignment[graph.dst]].sum())


def _memory_over(graph: Graph, a: np.ndarray, k: int, mem_cap: float) -> bool:
    return bool(np.bincount(a, weights=graph.memory, minlength=k).max() > mem_cap)


def _overload(graph: Graph, a: np.ndarray, k: int, cap: float, mem_cap: float) -> float:
    """How far the worst part exceeds the caps (0 when they hold): balance first, then makespan."""
    load = np.bincount(a, weights=graph.cost, minlength=k).max() / max(cap, 1e-300) - 1.0
    over = max(0.0, float(load)) if load > 1e-9 else 0.0
    if np.isfinite(mem_cap):
        mem = np.bincount(a, weights=graph.memory, minlength=k).max() / mem_cap - 1.0
        over += max(0.0, float(mem)) if mem > 1e-9 else 0.0
    return over
