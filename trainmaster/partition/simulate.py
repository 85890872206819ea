"""Scoring a partition: the makespan simulator, the pipeline max-load and the cut metrics.

The simulator is list scheduling: each device runs one operator at a time; an operator is ready
when every predecessor has finished, plus that edge's transfer cost when the predecessor ran on
another device; among ready operators the one with the highest static b-level (every edge charged
its transfer cost) goes first, ties to the lower node index, and starts on its device at
max(device free, data ready).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from trainmaster.partition.critical import critical_edges, critical_path_without_transfers, levels
from trainmaster.partition.graph import Graph


def makespan(graph: Graph, assignment: np.ndarray, priority: np.ndarray | None = None) -> float:
    """Simulated single-sample latency of ``assignment`` (see module docstring). Called once per
    candidate and per trial move, so the common case (static order) skips the array round trip."""
    plan = sim_plan(graph, priority)
    if plan.order is not None:
        return max(_static_finish(plan, np.asarray(assignment).tolist()), default=0.0)
    return float(schedule(graph, assignment, priority)[1].max(initial=0.0))


def finish_times(graph: Graph, assignment: np.ndarray, shared_links: bool = False) -> list:
    """Every operator's finish time as a list (``max`` of it is ``makespan``); with
    ``shared_links``, messages queue on the devices' links (``schedule``)."""
    plan = sim_plan(graph)
    if plan.order is not None and not shared_links:
        return _static_finish(plan, np.asarray(assignment).tolist())
    return schedule(graph, assignment, shared_links=shared_links)[1].tolist()


def _static_finish(plan: SimPlan, part: list, finish: list | None = None, first: int = 0) -> list:
    """Finish times when the priority order is topological: one pass, no ready heap. With
    ``finish`` (a schedule whose operators before position ``first`` of the order are placed as
    in ``part``) the pass resumes at ``first``: in this order an operator depends only on
    operators before it, so the prefix is unchanged."""
    order, steps = plan.order, plan.steps
    assert order is not None and steps is not None
    free = [0.0] * (max(part, default=0) + 1)
    if finish is None:
        finish = [0.0] * len(order)
    else:
        finish = list(finish)
        for v in order[:first]:  # device free times at the resume point
            d = part[v]
            if finish[v] > free[d]:
                free[d] = finish[v]
    for v, pv, wv in steps[first:] if first else steps:
        d = part[v]
        s = free[d]
        for u, c in pv:
            t = finish[u]
            if part[u] != d:
                t += c
            if t > s:
                s = t
        finish[v] = free[d] = s + wv
    return finish


def resumed_makespan(
    graph: Graph, assignment: np.ndarray | list, finish: list, changed: np.ndarray | list[int]
) -> tuple[float, list]:
    """(makespan, finish times) of ``assignment`` given ``finish``, the finish times under an
    assignment that differs only on the ``changed`` operators: the simulation resumes at the
    first changed operator in priority order (the makespan descent's trial moves)."""
    plan = sim_plan(graph)
    part = assignment if isinstance(assignment, list) else np.asarray(assignment).tolist()
    if plan.order is None:
        fin = schedule(graph, np.asarray(part))[1].tolist()
    else:
        rank = plan.rank_list
        first = min([rank[v] for v in changed]) if len(changed) else graph.n
        fin = _static_finish(plan, part, finish, first)
    return max(fin, default=0.0), fin


