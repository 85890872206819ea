"""Synthetic device pools and jobs in the shape of the multi-job FL literature.

Devices differ by an order of magnitude in speed (log-normal shift a_k), in steadiness (mu_k)
and bandwidth; each device's data per job is non-IID in size (log-normal sample counts). The
numbers are ours, chosen so that a round takes seconds to minutes like a phone-class device.
"""

from __future__ import annotations

import numpy as np

from trainmaster.flsched.model import Device, Job, Problem

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


def make_jobs(devices: list[Device], num_jobs: int, per_round: int, seed: int) -> list[Job]:
    """Jobs cycling through JOB_SHAPES; every device holds 50-1000 samples of every job."""
    rng = np.random.default_rng(seed + 7919)
    jobs = []
    for m in range(num_jobs):
        shape = JOB_SHAPES[m % len(JOB_SHAPES)]
        counts = np.clip(rng.lognormal(np.log(250), 0.6, len(devices)), 50, 1000).astype(int)
        jobs.append(Job(id=f"job{m}", tau=shape["tau"], model_bytes=shape["model_bytes"], per_round=per_round,
                        data={d.id: int(c) for d, c in zip(devices, counts)}))
    return jobs


def make_problem(num_devices: int, num_jobs: int, per_round: int, seed: int,
                 weights: dict[str, float] | None = None) -> Problem:
    devices = make_pool(num_devices, seed)
    return Problem.build(devices, make_jobs(devices, num_jobs, per_round, seed), weights=weights)
