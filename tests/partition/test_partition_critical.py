"""Slack and critical edges on hand-made DAGs with known answers."""

import numpy as np
import pytest

from trainmaster.partition import build_graph, critical_edges, edge_slack, levels
from trainmaster.partition.critical import critical_path_without_transfers


def diamond():
    # a -> b -> d and a -> c -> d; b is heavy so a-b-d is the critical path
    return build_graph(
        ["a", "b", "c", "d"], [1.0, 5.0, 2.0, 1.0], ["a", "a", "b", "c"], ["b", "c", "d", "d"], [1.0, 1.0, 1.0, 1.0]
    )


def test_levels_est_and_blevel_static():
    """Mechanism: EST / b-level with every edge charged its transfer cost (static definition)."""
    lv = levels(diamond())
    assert lv.est.tolist() == [0.0, 2.0, 2.0, 8.0]
    assert lv.blevel.tolist() == [9.0, 7.0, 4.0, 1.0]
    assert lv.length == 9.0


def test_edge_slack_and_critical_mask_static():
    """Mechanism: edge slack = L - (EST[u] + w[u] + c + b[v]); critical when slack <= delta*L."""
    g = diamond()
    assert edge_slack(g).tolist() == [0.0, 3.0, 0.0, 3.0]
    assert critical_edges(g).tolist() == [True, False, True, False]
    # delta = 1/3 -> threshold 3 makes the side branch critical too
    assert critical_edges(g, delta=1 / 3).all()


def test_partition_aware_slack_charges_only_cut_edges():
    """Mechanism: partition-aware slack (transfer paid only across devices)."""
    g = diamond()
    same = np.zeros(4, dtype=np.int64)
    lv = levels(g, same)
    assert lv.length == 7.0  # 1 + 5 + 1, no transfers
    # put c alone on device 1: a->c and c->d now pay 1 each, path a-c-d = 1+1+2+1+1 = 6 < 7
    part = np.array([0, 0, 1, 0])
    assert levels(g, part).length == 7.0
    assert edge_slack(g, part).tolist() == [0.0, 1.0, 0.0, 1.0]
    # make c heavy: now the cut branch decides the length
    g2 = build_graph(
        ["a", "b", "c", "d"], [1.0, 5.0, 5.0, 1.0], ["a", "a", "b", "c"], ["b", "c", "d", "d"], [1.0, 1.0, 1.0, 1.0]
    )
    assert levels(g2, part).length == 9.0
    assert critical_edges(g2, assignment=part).tolist() == [False, True, False, True]


def test_user_labelled_critical_edges_are_kept():
    """Mechanism: users may label edges critical themselves."""
    g = build_graph(["a", "b", "c"], [1.0, 1.0, 5.0], ["a", "a"], ["b", "c"], [0.0, 0.0], critical_label=[True, False])
    assert critical_edges(g).tolist() == [True, True]


def test_critical_path_without_transfers():
    """Mechanism: the lower bound's compute-only critical path."""
    assert critical_path_without_transfers(diamond()) == 7.0


@pytest.mark.parametrize("seed", range(3))
def test_slack_matches_brute_force_paths(seed):
    """Mechanism: slack on random DAGs equals L minus the longest path through each edge."""
    rng = np.random.default_rng(seed)
    n = 9
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.35]
    w = rng.integers(0, 5, n).astype(float)
    c = rng.integers(0, 3, len(edges)).astype(float)
    g = build_graph(list(range(n)), w, [e[0] for e in edges], [e[1] for e in edges], c)

    def longest_from(v):  # includes w[v]
        return w[v] + max([c[i] + longest_from(b) for i, (a, b) in enumerate(edges) if a == v], default=0.0)

    def longest_to(v):  # excludes w[v]
        return max([longest_to(a) + w[a] + c[i] for i, (a, b) in enumerate(edges) if b == v], default=0.0)

    L = max(longest_to(v) + longest_from(v) for v in range(n))
    expect = [L - (longest_to(a) + w[a] + c[i] + longest_from(b)) for i, (a, b) in enumerate(edges)]
    assert np.allclose(edge_slack(g), expect)
