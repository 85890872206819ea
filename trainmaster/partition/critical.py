"""Critical edges from slack: which flow relations lie on (or near) the longest path.

With operator costs w and transfer costs c, the earliest start time EST (top level) and the
bottom level b give each edge (u, v) the length of the longest path through it,
EST[u] + w[u] + c[u,v] + b[v]; its slack is the critical-path length minus that. An edge is
critical when slack <= delta * critical-path length. The static definition charges every edge its
transfer cost (as HEFT's ranks do); the partition-aware one charges only edges that cross devices,
which is what the refinement optimises.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainmaster.partition.graph import Graph


@dataclass(frozen=True)
class Levels:
    """Top level (EST), bottom level (including the node's own cost) and critical-path length."""

    est: np.ndarray
    blevel: np.ndarray
    length: float


def _charged(graph: Graph, assignment: np.ndarray | None) -> np.ndarray:
    if assignment is None:
        return graph.edge_cost
    return np.where(assignment[graph.src] != assignment[graph.dst], graph.edge_cost, 0.0)


def levels(graph: Graph, assignment: np.ndarray | None = None) -> Levels:
    """EST and b-level in one forward and one backward sweep over edges in topological order.

    ``assignment`` None charges every edge (static, cached on the graph: the method, the
    simulator's priorities and the descent all need it); otherwise only cut edges pay transfer.
    """
    if assignment is None:
        cached = graph.cache.get("levels")
        if cached is None:
            cached = graph.cache["levels"] = _levels(graph, None)
        return cached
    return _levels(graph, assignment)


def _levels(graph: Graph, assignment: np.ndarray | None) -> Levels:
    n = graph.n
    sweeps = graph.cache.get("level_sweeps")
    if sweeps is None:  # the edge orders depend on the graph only: made once per graph
        pos = np.empty(n, dtype=np.int64)
        pos[graph.topo] = np.arange(n)
        src, dst = graph.src, graph.dst
        fwd = np.argsort(pos[src], kind="stable")
        bwd = np.argsort(-pos[dst], kind="stable")
        sweeps = (
            fwd,
            src[fwd].tolist(),
            dst[fwd].tolist(),
            bwd,
            src[bwd].tolist(),
            dst[bwd].tolist(),
            graph.cost.tolist(),
        )
        graph.cache["level_sweeps"] = sweeps
    fwd, src_f, dst_f, bwd, src_b, dst_b, w = sweeps
    c = _charged(graph, assignment)
    est = [0.0] * n
    for s, d, ce in zip(src_f, dst_f, c[fwd].tolist()):
        t = est[s] + w[s] + ce
        if t > est[d]:
            est[d] = t
    tail = [0.0] * n
    for s, d, ce in zip(src_b, dst_b, c[bwd].tolist()):
        t = ce + w[d] + tail[d]
        if t > tail[s]:
            tail[s] = t
    est_a = np.asarray(est)
    bl = graph.cost + np.asarray(tail)
    length = float(np.max(est_a + bl)) if n else 0.0
    return Levels(est_a, bl, length)


def edge_slack(graph: Graph, assignment: np.ndarray | None = None, lv: Levels | None = None) -> np.ndarray:
    """Slack of each edge: how much it could grow before it lengthens the critical path."""
    lv = lv or levels(graph, assignment)
    charge = _charged(graph, assignment)
    through = lv.est[graph.src] + graph.cost[graph.src] + charge + lv.blevel[graph.dst]
    return lv.length - through


def critical_edges(
    graph: Graph, delta: float = 0.0, assignment: np.ndarray | None = None, lv: Levels | None = None
) -> np.ndarray:
    """Boolean mask of critical edges (slack <= delta * L), OR-ed with user labels if present."""
    lv = lv or levels(graph, assignment)
    slack = edge_slack(graph, assignment, lv)
    tol = max(delta * lv.length, 1e-9 * max(lv.length, 1.0))
    mask = slack <= tol
    if graph.critical_label is not None:
        mask = mask | graph.critical_label
    return mask


def critical_path_without_transfers(graph: Graph) -> float:
    """Longest path counting compute only: the makespan of an infinitely parallel machine."""
    return levels(graph.with_edges_costs(np.zeros(graph.m))).length
