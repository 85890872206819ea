"""The DNN computation graph as a CSR DAG: operators with cost and memory, flow edges with costs.

Every algorithm in this package works on dense node indices 0..n-1; ``node_ids`` maps them back
to the ids the user's file used, so that assignments are reported in the user's words.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainmaster.errors import UserError


@dataclass(frozen=True, eq=False)
class Graph:
    """A directed acyclic graph of operators.

    ``cost[v]`` is the compute time of operator v, ``memory[v]`` its bytes, ``edge_cost[e]`` the
    time to move edge e's tensor between devices, ``group[v]`` its co-location class (-1: none;
    nodes sharing a class must share a device), ``memory_cap`` the bytes one device holds (inf:
    unlimited). ``critical_label`` optionally carries user-labelled critical edges.
    """

    node_ids: list
    cost: np.ndarray
    memory: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    edge_cost: np.ndarray
    group: np.ndarray
    memory_cap: float = float("inf")
    names: list[str] | None = None
    critical_label: np.ndarray | None = None
    # derived CSR views, built in __post_init__
    out_ptr: np.ndarray = field(init=False, repr=False)
    out_edge: np.ndarray = field(init=False, repr=False)
    in_ptr: np.ndarray = field(init=False, repr=False)
    in_edge: np.ndarray = field(init=False, repr=False)
    topo: np.ndarray = field(init=False, repr=False)
    cache: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        n = len(self.node_ids)
        for name, arr in (("cost", self.cost), ("memory", self.memory), ("group", self.group)):
            if len(arr) != n:
                raise UserError(f"graph: {name} has {len(arr)} entries for {n} nodes")
        if np.any(self.cost < 0) or np.any(self.edge_cost < 0):
            raise UserError("graph: node and edge costs must be non-negative")
        if np.any(self.src == self.dst):
            bad = int(self.src[np.flatnonzero(self.src == self.dst)[0]])
            raise UserError(f"graph has a cycle: self-loop on node {self.node_ids[bad]!r}")
        out_order = np.lexsort((self.dst, self.src))
        in_order = np.lexsort((self.src, self.dst))
        object.__setattr__(self, "out_edge", out_order.astype(np.int64))
        object.__setattr__(self, "in_edge", in_order.astype(np.int64))
        object.__setattr__(self, "out_ptr", _ptr(self.src, n))
        object.__setattr__(self, "in_ptr", _ptr(self.dst, n))
        object.__setattr__(self, "topo", self._topological_order())
        object.__setattr__(self, "cache", {})

    @property
    def n(self) -> int:
        return len(self.node_ids)

    @property
    def m(self) -> int:
        return len(self.src)

    def successors(self, v: int) -> np.ndarray:
        return self.dst[self.out_edge[self.out_ptr[v] : self.out_ptr[v + 1]]]

    def predecessors(self, v: int) -> np.ndarray:
        return self.src[self.in_edge[self.in_ptr[v] : self.in_ptr[v + 1]]]

    def _topological_order(self) -> np.ndarray:
        """Kahn's algorithm, lowest index first among ready nodes; a leftover means a cycle."""
        n = self.n
        indeg = np.bincount(self.dst, minlength=n).tolist()
        ptr = self.out_ptr.tolist()
        succ = self.dst[self.out_edge].tolist()
        frontier = np.flatnonzero(np.bincount(self.dst, minlength=n) == 0).tolist()
        order: list[int] = []
        while frontier:
            order.extend(frontier)
            nxt: list[int] = []
            for v in frontier:
                for w in succ[ptr[v]:ptr[v + 1]]:
                    indeg[w] -= 1
                    if indeg[w] == 0:
                        nxt.append(w)
            frontier = sorted(nxt)
        if len(order) != n:
            stuck = [self.node_ids[i] for i in np.flatnonzero(np.asarray(indeg) > 0)[:5]]
            raise UserError(
                "graph has a cycle: a DNN computation graph must be a DAG",
                details=[f"nodes on or after a cycle include {stuck}"],
            )
        return np.asarray(order, dtype=np.int64)

    def undirected_csr(self, edge_weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Symmetric CSR (xadj, adjncy, weights) with parallel edges merged, for METIS/KaHIP."""
        n = self.n
        a = np.concatenate([self.src, self.dst])
        b = np.concatenate([self.dst, self.src])
        w = np.concatenate([edge_weight, edge_weight])
        key = a * n + b
        uniq, inv = np.unique(key, return_inverse=True)
        wsum = np.bincount(inv, weights=w)
        ua, ub = uniq // n, uniq % n
        xadj = _ptr(ua, n)
        return xadj, ub.astype(np.int64), wsum

    def with_edges_costs(self, edge_cost: np.ndarray) -> "Graph":
        return Graph(self.node_ids, self.cost, self.memory, self.src, self.dst, edge_cost,
                     self.group, self.memory_cap, self.names, self.critical_label)


def _ptr(keys: np.ndarray, n: int) -> np.ndarray:
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=n), out=ptr[1:])
    return ptr


def build_graph(
    node_ids: list,
    cost,
    edges_src_ids,
    edges_dst_ids,
    edge_cost,
    memory=None,
    group=None,
    memory_cap: float = float("inf"),
    names: list[str] | None = None,
    critical_label=None,
) -> Graph:
    """Build a Graph from user ids, checking that every edge names a known node."""
    index = {nid: i for i, nid in enumerate(node_ids)}
    if len(index) != len(node_ids):
        raise UserError("graph: node ids must be unique")
    unknown = sorted({str(x) for x in list(edges_src_ids) + list(edges_dst_ids) if x not in index})
    if unknown:
        raise UserError("graph: edges name unknown node ids", details=unknown[:10])
    n = len(node_ids)
    src = np.fromiter((index[x] for x in edges_src_ids), dtype=np.int64, count=len(edges_src_ids))
    dst = np.fromiter((index[x] for x in edges_dst_ids), dtype=np.int64, count=len(edges_dst_ids))
    mem = np.zeros(n) if memory is None else np.asarray(memory, dtype=np.float64)
    grp = np.full(n, -1, dtype=np.int64) if group is None else np.asarray(group, dtype=np.int64)
    crit = None if critical_label is None else np.asarray(critical_label, dtype=bool)
    return Graph(list(node_ids), np.asarray(cost, dtype=np.float64), mem, src, dst,
                 np.asarray(edge_cost, dtype=np.float64), grp, float(memory_cap), names, crit)


def clusters_of(graph: Graph) -> np.ndarray:
    """Map each node to its co-location cluster id 0..c-1 (ungrouped nodes are singletons)."""
    key = np.where(graph.group >= 0, graph.group, graph.group.max(initial=0) + 1 + np.arange(graph.n))
    _, cluster = np.unique(key, return_inverse=True)
    return cluster.astype(np.int64)
