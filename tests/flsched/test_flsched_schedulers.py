"""Every scheduler keeps the constraints; annealing's acceptance statistics; exact optimum agreement."""

import numpy as np
import pytest

from trainmaster.flsched import ExactCost, Problem, SampledCost, make_scheduler, names, violations
from trainmaster.flsched.schedulers import metropolis_accept
from trainmaster.flsched.schedulers.annealing import AnnealingScheduler
from trainmaster.flsched.schedulers.exact import brute_force, milp_optimum
from trainmaster.flsched.synthetic import make_problem


def _constrained_problem(seed: int) -> Problem:
    """A pool where some devices are unavailable and some hold no data for some jobs."""
    rng = np.random.default_rng(seed)
    K = 30
    devices = [
        {
            "id": f"d{k}",
            "a": float(rng.uniform(0.001, 0.02)),
            "mu": float(rng.uniform(20, 500)),
            "bandwidth": float(rng.uniform(1e6, 1e7)),
            "available": bool(rng.random() > 0.2),
        }
        for k in range(K)
    ]
    jobs = [
        {
            "id": f"j{m}",
            "tau": 1.0,
            "model_bytes": 1e6,
            "per_round": 4,
            "data": {f"d{k}": int(rng.integers(10, 300)) for k in range(K) if rng.random() > 0.3},
        }
        for m in range(3)
    ]
    history = {f"j{m}": {f"d{k}": int(rng.integers(0, 5)) for k in range(K)} for m in range(3)}
    return Problem.from_dict(
        {"devices": devices, "jobs": jobs, "history": history, "weights": {"time": 1.0, "fairness": 5.0}}
    )


@pytest.mark.parametrize("name", [n for n in names() if n != "exact"])
def test_constraints_never_violated(name):
    """Constraints: no device in two jobs, no unavailable or data-less device, exactly per_round."""
    for seed in range(4):
        p = _constrained_problem(seed)
        options = {"population": 8, "generations": 8} if name == "genetic" else {}
        sched = make_scheduler(name, seed=seed, **options)
        for _ in range(3):
            assignment = sched.schedule(p)
            assert violations(p, assignment) == []


def test_violations_detects_each_fault():
    """The checker itself catches a device in two jobs, an unavailable device, too many devices."""
    p = _constrained_problem(0)
    good = make_scheduler("greedy").schedule(p)
    shared = [good[0], np.concatenate([good[1][:-1], good[0][:1]]), good[2]]
    assert any("serves both" in f for f in violations(p, shared))
    off = int(np.flatnonzero(~p.available)[0])
    assert any("unavailable" in f for f in violations(p, [np.concatenate([good[0][:-1], [off]]), good[1], good[2]]))
    assert any("asked for" in f for f in violations(p, [np.concatenate([good[0], good[1][:1]]), good[1][1:], good[2]]))


def test_metropolis_acceptance_rate_matches_exp():
    """Acceptance rule: worse moves accepted with probability exp(-delta/T), better always."""
    rng = np.random.default_rng(0)
    n = 20000
    for delta, temp in [(1.0, 2.0), (3.0, 1.0), (0.2, 0.1)]:
        rate = np.mean([metropolis_accept(delta, temp, rng.random()) for _ in range(n)])
        p = np.exp(-delta / temp)
        assert abs(rate - p) < 4 * np.sqrt(p * (1 - p) / n) + 1e-3
    assert metropolis_accept(-1.0, 1e-9, 0.999999)
    assert not metropolis_accept(1.0, 0.0, 0.0)


def test_annealing_acceptance_statistics_follow_temperature():
    """Annealing: at a fixed high temperature most worse moves are taken, at a low one almost none;
    with cooling the share lies in between, and the result is never worse than the greedy start."""
    p = make_problem(60, 3, 5, seed=3, weights={"time": 1.0, "fairness": 50.0})
    cm = ExactCost(p)
    hot = AnnealingScheduler(seed=1, moves=300, temperature=1e6, swap_prob=0.0)
    hot.schedule(p, cm)
    cold = AnnealingScheduler(seed=1, moves=300, temperature=1e-6, swap_prob=0.0)
    cold.schedule(p, cm)
    cooled = AnnealingScheduler(seed=1, moves=300)
    cooled.schedule(p, cm)
    rate = lambda s: s.stats.accepted_worse / max(s.stats.proposed_worse, 1)  # noqa: E731
    assert hot.stats.proposed_worse > 50 and rate(hot) > 0.95
    assert cold.stats.proposed_worse > 50 and rate(cold) < 0.02
    assert rate(cold) < rate(cooled) < rate(hot)
    for s in (hot, cold, cooled):
        assert s.stats.best_cost <= s.stats.initial_cost + 1e-9


def test_annealing_improves_on_greedy_when_fairness_matters():
    """SA beats its greedy start when history makes the fastest devices over-served."""
    p = make_problem(50, 2, 5, seed=4)
    history = np.zeros_like(p.history)
    fast = np.argsort(p.expected_time()[0])[:15]
    history[:, fast] = 8.0
    p = p.with_history(history, p.available)
    p.weight_fairness = 20.0
    cm = ExactCost(p)
    greedy = cm.cost(make_scheduler("greedy").schedule(p, cm))
    sa = cm.cost(make_scheduler("sa", seed=0).schedule(p, cm))
    assert sa < greedy


