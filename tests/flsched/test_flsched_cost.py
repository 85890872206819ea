"""Cost and fairness on hand-computed cases; validation of problems."""

import numpy as np
import pytest

from trainmaster.flsched import SampledCost, Device, Job, Problem, ProblemError


def _problem(history=None, weights=None):
    devices = [
        Device("d0", a=1.0, mu=2.0, bandwidth=10.0),
        Device("d1", a=2.0, mu=1.0, bandwidth=5.0),
        Device("d2", a=0.5, mu=4.0, bandwidth=20.0),
        Device("d3", a=1.0, mu=1.0, bandwidth=10.0),
    ]
    jobs = [Job("j", tau=2.0, model_bytes=10.0, per_round=2, data={"d0": 1, "d1": 1, "d2": 2, "d3": 1})]
    return Problem.build(devices, jobs, history=history, weights=weights)


def test_fairness_variance_hand_computed():
    """Fairness: population variance over all K devices of history + this round's choice."""
    p = _problem(history={"j": {"d0": 2, "d1": 1}})
    cm = SampledCost.draw(p, np.random.default_rng(0), n_samples=4)
    # choose d0, d2 -> counts [3, 1, 1, 0]: mean 1.25, E[q^2] = (9+1+1+0)/4 = 2.75 -> var 1.1875
    assert cm.job_fairness(0, np.array([0, 2])) == pytest.approx(np.var([3, 1, 1, 0]))
    assert cm.job_fairness(0, np.array([0, 2])) == pytest.approx(1.1875)
    # O(1) replacement delta agrees with recomputation: swap d0 out for d3 -> [2,1,1,1]
    delta = cm.fairness_delta_replace(0, out_k=0, in_k=3)
    assert cm.job_fairness(0, np.array([3, 2])) == pytest.approx(1.1875 + delta)
    assert cm.job_fairness(0, np.array([3, 2])) == pytest.approx(np.var([2, 1, 1, 1]))


def test_round_time_is_slowest_device_with_common_random_numbers():
    """Cost: expected round time = mean over pre-drawn samples of the slowest chosen device's
    tau*d*(a + X/mu) + bytes/bandwidth; same samples for every candidate (CRN)."""
    p = _problem(weights={"time": 1.0, "fairness": 0.0})
    rng = np.random.default_rng(5)
    cm = SampledCost.draw(p, rng, n_samples=3)
    x = np.random.default_rng(5).exponential(1.0, size=(3, 4))
    # device d1: tau 2 * d 1 * (2 + x/1) + 10/5 ; device d2: 2 * 2 * (0.5 + x/4) + 10/20
    t1 = 2 * 1 * (2.0 + x[:, 1] / 1.0) + 2.0
    t2 = 2 * 2 * (0.5 + x[:, 2] / 4.0) + 0.5
    expected = np.maximum(t1, t2).mean()
    assert cm.job_time(0, np.array([1, 2])) == pytest.approx(expected)
    assert cm.cost([np.array([1, 2])]) == pytest.approx(expected)
    # the same candidate scored twice gets the same value (no fresh noise)
    assert cm.cost([np.array([1, 2])]) == cm.cost([np.array([2, 1])])


def test_total_cost_weights_time_and_fairness():
    """Cost = sum over jobs of w_time * E[round time] + w_fair * fairness variance."""
    p = _problem(history={"j": {"d0": 1}}, weights={"time": 0.5, "fairness": 3.0})
    cm = SampledCost.draw(p, np.random.default_rng(1), n_samples=8)
    s = np.array([0, 3])
    assert cm.cost([s]) == pytest.approx(0.5 * cm.job_time(0, s) + 3.0 * np.var([2, 0, 0, 1]))


def test_expected_time_formula():
    """Shifted exponential mean: tau d (a + 1/mu) + bytes / bandwidth."""
    p = _problem()
    assert p.expected_time()[0, 2] == pytest.approx(2 * 2 * (0.5 + 0.25) + 0.5)


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (
            {
                "devices": [{"id": "a", "a": 1, "mu": 1, "bandwidth": 1}],
                "jobs": [{"id": "j", "tau": 1, "per_round": 2, "data": {"a": 5}}],
            },
            "only 1 available",
        ),
        (
            {
                "devices": [{"id": "a", "a": 1, "mu": 1, "bandwidth": 1}],
                "jobs": [{"id": "j", "tau": 1, "per_round": 1, "data": {"zz": 5}}],
            },
            "unknown device 'zz'",
        ),
        (
            {
                "devices": [{"id": "a", "a": 1, "mu": -2, "bandwidth": 1}],
                "jobs": [{"id": "j", "tau": 1, "per_round": 1, "data": {"a": 5}}],
            },
            "mu must be a positive",
        ),
        (
            {
                "devices": [
                    {"id": "a", "a": 1, "mu": 1, "bandwidth": 1, "available": False},
                    {"id": "b", "a": 1, "mu": 1, "bandwidth": 1},
                ],
                "jobs": [{"id": "j", "tau": 1, "per_round": 2, "data": {"a": 5, "b": 1}}],
            },
            "only 1 available",
        ),
        (
            {
                "devices": [
                    {"id": "a", "a": 1, "mu": 1, "bandwidth": 1},
                    {"id": "b", "a": 1, "mu": 1, "bandwidth": 1},
                    {"id": "c", "a": 1, "mu": 1, "bandwidth": 1},
                ],
                "jobs": [
                    {"id": "j", "tau": 1, "per_round": 1, "data": {"a": 5}},
                    {"id": "k", "tau": 1, "per_round": 1, "data": {"a": 5}},
                    {"id": "l", "tau": 1, "per_round": 1, "data": {"b": 5, "c": 1}},
                ],
            },
            "overlap too much",
        ),
        (
            {
                "devices": [{"id": "a", "a": 1, "mu": 1, "bandwidth": 1}],
                "jobs": [{"id": "j", "tau": 1, "per_round": 1, "data": {"a": 5}}],
                "history": {"nope": {"a": 1}},
            },
            "unknown job 'nope'",
        ),
    ],
)
def test_infeasible_or_invalid_problems_are_rejected(raw, fragment):
    """Validation: infeasible (too many asked, Hall-violating overlap via max-flow), unknown ids,
    negative parameters all raise ProblemError naming the fault."""
    with pytest.raises(ProblemError) as info:
        Problem.from_dict(raw)
    assert fragment in str(info.value)
