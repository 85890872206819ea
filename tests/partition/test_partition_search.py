"""Makespan descent on the schedule's critical chain, the hard memory cap, synthetic DAGs."""

import numpy as np
import pytest

from trainmaster.partition import build_graph, evaluate, makespan, partition
from trainmaster.partition.graph import Graph, clusters_of
from trainmaster.partition.initial import sources_late
from trainmaster.partition.search import critical_chain, makespan_descent
from trainmaster.partition.simulate import load_cap
from trainmaster.partition.synthetic import FAMILIES, synthetic_dag


def test_critical_chain_names_transfer_and_device_wait():
    """Mechanism: the simulator's schedule names what held each operator back (data from another
    device, or its device busy) along the chain that ends last."""
    # a -> b (cut, cost 5); c independent on a's device, after a
    g = build_graph(["a", "b", "c"], [1.0, 1.0, 3.0], ["a"], ["b"], [5.0])
    part = np.array([0, 1, 0])
    span, links = critical_chain(g, part)
    # a 0-1 on dev0, c 1-4 on dev0 (waits for a), b ready 1+5=6, runs 6-7
    assert span == 7.0
    assert links == [(0, 1, True)]
    span, links = critical_chain(g, np.array([0, 0, 0]))
    assert span == 5.0  # a, c, b back to back in b-level order: a(0-1), c(1-4), b(4-5)
    assert all(not t for _, _, t in links)


def test_makespan_descent_never_worse_and_keeps_caps():
    """Mechanism: refinement by simulated makespan, first improvement, within the balance cap."""
    for seed in range(6):
        g = synthetic_dag(FAMILIES[seed % 3], 120, seed)
        base = clusters_of(g)
        k = 4
        cap = load_cap(g, k, 0.05, base)
        start = np.arange(g.n) * k // g.n  # contiguous blocks of the index order
        start_span = makespan(g, start)
        if np.bincount(start, weights=g.cost, minlength=k).max() > cap:
            cap = float(np.bincount(start, weights=g.cost, minlength=k).max())
        part, span, used = makespan_descent(g, start, k, cap, float("inf"), [base], 30)
        assert used <= 30
        assert span == pytest.approx(makespan(g, part))
        assert span <= start_span + 1e-9
        assert np.bincount(part, weights=g.cost, minlength=k).max() <= cap * (1 + 1e-9)


def memory_heavy_chain():
    """A chain whose memory sits at the front: a cost-balanced split overflows device 0."""
    n = 40
    memory = [10.0] * 10 + [0.1] * 30
    return build_graph(
        list(range(n)),
        [1.0] * n,
        list(range(n - 1)),
        list(range(1, n)),
        [1.0] * (n - 1),
        memory=memory,
        memory_cap=60.0,
    )


def test_memory_cap_is_hard_for_ours_and_reported_for_every_method():
    """Mechanism: balance is a hard constraint over operator cost and device memory."""
    g = memory_heavy_chain()
    for method in ("trainmaster", "patent", "metis", "kahip"):
        ev = evaluate(g, partition(g, 2, method, imbalance=0.5).assignment, 2, 0.5)
        assert isinstance(ev["memory_ok"], bool)
        assert len(ev["memory_per_device"]) == 2
        if method == "trainmaster":
            assert ev["memory_ok"], ev["memory_per_device"]
            assert ev["balanced"]


@pytest.mark.parametrize("family", FAMILIES)
def test_synthetic_families_are_dags_with_costs(family):
    """Mechanism: the computation task as a DAG of operators with costs (benchmark inputs)."""
    g = synthetic_dag(family, 200, seed=3)
    assert 200 <= g.n < 230
    assert len(g.topo) == g.n  # a topological order exists: acyclic
    assert np.all(g.cost > 0) and np.all(g.edge_cost > 0)
    assert g.n - 1 <= g.m
    ev = evaluate(g, partition(g, 4).assignment, 4)
    assert ev["balanced"] and ev["makespan"] >= ev["lower_bound"] - 1e-9


def test_guarded_descent_never_raises_the_guarded_cut():
    """Mechanism: the makespan descent can refuse every move that cuts more of the static
    critical edges' transfer cost than the start did."""
    from trainmaster.partition.critical import critical_edges

    for seed in range(6):
        g = synthetic_dag(FAMILIES[seed % 3], 120, seed)
        base = clusters_of(g)
        k = 4
        start = np.arange(g.n) * k // g.n
        cap = max(load_cap(g, k, 0.05, base), float(np.bincount(start, weights=g.cost, minlength=k).max()))
        guarded = g.edge_cost * critical_edges(g)

        def cut(a):
            return float(guarded[a[g.src] != a[g.dst]].sum())

        part, span, _ = makespan_descent(g, start, k, cap, float("inf"), [base], 30, guarded=guarded)
        assert cut(part) <= cut(start) + 1e-9
        assert span <= makespan(g, start) + 1e-9


