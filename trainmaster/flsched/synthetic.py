"""Synthetic device pools and jobs in the shape of the multi-job FL literature.

Devices differ by an order of magnitude in speed (log-normal shift a_k), in steadiness (mu_k)
and bandwidth; each device's data per job is non-IID in size (log-normal sample counts). The
numbers are ours, chosen so that a round takes seconds to minutes like a phone-class device.
"""

from __future__ import annotations

import numpy as np

from trainmaster.flsched.fleet import Fleet, FleetJob
from trainmaster.flsched.model import Device, Job, Problem
from trainmaster.flsched.simulate import ConvergenceCurve

# Three jobs like the benchmark's (image, tabular, text-ish): local epochs, model size in bytes.
JOB_SHAPES = [
    {"tau": 2.0, "model_bytes": 4.0e6},
    {"tau": 1.0, "model_bytes": 1.0e6},
    {"tau": 3.0, "model_bytes": 8.0e6},
]


def make_pool(num_devices: int, seed: int) -> list[Device]:
    """Heterogeneous devices: per-sample time 1-30 ms, fluctuation up to 2x the shift, 1-20 MB/s."""
    rng = np.random.default_rng(seed)
    a = np.exp(rng.uniform(np.log(1e-3), np.log(3e-2), num_devices))
    mu = 1.0 / (a * rng.uniform(0.1, 2.0, num_devices))
    bw = np.exp(rng.uniform(np.log(1e6), np.log(2e7), num_devices))
    return [Device(id=f"d{k}", a=float(a[k]), mu=float(mu[k]), bandwidth=float(bw[k])) for k in range(num_devices)]


def make_straggler_pool(num_devices: int, seed: int, share: float = 0.25, factor: float = 10.0) -> list[Device]:
    """``make_pool`` with a heavy slow tail, as in deployed FL (old phones on poor links): a
    random ``share`` of the devices computes ``factor`` times slower (shift and spread) and
    sends ``factor`` times slower. This is where a scheduler matters: a round that includes one
    straggler lasts as long as the straggler."""
    if not (0.0 <= share <= 1.0 and factor >= 1.0):
        raise ValueError(f"straggler share must be in [0, 1] and factor >= 1, got {share!r}, {factor!r}")
    rng = np.random.default_rng([seed, 4243])
    slow = rng.permutation(num_devices)[: int(round(share * num_devices))]
    devices = make_pool(num_devices, seed)
    for k in slow:
        d = devices[k]
        devices[k] = Device(
            id=d.id, a=d.a * factor, mu=d.mu / factor, bandwidth=d.bandwidth / factor, available=d.available
        )
    return devices


def make_jobs(devices: list[Device], num_jobs: int, per_round: int, seed: int) -> list[Job]:
    """Jobs cycling through JOB_SHAPES; every device holds 50-1000 samples of every job."""
    rng = np.random.default_rng(seed + 7919)
    jobs = []
    for m in range(num_jobs):
        shape = JOB_SHAPES[m % len(JOB_SHAPES)]
        counts = np.clip(rng.lognormal(np.log(250), 0.6, len(devices)), 50, 1000).astype(int)
        jobs.append(
            Job(
                id=f"job{m}",
                tau=shape["tau"],
                model_bytes=shape["model_bytes"],
                per_round=per_round,
                data={d.id: int(c) for d, c in zip(devices, counts)},
            )
        )
    return jobs


def make_problem(
    num_devices: int, num_jobs: int, per_round: int, seed: int, weights: dict[str, float] | None = None
) -> Problem:
    devices = make_pool(num_devices, seed)
    return Problem.build(devices, make_jobs(devices, num_jobs, per_round, seed), weights=weights)


FAMILIES = ("heterogeneous", "bimodal", "sparse", "churn")
"""Problem families of the benchmark (``make_family_problem``)."""


