"""flsched at scale: the sparse fleet, its incremental state and exact pricing, the shortlist, the
budgeted decision and the simulator at 100,000 devices. Timings live in bench/flsched.py --scale."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmaster.flsched import ExactCost, make_scheduler, violations
from trainmaster.flsched.fleet import Fleet, FleetCost, FleetJob, FleetState, Shortlist, subproblem
from trainmaster.flsched.model import ProblemError
from trainmaster.flsched.simulate import participation_histogram, simulate
from trainmaster.flsched.synthetic import make_family_problem, make_fleet, make_fleet_curves


def _valid(fleet: Fleet, state: FleetState, jobs: list[int], assignment: list[np.ndarray]) -> None:
    """Each job got per_round distinct free devices holding its data, no device twice."""
    free = state.free()
    seen: set[int] = set()
    for m, devs in zip(jobs, assignment):
        assert len(devs) == fleet.per_round[m] and len(set(devs.tolist())) == len(devs)
        assert free[devs].all()
        assert np.isin(devs, fleet.members[m]).all()
        assert not seen & set(devs.tolist())
        seen |= set(devs.tolist())


def test_fleet_prices_exactly_like_the_dense_cost():
    """Exact pricing at scale: a fleet (sparse per job) with its running participation sums
    prices any schedule as ExactCost prices the same dense problem (E[max] + variance over all K)."""
    p = make_family_problem("sparse", 300, 4, seed=5)
    fleet, state = Fleet.from_problem(p)
    exact, fc = ExactCost(p), FleetCost(fleet, state)
    assignment = make_scheduler("random", seed=1).schedule(p)
    assert fc.cost(list(range(4)), assignment) == pytest.approx(exact.cost(assignment), rel=1e-12)
    for m, s in enumerate(assignment):
        assert fc.job_fairness(m, s) == pytest.approx(exact.job_fairness(m, s), rel=1e-12)


def test_state_records_rounds_incrementally():
    """Incremental state: recording a round updates a job's counts and its running sum and sum
    of squares in O(round); they equal a recount over the whole pool."""
    fleet = make_fleet(5_000, 4, seed=3)
    state = FleetState(fleet)
    rng = np.random.default_rng(0)
    for _ in range(200):
        m = int(rng.integers(fleet.num_jobs))
        state.record(m, rng.choice(fleet.members[m], size=int(fleet.per_round[m]), replace=False))
    for m in range(fleet.num_jobs):
        counts = state.counts(m)
        assert state.h_sum[m] == pytest.approx(counts.sum())
        assert state.h_sq[m] == pytest.approx((counts**2).sum())


def test_fleet_rejects_bad_descriptions_listing_every_fault():
    """Validation at the boundary: a fleet with bad numbers and bad memberships is refused with
    every fault listed."""
    with pytest.raises(ProblemError) as info:
        Fleet(
            a=np.array([1e-3, -1.0, 2e-3]),
            mu=np.array([10.0, 10.0, 10.0]),
            bandwidth=np.array([1e6, 1e6, 1e6]),
            jobs=[FleetJob("j", 1.0, 1e6, 5), FleetJob("k", 1.0, 1e6, 1)],
            members=[np.array([0, 1]), np.array([2, 0])],
            samples=[np.array([10.0, 10.0]), np.array([10.0, 10.0])],
        )
    text = "\n".join(info.value.details)
    assert "device 1: a must be a positive number" in text
    assert "'j' asks for 5 devices per round but 2 hold its data" in text
    assert "'k': member devices must be distinct sorted indices" in text


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rounds=st.integers(0, 60), count=st.integers(1, 40), busy=st.floats(0.0, 0.9))
def test_shortlist_gives_the_exact_lowest_keys(seed, rounds, count, busy):
    """Shortlist (incremental candidates): after any rounds of history growth, the devices it
    returns are exactly the free devices of lowest key w_t E[T] + w_f 2 h / K (checked against a
    full sort), though it rescans the job's devices only now and then."""
    fleet = make_fleet(3_000, 2, seed=seed % 50)
    state = FleetState(fleet)
    rng = np.random.default_rng(seed)
    sl = Shortlist(fleet, state, 0)
    members = fleet.members[0]
    for r in range(rounds):
        free = rng.random(fleet.num_devices) >= busy
        got = sl.best(count, free)
        state.record(
            0, got[: min(len(got), int(fleet.per_round[0]))] if r % 2 else rng.choice(members, 5, replace=False)
        )
    free = rng.random(fleet.num_devices) >= busy
    got = sl.best(count, free)
    keys = fleet.weight_time * fleet.mean[0] + fleet.weight_fairness * 2.0 * state.history[0] / fleet.num_devices
    ok = free[members]
    expect = np.sort(keys[ok])[:count]
    assert np.allclose(np.sort(keys[np.searchsorted(members, got)]), expect)


def test_shortlist_rescans_rarely():
    """Shortlist (incremental): over 300 rounds that each take a job's best devices (so their keys
    grow) with a tenth of the pool busy, the job's devices are rescanned a few times, not 300."""
    fleet = make_fleet(20_000, 1, seed=1)
    state = FleetState(fleet)
    rng = np.random.default_rng(2)
    n = int(fleet.per_round[0])
    for _ in range(300):
        free = rng.random(fleet.num_devices) >= 0.1
        state.record(0, state.shortlist(0).best(6 * n, free)[:n])
    assert state.shortlist(0).rescans <= 10


