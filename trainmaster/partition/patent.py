"""The disclosure's method as written (steps 1-6 of the spec), kept as a baseline.

1. cluster operators chained together into groups; assign groups at random to k parts; move random
   groups, keeping the assignment with the fewest cut edges (balance respected);
2-5. boundary nodes, first gain g1 (critical relations to its own part) and second gain g2
   (to another part); move nodes whose g2 - g1 > threshold, all at once or the earliest in flow
   order; repeat while the moves create new boundary nodes;
6. keep the partition with the fewest critical relations between parts.
A "node" that moves is its co-location cluster, so co-location always holds.
"""

from __future__ import annotations

import numpy as np

from trainmaster.partition.coarse import coarsen_chains
from trainmaster.partition.graph import Graph, clusters_of


def group_operators(graph: Graph, cap: float) -> np.ndarray:
    """Step 1's clustering: merge along chain links (one successor feeding one predecessor)."""
    return coarsen_chains(graph, np.ones(graph.m), max_weight=cap / 2.0, only_chain_links=True)


def random_initial(
    graph: Graph, groups: np.ndarray, k: int, cap: float, rng: np.random.Generator, moves: int | None = None
) -> np.ndarray:
    """Random group assignment, then random group moves keeping the fewest cut edges."""
    g = int(groups.max()) + 1
    gw = np.bincount(groups, weights=graph.cost, minlength=g)
    part = np.empty(g, dtype=np.int64)
    load = np.zeros(k)
    for grp in rng.permutation(g):
        room = np.flatnonzero(load + gw[grp] <= cap)
        p = int(rng.choice(room)) if len(room) else int(np.argmin(load))
        part[grp] = p
        load[p] += gw[grp]
    a, b = groups[graph.src], groups[graph.dst]
    inter = a != b
    a, b = a[inter], b[inter]
    inc: list[list[int]] = [[] for _ in range(g)]
    for x, y in zip(a.tolist(), b.tolist()):
        inc[x].append(y)
        inc[y].append(x)
    cut = int((part[a] != part[b]).sum())
    best_cut, best = cut, part.copy()
    for _ in range(moves if moves is not None else 20 * g):
        grp = int(rng.integers(g))
        q = int(rng.integers(k))
        p = int(part[grp])
        if q == p or load[q] + gw[grp] > cap:
            continue
        delta = sum(int(part[y] != q) - int(part[y] != p) for y in inc[grp])
        if delta <= 0:  # keep the move when the cut does not grow
            part[grp] = q
            load[p] -= gw[grp]
            load[q] += gw[grp]
            cut += int(delta)
            if cut < best_cut:
                best_cut, best = cut, part.copy()
    return best[groups]


def boundary_nodes(graph: Graph, assignment: np.ndarray) -> np.ndarray:
    """Step 2: nodes with a flow relation to a node in another part."""
    cut = assignment[graph.src] != assignment[graph.dst]
    mask = np.zeros(graph.n, dtype=bool)
    mask[graph.src[cut]] = True
    mask[graph.dst[cut]] = True
    return mask


def gains(
    graph: Graph, assignment: np.ndarray, critical: np.ndarray, k: int, weight: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Step 3: g1[v] (weighted critical relations inside v's part) and g2[v, Q] (to part Q)."""
    s, d = graph.src[critical], graph.dst[critical]
    ps, pd = assignment[s], assignment[d]
    same = ps == pd
    g1 = np.bincount(np.concatenate([s[same], d[same]]), minlength=graph.n) * weight
    g2 = np.zeros((graph.n, k))
    np.add.at(g2, (s[~same], pd[~same]), weight)
    np.add.at(g2, (d[~same], ps[~same]), weight)
    return g1.astype(np.float64), g2


def patent_partition(
    graph: Graph,
    k: int,
    cap: float,
    critical: np.ndarray,
    seed: int = 0,
    threshold: float = 0.0,
    move_all: bool = True,
    max_rounds: int | None = None,
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    groups = group_operators(graph, cap)
    part = random_initial(graph, groups, k, cap, rng)
    cluster = clusters_of(graph)
    cw = np.bincount(cluster, weights=graph.cost)
    pos = np.empty(graph.n, dtype=np.int64)
    pos[graph.topo] = np.arange(graph.n)

    def crit_cut(a: np.ndarray) -> int:
        return int((critical & (a[graph.src] != a[graph.dst])).sum())

    best, best_cc = part.copy(), crit_cut(part)
    seen = boundary_nodes(graph, part)
    for _ in range(max_rounds or graph.n):
        g1, g2 = gains(graph, part, critical, k)
        diff = g2 - g1[:, None]
        diff[np.arange(graph.n), part] = -np.inf
        q = np.argmax(diff, axis=1)
        movable = diff[np.arange(graph.n), q] > threshold
        cand = np.flatnonzero(movable & boundary_nodes(graph, part))
        cand = cand[np.argsort(pos[cand], kind="stable")]
        load = np.bincount(part, weights=graph.cost, minlength=k)
        moved_clusters: set[int] = set()
        for v in cand.tolist():
            c = int(cluster[v])
            if c in moved_clusters:
                continue
            p, target = int(part[v]), int(q[v])
            if load[target] + cw[c] > cap:
                continue
            part[cluster == c] = target
            load[p] -= cw[c]
            load[target] += cw[c]
            moved_clusters.add(c)
            if not move_all:
                break  # flow order: only the earliest qualifying node
        cc = crit_cut(part)
        if cc < best_cc:
            best, best_cc = part.copy(), cc
        bnd = boundary_nodes(graph, part)
        new = bnd & ~seen
        if not moved_clusters or not new.any():
            break
        seen |= bnd
    return best
