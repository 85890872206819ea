"""The exact optimum of the cost-weighted critical cut, as a MILP for scipy's HiGHS.

Variables: x[c, p] = 1 when co-location cluster c is on device p; y[e] >= |x[a, p] - x[b, p]|
for each (merged) critical cluster edge e, so y[e] = 1 exactly when e is cut. Minimise
sum cost[e] * y[e] subject to one device per cluster, the load cap and (when feasible) the
memory cap. Cluster 0 (the heaviest) is pinned to device 0 to remove some of the k! symmetry.
Used on small graphs to tell how far the heuristics are from optimal.
"""

from __future__ import annotations

import numpy as np

from trainmaster.partition.coarse import cluster_graph
from trainmaster.partition.critical import critical_edges
from trainmaster.partition.graph import Graph, clusters_of
from trainmaster.partition.simulate import load_cap, memory_cap_enforced


def ilp_partition(
    graph: Graph, k: int, imbalance: float, delta: float = 0.0, time_limit: float = 120.0
) -> tuple[np.ndarray, dict]:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    base = clusters_of(graph)
    crit = critical_edges(graph, delta)
    cg = cluster_graph(graph, base, graph.edge_cost * crit)
    c = cg.size
    cap = load_cap(graph, k, imbalance, base)
    mem_cap = memory_cap_enforced(graph, k)
    rows_all = np.repeat(np.arange(c), np.diff(cg.xadj))
    keep = (rows_all < cg.adjncy) & (cg.adjw > 0)
    ea, eb, ew = rows_all[keep], cg.adjncy[keep], cg.adjw[keep]
    m = len(ea)
    nx = c * k
    nvar = nx + m

    def xi(cl, p):
        return cl * k + p

    r, cols, vals, lo, hi = [], [], [], [], []
    row = 0
    for cl in range(c):  # one device per cluster
        r += [row] * k
        cols += [xi(cl, p) for p in range(k)]
        vals += [1.0] * k
        lo.append(1.0)
        hi.append(1.0)
        row += 1
    for p in range(k):  # load (and memory) caps
        r += [row] * c
        cols += [xi(cl, p) for cl in range(c)]
        vals += cg.weight.tolist()
        lo.append(-np.inf)
        hi.append(cap * (1 + 1e-9))
        row += 1
        if np.isfinite(mem_cap):
            r += [row] * c
            cols += [xi(cl, p) for cl in range(c)]
            vals += cg.memory.tolist()
            lo.append(-np.inf)
            hi.append(mem_cap)
            row += 1
    for e in range(m):  # y_e >= x[a,p] - x[b,p] and >= x[b,p] - x[a,p]
        a, b = int(ea[e]), int(eb[e])
        for p in range(k):
            for s, t in ((a, b), (b, a)):
                r += [row, row, row]
                cols += [nx + e, xi(s, p), xi(t, p)]
                vals += [1.0, -1.0, 1.0]
                lo.append(0.0)
                hi.append(np.inf)
                row += 1
    A = coo_matrix((vals, (r, cols)), shape=(row, nvar)).tocsr()
    cost = np.concatenate([np.zeros(nx), ew])
    integrality = np.concatenate([np.ones(nx), np.zeros(m)])
    lb = np.zeros(nvar)
    ub = np.ones(nvar)
    heaviest = int(np.argmax(cg.weight))
    lb[xi(heaviest, 0)] = 1.0
    res = milp(
        cost,
        constraints=LinearConstraint(A, lo, hi),
        integrality=integrality,
        bounds=Bounds(lb, ub),
        options={"time_limit": time_limit, "disp": False},
    )
    if res.x is None:
        return np.zeros(graph.n, dtype=np.int64), {"status": res.message, "optimal": False}
    x = res.x[:nx].reshape(c, k)
    part = np.argmax(x, axis=1)
    return cg.expand(part), {
        "status": res.message,
        "optimal": bool(res.status == 0),
        "objective": float(res.fun),
        "mip_gap": float(getattr(res, "mip_gap", np.nan) or 0.0),
    }
