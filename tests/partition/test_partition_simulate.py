"""The makespan simulator on known schedules, pipeline max-load and the device-graph check."""

import numpy as np
import pytest

from trainmaster.partition import build_graph, evaluate, makespan, max_load
from trainmaster.partition.simulate import device_graph_acyclic, lower_bound, schedule


def fork_join():
    # s -> x, s -> y, x -> t, y -> t ; transfers cost 2
    return build_graph(
        ["s", "x", "y", "t"], [1.0, 4.0, 3.0, 1.0], ["s", "s", "x", "y"], ["x", "y", "t", "t"], [2.0, 2.0, 2.0, 2.0]
    )


def test_single_device_runs_everything_back_to_back():
    """Mechanism: one device runs one node at a time; no transfers on one device."""
    g = fork_join()
    assert makespan(g, np.zeros(4, dtype=np.int64)) == 9.0


def test_cross_device_predecessor_pays_transfer():
    """Mechanism: ready = predecessor finish + transfer cost when it ran on another device."""
    g = fork_join()
    part = np.array([0, 0, 1, 0])
    start, finish = schedule(g, part)
    # s 0-1; x on dev0 1-5; y on dev1 ready at 1+2=3, 3-6; t ready max(5, 6+2=8) -> 8-9
    assert start.tolist() == [0.0, 1.0, 3.0, 8.0]
    assert finish.tolist() == [1.0, 5.0, 6.0, 9.0]
    assert makespan(g, part) == 9.0


def test_list_scheduling_priority_by_blevel_then_index():
    """Mechanism: among ready nodes the highest static b-level runs first, ties to lower index."""
    # two independent nodes on one device: b (higher b-level) must run first despite its index
    g = build_graph(["a", "b", "c"], [1.0, 1.0, 5.0], ["b"], ["c"], [0.0])
    start, _ = schedule(g, np.zeros(3, dtype=np.int64))
    assert start[1] == 0.0 and start[0] >= 1.0
    # equal b-levels: lower index first
    g2 = build_graph(["a", "b"], [2.0, 2.0], [], [], [])
    s2, _ = schedule(g2, np.zeros(2, dtype=np.int64))
    assert s2.tolist() == [0.0, 2.0]


def test_max_load_is_busiest_device():
    """Mechanism: pipeline max-load (time per sample) = busiest device's compute."""
    g = fork_join()
    assert max_load(g, np.array([0, 0, 1, 1]), 2) == 5.0


def test_device_graph_acyclic_detection():
    """Mechanism: device quotient graph acyclicity (needed for a pipeline)."""
    g = build_graph(["a", "b", "c"], [1, 1, 1], ["a", "b"], ["b", "c"], [0, 0])
    assert device_graph_acyclic(g, np.array([0, 1, 1]), 2)
    assert not device_graph_acyclic(g, np.array([0, 1, 0]), 2)


def test_lower_bound_and_evaluate_metrics():
    """Mechanism: lower bound max(CP without transfers, W/k) and the reported cut metrics."""
    g = fork_join()
    assert lower_bound(g, 2) == 6.0
    ev = evaluate(g, np.array([0, 0, 1, 0]), 2)
    assert ev["cut_count"] == 2 and ev["cut_cost"] == 4.0
    assert ev["critical_edges"] == 2  # s->x, x->t
    assert ev["critical_cut_count"] == 0
    assert ev["makespan"] == 9.0 and ev["device_graph_acyclic"] is False


def test_resumed_makespan_equals_a_full_simulation():
    """Mechanism: the descent's trial simulations resume at the first moved operator; the
    schedule before it cannot change, so the result must equal a simulation from scratch."""
    from trainmaster.partition.simulate import resumed_makespan, schedule
    from trainmaster.partition.synthetic import FAMILIES, synthetic_dag

    rng = np.random.default_rng(0)
    for seed, family in enumerate(FAMILIES * 2):
        g = synthetic_dag(family, 150, seed)
        part = rng.integers(0, 3, g.n)
        finish = schedule(g, part)[1].tolist()
        moved = rng.choice(g.n, 4, replace=False)
        trial = part.copy()
        trial[moved] = (trial[moved] + 1) % 3
        span, fin = resumed_makespan(g, trial, finish, moved)
        full = schedule(g, trial)[1]
        assert span == pytest.approx(float(full.max()))
        assert np.allclose(fin, full)
        # the descent passes plain lists (assignment and moved operators): same answer
        span_l, fin_l = resumed_makespan(g, trial.tolist(), finish, moved.tolist())
        assert span_l == span and fin_l == fin


def test_trial_simulator_matches_full_simulation_and_stops_only_when_hopeless():
    """Mechanism: the descent's ``TrialSimulator`` resumes a trial from a checkpoint of the
    accepted schedule (device free times, compute placed per device) and stops once a lower
    bound (start + compute-only bottom level, or device free time + its remaining compute)
    reaches the limit. A completed trial must equal a simulation from scratch, and a stopped
    one must really have a makespan >= the limit (so the descent would have refused it)."""
    from trainmaster.partition.simulate import TrialSimulator, schedule
    from trainmaster.partition.synthetic import FAMILIES, synthetic_dag

    rng = np.random.default_rng(1)
    stopped = completed = 0
    for seed, family in enumerate(FAMILIES * 2):
        g = synthetic_dag(family, 150, seed)
        k = 3
        part = rng.integers(0, k, g.n)
        finish = schedule(g, part)[1].tolist()
        sim = TrialSimulator(g, k)
        sim.set(part.tolist(), finish)
        for _ in range(30):
            moved = rng.choice(g.n, int(rng.integers(1, 6)), replace=False)
            trial = part.copy()
            trial[moved] = (trial[moved] + rng.integers(1, k, len(moved))) % k
            full = schedule(g, trial)[1]
            for limit in (float("inf"), max(finish), float(full.max()) + 1e-6, float(full.max()) * 0.9):
                span, fin = sim.run(trial.tolist(), moved.tolist(), limit)
                if fin is None:
                    stopped += 1
                    assert span == float("inf") and float(full.max()) >= limit * (1 - 1e-12)
                else:
                    completed += 1
                    assert span == float(full.max()) and fin == full.tolist()
                    assert span < limit
    assert stopped > 0 and completed > 0