@pytest.mark.parametrize("seed", range(5))
def test_exact_optimum_agreement_on_tiny_instances(seed):
    """Exact optimum: brute force and the MILP agree on a sampled cost; on the exact cost sa is
    within 2% of the brute-force optimum on tiny instances."""
    p = make_problem(8, 2, 2, seed=seed, weights={"time": 1.0, "fairness": 30.0})
    rng = np.random.default_rng(seed)
    p = p.with_history(rng.integers(0, 4, size=p.history.shape), p.available)
    cm = SampledCost.draw(p, np.random.default_rng(seed), n_samples=16)
    bf, bf_cost = brute_force(cm)
    mi, mi_cost = milp_optimum(cm)
    assert violations(p, bf) == [] and violations(p, mi) == []
    assert mi_cost == pytest.approx(bf_cost, rel=1e-6)
    cm = ExactCost(p)
    bf, bf_cost = brute_force(cm)
    sa_cost = cm.cost(make_scheduler("sa", seed=seed, chains=2).schedule(p, cm))
    assert bf_cost <= sa_cost + 1e-9
    assert sa_cost <= bf_cost * 1.02


def test_unknown_scheduler_is_a_user_error():
    """Registry: unknown names are reported with the list of choices."""
    from trainmaster.errors import UserError

    with pytest.raises(UserError, match="unknown scheduler"):
        make_scheduler("nope")


def test_incremental_round_time_and_cost_match_full_recompute():
    """Incremental (delta) evaluation (annealing): the exact round time after replacing one
    device, and the running total after many accepted moves and the local search, equal a full
    re-pricing of the schedule."""
    from trainmaster.flsched.schedulers.annealing import _Chain, _Tables

    p = _constrained_problem(1)
    cm = ExactCost(p)
    sa = AnnealingScheduler(seed=3, temperature=1e3)  # hot: many accepted moves
    start = make_scheduler("greedy").schedule(p, cm)
    chain = _Chain(sa, _Tables.build(cm), start)
    rng = np.random.default_rng(4)
    for m in range(p.num_jobs):
        free = [k for k in np.flatnonzero(p.eligible[m]) if chain.owner[k] == -1]
        for pos in range(len(chain.sets[m])):
            k_in = int(rng.choice(free))
            trial = chain.sets[m].copy()
            trial[pos] = k_in
            assert chain._time_after(m, pos, k_in) == pytest.approx(cm.job_time(m, trial), rel=1e-12)
    best_sets, best_cost = chain.anneal(400, None)
    assert sa.stats.accepted_worse > 10
    assert chain.current == pytest.approx(cm.cost(chain.sets), rel=1e-9)
    assert best_cost == pytest.approx(cm.cost(best_sets), rel=1e-12)
    assert violations(p, best_sets) == []
    chain.descend(None)
    assert chain.current == pytest.approx(cm.cost(chain.sets), rel=1e-9)
    assert violations(p, chain.sets) == []


def test_pace_start_groups_least_served_devices_of_similar_speed():
    """Pace start: with a heavy fairness weight it takes the least-served devices, and among
    equally served ones the fastest, so one slow device does not set the pace of the round."""
    from trainmaster.flsched.schedulers.annealing import pace_assignment

    p = make_problem(40, 1, 5, seed=6, weights={"time": 1.0, "fairness": 1e4})
    served = np.argsort(p.expected_time()[0])[:20]  # the 20 fastest have served 3 rounds already
    history = np.zeros_like(p.history)
    history[0, served] = 3.0
    p = p.with_history(history, p.available)
    chosen = pace_assignment(ExactCost(p))[0]
    unserved = np.setdiff1d(np.arange(40), served)
    fastest_unserved = unserved[np.argsort(p.expected_time()[0][unserved])[:5]]
    assert sorted(chosen.tolist()) == sorted(fastest_unserved.tolist())
    assert violations(p, [chosen]) == []


@pytest.mark.parametrize("family, size", [("heterogeneous", (100, 5)), ("churn", (60, 4)), ("bimodal", (40, 2))])
def test_screening_hopeless_moves_leaves_the_chain_unchanged(monkeypatch, family, size):
    """Annealing acceptance (Metropolis) with delta evaluation: moves whose lower bound already
    makes u >= exp(-bound / T) are rejected without pricing; the chain must take exactly the
    steps it takes when every move is priced (same schedule, same cost, same accepted moves)."""
    from trainmaster.flsched.schedulers.annealing import _Chain
    from trainmaster.flsched.synthetic import make_family_problem

    p = make_family_problem(family, size[0], size[1], seed=5)
    screened = AnnealingScheduler(seed=11)
    with_screen = screened.schedule(p)
    monkeypatch.setattr(_Chain, "_hopeless", lambda self, bound, temperature, u: False)
    priced = AnnealingScheduler(seed=11)
    without = priced.schedule(p)
    assert [s.tolist() for s in with_screen] == [s.tolist() for s in without]
    assert screened.stats.best_cost == priced.stats.best_cost
    assert screened.stats.accepted_worse == priced.stats.accepted_worse
    assert screened.stats.accepted_better == priced.stats.accepted_better
    assert screened.stats.proposed_worse == priced.stats.proposed_worse
