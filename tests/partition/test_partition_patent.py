"""The disclosure's method, step by step."""

import numpy as np

from trainmaster.partition import build_graph, critical_edges, evaluate, partition
from trainmaster.partition.patent import boundary_nodes, gains, group_operators, patent_partition, random_initial
from trainmaster.partition.simulate import load_cap


def two_chains():
    # two parallel chains a0..a4 and b0..b4 joined at a sink
    ids = [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(5)] + ["t"]
    src = [f"a{i}" for i in range(4)] + [f"b{i}" for i in range(4)] + ["a4", "b4"]
    dst = [f"a{i}" for i in range(1, 5)] + [f"b{i}" for i in range(1, 5)] + ["t", "t"]
    return build_graph(ids, [1.0] * 10 + [0.5], src, dst, [1.0] * 10)


def test_step1_groups_follow_chains():
    """Mechanism: step 1 clustering groups operators chained together."""
    g = two_chains()
    groups = group_operators(g, cap=100.0)
    assert len(set(groups[:5])) == 1 and len(set(groups[5:10])) == 1
    assert groups[0] != groups[5]


def test_step1_random_moves_keep_fewest_cut_edges():
    """Mechanism: random group assignment then random group moves keeping the fewest cut edges."""
    g = two_chains()
    groups = np.arange(g.n)  # singletons, so the walk has work to do
    cap = load_cap(g, 2, 0.3)
    rng = np.random.default_rng(0)
    start = random_initial(g, groups, 2, cap, rng, moves=0)
    after = random_initial(g, groups, 2, cap, np.random.default_rng(0), moves=400)

    def cut(a):
        return int((a[g.src] != a[g.dst]).sum())

    assert cut(after) <= cut(start)
    assert np.bincount(after, weights=g.cost, minlength=2).max() <= cap + 1e-9


def test_steps2_3_boundary_nodes_and_gains():
    """Mechanism: boundary nodes, first gain g1 (own part) and second gain g2 (other part)."""
    g = build_graph(["u", "v", "w", "x"], [1, 1, 1, 1], ["u", "v", "w"], ["v", "w", "x"], [1, 1, 1])
    part = np.array([0, 0, 1, 1])
    assert boundary_nodes(g, part).tolist() == [False, True, True, False]
    crit = np.array([True, True, True])
    g1, g2 = gains(g, part, crit, 2)
    assert g1.tolist() == [1, 1, 1, 1]
    assert g2[1].tolist() == [0, 1] and g2[2].tolist() == [1, 0]
    # a chain node has g2 - g1 = 0: the literal rule (> 0) does not move it
    assert (g2[1, 1] - g1[1]) == 0


def test_steps4_6_moves_improve_and_best_kept():
    """Mechanism: moves with g2 - g1 > threshold until no new boundary node; keep fewest critical."""
    g = build_graph(list(range(6)), [1] * 6, [0, 0, 1, 3, 4], [1, 2, 2, 4, 5], [1] * 5)
    crit = np.ones(g.m, dtype=bool)
    res = patent_partition(g, 2, cap=4.0, critical=crit, seed=3)
    cc = int((crit & (res[g.src] != res[g.dst])).sum())
    assert cc == 0  # {0,1,2} and {3,4,5} are separable without cutting anything
    assert np.bincount(res, minlength=2).max() <= 4


def test_patent_method_respects_balance_on_random_graphs():
    """Mechanism: balance is a hard constraint for the patent method's moves."""
    rng = np.random.default_rng(1)
    n = 50
    edges = sorted({(int(u), int(u) + int(d)) for u, d in zip(rng.integers(0, n - 5, 120), rng.integers(1, 5, 120))})
    g = build_graph(
        list(range(n)),
        rng.uniform(0.5, 2, n),
        [e[0] for e in edges],
        [e[1] for e in edges],
        rng.uniform(0, 1, len(edges)),
    )
    for k in (2, 4):
        res = partition(g, k, "patent", seed=2)
        ev = evaluate(g, res.assignment, k)
        assert ev["balanced"] and ev["colocation_ok"]
        assert critical_edges(g).sum() == ev["critical_edges"]