@pytest.mark.parametrize("guard", [False, True])
def test_descent_remembered_refusals_change_nothing(monkeypatch, guard):
    """Mechanism: the makespan descent does not re-check a move the caps or the guard refused
    until an accepted move could have lifted that refusal (its target lost load, its unit
    changed, or a moved operator sits in or next to its unit); checking every move again after
    each gain gives the same descent."""
    import trainmaster.partition.search as search
    from trainmaster.partition.coarse import coarsen_chains
    from trainmaster.partition.critical import critical_edges

    for seed in range(8):
        g = synthetic_dag(FAMILIES[seed % 3], 150, seed)
        base = clusters_of(g)
        k = 2 + seed % 3
        start = np.arange(g.n) * k // g.n
        # a tight cap (the start's own max load) so that many moves are refused
        cap = float(np.bincount(start, weights=g.cost, minlength=k).max()) * 1.01
        mem_cap = float(np.bincount(start, weights=g.memory, minlength=k).max()) * 1.02
        units = [base, coarsen_chains(g, g.edge_cost, cap / 4)]
        guarded = g.edge_cost * critical_edges(g) if guard else None
        got = makespan_descent(g, start, k, cap, mem_cap, units, 60, guarded=guarded)
        with monkeypatch.context() as m:
            m.setattr(search, "_still_refused", lambda *a, **kw: {})
            want = makespan_descent(g, start, k, cap, mem_cap, units, 60, guarded=guarded)
        assert np.array_equal(got[0], want[0]) and got[1:] == want[1:]


def test_descent_swaps_a_cluster_back_when_the_memory_cap_refuses_a_move():
    """Mechanism: balance (memory) is a hard constraint; with tight caps a descent move that
    would overflow the target device instead swaps a co-location cluster back, when that lowers
    the simulated makespan and keeps both caps."""
    # a -> b -> c is the long chain (costs 4; transfers 5 then 0.5); x, y, z are fillers
    # (cost 1). Memory 3 each, cap 9: device 0 holds {a, x, y}, device 1 {b, c, z}, both full,
    # so every single move overflows one; a swap (e.g. b for x) removes the dear a -> b transfer
    g = build_graph(
        ["a", "b", "c", "x", "y", "z"],
        [4.0, 4.0, 4.0, 1.0, 1.0, 1.0],
        ["a", "b"],
        ["b", "c"],
        [5.0, 0.5],
        memory=[3.0] * 6,
        memory_cap=9.0,
    )
    base = clusters_of(g)
    start = np.array([0, 1, 1, 0, 0, 1])
    cap, mem_cap = 14.0, 9.0
    plain, span0, _ = makespan_descent(g, start, 2, cap, mem_cap, [base], 20)
    part, span, _ = makespan_descent(g, start, 2, cap, mem_cap, [base], 20, swaps=True)
    assert span < span0 == makespan(g, start)  # without swaps the descent is stuck
    assert span == pytest.approx(makespan(g, part))
    assert np.bincount(part, weights=g.memory, minlength=2).max() <= mem_cap
    assert np.bincount(part, weights=g.cost, minlength=2).max() <= cap


def _layers_with_weights(layers: int, weight_edge: float) -> "Graph":
    """A chain of ``layers`` operators (cost 1, activation edges 1), each reading its own weight:
    a source listed before every operator, as traced graphs list parameters first."""
    weights = [f"w{i}" for i in range(layers)]
    ops = [f"op{i}" for i in range(layers)]
    src = weights + ops[:-1]
    dst = ops + ops[1:]
    cost = [0.0] * layers + [1.0] * layers
    edge_cost = [weight_edge] * layers + [1.0] * (layers - 1)
    return build_graph(weights + ops, cost, src, dst, edge_cost)


def test_sources_late_puts_each_parameter_before_its_reader():
    """Mechanism (contiguous split of the topological order): parameters listed first move to
    just before their first reader, and the order stays topological."""
    g = _layers_with_weights(6, 10.0)
    order = sources_late(g).tolist()
    pos = {v: i for i, v in enumerate(order)}
    assert sorted(order) == list(range(g.n))
    assert all(pos[u] < pos[v] for u, v in zip(g.src.tolist(), g.dst.tolist()))
    for i in range(6):
        assert pos[g.node_ids.index(f"w{i}")] == pos[g.node_ids.index(f"op{i}")] - 1


@pytest.mark.parametrize("acyclic", [True, False])
def test_layers_split_with_their_weights(acyclic):
    """Mechanism (acyclic split, the pipeline's stages): a weight goes with its layer, so two
    devices cut one activation edge and the makespan is the work plus one transfer (the plain
    order's split left every weight on the first device: 10 per later layer)."""
    g = _layers_with_weights(8, 10.0)
    p = partition(g, 2, "trainmaster", acyclic=acyclic)
    assert p.notes["candidates"]["acyclic-late"]["makespan"] == pytest.approx(9.0)  # the start itself
    assert p.notes["candidates"]["acyclic"]["makespan"] > 9.0 + 1.0  # a weight crossed over
    a = p.assignment
    assert int((a[g.src] != a[g.dst]).sum()) == 1
    assert makespan(g, a) == pytest.approx(9.0)
    assert p.feasible
