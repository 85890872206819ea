"""The path-cut lower bound: no partition within the load (and memory) cap has a lower makespan."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmaster.partition import build_graph, evaluate, makespan
from trainmaster.partition.graph import Graph, clusters_of
from trainmaster.partition.simulate import (
    critical_cut_bound,
    device_loads,
    forced_cut_bound,
    heaviest_path,
    load_cap,
    lower_bound,
    path_bound,
    path_cut_bound,
)
from partition_fixtures import weighted_layers


def chain(costs, links):
    names = [str(i) for i in range(len(costs))]
    return build_graph(names, costs, names[:-1], names[1:], links)


def test_chain_must_be_cut_at_its_only_fitting_link():
    """Known answer: 4 unit operators, cap 2, so the only single cut is the middle link (3);
    two cuts (5 + 1) cost more. Bound 4 + 3 = 7, which the split [0, 0, 1, 1] attains."""
    g = chain([1.0, 1.0, 1.0, 1.0], [5.0, 3.0, 1.0])
    assert lower_bound(g, 2) == 4.0
    assert path_cut_bound(g, 2, 2.0) == 7.0
    assert makespan(g, np.array([0, 0, 1, 1])) == 7.0
    ev = evaluate(g, np.array([0, 0, 1, 1]), 2, imbalance=0.0)
    assert ev["path_cut_bound"] == 7.0 and ev["lower_bound"] == 4.0


def test_runs_bound_is_stronger_than_cheapest_links():
    """The chain above: ceil(4 / 2) = 2 devices, so >= 1 cut link; the cheapest link (1) gives
    only 5, the run argument 7."""
    assert path_bound([1.0] * 4, [5.0, 3.0, 1.0], 2.0) == 7.0
    assert path_bound([1.0] * 4, [5.0, 3.0, 1.0], 4.0) == 4.0  # fits on one device: no cut


def test_side_path_with_dear_links_sets_the_bound():
    """Known answer: a fork a -> {b, c} -> d, compute 4, 4, 1, 1, cap 5 (k = 2). The heaviest
    compute path a-b-d (9) can be cut at a 1-cost link: 10. But a-c-d (6 > 5) must be cut at a
    50-cost link: 56, and the best within-cap partition ({a, c}, {b, d}) attains 56."""
    g = build_graph(
        ["a", "b", "c", "d"], [4.0, 4.0, 1.0, 1.0], ["a", "a", "b", "c"], ["b", "c", "d", "d"], [1.0, 50.0, 1.0, 50.0]
    )
    nodes, links = heaviest_path(g, 0.0)
    assert nodes == [0, 1, 3] and links == [1.0, 1.0]
    assert path_bound(g.cost[nodes].tolist(), links, 5.0) == 10.0
    assert heaviest_path(g, 1.0)[0] == [0, 2, 3]
    assert path_cut_bound(g, 2, 5.0) == 56.0
    best = min(
        makespan(g, np.array(p))
        for p in itertools.product(range(2), repeat=4)
        if device_loads(g, np.array(p), 2).max() <= 5.0
    )
    assert best == 56.0


def test_operator_over_the_cap_means_no_partition():
    assert path_bound([3.0, 1.0], [1.0], 2.0) == math.inf


@st.composite
def small_dags(draw):
    n = draw(st.integers(2, 6))
    costs = [float(draw(st.integers(0, 6))) for _ in range(n)]
    src, dst, ecost = [], [], []
    for v in range(1, n):
        for u in range(v):
            if draw(st.booleans()):
                src.append(str(u))
                dst.append(str(v))
                ecost.append(float(draw(st.integers(0, 8))))
    return build_graph([str(i) for i in range(n)], costs, src, dst, ecost)


@settings(max_examples=80, deadline=None)
@given(small_dags(), st.integers(2, 3), st.sampled_from([0.0, 0.05, 0.3, 1.0]))
def test_no_partition_within_the_cap_beats_the_bound(g, k, imbalance):
    """Property: brute force over every assignment of a tiny DAG; each one whose loads are all
    within the cap has makespan >= the bound (and the bound is >= the old LB)."""
    cap = max((1 + imbalance) * float(g.cost.sum()) / k, float(g.cost.max()))
    bound = path_cut_bound(g, k, cap)
    assert bound >= lower_bound(g, k)
    for p in itertools.product(range(k), repeat=g.n):
        part = np.array(p, dtype=np.int64)
        if device_loads(g, part, k).max() <= cap * (1 + 1e-9):
            assert makespan(g, part) >= bound - 1e-9


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=7), st.data())
def test_path_bound_is_the_cheapest_fitting_cut(costs, data):
    """Property: the DP equals brute force over every set of cut links whose runs fit the cap,
    and is never below the cheapest (ceil(W / cap) - 1) links."""
    w = [float(c) for c in costs]
    links = [float(data.draw(st.integers(0, 9))) for _ in range(len(w) - 1)]
    cap = float(data.draw(st.integers(max(costs), max(sum(costs), max(costs)))))
    if cap == 0:
        return
    best = math.inf
    for cuts in itertools.product([False, True], repeat=len(links)):
        runs, run = [], w[0]
        for i, cut in enumerate(cuts):
            if cut:
                runs.append(run)
                run = 0.0
            run += w[i + 1]
        runs.append(run)
        if max(runs) <= cap:
            best = min(best, sum(c for c, cut in zip(links, cuts) if cut))
    assert path_bound(w, links, cap) == sum(w) + best
    m = math.ceil(sum(w) / cap)
    assert path_bound(w, links, cap) >= sum(w) + sum(sorted(links)[: max(m - 1, 0)])


def test_memory_cap_shortens_the_runs():
    """Known answer: 4 unit operators, load cap 4 (no cut needed), memory 0, 1, 5, 5 against a
    memory cap 6: the two 5s cannot share a device, so the link between them (cost 2) must be
    cut: 4 + 2 = 6. Without the memory cap the bound is 4; with memory 1, 1, 5, 5 the first
    three no longer fit together either, so a 9-link goes too: 4 + 2 + 9 = 15."""
    assert path_bound([1.0] * 4, [9.0, 9.0, 2.0], 4.0) == 4.0
    assert path_bound([1.0] * 4, [9.0, 9.0, 2.0], 4.0, [0.0, 1.0, 5.0, 5.0], 6.0) == 6.0
    assert path_bound([1.0] * 4, [9.0, 9.0, 2.0], 4.0, [1.0, 1.0, 5.0, 5.0], 6.0) == 15.0
    assert path_bound([1.0] * 2, [1.0], 4.0, [7.0, 1.0], 6.0) == math.inf
    g = build_graph(
        list("abcd"), [1.0] * 4, list("abc"), list("bcd"), [9.0, 9.0, 2.0], memory=[0.0, 1.0, 5.0, 5.0], memory_cap=6.0
    )
    assert path_cut_bound(g, 2, 4.0, 6.0) == 6.0
    ev = evaluate(g, np.array([0, 0, 0, 1]), 2, imbalance=1.0)  # cap 4; memory 11 <= 2 x 6
    assert ev["path_cut_bound"] == 6.0 and ev["makespan"] == 6.0


@settings(max_examples=80, deadline=None)
@given(small_dags(), st.integers(2, 3), st.sampled_from([0.05, 0.3, 1.0]), st.data())
def test_no_partition_within_both_caps_beats_the_memory_bound(g, k, imbalance, data):
    """Property: with random operator memory and a memory cap, brute force over every
    assignment of a tiny DAG; each one within the load cap and the memory cap has makespan
    >= the bound with memory."""
    memory = np.array([float(data.draw(st.integers(0, 5))) for _ in range(g.n)])
    mem_cap = float(data.draw(st.integers(int(memory.max()), max(int(memory.sum()), 1))))
    cap = max((1 + imbalance) * float(g.cost.sum()) / k, float(g.cost.max()))
    gm = build_graph(
        g.node_ids, g.cost, [g.node_ids[u] for u in g.src], [g.node_ids[v] for v in g.dst], g.edge_cost, memory=memory
    )
    bound = path_cut_bound(gm, k, cap, mem_cap)
    assert bound >= path_cut_bound(gm, k, cap)
    for p in itertools.product(range(k), repeat=g.n):
        part = np.array(p, dtype=np.int64)
        if (
            device_loads(gm, part, k).max() <= cap * (1 + 1e-9)
            and np.bincount(part, weights=memory, minlength=k).max() <= mem_cap
        ):
            assert makespan(gm, part) >= bound - 1e-9


def test_critical_cut_bound_on_a_chain_is_its_cheapest_fitting_cut():
    """Critical edges (static slack 0) and the balance cap, known answer: every link of a chain
    is critical; 4 unit operators under cap 2 must be cut at the middle link (cost 3), so no
    within-cap partition cuts less than 3 of critical edges, and [0, 0, 1, 1] cuts exactly 3."""
    g = chain([1.0, 1.0, 1.0, 1.0], [5.0, 3.0, 1.0])
    assert critical_cut_bound(g, 2.0) == 3.0
    ev = evaluate(g, np.array([0, 0, 1, 1]), 2, imbalance=0.0)
    assert ev["critical_cut_cost"] == 3.0 and ev["critical_cut_bound"] == 3.0
    assert critical_cut_bound(g, 4.0) == 0.0  # fits on one device


@settings(max_examples=80, deadline=None)
@given(small_dags(), st.integers(2, 3), st.sampled_from([0.0, 0.05, 0.3, 1.0]), st.data())
def test_no_partition_within_the_caps_cuts_less_critical_cost_than_the_bound(g, k, imbalance, data):
    """Property (critical edges by static slack, cost-weighted critical cut, balance and memory
    caps): brute force over every assignment of a tiny DAG; each one within the load cap (and
    the memory cap) cuts critical edges costing at least the critical-cut bound."""
    memory = np.array([float(data.draw(st.integers(0, 5))) for _ in range(g.n)])
    mem_cap = float(data.draw(st.integers(int(memory.max()), max(int(memory.sum()), 1))))
    gm = build_graph(
        g.node_ids,
        g.cost,
        [g.node_ids[u] for u in g.src],
        [g.node_ids[v] for v in g.dst],
        g.edge_cost,
        memory=memory,
        memory_cap=mem_cap,
    )
    cap = max((1 + imbalance) * float(g.cost.sum()) / k, float(g.cost.max()))
    bound = critical_cut_bound(gm, cap, mem_cap)
    for p in itertools.product(range(k), repeat=g.n):
        part = np.array(p, dtype=np.int64)
        fits = (
            device_loads(gm, part, k).max() <= cap * (1 + 1e-9)
            and np.bincount(part, weights=memory, minlength=k).max() <= mem_cap
        )
        if fits:
            assert evaluate(gm, part, k, imbalance)["critical_cut_cost"] >= bound - 1e-9


def test_colocated_link_is_never_cut():
    """Co-location in the path bounds, known answer: 4 unit operators, cap 2, links 5, 1, 3
    (the middle one cheapest). Alone, the bound cuts the middle link: 4 + 1 = 5 and a critical
    cut of 1. With operators 1 and 2 in one co-location class that link cannot be cut, so the
    runs are {0}, {1, 2}, {3}: 4 + 5 + 3 = 12, critical cut 8, which [0, 1, 1, 0] attains."""
    g = build_graph(list("abcd"), [1.0] * 4, list("abc"), list("bcd"), [5.0, 1.0, 3.0], group=[-1, 7, 7, -1])
    cluster = clusters_of(g)
    assert path_cut_bound(g, 2, 2.0) == 5.0 and critical_cut_bound(g, 2.0) == 1.0
    assert path_cut_bound(g, 2, 2.0, cluster=cluster) == 12.0
    assert critical_cut_bound(g, 2.0, cluster=cluster) == 8.0
    ev = evaluate(g, np.array([0, 1, 1, 0]), 2, imbalance=0.0)
    assert ev["makespan"] == 12.0 and ev["path_cut_bound"] == 12.0
    assert ev["critical_cut_cost"] == 8.0 and ev["critical_cut_bound"] == 8.0


@settings(max_examples=80, deadline=None)
@given(small_dags(), st.integers(2, 3), st.sampled_from([0.0, 0.05, 0.3, 1.0]), st.data())
def test_no_colocated_partition_within_the_cap_beats_either_bound(g, k, imbalance, data):
    """Property (co-location in the path bounds): random co-location classes on a tiny DAG;
    brute force over every assignment that keeps each class on one device and the loads within
    the cap: each has makespan >= the path-cut bound and critical cut cost >= the critical-cut
    bound, both computed with the classes."""
    group = [data.draw(st.integers(-1, 2)) for _ in range(g.n)]
    gg = build_graph(
        g.node_ids, g.cost, [g.node_ids[u] for u in g.src], [g.node_ids[v] for v in g.dst], g.edge_cost, group=group
    )
    cluster = clusters_of(gg)
    cap = max((1 + imbalance) * float(g.cost.sum()) / k, float(np.bincount(cluster, weights=gg.cost).max()))
    span_bound = path_cut_bound(gg, k, cap, cluster=cluster)
    cut_bound = critical_cut_bound(gg, cap, cluster=cluster)
    assert span_bound >= path_cut_bound(gg, k, cap)
    for p in itertools.product(range(k), repeat=int(cluster.max()) + 1):
        part = np.array(p, dtype=np.int64)[cluster]
        if device_loads(gg, part, k).max() <= cap * (1 + 1e-9):
            assert makespan(gg, part) >= span_bound - 1e-9
            assert evaluate(gg, part, k, imbalance)["critical_cut_cost"] >= cut_bound - 1e-9


def _training_layers(layers: int = 3) -> "Graph":
    """A toy training step: per layer a weight w (no compute) read by its forward f and its
    backward b through dear edges (100), the forward chain then the backward chain back (0.1)."""
    nodes, cost, src, dst, ecost = [], [], [], [], []
    for i in range(layers):
        nodes += [f"w{i}", f"f{i}", f"b{i}"]
        cost += [0.0, 1.0, 1.0]
        src += [f"w{i}", f"w{i}"]
        dst += [f"f{i}", f"b{i}"]
        ecost += [100.0, 100.0]
    chain = [f"f{i}" for i in range(layers)] + [f"b{i}" for i in reversed(range(layers))]
    src += chain[:-1]
    dst += chain[1:]
    ecost += [0.1] * (len(chain) - 1)
    return build_graph(nodes, cost, src, dst, ecost)


def test_forced_cut_bound_charges_a_dear_edge_the_cap_forces():
    """Mechanism (makespan bound on training graphs): three layers of load 2 on two devices at
    5% imbalance (cap 3.15) cannot stay whole, so some weight edge (100) is cut and the makespan
    is at least 100 + the backward tail after it; every within-cap partition, by brute force,
    is at or above the bound, and one reaches it. A loose cap forces no cut: no bound."""
    g = _training_layers(3)
    k = 2
    cap = load_cap(g, k, 0.05)
    bound = forced_cut_bound(g, k, cap)
    assert bound == pytest.approx(101.0)
    assert path_cut_bound(g, k, cap) >= bound
    best = float("inf")
    for bits in itertools.product(range(k), repeat=g.n):
        a = np.asarray(bits)
        if np.bincount(a, weights=g.cost, minlength=k).max() <= cap:
            span = makespan(g, a)
            assert span >= bound - 1e-9
            best = min(best, span)
    assert best < 110.0  # the bound is close: the cheapest forced transfer is off the chain's head
    assert forced_cut_bound(g, k, load_cap(g, k, 1.0)) == 0.0


def test_forced_cut_bound_asks_which_cuts_the_packing_needs():
    """Mechanism (makespan bound on training graphs, issue 35): four layers of load 10, 4, 7, 5
    on two devices with no slack (cap 13). The pigeonhole argument alone proves only that some
    weight edge is cut, and the cheapest one to cut (the last backward's) costs little on the
    path; but splitting that layer alone does not make the rest packable (exact bin packing), so
    a dearer cut is forced. The bound is the exact optimum here (brute force), where requiring
    only "some dear edge is cut" gave the compute-only 26.1."""
    g = weighted_layers([4.0, 2.0, 3.0, 2.0], [6.0, 2.0, 4.0, 3.0])
    k = 2
    cap = load_cap(g, k, 0.0)
    bound = forced_cut_bound(g, k, cap)
    assert bound == pytest.approx(106.0)
    best = min(
        makespan(g, np.asarray(bits))
        for bits in itertools.product(range(k), repeat=g.n)
        if np.bincount(np.asarray(bits), weights=g.cost, minlength=k).max() <= cap * (1 + 1e-9)
    )
    assert best == pytest.approx(106.0)
    assert path_cut_bound(g, k, cap) >= bound


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=2, max_size=3),
    st.lists(st.integers(1, 6), min_size=3, max_size=3),
    st.sampled_from([0.0, 0.05, 0.2]),
    st.sampled_from([2, 3]),
)
def test_forced_cut_bound_holds_for_every_partition_within_the_cap(forward, backward, imbalance, k):
    """Property: on random layered training-like graphs, every partition within the cap (brute
    force) has makespan >= the forced-cut bound (with its exact packing check)."""
    g = weighted_layers([float(x) for x in forward], [float(x) for x in backward[: len(forward)]])
    cap = load_cap(g, k, imbalance)
    bound = forced_cut_bound(g, k, cap)
    for bits in itertools.product(range(k), repeat=g.n):
        a = np.asarray(bits)
        if np.bincount(a, weights=g.cost, minlength=k).max() <= cap * (1 + 1e-9):
            assert makespan(g, a) >= bound - 1e-9
