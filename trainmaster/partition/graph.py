"""The DNN computation graph as a CSR DAG: operators with cost and memory, flow edges with costs.

Every algorithm in this package works on dense node indices 0..n-1; ``node_ids`` maps them back
to the ids the user's file used, so that assignments are reported in the user's words.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainmaster.errors import UserError


NEGATIVE_TOLERANCE = 1e-9
"""A negative amount no larger than this fraction of the graph's largest one is rounding: zero."""


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
        for name, arr in (("src", self.src), ("dst", self.dst), ("edge_cost", self.edge_cost)):
            if len(arr) != len(self.src):
                raise UserError(f"graph: {name} has {len(arr)} entries for {len(self.src)} edges")
        self._check_ids()
        object.__setattr__(self, "cost", self._checked_amounts("cost", self.cost, "node"))
        object.__setattr__(self, "memory", self._checked_amounts("memory", self.memory, "node"))
        object.__setattr__(self, "edge_cost", self._checked_amounts("cost", self.edge_cost, "edge"))
        if np.isnan(self.memory_cap) or self.memory_cap < 0:
            raise UserError(
                f"graph: memory_cap is {self.memory_cap}; give the bytes one device holds (>= 0), or none for unlimited"
            )
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

    def _check_ids(self) -> None:
        """Unique node ids and edge endpoints inside 0..n-1: every later index relies on both."""
        seen: dict = {}
        for i, nid in enumerate(self.node_ids):
            if not isinstance(nid, (str, int, np.integer)) or isinstance(nid, bool):
                raise UserError(f"graph: node #{i} has id {nid!r}; ids are strings or integers")
            if nid in seen:
                raise UserError(
                    f"graph: node id {nid!r} appears twice (nodes #{seen[nid]} and #{i}); node ids must be unique"
                )
            seen[nid] = i
        n = len(self.node_ids)
        for name, ends in (("src", self.src), ("dst", self.dst)):
            out = np.flatnonzero((ends < 0) | (ends >= n))
            if len(out):
                e = int(out[0])
                raise UserError(f"graph: edge #{e} has {name} index {int(ends[e])}, outside the {n} nodes")

    def _where(self, kind: str, i: int) -> str:
        if kind == "node":
            return f"node {self.node_ids[i]!r}"
        s, d = int(self.src[i]), int(self.dst[i])
        return f"edge {self.node_ids[s]!r} -> {self.node_ids[d]!r}"

    def _checked_amounts(self, name: str, values: np.ndarray, kind: str) -> np.ndarray:
        """Costs and bytes must be finite and non-negative. A negative within rounding of zero
        (relative to the graph's largest value, NEGATIVE_TOLERANCE) is taken as zero, since
        profilers subtract timings; anything else is refused, naming the first offender."""
        values = np.asarray(values, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            i = int(bad[0])
            raise UserError(
                f"graph: {self._where(kind, i)} has {name} {values[i]}; {name}s must "
                f"be finite numbers ({len(bad)} {kind}(s) affected)"
            )
        scale = float(np.abs(values).max(initial=0.0))
        negative = np.flatnonzero(values < -NEGATIVE_TOLERANCE * scale)
        if len(negative):
            i = int(negative[0])
            raise UserError(
                f"graph: {self._where(kind, i)} has negative {name} {values[i]}; "
                f"{name}s must be >= 0 ({len(negative)} {kind}(s) affected)"
            )
        return np.maximum(values, 0.0) if np.any(values < 0) else values

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
                for w in succ[ptr[v] : ptr[v + 1]]:
                    indeg[w] -= 1
                    if indeg[w] == 0:
                        nxt.append(w)
            frontier = sorted(nxt)
        if len(order) != n:
            cycle = " -> ".join(repr(self.node_ids[v]) for v in self._a_cycle(np.asarray(indeg) > 0))
            raise UserError(
                f"graph has a cycle: {cycle}; a DNN computation graph must be a DAG "
                "(remove or reverse one of these edges)"
            )
        return np.asarray(order, dtype=np.int64)

    def _a_cycle(self, left: np.ndarray) -> list[int]:
        """One directed cycle among the nodes Kahn's algorithm left over: each of them still has a
        left-over predecessor, so walking predecessors must revisit a node; the walk from the first
        revisit back to itself, reversed, is a cycle in edge direction."""
        v = int(np.flatnonzero(left)[0])
        walk: list[int] = []
        position: dict[int, int] = {}
        while v not in position:
            position[v] = len(walk)
            walk.append(v)
            v = next(int(u) for u in self.predecessors(v) if left[u])
        cycle = walk[position[v] :][::-1]
        return cycle + [cycle[0]]

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
        return Graph(
            self.node_ids,
            self.cost,
            self.memory,
            self.src,
            self.dst,
            edge_cost,
            self.group,
            self.memory_cap,
            self.names,
            self.critical_label,
        )


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
    index: dict = {}
    for i, nid in enumerate(node_ids):
        if nid in index:
            raise UserError(
                f"graph: node id {nid!r} appears twice (nodes #{index[nid]} and #{i}); node ids must be unique"
            )
        index[nid] = i
    for e, (s, d) in enumerate(zip(edges_src_ids, edges_dst_ids)):
        for end in (s, d):
            if end not in index:
                raise UserError(
                    f"graph: edge #{e} {s!r} -> {d!r} names unknown node id {end!r}; "
                    "every edge must join two listed nodes"
                )
    n = len(node_ids)
    src = np.fromiter((index[x] for x in edges_src_ids), dtype=np.int64, count=len(edges_src_ids))
    dst = np.fromiter((index[x] for x in edges_dst_ids), dtype=np.int64, count=len(edges_dst_ids))
    mem = np.zeros(n) if memory is None else np.asarray(memory, dtype=np.float64)
    grp = np.full(n, -1, dtype=np.int64) if group is None else np.asarray(group, dtype=np.int64)
    crit = None if critical_label is None else np.asarray(critical_label, dtype=bool)
    return Graph(
        list(node_ids),
        np.asarray(cost, dtype=np.float64),
        mem,
        src,
        dst,
        np.asarray(edge_cost, dtype=np.float64),
        grp,
        float(memory_cap),
        names,
        crit,
    )


def clusters_of(graph: Graph) -> np.ndarray:
    """Map each node to its co-location cluster id 0..c-1 (ungrouped nodes are singletons)."""
    key = np.where(graph.group >= 0, graph.group, graph.group.max(initial=0) + 1 + np.arange(graph.n))
    _, cluster = np.unique(key, return_inverse=True)
    return cluster.astype(np.int64)