def test_subproblem_prices_moves_as_the_fleet_does():
    """Sparse decision on a dense subproblem: with the fairness weight rescaled by K_sub / K, a
    replacement costs in the subproblem exactly what it costs on the fleet."""
    fleet = make_fleet(20_000, 3, seed=2)
    state = FleetState(fleet)
    rng = np.random.default_rng(1)
    for m in range(3):
        for _ in range(30):
            state.record(m, rng.choice(fleet.members[m], size=int(fleet.per_round[m]), replace=False))
    free = state.free()
    cand = [state.shortlist(m).best(60, free) for m in range(3)]
    problem, union = subproblem(fleet, state, [0, 1, 2], cand)
    sub, fc = ExactCost(problem), FleetCost(fleet, state)
    n = int(fleet.per_round[0])
    a, b = cand[0][:n].copy(), cand[0][:n].copy()
    b[0] = cand[0][n + 3]
    col = {int(k): i for i, k in enumerate(union)}
    sa, sb = np.array([col[int(k)] for k in a]), np.array([col[int(k)] for k in b])
    fleet_delta = fc.cost([0], [b]) - fc.cost([0], [a])
    assert sub.job_cost(0, sb) - sub.job_cost(0, sa) == pytest.approx(fleet_delta, rel=1e-9, abs=1e-9)


def test_fleet_schedulers_give_valid_rounds():
    """Scheduler interface on a fleet: sa (shortlists), greedy and random (no dense problem) and
    a dense-only baseline (fedcs, through the default) all give valid rounds of free devices."""
    fleet = make_fleet(30_000, 6, seed=4)
    state = FleetState(fleet)
    state.available = np.random.default_rng(0).random(fleet.num_devices) < 0.8
    state.prepare()
    jobs = [0, 2, 3, 5]
    for name in ("sa", "greedy", "random", "fedcs"):
        _valid(fleet, state, jobs, make_scheduler(name, seed=1).schedule_fleet(fleet, state, jobs))


def test_fleet_sa_is_as_good_as_dense_sa():
    """The shortlist loses nothing that matters: on 2,000 devices x 5 jobs with history, sa on
    the fleet (candidates from shortlists) is within 1% of sa on the whole dense problem, both
    priced by the exact cost of the whole pool."""
    p = make_family_problem("heterogeneous", 2000, 5, seed=11)
    fleet, state = Fleet.from_problem(p)
    jobs = list(range(5))
    dense = make_scheduler("sa", seed=3).schedule(p)
    sparse = make_scheduler("sa", seed=3, cpu_limit=5.0).schedule_fleet(fleet, state, jobs)
    assert violations(p, sparse) == []
    exact = ExactCost(p)
    assert exact.cost(sparse) <= 1.01 * exact.cost(dense)


def test_fleet_decision_keeps_its_time_budget():
    """Time budget per decision: with a tiny CPU budget sa stops annealing early and still
    returns a valid round (the budget bounds the search; the benchmark measures the time)."""
    fleet = make_fleet(100_000, 20, seed=7)
    state = FleetState(fleet)
    state.prepare()
    sa = make_scheduler("sa", seed=0, cpu_limit=0.001)
    jobs = list(range(20))
    _valid(fleet, state, jobs, sa.schedule_fleet(fleet, state, jobs))
    assert sa.stats.stopped_by_time_limit


@pytest.mark.timeout(240)
def test_simulator_runs_a_fleet_of_100000_devices():
    """Simulator at scale: 100,000 devices x 20 jobs, a few rounds per job with sa and random;
    every round's devices are free and hold the job's data, each job's participation adds up,
    and the decision times are recorded."""
    fleet = make_fleet(100_000, 20, seed=8)
    curves = make_fleet_curves(20, seed=8)
    for name in ("sa", "random"):
        res = simulate(fleet, make_scheduler(name, seed=8), curves=curves, seed=8, rounds=2)
        assert all(tr.rounds == 2 for tr in res.jobs)
        for m, tr in enumerate(res.jobs):
            assert tr.participation.sum() == 2 * fleet.per_round[m]
            assert np.isin(np.flatnonzero(tr.participation), fleet.members[m]).all()
        assert len(res.decision_cpu_seconds) == len(res.decision_seconds) >= 1
        out = res.to_dict()
        assert out["devices"] == 100_000 and out["decision_cpu_ms_max"] > 0


def test_fleet_simulation_sa_beats_random_on_completion_time():
    """True objective, small fleet: on 5,000 devices x 5 jobs, sa's mean job completion time (the
    simulated time to each target) is shorter than random's; greedy, blind to re-use, is slower
    than sa (its re-used devices teach less)."""
    fleet = make_fleet(5_000, 5, seed=12)
    curves = make_fleet_curves(5, seed=12)
    jct = {
        name: simulate(
            fleet, make_scheduler(name, seed=12), curves=curves, seed=12, max_rounds=400
        ).mean_completion_time
        for name in ("sa", "random", "greedy")
    }
    assert jct["sa"] is not None and jct["random"] is not None
    assert jct["random"] >= 1.88 * jct["sa"]
    assert jct["greedy"] is None or jct["greedy"] > jct["sa"]


def test_participation_histogram_is_labelled():
    """Participation histogram (issue 38): bins are labelled with the rounds served, and the
    devices in them add up to the pool."""
    counts = np.array([0, 0, 1, 2, 2, 3, 7, 7, 12])
    hist = participation_histogram(counts, bins=5)
    assert sum(b["devices"] for b in hist["bins"]) == len(counts)
    assert hist["bins"][0] == {"rounds": "0-2", "devices": 5}
    assert [b["rounds"] for b in hist["bins"]] == ["0-2", "3-5", "6-8", "9-11", "12-14"]
    one = participation_histogram(np.array([0, 1, 1, 2]), bins=10)
    assert [b["rounds"] for b in one["bins"]] == ["0", "1", "2"] and one["counts"] == [1, 2, 1]