class TrialSimulator:
    """Trial moves against one accepted schedule (the makespan descent's inner loop), with the
    same finish times as ``resumed_makespan`` for every trial it completes.

    Two savings, neither of which changes a result. (1) Resume point: the device free times
    and the compute already placed on each device before any position of the priority order are
    kept for every ``CHECKPOINT``-th position of the accepted schedule, so a trial resuming at
    position i replays fewer than ``CHECKPOINT`` operators instead of i. (2) Cut-off: a trial
    counts only if its makespan is below ``limit`` (the accepted makespan); it stops as soon as
    a lower bound on its makespan reaches ``limit``: an operator starting at s is followed by at
    least its compute-only bottom level (``bottom0``: every successor starts after it ends), and
    a device free at f still has the compute of its remaining operators to run. Both bounds hold
    for the finished schedule, so a stopped trial could never have been accepted. Only for a
    topological priority order (the simulator's usual case); otherwise it runs full schedules."""

    CHECKPOINT = 16

    def __init__(self, graph: Graph, k: int) -> None:
        plan = sim_plan(graph)
        self.graph, self.k, self.plan = graph, k, plan
        self.static = plan.order is not None
        self.free_at: list[list[float]] = []
        self.done_at: list[list[float]] = []
        if self.static:
            bottom = graph.cache.get("bottom0")
            if bottom is None:
                bottom = list(plan.cost)  # compute-only bottom level, the operator's own included
                for v, pv, wv in reversed(plan.steps or []):
                    b = bottom[v]
                    for u, _ in pv:
                        t = plan.cost[u] + b
                        if t > bottom[u]:
                            bottom[u] = t
                graph.cache["bottom0"] = bottom
            steps = graph.cache.get("trial_steps")
            if steps is None:  # (v, its one predecessor and cost or -1, preds, w, bottom)
                steps = [
                    (v, pv[0][0] if len(pv) == 1 else -1, pv[0][1] if len(pv) == 1 else 0.0, pv, wv, bottom[v])
                    for v, pv, wv in plan.steps or []
                ]
                graph.cache["trial_steps"] = steps
            self.steps: list = steps

    def set(self, part: list[int], finish: list, moved: list[int] | None = None) -> None:
        """The accepted schedule: ``part`` (a list) and its finish times. With ``moved`` (the
        operators whose device changed since the last accepted schedule, which was simulated
        from the first of them on), the checkpoints before that operator are kept."""
        self.part, self.finish = part, finish
        if not self.static:
            return
        k, w, step, order = self.k, self.plan.cost, self.CHECKPOINT, self.plan.order or []
        j = 0
        if moved is not None and self.free_at:
            rank = self.plan.rank_list
            first = min([rank[v] for v in moved]) if moved else len(order)
            j = min(first // step, len(self.free_at) - 1)
            del self.free_at[j + 1 :], self.done_at[j + 1 :]
            free, done = list(self.free_at[j]), list(self.done_at[j])
        else:
            free, done = [0.0] * k, [0.0] * k
            self.free_at, self.done_at = [list(free)], [list(done)]
        for start in range(j * step, len(order), step):
            if start > j * step:
                self.free_at.append(list(free))
                self.done_at.append(list(done))
            for v in order[start : start + step]:
                d = part[v]
                if finish[v] > free[d]:
                    free[d] = finish[v]
                done[d] += w[v]
        self.total = done

    def run(self, part: list[int], moved: list[int], limit: float) -> tuple[float, list | None]:
        """(makespan, finish times) of ``part``, which differs from the accepted assignment only
        on the ``moved`` operators; (inf, None) once the makespan provably is >= ``limit``."""
        if not self.static:
            return resumed_makespan(self.graph, part, self.finish, moved)
        rank, w, old = self.plan.rank_list, self.plan.cost, self.part
        if not moved:
            return max(self.finish, default=0.0), list(self.finish)
        first = min([rank[v] for v in moved])
        rem = list(self.total)
        for v in moved:
            rem[old[v]] -= w[v]
            rem[part[v]] += w[v]
        j = first // self.CHECKPOINT
        free, done = list(self.free_at[j]), list(self.done_at[j])
        finish = self.finish
        for v in (self.plan.order or [])[j * self.CHECKPOINT : first]:
            d = old[v]
            if finish[v] > free[d]:
                free[d] = finish[v]
            done[d] += w[v]
        for d in range(self.k):
            rem[d] -= done[d]
        fin = list(finish)
        inf = float("inf")
        for v, u1, c1, pv, wv, bv in self.steps[first:]:
            d = part[v]
            s = free[d]
            if u1 >= 0:  # one predecessor (most operators): no inner loop
                t = fin[u1]
                if part[u1] != d:
                    t += c1
                if t > s:
                    s = t
            else:
                for u, c in pv:
                    t = fin[u]
                    if part[u] != d:
                        t += c
                    if t > s:
                        s = t
            if s + bv >= limit:
                return inf, None
            f = s + wv
            r = rem[d] - wv
            if f + r >= limit:
                return inf, None
            rem[d] = r
            fin[v] = free[d] = f
        return max(fin, default=0.0), fin


def static_order(graph: Graph) -> list[int] | None:
    """The simulator's priority order when it is topological (then it walks it directly, and
    each device runs its operators in that order); None when it keeps a ready heap instead."""
    return sim_plan(graph).order


def predecessor_lists(graph: Graph) -> list[list[tuple[int, float]]]:
    """Per operator, its (predecessor, transfer cost) pairs; cached with the simulator's plan."""
    return sim_plan(graph).preds


@dataclass(frozen=True)
class SimPlan:
    """Per-graph lists for the simulator, cached on the graph: the hot loop then touches only
    Python lists (indexing a numpy array element by element is several times slower)."""

    priority: list[float]  # the scheduling priority (static b-level) per operator
    order: list[int] | None  # the priority order when it is topological, else None (ready heap)
    in_ptr: list[int]  # CSR of in-edges: predecessors of v at pred[in_ptr[v]:in_ptr[v + 1]]
    pred: list[int]
    pred_cost: list[float]  # transfer cost of each in-edge, aligned with ``pred``
    out_ptr: list[int]  # CSR of out-edges, likewise
    succ: list[int]
    succ_cost: list[float]
    cost: list[float]  # compute cost per operator
    indegree: list[int]
    preds: list[list[tuple[int, float]]]  # per operator, its (predecessor, transfer cost) pairs
    rank: np.ndarray  # position of each operator in the priority order
    rank_list: list[int]
    # (operator, its predecessors, its cost) in the static order; None when not static
    steps: list[tuple[int, list[tuple[int, float]], float]] | None


def sim_plan(graph: Graph, priority: np.ndarray | None = None) -> SimPlan:
    """The simulator's ``SimPlan`` for ``graph`` (cached for the default priority).

    When sorting by (-b-level, index) is already a topological order (true unless a zero-cost
    predecessor ties its successor's b-level from a higher index), the ready-list pops nodes in
    exactly that order, so the simulator walks it directly instead of keeping a heap."""
    plan = graph.cache.get("plan") if priority is None else None
    if plan is None:
        prio = levels(graph).blevel if priority is None else priority
        order = np.lexsort((np.arange(graph.n), -prio))
        rank = np.empty(graph.n, dtype=np.int64)
        rank[order] = np.arange(graph.n)
        static = bool(np.all(rank[graph.src] < rank[graph.dst]))
        order_l = order.tolist() if static else None
        in_ptr_l = graph.in_ptr.tolist()
        pred_l = graph.src[graph.in_edge].tolist()
        pcost_l = graph.edge_cost[graph.in_edge].tolist()
        cost_l = graph.cost.tolist()
        preds = [
            list(zip(pred_l[in_ptr_l[v] : in_ptr_l[v + 1]], pcost_l[in_ptr_l[v] : in_ptr_l[v + 1]]))
            for v in range(graph.n)
        ]
        steps = None if order_l is None else [(v, preds[v], cost_l[v]) for v in order_l]
        plan = SimPlan(
            priority=prio.tolist(),
            order=order_l,
            in_ptr=in_ptr_l,
            pred=pred_l,
            pred_cost=pcost_l,
            out_ptr=graph.out_ptr.tolist(),
            succ=graph.dst[graph.out_edge].tolist(),
            succ_cost=graph.edge_cost[graph.out_edge].tolist(),
            cost=cost_l,
            indegree=np.bincount(graph.dst, minlength=graph.n).tolist(),
            preds=preds,
            rank=rank,
            rank_list=rank.tolist(),
            steps=steps,
        )
        if priority is None:
            graph.cache["plan"] = plan
    return plan


def schedule(
    graph: Graph, assignment: np.ndarray, priority: np.ndarray | None = None, shared_links: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Start and finish time of every operator under list scheduling.

    Without ``shared_links`` every cut edge has a link of its own (its transfer never waits).
    With it, a device has one link out and one link in, as a host's network interface does: an
    operator's value goes once to each other device that reads it (for the dearest of those
    edges' costs), and that message holds the sender's link out and the receiver's link in,
    starting when both are free, in the order the scheduler meets the senders. Measured on a
    testbed, splits that cut many edges at once were up to 2.3x slower than priced without it."""
    n = graph.n
    plan = sim_plan(graph, priority)
    prio, order, out_ptr, succ, ecost, w = (
        plan.priority,
        plan.order,
        plan.out_ptr,
        plan.succ,
        plan.succ_cost,
        plan.cost,
    )
    part = np.asarray(assignment).tolist()
    start = [0.0] * n
    finish = [0.0] * n
    free: dict[int, float] = {}
    if order is not None and not shared_links:
        fin = np.asarray(_static_finish(plan, part))
        return fin - graph.cost, fin
    link_out: dict[int, float] = {}  # shared_links: when each device's link out is free
    link_in: dict[int, float] = {}  # and its link in
    indeg = list(plan.indegree)
    ready = [0.0] * n
    heap = [(-prio[v], v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(heap)
    while heap:
        _, v = heapq.heappop(heap)
        d = part[v]
        s = max(ready[v], free.get(d, 0.0))
        f = s + w[v]
        start[v], finish[v] = s, f
        free[d] = f
        # shared links: when v's value reaches each other device that reads it
        arrival = _send_on_links(v, d, f, plan, part, link_out, link_in) if shared_links else None
        for j in range(out_ptr[v], out_ptr[v + 1]):
            x = succ[j]
            if part[x] == d:
                t = f
            elif arrival is None:
                t = f + ecost[j]
            else:
                t = arrival[part[x]]
            if t > ready[x]:
                ready[x] = t
            indeg[x] -= 1
            if indeg[x] == 0:
                heapq.heappush(heap, (-prio[x], x))
    return np.asarray(start), np.asarray(finish)


def _send_on_links(
    v: int, d: int, f: float, plan: SimPlan, part: list, link_out: dict[int, float], link_in: dict[int, float]
) -> dict[int, float]:
    """``schedule`` with shared links: operator ``v`` ended at ``f`` on device ``d``; its value
    goes once to each other device that reads it (priced at the dearest of those edges), each
    message starting when ``d``'s link out and the reader's link in are free, and holding both
    until it arrives. Returns the arrival time per reading device."""
    message: dict[int, float] = {}  # reading device -> the message's cost
    for j in range(plan.out_ptr[v], plan.out_ptr[v + 1]):
        to = part[plan.succ[j]]
        if to != d:
            message[to] = max(message.get(to, 0.0), plan.succ_cost[j])
    arrival: dict[int, float] = {}
    for to, cost in message.items():
        begin = max(f, link_out.get(d, 0.0), link_in.get(to, 0.0))
        link_out[d] = link_in[to] = arrival[to] = begin + cost
    return arrival


def device_loads(graph: Graph, assignment: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(assignment, weights=graph.cost, minlength=k)


def max_load(graph: Graph, assignment: np.ndarray, k: int) -> float:
    """Pipeline time per sample: with samples streaming through, the busiest device sets the pace."""
    return float(device_loads(graph, assignment, k).max(initial=0.0))


def device_graph_acyclic(graph: Graph, assignment: np.ndarray, k: int) -> bool:
    """Whether the quotient graph of devices is a DAG (a pipeline needs that)."""
    cut = assignment[graph.src] != assignment[graph.dst]
    a, b = assignment[graph.src][cut], assignment[graph.dst][cut]
    adj = np.zeros((k, k), dtype=bool)
    adj[a, b] = True
    indeg = adj.sum(axis=0)
    alive = np.ones(k, dtype=bool)
    for _ in range(k):
        roots = np.flatnonzero(alive & (indeg == 0))
        if len(roots) == 0:
            break
        alive[roots] = False
        indeg = indeg - adj[roots].sum(axis=0)
    return not alive.any()


def lower_bound(graph: Graph, k: int) -> float:
    """max(critical path without transfers, total work / k): no partition's makespan is lower."""
    return max(critical_path_without_transfers(graph), float(graph.cost.sum()) / k)


# Edge weights (per unit of transfer cost, nodes weigh 1) of the heaviest paths that
# ``path_cut_bound`` tries: 0 is the critical path without transfers, 1 the one with every edge
# charged; the ones between find paths that are long in compute and dear to cut.
PATH_EDGE_WEIGHTS = (0.0, 0.01, 0.1, 0.3, 1.0)


def path_cut_bound(
    graph: Graph, k: int, cap: float, mem_cap: float = float("inf"), cluster: np.ndarray | None = None
) -> float:
    """A makespan lower bound for partitions whose every device load is <= ``cap`` (and every
    device's memory <= ``mem_cap``, when given) and that keep each co-location ``cluster``
    (node -> cluster id, when given) on one device.

    ``lower_bound`` ignores transfers, but on near-chain graphs a within-cap split must cut the
    long path and pay for it: a run of consecutive path operators on one device holds at most
    ``cap`` of compute (and ``mem_cap`` of memory), so the path is cut into such runs and the
    edges between runs cross devices; every path operator starts after its predecessor ends
    plus that transfer, so the makespan is at least the path's compute plus the cheapest such
    set of cut edges (``path_bound``). A link inside a co-location cluster is never cut
    (``_uncut_links``). Applied to a few heaviest paths (``PATH_EDGE_WEIGHTS``); the max is
    kept, with ``forced_cut_bound`` (a cap that forces some dear edge to be cut). Without
    ``cluster`` or ``mem_cap`` the bound is weaker but still valid."""
    bound = lower_bound(graph, k)
    for weight in PATH_EDGE_WEIGHTS:
        nodes, links = heaviest_path(graph, weight)
        memory = graph.memory[nodes].tolist() if np.isfinite(mem_cap) else None
        links = _uncut_links(nodes, links, cluster)
        bound = max(bound, path_bound(graph.cost[nodes].tolist(), links, cap, memory, mem_cap))
    return max(bound, forced_cut_bound(graph, k, cap, cluster, mem_cap))


def critical_cut_bound(
    graph: Graph, cap: float, mem_cap: float = float("inf"), cluster: np.ndarray | None = None
) -> float:
    """A lower bound on the cost-weighted critical cut of any partition whose device loads are
    all <= ``cap`` (and memories <= ``mem_cap``, when given) and that keeps each co-location
    ``cluster`` whole (when given): the static critical path (compute plus every transfer, as
    HEFT's ranks charge them) has slack 0 on each of its links, so each link a partition cuts
    is a critical edge, and a within-cap partition cuts that path into runs that fit a device
    (``path_bound``'s argument) at links between clusters only. Where METIS's critical cut
    already equals this bound, no partition within the caps cuts less. inf when no partition
    fits the caps."""
    nodes, links = heaviest_path(graph, 1.0)
    memory = graph.memory[nodes].tolist() if np.isfinite(mem_cap) else None
    links = _uncut_links(nodes, links, cluster)
    return path_cut_cost(graph.cost[nodes].tolist(), links, cap, memory, mem_cap)


def _uncut_links(
    nodes: list[int],
    links: list[float],
    cluster: np.ndarray | None,
) -> list[float]:
    """``links`` with the ones inside a co-location cluster priced at inf: a partition that keeps
    the cluster on one device never cuts them, so the path's runs cannot end there."""
    if cluster is None:
        return links
    of = np.asarray(cluster)[nodes].tolist()
    return [math.inf if a == b else c for a, b, c in zip(of, of[1:], links)]


def path_bound(
    node_cost: list[float],
    link_cost: list[float],
    cap: float,
    node_memory: list[float] | None = None,
    mem_cap: float = float("inf"),
) -> float:
    """Compute of a path plus its cheapest cut into fitting runs (``path_cut_cost``)."""
    return sum(node_cost) + path_cut_cost(node_cost, link_cost, cap, node_memory, mem_cap)


def path_cut_cost(
    node_cost: list[float],
    link_cost: list[float],
    cap: float,
    node_memory: list[float] | None = None,
    mem_cap: float = float("inf"),
) -> float:
    """The cheapest cut of a path into runs of <= ``cap`` compute each (and <= ``mem_cap`` of
    ``node_memory`` each, when given): the sum of the links between runs.

    ``link_cost[i]`` is the transfer between path operators i and i + 1. Any within-cap partition
    cuts the path at least this dearly (each maximal same-device run fits on its device), which
    implies the simpler argument too: the path spans >= ceil(W / cap) runs, so >= that - 1 cut
    links, costing at least the sum of that many cheapest links. Exact DP over the position of
    the last cut with a sliding-window minimum, O(length) (a run's allowed starts shrink
    monotonically under both caps). inf when an operator alone exceeds a cap (no partition
    within the caps exists)."""
    limit = cap * (1 + 1e-9)  # the tolerance `evaluate` uses for "balanced"
    if any(w > limit for w in node_cost):
        return float("inf")
    memory = node_memory if node_memory is not None else [0.0] * len(node_cost)
    if any(m > mem_cap for m in memory):
        return float("inf")
    prefix, mprefix = [0.0], [0.0]
    for w, m in zip(node_cost, memory):
        prefix.append(prefix[-1] + w)
        mprefix.append(mprefix[-1] + m)
    n = len(node_cost)
    # best[i]: cheapest cut of operators 0..i-1 into fitting runs, with a cut just before i
    best = [0.0] * n
    window: list[int] = []  # candidate run starts j, best[j] increasing
    head, lo = 0, 0.0
    for i in range(1, n + 1):
        window.append(i - 1)
        while head < len(window) - 1 and best[window[-1]] <= best[window[-2]]:
            window.pop(-2)
        while prefix[i] - prefix[window[head]] > limit or mprefix[i] - mprefix[window[head]] > mem_cap:
            head += 1
        lo = best[window[head]]
        if i < n:
            best[i] = link_cost[i - 1] + lo
    return lo


def heaviest_path(graph: Graph, edge_weight: float) -> tuple[list[int], list[float]]:
    """The path maximising compute + ``edge_weight`` x transfer cost, as (operators in order,
    transfer cost of each link). A link with parallel edges costs their max: the simulator waits
    for the latest of them."""
    pos = np.empty(graph.n, dtype=np.int64)
    pos[graph.topo] = np.arange(graph.n)
    order = np.argsort(pos[graph.src], kind="stable")
    w = graph.cost.tolist()
    into = [0.0] * graph.n  # heaviest path weight arriving at v, v's own cost excluded
    prev = [-1] * graph.n
    for s, d, c in zip(graph.src[order].tolist(), graph.dst[order].tolist(), graph.edge_cost[order].tolist()):
        t = into[s] + w[s] + edge_weight * c
        if t > into[d]:
            into[d], prev[d] = t, s
    end = int(np.argmax(np.asarray(into) + graph.cost)) if graph.n else -1
    nodes: list[int] = []
    while end >= 0:
        nodes.append(end)
        end = prev[end]
    nodes.reverse()
    links = [_link_cost(graph, u, v) for u, v in zip(nodes, nodes[1:])]
    return nodes, links


def _link_cost(graph: Graph, u: int, v: int) -> float:
    """Transfer cost of u -> v (the max over parallel edges)."""
    edges = graph.in_edge[graph.in_ptr[v] : graph.in_ptr[v + 1]]
    return float(graph.edge_cost[edges[graph.src[edges] == u]].max())


def load_cap(graph: Graph, k: int, imbalance: float, cluster: np.ndarray | None = None) -> float:
    """The balance cap: (1 + imbalance) * average load, or the heaviest unsplittable unit's load."""
    heaviest = float(graph.cost.max(initial=0.0))
    if cluster is not None and len(cluster):
        heaviest = float(np.bincount(cluster, weights=graph.cost).max())
    return max((1.0 + imbalance) * float(graph.cost.sum()) / k, heaviest)


def least_max_load(graph: Graph, k: int, cluster: np.ndarray | None = None) -> float:
    """A lower bound on the busiest device's load over every partition into k devices that keeps
    each co-location cluster (``cluster``; every operator its own when None) whole: the average
    load, and the pigeonhole bound: of the m heaviest clusters some device holds ceil(m / k), so
    at least the ceil(m / k) lightest of them (max over m). Above the load cap it proves that no
    partition meets the cap (e.g. 12 equal layers on 8 devices: some device runs 2 of them,
    1.33x the average, whatever a partitioner does), so a result over it is not a miss."""
    units = graph.cost if cluster is None or not len(cluster) else np.bincount(cluster, weights=graph.cost)
    return max(float(graph.cost.sum()) / k, _pigeonhole(units, k))


def _pigeonhole(units: np.ndarray, k: int) -> float:
    """max over m of the sum of the ceil(m / k) lightest of the m heaviest ``units``."""
    heavy = np.sort(units)[::-1]
    prefix = np.concatenate([[0.0], np.cumsum(heavy)])
    m = np.arange(1, len(heavy) + 1)
    per_device = -(-m // k)  # ceil(m / k)
    return float((prefix[m] - prefix[m - per_device]).max(initial=0.0))


FORCED_CUT_THRESHOLDS = 12  # transfer costs tried as thresholds by ``forced_cut_bound``
PACKING_ITEMS = 40  # heaviest units the exact packing check places one by one (the rest as a fluid)
PACKING_NODES = 5000  # branch-and-bound nodes of one exact packing check (undecided counts as packable)
PACKING_SECONDS = 20.0  # and its time limit, a guard only: the node limit binds first


def forced_cut_bound(
    graph: Graph, k: int, cap: float, cluster: np.ndarray | None = None, mem_cap: float = float("inf")
) -> float:
    """A makespan lower bound for partitions whose device loads are all <= ``cap`` (and memories
    <= ``mem_cap``) and that keep each co-location ``cluster`` whole.

    Cutting an edge (u, v) delays v to at least EST(u) + w(u) + c(u, v), and v's compute-only
    bottom level follows: so a partition that cuts (u, v) has makespan >= that edge's
    ``through`` = EST(u) + w(u) + c(u, v) + b(v) (levels without transfers). Hence, for any tau,
    a partition with makespan < tau cuts no edge whose ``through`` is >= tau, and keeps whole
    every unit that those edges (with the co-location clusters) join. Where those units cannot
    be packed k ways within the caps, no within-cap partition is faster than tau. The bound is
    the largest such tau, searched over the ``through`` values of the edges at or above a few
    transfer-cost thresholds (the distinct costs, sampled). "Cannot be packed" is proven by the
    pigeonhole bound (``least_max_load``'s argument) or, failing that, by an exact bin-packing
    check (``_cannot_pack``); an undecided check counts as packable, so the bound stays valid
    (and, bounded by search nodes rather than time, the same on a loaded machine).

    Why: on training graphs each weight reaches its readers by an edge dearer than much of the
    step's compute (a 512 x 512 weight at 1 GB/s: 1.05 ms against 1.43 ms), a tight cap forces
    some of them to be cut, and which ones can be cut cheaply (a late reader) decides the
    makespan; the compute-only bound (0.86 ms) sees none of it. Requiring only that some heavy
    edge be cut gives the cheapest heavy edge's ``through``; asking which edges the packing
    really needs cut lifts it where the cheap cuts alone cannot balance the devices (a layer's
    input-gradient matmul split off is too small to make room). 0 when no threshold forces a
    cut."""
    if graph.m == 0 or k < 2:
        return 0.0
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    flat = levels(graph.with_edges_costs(np.zeros(graph.m)))
    through = flat.est[graph.src] + graph.cost[graph.src] + graph.edge_cost + flat.blevel[graph.dst]
    costs = np.unique(graph.edge_cost[graph.edge_cost > 0])[::-1]
    if not len(costs):
        return 0.0
    picks = np.unique(np.linspace(0, len(costs) - 1, min(FORCED_CUT_THRESHOLDS, len(costs))).astype(np.int64))
    n = graph.n
    # co-location clusters joined by a chain of edges member -> first member (never cut)
    if cluster is not None and len(cluster):
        order = np.argsort(cluster, kind="stable")
        same = cluster[order[1:]] == cluster[order[:-1]]
        join_a, join_b = order[:-1][same], order[1:][same]
    else:
        join_a = join_b = np.zeros(0, dtype=np.int64)
    memory = graph.memory if np.isfinite(mem_cap) else None
    checked: dict[bytes, bool] = {}

    def unpackable(edges: np.ndarray) -> bool:
        """Whether the units joined by ``edges`` (and the clusters) cannot be packed."""
        a = np.concatenate([graph.src[edges], join_a])
        b = np.concatenate([graph.dst[edges], join_b])
        _, unit = connected_components(coo_matrix((np.ones(len(a)), (a, b)), shape=(n, n)), directed=False)
        key = unit.tobytes()
        if key not in checked:
            load = np.bincount(unit, weights=graph.cost)
            mem = None if memory is None else np.bincount(unit, weights=memory)
            checked[key] = _cannot_pack(load, mem, k, cap, mem_cap)
        return checked[key]

    best = 0.0
    for t in costs[picks].tolist():
        heavy = np.flatnonzero(graph.edge_cost >= t)
        taus = np.unique(through[heavy])  # ascending; F(tau) = heavy edges with through >= tau
        if taus[-1] <= best or not unpackable(heavy[through[heavy] >= max(taus[0], best)]):
            continue
        lo = int(np.searchsorted(taus, best)) if best > taus[0] else 0
        hi = len(taus) - 1  # unpackable at lo (proven); find the largest such index
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if unpackable(heavy[through[heavy] >= taus[mid]]):
                lo = mid
            else:
                hi = mid - 1
        best = max(best, float(taus[lo]))
    return best


def _cannot_pack(load: np.ndarray, memory: np.ndarray | None, k: int, cap: float, mem_cap: float) -> bool:
    """Proven: units of these loads (and memories) cannot be placed on k devices with every
    device's load <= ``cap`` (and memory <= ``mem_cap``). First the pigeonhole bound; then an
    exact bin-packing check (HiGHS) of a relaxation: the ``PACKING_ITEMS`` heaviest units as
    items, the rest as a fluid that may be split anywhere (splitting only makes packing easier,
    so an infeasible relaxation proves the real packing infeasible). Bins are identical: item j
    goes to one of the first j + 1 bins (any packing can be relabelled so). A check the solver
    cannot decide within ``PACKING_NODES`` search nodes counts as packable (False)."""
    limit = cap * (1 + 1e-9)
    if _pigeonhole(load, k) > limit or load.sum() > k * limit:
        return True
    if memory is not None and (memory.max(initial=0.0) > mem_cap or memory.sum() > k * mem_cap):
        return True
    order = np.argsort(-load, kind="stable")
    items = order[:PACKING_ITEMS]
    items = items[load[items] > 0]
    if len(items) <= k:
        return False  # one item per device fits (each is within the cap: the pigeonhole passed)
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    m = len(items)
    fluid = float(load.sum() - load[items].sum())
    fluid_mem = 0.0 if memory is None else float(memory.sum() - memory[items].sum())
    # variables: x[j, b] (j item, b bin, b <= j), then the fluid load f[b] and fluid memory g[b]
    pairs = [(j, b) for j in range(m) for b in range(min(j + 1, k))]
    nx = len(pairs)
    nv = nx + 2 * k
    rows = m + 2 * k + 2
    a = lil_matrix((rows, nv))
    lower, upper = np.zeros(rows), np.zeros(rows)
    for col, (j, b) in enumerate(pairs):
        a[j, col] = 1.0  # each item in one bin
        a[m + b, col] = float(load[items[j]])
        if memory is not None:
            a[m + k + b, col] = float(memory[items[j]])
    lower[:m] = upper[:m] = 1.0
    for b in range(k):
        a[m + b, nx + b] = 1.0
        a[m + k + b, nx + k + b] = 1.0
        a[m + 2 * k, nx + b] = 1.0
        a[m + 2 * k + 1, nx + k + b] = 1.0
    lower[m : m + k], upper[m : m + k] = -np.inf, limit
    lower[m + k : m + 2 * k], upper[m + k : m + 2 * k] = -np.inf, (mem_cap if memory is not None else np.inf)
    lower[m + 2 * k] = upper[m + 2 * k] = fluid
    lower[m + 2 * k + 1] = upper[m + 2 * k + 1] = fluid_mem
    integrality = np.concatenate([np.ones(nx), np.zeros(2 * k)])
    result = milp(
        np.zeros(nv),
        constraints=LinearConstraint(a.tocsr(), lower, upper),
        integrality=integrality,
        bounds=Bounds(np.zeros(nv), np.concatenate([np.ones(nx), np.full(2 * k, np.inf)])),
        options={"node_limit": PACKING_NODES, "time_limit": PACKING_SECONDS, "presolve": True},
    )
    return result.status == 2  # 2: proven infeasible


def memory_cap_enforced(graph: Graph, k: int) -> float:
    """The per-device memory cap, enforced only when k devices can hold the graph at all
    (otherwise no partition meets it and it is reported, not enforced): inf then."""
    if np.isfinite(graph.memory_cap) and graph.memory.sum() <= k * graph.memory_cap:
        return float(graph.memory_cap)
    return float("inf")


def evaluate(
    graph: Graph, assignment: np.ndarray, k: int, imbalance: float = 0.05, critical: np.ndarray | None = None
) -> dict:
    """All metrics the CLI and the benchmark report for one partition."""
    assignment = np.asarray(assignment, dtype=np.int64)
    if critical is None:
        critical = critical_edges(graph)
    cut = assignment[graph.src] != assignment[graph.dst]
    loads = device_loads(graph, assignment, k)
    mem = np.bincount(assignment, weights=graph.memory, minlength=k)
    avg = float(graph.cost.sum()) / k
    span = makespan(graph, assignment)
    lb = lower_bound(graph, k)
    from trainmaster.partition.graph import clusters_of

    cluster = clusters_of(graph)
    cap = load_cap(graph, k, imbalance, cluster)
    mem_cap = memory_cap_enforced(graph, k)
    return {
        "nodes": graph.n,
        "edges": graph.m,
        "devices": k,
        "critical_edges": int(critical.sum()),
        "critical_cut_count": int((cut & critical).sum()),
        "critical_cut_cost": float(graph.edge_cost[cut & critical].sum()),
        "cut_count": int(cut.sum()),
        "cut_cost": float(graph.edge_cost[cut].sum()),
        "max_load": float(loads.max(initial=0.0)),
        "avg_load": avg,
        "balance": float(loads.max(initial=0.0)) / avg if avg > 0 else 1.0,
        "load_cap": cap,
        "balanced": bool(loads.max(initial=0.0) <= cap * (1 + 1e-9)),
        "memory_per_device": mem.tolist(),
        "memory_cap": None if not np.isfinite(graph.memory_cap) else graph.memory_cap,
        "memory_ok": bool(mem.max(initial=0.0) <= graph.memory_cap),
        "colocation_ok": colocation_respected(graph, assignment),
        "makespan": span,
        "lower_bound": lb,
        "path_cut_bound": path_cut_bound(graph, k, cap, mem_cap, cluster),
        "critical_cut_bound": critical_cut_bound(graph, cap, mem_cap, cluster),
        "device_graph_acyclic": device_graph_acyclic(graph, assignment, k),
    }


def colocation_respected(graph: Graph, assignment: np.ndarray) -> bool:
    grouped = graph.group >= 0
    if not grouped.any():
        return True
    g, a = graph.group[grouped], assignment[grouped]
    order = np.argsort(g, kind="stable")
    g, a = g[order], a[order]
    same = g[1:] == g[:-1]
    return bool(np.all(a[1:][same] == a[:-1][same]))
