"""The final improvement phase: never worse than its start, every constraint kept."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmaster.partition import build_graph, evaluate, partition
from trainmaster.partition.coarse import coarsen_chains
from trainmaster.partition.graph import clusters_of
from trainmaster.partition.improve import improve
from trainmaster.partition.simulate import (
    device_graph_acyclic,
    finish_times,
    load_cap,
    makespan,
    memory_cap_enforced,
)
from trainmaster.partition.synthetic import FAMILIES, synthetic_dag


def random_graph(seed: int, n: int):
    rng = np.random.default_rng(seed)
    edges = sorted({(u, v) for v in range(1, n) for u in rng.choice(v, size=min(v, 3), replace=False).tolist()})
    group = [-1] * n
    for gid in range(n // 10):
        a, b = rng.choice(n, 2, replace=False).tolist()
        group[a] = group[b] = gid
    mem = rng.uniform(1.0, 3.0, n)
    return build_graph(
        list(range(n)),
        rng.lognormal(0.0, 0.7, n),
        [e[0] for e in edges],
        [e[1] for e in edges],
        float(rng.choice([0.1, 1.0, 3.0])) * rng.lognormal(0.0, 0.7, len(edges)),
        memory=mem,
        group=group,
        memory_cap=float(mem.sum()) / 2.5,
    )


def feasible_start(g, k, cap, mem_cap, rng):
    """A random partition within the caps (clusters dealt to the least loaded device with room)."""
    base = clusters_of(g)
    load, mem = np.zeros(k), np.zeros(k)
    part = np.zeros(base.max() + 1, dtype=np.int64)
    cw, cm = np.bincount(base, weights=g.cost), np.bincount(base, weights=g.memory)
    for c in rng.permutation(len(cw)):
        room = [d for d in range(k) if load[d] + cw[c] <= cap and mem[d] + cm[c] <= mem_cap]
        d = int(rng.choice(room)) if room else int(np.argmin(load))
        part[c] = d
        load[d] += cw[c]
        mem[d] += cm[c]
    return part[base]


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    k=st.sampled_from([2, 3, 4]),
    acyclic=st.booleans(),
    shared_links=st.booleans(),
    ceiling_share=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
)
def test_improve_never_returns_worse_than_its_start(seed, k, acyclic, shared_links, ceiling_share):
    """Mechanism (final improvement phase): whatever the start, the result's makespan (simulated
    as the phase simulates it, with or without shared links) is no higher than the start's, and
    every constraint the start meets is met: load and memory caps, co-location, the guarded
    (critical) cut ceiling, an acyclic device graph."""
    g = random_graph(seed, 40)
    rng = np.random.default_rng(seed)
    base = clusters_of(g)
    cap = load_cap(g, k, 0.3, base)
    mem_cap = memory_cap_enforced(g, k)
    start = feasible_start(g, k, cap, mem_cap, rng)
    guarded = g.edge_cost * (rng.random(g.m) < 0.3)
    start_cut = float(guarded[start[g.src] != start[g.dst]].sum())
    ceiling = start_cut * ceiling_share  # below 1: the start itself breaks the ceiling
    units = [coarsen_chains(g, g.edge_cost, cap / 4), base]
    out = improve(g, start, k, cap, mem_cap, units, 300, guarded, ceiling, acyclic=acyclic, shared_links=shared_links)
    before = max(finish_times(g, start, shared_links=shared_links))
    assert out.makespan <= before
    assert max(finish_times(g, out.assignment, shared_links=shared_links)) == pytest.approx(out.makespan)
    start_ok = (
        np.bincount(start, weights=g.cost, minlength=k).max() <= cap * (1 + 1e-9)
        and np.bincount(start, weights=g.memory, minlength=k).max() <= mem_cap
        and start_cut <= ceiling + 1e-12
        and (not acyclic or device_graph_acyclic(g, start, k))
    )
    if not start_ok:  # a start breaking a constraint is returned as it is
        assert np.array_equal(out.assignment, start) and out.moves == 0
        return
    a = out.assignment
    ev = evaluate(g, a, k, 0.3)
    assert ev["colocation_ok"]
    assert np.bincount(a, weights=g.cost, minlength=k).max() <= cap * (1 + 1e-9)
    assert np.bincount(a, weights=g.memory, minlength=k).max() <= mem_cap * (1 + 1e-12)
    assert float(guarded[a[g.src] != a[g.dst]].sum()) <= ceiling + 1e-9
    if acyclic:
        assert device_graph_acyclic(g, a, k)
    assert out.simulations <= 300


def test_improve_takes_the_one_move_that_removes_a_transfer():
    """Mechanism: a unit is sent to every other device, not only its neighbours', and the move
    that lowers the simulated makespan is kept: a -> b -> c with b alone on device 1 and a
    dear transfer each way; moving b to device 0 removes both transfers."""
    g = build_graph(["a", "b", "c", "d"], [1.0, 1.0, 1.0, 3.0], ["a", "b"], ["b", "c"], [5.0, 5.0])
    start = np.array([0, 1, 0, 1])
    k = 2
    cap = 4.0
    out = improve(g, start, k, cap, float("inf"), [clusters_of(g)], 50)
    assert out.makespan == pytest.approx(3.0)
    assert out.assignment.tolist()[:3] == [0, 0, 0]
    assert makespan(g, out.assignment) == pytest.approx(3.0)


def test_improve_swaps_where_the_caps_refuse_a_move():
    """Mechanism: when the target device is full, the lightest unit of it that makes room is
    sent back (a swap): the chain a -> b sits on two devices at the cap; swapping b with the
    independent x of equal load puts the chain on one device."""
    g = build_graph(["a", "b", "x", "y"], [1.0, 1.0, 1.0, 1.0], ["a"], ["b"], [10.0])
    start = np.array([0, 1, 0, 1])  # a, x on 0; b, y on 1
    out = improve(g, start, 2, 2.0, float("inf"), [clusters_of(g)], 50)
    a = out.assignment
    assert a[0] == a[1] and np.bincount(a, minlength=2).tolist() == [2, 2]
    assert out.makespan == pytest.approx(2.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_ours_never_slower_than_metis_nor_cutting_more_critical_cost(family):
    """Mechanism (the structural guarantee): the final phase also starts from METIS's own
    partition and keeps only strict improvements within the caps and the critical-cut ceiling
    (METIS's cut), so wherever METIS meets the caps ours is no slower and cuts no more static
    critical cost, on every graph, not only on average."""
    for seed in (3, 4):
        g = synthetic_dag(family, 120, seed)
        for k in (2, 4):
            ours, metis = partition(g, k), partition(g, k, "metis")
            eo, em = evaluate(g, ours.assignment, k), evaluate(g, metis.assignment, k)
            if metis.feasible:
                assert eo["makespan"] <= em["makespan"] * (1 + 1e-12)
                assert eo["critical_cut_cost"] <= em["critical_cut_cost"] + 1e-9
            assert ours.notes["phases"]["improved"] == pytest.approx(eo["makespan"])


def test_improve_brings_the_critical_cut_down_to_reach_first():
    """Mechanism (critical-cut ceiling where METIS breaks a cap): a start cutting more guarded
    cost than ``reach`` gets moves that lower the cut kept whatever they do to the makespan,
    and ends at or below ``reach`` where a move gets it there; never above the start's cut."""
    g = build_graph(["a", "b", "c", "d"], [1.0, 1.0, 1.0, 1.0], ["a", "c"], ["b", "d"], [0.1, 0.1])
    guarded = np.array([1.0, 0.0])  # a -> b is the critical edge
    start = np.array([0, 1, 0, 1])  # cuts both edges: guarded cut 1.0, makespan 2.1
    units = [clusters_of(g)]
    kept = improve(g, start, 2, 4.0, float("inf"), units, 50, guarded, ceiling=1.0)
    assert float(guarded[kept.assignment[g.src] != kept.assignment[g.dst]].sum()) <= 1.0
    out = improve(g, start, 2, 4.0, float("inf"), units, 50, guarded, ceiling=1.0, reach=0.0)
    a = out.assignment
    assert a[0] == a[1]  # the critical edge is no longer cut
    assert out.makespan == pytest.approx(makespan(g, a))
