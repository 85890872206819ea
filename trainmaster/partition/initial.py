"""Initial partitions: an acyclic split of the topological order, capped list scheduling, and
METIS/KaHIP on a weighted cluster graph (also the baselines).

All of them assign clusters (see coarse.py), so co-location is kept by construction.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from trainmaster.partition.coarse import ClusterGraph
from trainmaster.partition.critical import levels
from trainmaster.partition.graph import Graph
from trainmaster.partition.native_output import native_noise_as_warning
from trainmaster.partition.simulate import predecessor_lists, static_order


def cluster_order(graph: Graph, of: np.ndarray, node_order: np.ndarray | None = None) -> np.ndarray:
    """Clusters sorted by the position of their first operator in ``node_order`` (a topological
    order of the nodes; the graph's own by default)."""
    pos = np.empty(graph.n, dtype=np.int64)
    pos[graph.topo if node_order is None else node_order] = np.arange(graph.n)
    first = np.full(int(of.max()) + 1, graph.n, dtype=np.int64)
    np.minimum.at(first, of, pos)
    return np.argsort(first, kind="stable")


def sources_late(graph: Graph, node_order: np.ndarray | None = None) -> np.ndarray:
    """``node_order`` (a topological order; the graph's own by default) with every source (an
    operator no edge enters: a parameter, a constant, an input) moved to just before its first
    reader. Why: traced graphs list all parameters first, so a contiguous split of the plain
    order puts every parameter on the first device and every later layer pays for its weights
    (a 256 x 256 weight is 22 ms over a 100 Mbit/s link, measured on GPT-2 4x256 at k = 2: 27
    cut edges and 31.5 ms against 5 cut edges for METIS); moved next to their readers they
    travel with their layer. Still topological: a source has no predecessor."""
    n = graph.n
    order = graph.topo if node_order is None else np.asarray(node_order)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    key = pos.astype(float)
    first = np.full(n, n, dtype=np.int64)  # position of each node's first reader
    np.minimum.at(first, graph.src, pos[graph.dst])
    late = (np.diff(graph.in_ptr) == 0) & (first < n)
    key[late] = first[late] - 0.5
    return np.lexsort((pos, key))


def acyclic_split(
    graph: Graph, cg: ClusterGraph, k: int, cap: float, node_order: np.ndarray | None = None
) -> np.ndarray | None:
    """Cut the topological order of clusters into at most k contiguous segments, each within the
    load cap, minimising the weight of edges crossing the cuts (exact dynamic programme over cut
    positions, O(k n) with a sliding-window minimum). Contiguous segments make the device
    graph a chain, which is what a pipeline needs. None when no such split fits the cap.
    ``node_order`` picks the topological order swept (e.g. by earliest start time)."""
    order = cluster_order(graph, cg.of, node_order)
    c = cg.size
    pos = np.empty(c, dtype=np.int64)
    pos[order] = np.arange(c)
    rows = np.repeat(np.arange(c), np.diff(cg.xadj))
    half = rows < cg.adjncy
    cross = _boundary_costs(pos[rows[half]], pos[cg.adjncy[half]], cg.adjw[half], c)
    seg = split_sequence(cg.weight[order], cross, k, cap)
    if seg is None:
        return None
    part = np.empty(c, dtype=np.int64)
    part[order] = seg
    return part


def _boundary_costs(pa: np.ndarray, pb: np.ndarray, w: np.ndarray, c: int) -> np.ndarray:
    """cross[p]: weight of the edges (positions pa-pb, weight w) that a boundary placed before
    position p of a sequence of c items would cut (0 at both ends)."""
    lo, hi = np.minimum(pa, pb), np.maximum(pa, pb)
    diff = np.zeros(c + 2)
    np.add.at(diff, lo + 1, w)
    np.add.at(diff, hi + 1, -w)
    cross = np.cumsum(diff)[: c + 1]
    cross[0] = cross[c] = 0.0
    return cross


def split_sequence(load: np.ndarray, cross: np.ndarray, k: int, cap: float) -> np.ndarray | None:
    """Segment index (0..k-1) of each item when a sequence is cut into at most k contiguous
    segments of load <= cap at the least total boundary cost ``cross`` (exact DP over cut
    positions); None when no such split exists. Each DP layer needs, for every position p,
    the leftmost argmin of the previous layer over the window [first start that fits, p];
    both ends only move right, so a monotone deque gives them all in O(c) (plain lists: at
    these sizes numpy's per-call cost dominated the range-minimum tables used before)."""
    c = len(load)
    prefix = np.concatenate([[0.0], np.cumsum(load)])
    slack = cap * (1 + 1e-12)
    window_lo = np.searchsorted(prefix, prefix - slack, side="left").tolist()
    cross_l = np.asarray(cross, dtype=float).tolist()
    dp = [np.inf] * (c + 1)
    dp[0] = 0.0
    back: list[list[int]] = []
    for _ in range(k - 1):
        arg = [0] * (c + 1)
        window: deque[int] = deque()  # positions, values non-decreasing; ties keep the earlier
        for p in range(c + 1):
            x = dp[p]
            while window and dp[window[-1]] > x:
                window.pop()
            window.append(p)
            lo = window_lo[p]
            while window[0] < lo:
                window.popleft()
            arg[p] = window[0]
        back.append(arg)
        dp = [dp[a] + cr for a, cr in zip(arg, cross_l)]
    dp_a = np.asarray(dp)
    last_ok = prefix[c] - prefix <= slack
    if not np.isfinite(dp_a[last_ok]).any():
        return None
    end = int(np.flatnonzero(last_ok)[np.argmin(dp_a[last_ok])])
    bounds = [end]
    for arg in reversed(back):
        end = arg[end]
        bounds.append(end)
    bounds = sorted(bounds)[1:] + [c]  # drop the leading 0 boundary, close with c
    seg_of_pos = np.searchsorted(np.asarray(bounds), np.arange(c), side="right")
    return np.minimum(seg_of_pos, k - 1)


def capped_list_schedule(
    graph: Graph,
    cg: ClusterGraph,
    k: int,
    cap: float,
    priority: np.ndarray,
    fixed: np.ndarray | None = None,
    mem_cap: float = float("inf"),
    penalty: np.ndarray | None = None,
) -> np.ndarray:
    """HEFT-style earliest-finish placement under the load and memory caps: operators in
    b-level order; the first operator of a cluster fixes the device of the whole cluster, picked
    as the one with room on both caps that finishes it earliest (transfers only from predecessors
    on other devices; when no device has room, the earliest finish among all). ``fixed``
    (cluster -> device, -1 free) pins clusters in advance, their load counted from the start.
    ``penalty`` (per edge) is added to a device's finish time for each penalised in-edge it
    would cut, so the schedule cuts a critical edge only when that saves more than the penalty
    (the final choice's objective: makespan + penalty of the critical edges cut)."""
    of = cg.of.tolist()
    cw, cm = cg.weight.tolist(), cg.memory.tolist()
    w = graph.cost.tolist()
    preds = predecessor_lists(graph)
    pen: list[list[tuple[int, float]]] = [[] for _ in range(graph.n)]  # (pred, penalty) per node
    if penalty is not None:
        hit = np.flatnonzero(penalty > 0)
        for u, v, p in zip(graph.src[hit].tolist(), graph.dst[hit].tolist(), penalty[hit].tolist()):
            pen[v].append((u, p))
    part_of_cluster = [-1] * cg.size
    load, mem = [0.0] * k, [0.0] * k
    if fixed is not None:
        part_of_cluster = np.asarray(fixed, dtype=np.int64).tolist()
        pinned = fixed >= 0
        load = np.bincount(fixed[pinned], weights=cg.weight[pinned], minlength=k).tolist()
        mem = np.bincount(fixed[pinned], weights=cg.memory[pinned], minlength=k).tolist()
    free = [0.0] * k
    finish = [0.0] * graph.n
    dev = [0] * graph.n
    devices = range(k)
    for v in _pop_order(graph, priority):
        c = of[v]
        d = part_of_cluster[c]
        pv = preds[v]
        if d < 0:  # a cluster's first operator: the device with room that finishes it first
            wc, mc = cw[c], cm[c]
            roomy = []  # a loop, not a comprehension (a call each in Python 3.11)
            for dd in devices:
                if load[dd] + wc <= cap and mem[dd] + mc <= mem_cap:
                    roomy.append(dd)
            # among the devices with room (all when none has): the lowest finish time plus
            # the penalties of the in-edges it would cut, then the earliest finish, then the
            # lightest load, then the lowest index
            total = 0.0
            kept: dict[int, float] = {}  # penalty of the in-edges that stay uncut per device
            for u, pu in pen[v]:
                total += pu
                kept[dev[u]] = kept.get(dev[u], 0.0) + pu
            best, d, wv = None, 0, w[v]
            for dd in roomy or devices:
                s = free[dd]
                for u, cu in pv:
                    t = finish[u] + cu if dev[u] != dd else finish[u]
                    if t > s:
                        s = t
                fd = s + wv
                key = (fd + total - kept.get(dd, 0.0), fd, load[dd])
                if best is None or key < best:
                    best, d = key, dd
            assert best is not None  # at least one device is tried
            f = best[1]
            part_of_cluster[c] = d
            load[d] += wc
            mem[d] += mc
        else:  # the cluster placed already: v finishes on its device
            s = free[d]
            for u, cu in pv:
                t = finish[u] + cu if dev[u] != d else finish[u]
                if t > s:
                    s = t
            f = s + w[v]
        finish[v] = free[d] = f
        dev[v] = d
    return np.asarray(part_of_cluster, dtype=np.int64)


def critical_path_pins(
    graph: Graph, cg: ClusterGraph, k: int, cap: float, est: np.ndarray, critical: np.ndarray
) -> np.ndarray:
    """Pin the clusters on the critical path (endpoints of ``critical`` edges) to devices in
    contiguous segments along the path (by earliest start ``est``), cut only where the load cap
    forces it and there at the cheapest critical edges (``split_sequence``): CPOP's "critical
    path on one processor", split as the cap demands. Returns cluster -> device, -1 off the path."""
    pins = np.full(cg.size, -1, dtype=np.int64)
    ends = np.concatenate([graph.src[critical], graph.dst[critical]])
    if len(ends) == 0:
        return pins
    first = np.full(cg.size, np.inf)
    np.minimum.at(first, cg.of[ends], est[ends])
    clusters = np.flatnonzero(np.isfinite(first))
    clusters = clusters[np.argsort(first[clusters], kind="stable")]
    pos = np.full(cg.size, -1, dtype=np.int64)
    pos[clusters] = np.arange(len(clusters))
    a, b = pos[cg.of[graph.src[critical]]], pos[cg.of[graph.dst[critical]]]
    inner = a != b
    cross = _boundary_costs(a[inner], b[inner], graph.edge_cost[critical][inner], len(clusters))
    seg = split_sequence(cg.weight[clusters], cross, k, cap)
    if seg is not None:
        pins[clusters] = seg
    return pins


def _pop_order(graph: Graph, priority: np.ndarray) -> list[int]:
    """The order list scheduling takes operators in: highest priority among the ready ones, ties
    to the lower index. It does not depend on the devices chosen, so it is computed up front:
    when sorting by (-priority, index) is already topological, that sort is the order."""
    import heapq

    n = graph.n
    order = static_order(graph)
    if order is not None and priority is levels(graph).blevel:
        return order  # the simulator's plan already holds this sort, and it is topological
    by_priority = np.lexsort((np.arange(n), -priority))
    rank = np.empty(n, dtype=np.int64)
    rank[by_priority] = np.arange(n)
    if np.all(rank[graph.src] < rank[graph.dst]):
        return by_priority.tolist()
    prio = priority.tolist()
    out_ptr = graph.out_ptr.tolist()
    succ = graph.dst[graph.out_edge].tolist()
    indeg = np.bincount(graph.dst, minlength=n).tolist()
    heap = [(-prio[v], v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(heap)
    popped: list[int] = []
    while heap:
        _, v = heapq.heappop(heap)
        popped.append(v)
        for x in succ[out_ptr[v] : out_ptr[v + 1]]:
            indeg[x] -= 1
            if indeg[x] == 0:
                heapq.heappush(heap, (-prio[x], x))
    return popped


def packed(cg: ClusterGraph, k: int, cap: float, mem_cap: float = float("inf"), by_memory: bool = False) -> np.ndarray:
    """Longest-processing-time bin packing of clusters (heaviest first onto the least loaded
    device that has room on both caps): a start that fits when the cut-driven candidates and
    single-cluster rebalancing cannot meet tight caps (few, large clusters). ``by_memory`` packs
    by memory instead of load, for when memory is the tighter cap. Where that leaves a device
    over the cap, best-fit decreasing (each cluster onto the fullest device it fits) is tried
    too, the lower busiest device kept, and ``level_loads`` lowers it further."""
    limit = cap * (1 + 1e-9)
    out, load = _pack(cg, k, limit, mem_cap, by_memory, fullest=False)
    if load > limit:
        other, other_load = _pack(cg, k, limit, mem_cap, by_memory, fullest=True)
        if other_load < load:
            out = other
        out = level_loads(cg.weight, cg.memory, out, k, cap, mem_cap)
    return out


def _pack(
    cg: ClusterGraph, k: int, limit: float, mem_cap: float, by_memory: bool, fullest: bool
) -> tuple[np.ndarray, float]:
    """One greedy packing, heaviest cluster first, onto the least filled (``fullest``: the most
    filled) device with room on both caps, the least filled when none has; (parts, top load)."""
    load, mem = [0.0] * k, [0.0] * k
    weight, memory = cg.weight.tolist(), cg.memory.tolist()
    part = [0] * cg.size
    level = mem if by_memory else load
    devices = range(k)
    for c in np.argsort(-(cg.memory if by_memory else cg.weight), kind="stable").tolist():
        wc, mc = weight[c], memory[c]
        p = -1
        for d in devices:
            if mem[d] + mc <= mem_cap and load[d] + wc <= limit:
                if p < 0 or (level[d] > level[p] if fullest else level[d] < level[p]):
                    p = d
        if p < 0:
            p = min(devices, key=level.__getitem__)
        part[c] = p
        load[p] += wc
        mem[p] += mc
    return np.asarray(part, dtype=np.int64), max(load, default=0.0)


LEVEL_STEPS = 256  # most moves or swaps ``level_loads`` makes
LEVEL_SWAP_UNITS = 16  # the busiest device's heaviest distinct unit loads tried for swaps


def level_loads(
    weight: np.ndarray, memory: np.ndarray, part: np.ndarray, k: int, cap: float, mem_cap: float = float("inf")
) -> np.ndarray:
    """Lower the busiest device's load until it is within ``cap``: move one of its units to
    another device, or swap one of its ``LEVEL_SWAP_UNITS`` heaviest (distinct loads) for a
    lighter unit of another, whichever leaves the pair's larger load lowest (memory kept within
    ``mem_cap``); stop at the cap or when no move or swap lowers it. Why: longest-processing-time
    packing stops a few percent over a tight cap where a within-cap assignment exists (traced
    inception-6 at k = 8: LPT 1.060x the average against a 5% cap; a packing at 1.034x exists);
    the exchange neighbourhood of makespan scheduling gets below the cap there. Each step lowers
    the busiest device's load or, on ties, the number of devices that carry it, so it ends;
    at most ``LEVEL_STEPS`` steps, each O(units x k)."""
    part = np.asarray(part, dtype=np.int64).copy()
    w = np.asarray(weight, dtype=float)
    m = np.asarray(memory, dtype=float)
    load = np.bincount(part, weights=w, minlength=k)
    mem = np.bincount(part, weights=m, minlength=k)
    limit = cap * (1 + 1e-9)
    tol = 1e-12 * max(float(load.sum()), 1e-300)
    for _ in range(LEVEL_STEPS):
        p = int(np.argmax(load))
        if load[p] <= limit:
            break
        mine = np.flatnonzero(part == p)
        best, pick = load[p] - tol, None
        # moves, every unit of p to every device: the pair's larger load max(load[p] - w_a, load[q] + w_a)
        after = np.maximum(load[p] - w[mine][:, None], load[None, :] + w[mine][:, None])
        after[:, p] = np.inf
        after[mem[None, :] + m[mine][:, None] > mem_cap] = np.inf
        i, t = np.unravel_index(int(np.argmin(after)), after.shape)
        if after[i, t] < best:
            best, pick = float(after[i, t]), (int(mine[i]), int(t), -1)
        rest = np.flatnonzero(part != p)
        if len(rest):
            _, first = np.unique(-w[mine], return_index=True)  # heaviest distinct loads first
            q_of = part[rest]
            for a in mine[first[:LEVEL_SWAP_UNITS]].tolist():
                # swap a with b (lighter, on q): max(load[p] - d, load[q] + d), d = w_a - w_b > 0
                d = w[a] - w[rest]
                pair = np.maximum(load[p] - d, load[q_of] + d)
                ok = (d > 0) & (mem[q_of] + m[a] - m[rest] <= mem_cap) & (mem[p] - m[a] + m[rest] <= mem_cap)
                pair[~ok] = np.inf
                j = int(np.argmin(pair))
                if pair[j] < best:
                    best, pick = float(pair[j]), (a, int(q_of[j]), int(rest[j]))
        if pick is None:
            break
        a, q, b = pick
        for v, frm, to in ((a, p, q), (b, q, p)) if b >= 0 else ((a, p, q),):
            part[v] = to
            load[frm] -= w[v]
            load[to] += w[v]
            mem[frm] -= m[v]
            mem[to] += m[v]
    return part


def _int_weights(cg: ClusterGraph) -> tuple[np.ndarray, np.ndarray]:
    """METIS/KaHIP need integers: loads scaled to ~1e6 in total, edge weights to 1..1e4."""
    total = cg.weight.sum()
    vw = np.rint(cg.weight / total * 1e6).astype(np.int64) if total > 0 else np.ones(cg.size, np.int64)
    top = cg.adjw.max(initial=0.0)
    ew = (np.rint(cg.adjw / top * 1e4).astype(np.int64) + 1) if top > 0 else np.ones(len(cg.adjw), np.int64)
    return vw, ew


def metis_parts(cg: ClusterGraph, k: int, imbalance: float, seed: int = 0) -> np.ndarray:
    """k-way METIS (never recursive bisection: pymetis picks it silently for k <= 8 by default)."""
    import pymetis

    if k == 1 or cg.size <= 1:
        return np.zeros(cg.size, dtype=np.int64)
    vw, ew = _int_weights(cg)
    opts = pymetis.Options(ufactor=max(1, int(round(1000 * imbalance))), seed=seed)
    with native_noise_as_warning("METIS"):
        _, parts = pymetis.part_graph(
            k, pymetis.CSRAdjacency(cg.xadj, cg.adjncy), vweights=vw, eweights=ew, recursive=False, options=opts
        )
    return np.asarray(parts, dtype=np.int64)


def kahip_parts(cg: ClusterGraph, k: int, imbalance: float, seed: int = 0, mode: int = 1) -> np.ndarray:
    """KaHIP's kaffpa (mode 0 fast, 1 eco, 2 strong); positional arguments as the binding wants."""
    import kahip

    if k == 1 or cg.size <= 1:
        return np.zeros(cg.size, dtype=np.int64)
    vw, ew = _int_weights(cg)
    with native_noise_as_warning("KaHIP"):
        _, blocks = kahip.kaffpa(
            vw.tolist(), cg.xadj.tolist(), ew.tolist(), cg.adjncy.tolist(), k, float(imbalance), True, seed, mode
        )
    return np.asarray(blocks, dtype=np.int64)
