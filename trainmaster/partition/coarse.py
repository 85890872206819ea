"""Clusters of operators that move together: co-location classes and coarsened chains.

Every method partitions clusters, never splits one, so co-location holds by construction. The
cluster graph keeps merged, weighted undirected adjacency for METIS/KaHIP and the FM refinement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainmaster.partition.graph import Graph, clusters_of


@dataclass(frozen=True)
class ClusterGraph:
    """``of[v]`` is node v's cluster; ``weight``/``memory`` per cluster; symmetric CSR adjacency
    (``xadj``, ``adjncy``, ``adjw``) of the given edge weights between distinct clusters."""

    of: np.ndarray
    weight: np.ndarray
    memory: np.ndarray
    xadj: np.ndarray
    adjncy: np.ndarray
    adjw: np.ndarray

    @property
    def size(self) -> int:
        return len(self.weight)

    def expand(self, cluster_part: np.ndarray) -> np.ndarray:
        """Node-level assignment from a cluster-level one."""
        return np.asarray(cluster_part, dtype=np.int64)[self.of]


def cluster_graph(graph: Graph, of: np.ndarray, edge_weight: np.ndarray) -> ClusterGraph:
    """The cluster graph of ``of`` with ``edge_weight``. The method builds several over the
    same clusters with different weights, so everything but the edge weights is cached on the
    graph by the cluster map (the weights are summed the same way either way)."""
    key_of = ("cluster_graph", np.asarray(of, dtype=np.int64).tobytes())
    shape = graph.cache.get(key_of)
    if shape is None:
        c = int(of.max()) + 1 if len(of) else 0
        a, b = of[graph.src], of[graph.dst]
        keep = a != b
        a, b = a[keep], b[keep]
        aa, bb = np.concatenate([a, b]), np.concatenate([b, a])
        key = aa * c + bb
        uniq, inv = np.unique(key, return_inverse=True)
        ua, ub = uniq // max(c, 1), uniq % max(c, 1)
        xadj = np.zeros(c + 1, dtype=np.int64)
        np.cumsum(np.bincount(ua, minlength=c), out=xadj[1:])
        shape = (
            keep,
            inv,
            len(uniq),
            xadj,
            ub.astype(np.int64),
            np.bincount(of, weights=graph.cost, minlength=c),
            np.bincount(of, weights=graph.memory, minlength=c),
        )
        graph.cache[key_of] = shape
    keep, inv, nuniq, xadj, adjncy, weight, memory = shape
    w = edge_weight[keep]
    wsum = np.bincount(inv, weights=np.concatenate([w, w])) if nuniq else np.zeros(0)
    return ClusterGraph(of, weight, memory, xadj, adjncy, wsum)


def _relabel(of: np.ndarray) -> np.ndarray:
    _, inv = np.unique(of, return_inverse=True)
    return inv.astype(np.int64)


def coarsen_chains(
    graph: Graph, edge_priority: np.ndarray, max_weight: float, only_chain_links: bool = True
) -> np.ndarray:
    """Merge co-location clusters along edges in descending ``edge_priority`` while the merged
    weight stays <= ``max_weight``. With ``only_chain_links`` an edge merges only when its source
    has one successor and its target one predecessor: such operators run back to back anyway, so
    merging them cannot cost parallelism. Returns a node -> cluster map."""
    of = clusters_of(graph)
    parent = np.arange(int(of.max()) + 1 if len(of) else 0)
    weight = np.bincount(of, weights=graph.cost, minlength=len(parent)).tolist()
    parent_l = parent.tolist()

    def find(x: int) -> int:
        root = x
        while parent_l[root] != root:
            root = parent_l[root]
        while parent_l[x] != root:
            parent_l[x], x = root, parent_l[x]
        return root

    eligible = np.ones(graph.m, dtype=bool)
    if only_chain_links:
        outdeg = np.bincount(graph.src, minlength=graph.n)
        indeg = np.bincount(graph.dst, minlength=graph.n)
        eligible = (outdeg[graph.src] == 1) & (indeg[graph.dst] == 1)
    idx = np.flatnonzero(eligible)
    idx = idx[np.argsort(-edge_priority[idx], kind="stable")]
    cs, cd = of[graph.src[idx]].tolist(), of[graph.dst[idx]].tolist()
    for a, b in zip(cs, cd):
        ra, rb = find(a), find(b)
        if ra != rb and weight[ra] + weight[rb] <= max_weight:
            parent_l[rb] = ra
            weight[ra] += weight[rb]
    roots = np.asarray([find(x) for x in range(len(parent_l))], dtype=np.int64)
    return _relabel(roots[of]) if len(of) else of
