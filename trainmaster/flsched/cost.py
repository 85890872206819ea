"""The cost of one round's schedule: exact (the objective) and sampled (for the MILP and checks).

cost = sum over jobs m of  w_time * E[max_{k in S_m} T_mk]  +  w_fair * Var_k(q_mk)

T_mk = tau_m d_mk (a_k + X_k / mu_k) + bytes_m / bw_k with X_k ~ Exp(1) (the shifted
exponential of the model). ``ExactCost`` computes the expectation of the maximum by quadrature
(``pricing.py``): it is the one objective every scheduler optimises and every benchmark number
is priced by. ``SampledCost`` is a mean over pre-drawn rows of X (common random numbers): the
MILP needs it (a maximum over samples linearises), and the benchmark prices schedules on fresh
samples with it, to show that nothing depends on the samples a scheduler saw.

q_mk = history + 1 if k is chosen: its population variance over all K devices. Because exactly
per_round devices are chosen, sum q is fixed and sum q^2 grows by (2h + 1) per chosen device, so
the fairness term is *linear* in the choice: that gives O(1) updates for a one-device move and a
linear objective for the exact MILP.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from trainmaster.flsched.model import Problem
from trainmaster.flsched.pricing import expected_max

Assignment = list[np.ndarray]
"""Per job (in problem order) the device indices chosen for this round."""


class RoundCost(ABC):
    """Time plus fairness of one round's schedule; subclasses say how E[round time] is priced."""

    problem: Problem
    h_sum: np.ndarray  # (M,) sum of history
    h_sq: np.ndarray  # (M,) sum of history squared

    def _init_fairness(self) -> None:
        h = self.problem.history
        self.h_sum, self.h_sq = h.sum(axis=1), (h * h).sum(axis=1)

    @abstractmethod
    def job_time(self, m: int, devices: np.ndarray) -> float:
        """Expected duration of job m's round with these devices (its slowest device)."""

    def job_fairness(self, m: int, devices: np.ndarray) -> float:
        """Population variance over all K devices of job m's participation counts after this round."""
        K = self.problem.num_devices
        h = self.problem.history[m]
        total = self.h_sum[m] + len(devices)
        squares = self.h_sq[m] + float((2.0 * h[devices] + 1.0).sum())
        return squares / K - (total / K) ** 2

    def job_cost(self, m: int, devices: np.ndarray) -> float:
        p = self.problem
        return p.weight_time * self.job_time(m, devices) + p.weight_fairness * self.job_fairness(m, devices)

    def fairness_delta_replace(self, m: int, out_k: int, in_k: int) -> float:
        """Change of job m's fairness variance when device out_k is replaced by in_k: O(1)."""
        h = self.problem.history[m]
        return 2.0 * (h[in_k] - h[out_k]) / self.problem.num_devices

    def cost(self, assignment: Assignment) -> float:
        """Total cost of a schedule (lower is better; fitness is its negative)."""
        return float(sum(self.job_cost(m, np.asarray(s, dtype=int)) for m, s in enumerate(assignment)))

    def breakdown(self, assignment: Assignment) -> dict[str, dict[str, float]]:
        """Per job: expected round time and fairness variance (for reports)."""
        out = {}
        for m, s in enumerate(assignment):
            s = np.asarray(s, dtype=int)
            out[self.problem.jobs[m].id] = {"time": self.job_time(m, s), "fairness": self.job_fairness(m, s)}
        return out


class ExactCost(RoundCost):
    """The objective: E[round time] of each job computed exactly from the model's parameters.

    ``shift[m, k]`` = tau_m d_mk a_k + bytes_m / bw_k and ``scale[m, k]`` = tau_m d_mk / mu_k,
    so T_mk = shift + scale X with X ~ Exp(1)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        work = problem.tau[:, None] * problem.samples
        self.shift = work * problem.a[None, :] + problem.comm_time()
        self.scale = work / problem.mu[None, :]
        self._init_fairness()

    def job_time(self, m: int, devices: np.ndarray) -> float:
        devices = np.asarray(devices, dtype=int)
        if len(devices) == 0:
            return 0.0
        return expected_max(self.shift[m, devices], self.scale[m, devices])


@dataclass
class SampledCost(RoundCost):
    """Pre-drawn time samples for one round plus the fairness sums; cheap to query many times."""

    problem: Problem
    times: np.ndarray  # (M, S, K) sampled round time of device k for job m

    def __post_init__(self) -> None:
        self._init_fairness()

    @classmethod
    def draw(cls, problem: Problem, rng: np.random.Generator, n_samples: int = 32) -> SampledCost:
        """Draw the common random numbers once (X ~ Exp(1), scaled per device)."""
        x = rng.exponential(1.0, size=(n_samples, problem.num_devices))
        compute = problem.a[None, :] + x / problem.mu[None, :]  # (S, K) seconds per unit work
        work = problem.tau[:, None] * problem.samples  # (M, K)
        times = work[:, None, :] * compute[None, :, :] + problem.comm_time()[:, None, :]
        return cls(problem=problem, times=times)

    def job_time(self, m: int, devices: np.ndarray) -> float:
        """Mean over the samples of the slowest chosen device."""
        if len(devices) == 0:
            return 0.0
        return float(self.times[m][:, devices].max(axis=1).sum()) / self.times.shape[1]


def violations(problem: Problem, assignment: Assignment) -> list[str]:
    """Every constraint a schedule breaks (empty = valid): one job per device, only eligible
    (available, data-holding) devices, exactly per_round devices per job."""
    faults = []
    if len(assignment) != problem.num_jobs:
        return [f"schedule covers {len(assignment)} jobs, problem has {problem.num_jobs}"]
    eligible = problem.eligible
    seen: dict[int, str] = {}
    for m, row in enumerate(assignment):
        job = problem.jobs[m].id
        chosen = [int(k) for k in row]
        if len(chosen) != int(problem.per_round[m]):
            faults.append(f"job {job!r} got {len(chosen)} devices, asked for {problem.per_round[m]}")
        if len(set(chosen)) != len(chosen):
            faults.append(f"job {job!r} lists a device twice")
        for k in chosen:
            if not 0 <= k < problem.num_devices:
                faults.append(f"job {job!r}: no device index {k}")
                continue
            dev = problem.devices[k].id
            if not problem.available[k]:
                faults.append(f"job {job!r} uses unavailable device {dev!r}")
            elif not eligible[m, k]:
                faults.append(f"job {job!r} uses device {dev!r} which holds none of its data")
            if k in seen and seen[k] != job:
                faults.append(f"device {dev!r} serves both {seen[k]!r} and {job!r}")
            seen[k] = job
    return faults
