"""The exact objective: E[max] of independent shifted exponentials (``pricing.py``)."""

import numpy as np
import pytest
from scipy import integrate

from trainmaster.flsched import ExactCost, SampledCost
from trainmaster.flsched.pricing import expected_max, expected_max_many
from trainmaster.flsched.synthetic import make_problem


def _adaptive_reference(shift: np.ndarray, scale: np.ndarray) -> float:
    """Integral of 1 - prod F_k(t) by scipy's adaptive quadrature (below max shift it is 1)."""
    top = shift.max()

    def survival(t: float) -> float:
        return 1.0 - float(np.prod(1.0 - np.exp(-(t - shift) / scale)))

    return top + integrate.quad(survival, top, np.inf, epsabs=1e-14, epsrel=1e-12, limit=1000)[0]


def test_exact_round_time_closed_forms():
    """Exact objective: one device gives shift + scale; n identical Exp(1) give the harmonic
    number H_n; a deterministic device (scale 0) only raises the floor."""
    assert expected_max(np.array([2.0]), np.array([3.0])) == pytest.approx(5.0, rel=1e-12)
    for n in (2, 7, 40):
        harmonic = sum(1.0 / k for k in range(1, n + 1))
        assert expected_max(np.zeros(n), np.ones(n)) == pytest.approx(harmonic, rel=1e-9)
    assert expected_max(np.array([10.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(10.0 + np.exp(-10.0), rel=1e-12)


def test_exact_round_time_matches_adaptive_quadrature():
    """Exact objective: the Gauss-Legendre panels agree with adaptive quadrature to 1e-9 on
    random jobs with shifts and scales spread over four orders of magnitude."""
    rng = np.random.default_rng(11)
    for _ in range(60):
        n = int(rng.integers(1, 16))
        shift = rng.uniform(0.0, 10.0, n) * rng.choice([0.01, 1.0, 100.0])
        scale = np.exp(rng.uniform(-5.0, 4.0, n))
        assert expected_max(shift, scale) == pytest.approx(_adaptive_reference(shift, scale), rel=1e-9)


def test_exact_round_time_matches_large_monte_carlo():
    """Exact objective against a large Monte-Carlo estimate (2 million draws per job): relative
    error below 0.1% on every job of a synthetic round, and within 4 standard errors."""
    p = make_problem(40, 3, 8, seed=21)
    exact = ExactCost(p)
    rng = np.random.default_rng(5)
    for m in range(p.num_jobs):
        chosen = rng.choice(40, size=8, replace=False)
        draws = np.empty(2_000_000)
        for i in range(0, len(draws), 250_000):  # in blocks: bounded memory
            x = rng.exponential(1.0, size=(250_000, len(chosen)))
            draws[i : i + 250_000] = (exact.shift[m, chosen] + x * exact.scale[m, chosen]).max(axis=1)
        mc, se = draws.mean(), draws.std() / np.sqrt(len(draws))
        priced = exact.job_time(m, chosen)
        assert abs(priced - mc) / mc < 1e-3
        assert abs(priced - mc) < 4 * se


def test_sampled_cost_converges_to_exact_cost():
    """The sampled cost (MILP, fresh-sample checks) is an estimate of the exact one: with many
    samples the two agree to 1%."""
    p = make_problem(30, 2, 5, seed=3, weights={"time": 1.0, "fairness": 10.0})
    exact, sampled = ExactCost(p), SampledCost.draw(p, np.random.default_rng(0), n_samples=20_000)
    schedule = [np.arange(5), np.arange(5, 10)]
    assert sampled.cost(schedule) == pytest.approx(exact.cost(schedule), rel=1e-2)


def test_batched_pricing_equals_one_by_one():
    """The vectorised batch (local search, pace start) prices every row as the single call does,
    including rows with absent (masked) devices."""
    rng = np.random.default_rng(2)
    shift = rng.uniform(0.0, 5.0, (30, 6))
    scale = np.exp(rng.uniform(-3.0, 2.0, (30, 6)))
    mask = rng.random((30, 6)) > 0.2
    mask[:, 0] = True
    batch = expected_max_many(shift, scale, mask)
    for b in range(30):
        assert batch[b] == pytest.approx(expected_max(shift[b, mask[b]], scale[b, mask[b]]), rel=1e-10)


def test_subset_closed_form_equals_quadrature():
    """Exact objective, both routes: for sets of at most SUBSET_MAX devices the subset closed form
    (sum over subsets of W_S / r_S) equals the Gauss-Legendre panels to 1e-10, single and batched,
    including far-apart shifts (tiny weights) and a deterministic device."""
    from trainmaster.flsched import pricing

    rng = np.random.default_rng(8)
    for _ in range(40):
        n = int(rng.integers(1, pricing.SUBSET_MAX + 1))
        shift = rng.uniform(0.0, 10.0, n) * rng.choice([0.01, 1.0, 100.0])
        scale = np.exp(rng.uniform(-5.0, 4.0, n))
        closed = expected_max(shift, scale)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pricing, "SUBSET_MAX", 0)  # force the quadrature route
            assert closed == pytest.approx(expected_max(shift, scale), rel=1e-10)
            batch_quadrature = expected_max_many(shift[None, :], scale[None, :])[0]
        assert expected_max_many(shift[None, :], scale[None, :])[0] == pytest.approx(batch_quadrature, rel=1e-10)
    with_fixed = np.array([3.0, 0.0, 1.0]), np.array([0.0, 1.0, 2.0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pricing, "SUBSET_MAX", 0)
        reference = expected_max(*with_fixed)
    assert expected_max(*with_fixed) == pytest.approx(reference, rel=1e-12)