def make_family_problem(family: str, num_devices: int, num_jobs: int, seed: int) -> Problem:
    """One mid-training round of a problem family, everything drawn from ``seed``.

    - heterogeneous: ``make_pool``'s log-uniform speeds and bandwidths;
    - bimodal: 30% fast devices (1-3 ms per sample, 10-50 MB/s), 70% slow ones (10-40 ms,
      0.5-3 MB/s), like flagship phones among old ones;
    - sparse: each device holds a job's data with probability 0.3 (at least 3 per_round / K;
      eligibility differs per job);
    - churn: 30% of the devices are unavailable this round, and the fast devices have served
      more (history grows with speed, as after rounds of a speed-greedy scheduler).

    Every family: per_round = clip(K / (3 M), 2, 10); history of 0-5 rounds per device and job
    (except churn's); fairness weight f K with f log-uniform in [0.3, 10], so one device more
    or less served weighs about as much as seconds of round time whatever the pool size.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown problem family {family!r}: one of {FAMILIES}")
    rng = np.random.default_rng([seed, FAMILIES.index(family), num_devices, num_jobs])
    per_round = int(np.clip(num_devices // (3 * num_jobs), 2, 10))
    devices = make_pool(num_devices, int(rng.integers(2**31)))
    if family == "bimodal":
        fast = rng.random(num_devices) < 0.3
        a = np.where(fast, rng.uniform(1e-3, 3e-3, num_devices), rng.uniform(1e-2, 4e-2, num_devices))
        bw = np.where(fast, rng.uniform(1e7, 5e7, num_devices), rng.uniform(5e5, 3e6, num_devices))
        mu = 1.0 / (a * rng.uniform(0.1, 2.0, num_devices))
        devices = [
            Device(id=f"d{k}", a=float(a[k]), mu=float(mu[k]), bandwidth=float(bw[k])) for k in range(num_devices)
        ]
    jobs = make_jobs(devices, num_jobs, per_round, int(rng.integers(2**31)))
    if family == "sparse":
        holds = max(0.3, 3.0 * per_round / num_devices)  # small pools: enough holders to choose from
        jobs = [
            Job(
                id=j.id,
                tau=j.tau,
                model_bytes=j.model_bytes,
                per_round=j.per_round,
                data={d: n for d, n in j.data.items() if rng.random() < holds},
            )
            for j in jobs
        ]
    if family == "churn":
        devices = [
            Device(id=d.id, a=d.a, mu=d.mu, bandwidth=d.bandwidth, available=bool(rng.random() >= 0.3)) for d in devices
        ]
    weights = {"time": 1.0, "fairness": float(np.exp(rng.uniform(np.log(0.3), np.log(10.0))) * num_devices)}
    problem = Problem.build(devices, jobs, weights=weights)
    if family == "churn":
        speed_rank = np.argsort(np.argsort(problem.expected_time().mean(axis=0)))  # 0 = fastest
        history = np.round((1.0 - speed_rank / num_devices)[None, :] * 8 * rng.random((num_jobs, num_devices)))
    else:
        history = rng.integers(0, 6, size=(num_jobs, num_devices)).astype(float)
    return problem.with_history(history, problem.available)


FLEET_PER_ROUND = (10, 20, 10, 50)
"""Devices per round of the fleet's jobs, in turn (most rounds at most 10, some much larger)."""


def make_fleet(
    num_devices: int,
    num_jobs: int,
    seed: int,
    fairness_per_device: float = 3.0,
    per_round: tuple[int, ...] = FLEET_PER_ROUND,
) -> Fleet:
    """A deployed-scale pool in sparse form (``fleet.Fleet``), drawn vectorised from ``seed``.

    Devices as ``make_pool``'s (per-sample time log-uniform 1-30 ms, fluctuation up to 2x the
    shift, 1-20 MB/s), a quarter of them stragglers 10x slower (``make_straggler_pool``'s slow
    tail). Each job's data lives on a share of the devices drawn log-uniform in [5%, 50%]
    (eligibility differs per job, as in multi-job FL where jobs target different
    populations), 50-1000 samples per holder (log-normal), shapes from JOB_SHAPES, per_round
    cycling through ``per_round``. Fairness weight ``fairness_per_device`` x K, so one round
    more or less on a device weighs about as much as seconds of round time at any pool size.
    """
    rng = np.random.default_rng([seed, 7717])
    K = num_devices
    a = np.exp(rng.uniform(np.log(1e-3), np.log(3e-2), K))
    mu = 1.0 / (a * rng.uniform(0.1, 2.0, K))
    bw = np.exp(rng.uniform(np.log(1e6), np.log(2e7), K))
    slow = rng.random(K) < 0.25
    a, mu, bw = np.where(slow, a * 10, a), np.where(slow, mu / 10, mu), np.where(slow, bw / 10, bw)
    jobs, members, samples = [], [], []
    for m in range(num_jobs):
        shape = JOB_SHAPES[m % len(JOB_SHAPES)]
        n = per_round[m % len(per_round)]
        share = float(np.exp(rng.uniform(np.log(0.05), np.log(0.5))))
        holders = np.flatnonzero(rng.random(K) < share)
        if len(holders) < 3 * n:
            holders = np.sort(rng.choice(K, size=min(K, 3 * n), replace=False))
        jobs.append(FleetJob(id=f"job{m}", tau=shape["tau"], model_bytes=shape["model_bytes"], per_round=n))
        members.append(holders)
        samples.append(np.clip(rng.lognormal(np.log(250), 0.6, len(holders)), 50, 1000).astype(int).astype(float))
    return Fleet(a, mu, bw, jobs, members, samples, weight_time=1.0, weight_fairness=fairness_per_device * K)


def make_fleet_curves(num_jobs: int, seed: int) -> list[ConvergenceCurve]:
    """Convergence curves for a fleet's jobs: no coverage term (a pool of 100,000 devices holds
    far more data than a job needs; what matters is how much each round teaches, which re-used
    devices do less of), alpha log-uniform in [3, 15] so that jobs need about 25-125 rounds of
    fresh devices to reach accuracy 0.83."""
    rng = np.random.default_rng([seed, 9127])
    alphas = np.exp(rng.uniform(np.log(3.0), np.log(15.0), num_jobs))
    return [ConvergenceCurve(alpha=float(a), beta=0.05, gamma=0.0, lam=0.5, target=0.83) for a in alphas]