def test_static_critical_chain_equals_the_sorted_one():
    """Mechanism: for a schedule walked in the static priority order, the descent's critical
    chain takes each operator's device predecessor from that order instead of sorting by
    (start, finish, priority); the links must be the same as the general path's."""
    from trainmaster.partition.search import critical_chain
    from trainmaster.partition.simulate import schedule, static_order
    from trainmaster.partition.synthetic import FAMILIES, synthetic_dag

    rng = np.random.default_rng(2)
    checked = 0
    for seed, family in enumerate(FAMILIES * 2):
        g = synthetic_dag(family, 120, seed)
        if static_order(g) is None:
            continue
        for k in (2, 3, 8):
            part = rng.integers(0, k, g.n)
            general = critical_chain(g, part)  # no finish times given: sorts
            fast = critical_chain(g, part.tolist(), schedule(g, part)[1].tolist())
            assert fast == general and len(fast[1]) > 0
            checked += 1
    assert checked >= 6


def test_trial_simulator_incremental_checkpoints_equal_fresh_ones():
    """Mechanism: accepting a trial keeps the checkpoints before its first moved operator and
    recomputes the rest; they must equal a fresh simulator's, and so must later trials."""
    from trainmaster.partition.simulate import TrialSimulator, schedule
    from trainmaster.partition.synthetic import synthetic_dag

    rng = np.random.default_rng(3)
    g = synthetic_dag("inception", 200, 4)
    k = 4
    part = rng.integers(0, k, g.n).tolist()
    sim = TrialSimulator(g, k)
    sim.set(part, schedule(g, np.asarray(part))[1].tolist())
    for _ in range(20):
        moved = rng.choice(g.n, 3, replace=False).tolist()
        trial = list(part)
        for v in moved:
            trial[v] = (trial[v] + 1) % k
        span, fin = sim.run(trial, moved, float("inf"))
        sim.set(trial, fin, moved)
        fresh = TrialSimulator(g, k)
        fresh.set(trial, fin)
        assert (sim.free_at, sim.done_at, sim.total) == (fresh.free_at, fresh.done_at, fresh.total)
        assert fin == schedule(g, np.asarray(trial))[1].tolist()
        part = trial


def test_static_critical_chain_falls_back_where_recomputed_starts_are_out_of_order():
    """Mechanism: the chain's general path sorts by start = finish - cost, which can be an ulp
    out of the simulator's order next to zero-cost operators with decimal costs; the fast path
    must notice that and give the same links as the sort (it returns None, the sort runs)."""
    from trainmaster.partition.graph import build_graph
    from trainmaster.partition.search import _static_chain, critical_chain
    from trainmaster.partition.simulate import schedule, static_order

    rng = np.random.default_rng(5)
    fallbacks = 0
    for _ in range(200):
        n = 12
        src, dst = [], []
        for v in range(1, n):
            for u in rng.choice(v, size=min(v, int(rng.integers(1, 3))), replace=False):
                src.append(int(u))
                dst.append(v)
        g = build_graph(
            list(range(n)),
            (rng.integers(0, 4, n) / 10.0).tolist(),
            src,
            dst,
            (rng.integers(0, 3, len(src)) / 10.0).tolist(),
        )
        if static_order(g) is None:
            continue
        part = rng.integers(0, 2, n)
        fin = schedule(g, part)[1].tolist()
        fallbacks += _static_chain(g, static_order(g), part.tolist(), fin) is None
        assert critical_chain(g, part.tolist(), fin) == critical_chain(g, part)
    assert fallbacks > 0


def test_shared_links_queue_messages_on_each_devices_link():
    """Mechanism: shared links (schedule with ``shared_links``): a device has one link out and one
    in; a value goes once to each other device that reads it, for the dearest of those edges,
    and a message starts when the sender's link out and the receiver's link in are both free.
    Without it every cut edge is a transfer of its own that never waits."""
    g = fork_join()  # s -> x, s -> y, x -> t, y -> t; every transfer costs 2
    part = np.array([0, 1, 2, 0])
    start, finish = schedule(g, part, shared_links=True)
    # s 0-1; s's message to dev1 holds dev0's link out 1-3, the one to dev2 waits for it: 3-5;
    # x on dev1 3-7, y on dev2 5-8; x's value reaches dev0 at 9, y's waits for dev0's link in
    # until 9 and arrives at 11; t 11-12
    assert start.tolist() == [0.0, 3.0, 5.0, 11.0]
    assert finish.tolist() == [1.0, 7.0, 8.0, 12.0]
    start, finish = schedule(g, part)  # every transfer alone: y ready at 3, t at max(9, 8)
    assert start.tolist() == [0.0, 3.0, 3.0, 9.0] and finish[-1] == 10.0
    # two readers of s on one other device: one message, priced at the dearer edge (3)
    g2 = build_graph(["s", "p", "q"], [1.0, 1.0, 1.0], ["s", "s"], ["p", "q"], [2.0, 3.0])
    start, _ = schedule(g2, np.array([0, 1, 1]), shared_links=True)
    assert start.tolist()[1:] in ([4.0, 5.0], [5.0, 4.0])
    start, _ = schedule(g2, np.array([0, 1, 1]))
    assert sorted(start.tolist()[1:]) == [3.0, 4.0]
