"""Devices, jobs and one round's scheduling problem.

A round's problem is held as dense numpy arrays (devices along one axis, jobs along the other)
because every scheduler evaluates thousands of candidate schedules against it; per-device
objects would put Python attribute lookups on that hot path. ``Problem.from_dict`` is the one
place where a user's description is checked, so every scheduler can trust the arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainmaster.errors import UserError


class ProblemError(UserError):
    """The problem cannot be scheduled as described (bad numbers, unknown ids, infeasible)."""


@dataclass(frozen=True)
class Device:
    """One edge device: computation shift ``a`` (seconds per sample per epoch at best),
    fluctuation ``mu`` (larger = steadier), uplink ``bandwidth`` (bytes/s) and availability."""

    id: str
    a: float
    mu: float
    bandwidth: float
    available: bool = True


@dataclass(frozen=True)
class Job:
    """One FL job: ``tau`` local epochs per round, ``model_bytes`` sent per round, ``per_round``
    devices wanted each round, and the samples each device holds for it (absent = not eligible)."""

    id: str
    tau: float
    model_bytes: float
    per_round: int
    data: dict[str, int] = field(default_factory=dict)


@dataclass
class Problem:
    """One round's scheduling problem in array form.

    ``samples[m, k]`` is job m's data on device k (0 = not eligible); ``history[m, k]`` is how
    many rounds device k has served job m so far; ``eligible`` folds availability in.
    """

    devices: list[Device]
    jobs: list[Job]
    a: np.ndarray  # (K,)
    mu: np.ndarray  # (K,)
    bandwidth: np.ndarray  # (K,)
    available: np.ndarray  # (K,) bool
    samples: np.ndarray  # (M, K) float
    history: np.ndarray  # (M, K) float
    per_round: np.ndarray  # (M,) int
    tau: np.ndarray  # (M,)
    model_bytes: np.ndarray  # (M,)
    weight_time: float = 1.0
    weight_fairness: float = 1.0

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_jobs(self) -> int:
        return len(self.jobs)

    @property
    def eligible(self) -> np.ndarray:
        """(M, K) bool: device k may serve job m this round (available and holds its data)."""
        return (self.samples > 0) & self.available[None, :]

    def expected_time(self) -> np.ndarray:
        """(M, K) mean time of device k for one round of job m: tau d (a + 1/mu) + bytes/bw."""
        work = self.tau[:, None] * self.samples
        return work * (self.a + 1.0 / self.mu)[None, :] + self.comm_time()

    def time_spread(self) -> np.ndarray:
        """(M, K) standard deviation of that time (the exponential part): tau d / mu."""
        return self.tau[:, None] * self.samples / self.mu[None, :]

    def comm_time(self) -> np.ndarray:
        """(M, K) communication time: model size over the device's bandwidth."""
        return self.model_bytes[:, None] / self.bandwidth[None, :]

    def with_history(self, history: np.ndarray, available: np.ndarray) -> Problem:
        """The same pool and jobs at a later round (the simulator's step)."""
        return Problem(
            devices=self.devices,
            jobs=self.jobs,
            a=self.a,
            mu=self.mu,
            bandwidth=self.bandwidth,
            available=np.asarray(available, dtype=bool),
            samples=self.samples,
            history=np.asarray(history, dtype=float),
            per_round=self.per_round,
            tau=self.tau,
            model_bytes=self.model_bytes,
            weight_time=self.weight_time,
            weight_fairness=self.weight_fairness,
        )

    def subset_jobs(self, job_rows: list[int]) -> Problem:
        """Only some jobs (those whose round starts now); the pool is unchanged."""
        rows = np.asarray(job_rows, dtype=int)
        return Problem(
            devices=self.devices,
            jobs=[self.jobs[i] for i in rows],
            a=self.a,
            mu=self.mu,
            bandwidth=self.bandwidth,
            available=self.available,
            samples=self.samples[rows],
            history=self.history[rows],
            per_round=self.per_round[rows],
            tau=self.tau[rows],
            model_bytes=self.model_bytes[rows],
            weight_time=self.weight_time,
            weight_fairness=self.weight_fairness,
        )

    # ------------------------------------------------------------------ building and checking
    @classmethod
    def build(
        cls,
        devices: list[Device],
        jobs: list[Job],
        history: dict[str, dict[str, int]] | None = None,
        weights: dict[str, float] | None = None,
    ) -> Problem:
        """Arrays from objects, after checking everything; raises ProblemError listing all faults."""
        problems: list[str] = []
        dev_index: dict[str, int] = {}
        for d in devices:
            if d.id in dev_index:
                problems.append(f"device id {d.id!r} appears twice")
            dev_index[d.id] = len(dev_index)
            for name in ("a", "mu", "bandwidth"):
                value = getattr(d, name)
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                    problems.append(f"device {d.id!r}: {name} must be a positive number, got {value!r}")
        job_index: dict[str, int] = {}
        for j in jobs:
            if j.id in job_index:
                problems.append(f"job id {j.id!r} appears twice")
            job_index[j.id] = len(job_index)
            for name in ("tau", "model_bytes"):
                value = getattr(j, name)
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    problems.append(f"job {j.id!r}: {name} must be a non-negative number, got {value!r}")
            if not isinstance(j.per_round, int) or j.per_round < 1:
                problems.append(f"job {j.id!r}: per_round must be a positive integer, got {j.per_round!r}")
            for dev_id, n in j.data.items():
                if dev_id not in dev_index:
                    problems.append(f"job {j.id!r}: data names unknown device {dev_id!r}")
                if not isinstance(n, (int, float)) or n < 0:
                    problems.append(f"job {j.id!r}: samples on {dev_id!r} must be >= 0, got {n!r}")
        for job_id, counts in (history or {}).items():
            if job_id not in job_index:
                problems.append(f"history names unknown job {job_id!r}")
                continue
            for dev_id, c in counts.items():
                if dev_id not in dev_index:
                    problems.append(f"history of job {job_id!r} names unknown device {dev_id!r}")
                if not isinstance(c, (int, float)) or c < 0:
                    problems.append(f"history of job {job_id!r} on {dev_id!r} must be >= 0, got {c!r}")
        w = {"time": 1.0, "fairness": 1.0, **(weights or {})}
        for key in ("time", "fairness"):
            if not isinstance(w[key], (int, float)) or w[key] < 0:
                problems.append(f"weights.{key} must be a non-negative number, got {w[key]!r}")
        unknown_weights = set(w) - {"time", "fairness"}
        if unknown_weights:
            problems.append(f"unknown weights: {sorted(unknown_weights)}")
        if not devices:
            problems.append("no devices")
        if not jobs:
            problems.append("no jobs")
        if problems:
            raise ProblemError("invalid scheduling problem", problems)

        K, M = len(devices), len(jobs)
        samples = np.zeros((M, K))
        hist = np.zeros((M, K))
        for m, j in enumerate(jobs):
            for dev_id, n in j.data.items():
                samples[m, dev_index[dev_id]] = float(n)
        for job_id, counts in (history or {}).items():
            for dev_id, c in counts.items():
                hist[job_index[job_id], dev_index[dev_id]] = float(c)
        problem = cls(
            devices=list(devices),
            jobs=list(jobs),
            a=np.array([d.a for d in devices], float),
            mu=np.array([d.mu for d in devices], float),
            bandwidth=np.array([d.bandwidth for d in devices], float),
            available=np.array([bool(d.available) for d in devices]),
            samples=samples,
            history=hist,
            per_round=np.array([j.per_round for j in jobs], int),
            tau=np.array([j.tau for j in jobs], float),
            model_bytes=np.array([j.model_bytes for j in jobs], float),
            weight_time=float(w["time"]),
            weight_fairness=float(w["fairness"]),
        )
        check_feasible(problem)
        return problem

    @classmethod
    def from_dict(cls, raw: Any) -> Problem:
        """Parse the JSON problem format of ``trainmaster flsched schedule``."""
        if not isinstance(raw, dict):
            raise ProblemError("a problem must be a JSON object with 'devices' and 'jobs'")
        faults: list[str] = []
        unknown = set(raw) - {"devices", "jobs", "history", "weights"}
        if unknown:
            faults.append(f"unknown top-level keys: {sorted(unknown)}")
        devices: list[Device] = []
        for i, d in enumerate(raw.get("devices") or []):
            try:
                devices.append(
                    Device(
                        id=str(d["id"]),
                        a=d["a"],
                        mu=d["mu"],
                        bandwidth=d["bandwidth"],
                        available=bool(d.get("available", True)),
                    )
                )
            except (KeyError, TypeError) as exc:
                faults.append(f"devices[{i}]: needs id, a, mu, bandwidth ({exc!r})")
        jobs: list[Job] = []
        for i, j in enumerate(raw.get("jobs") or []):
            try:
                data = {str(k): v for k, v in (j.get("data") or {}).items()}
                jobs.append(
                    Job(
                        id=str(j["id"]),
                        tau=j["tau"],
                        model_bytes=j.get("model_bytes", 0.0),
                        per_round=j["per_round"],
                        data=data,
                    )
                )
            except (KeyError, TypeError, AttributeError) as exc:
                faults.append(f"jobs[{i}]: needs id, tau, per_round, data ({exc!r})")
        history = raw.get("history") or {}
        if not isinstance(history, dict) or not all(isinstance(v, dict) for v in history.values()):
            faults.append("history must map job id -> {device id: count}")
            history = {}
        weights = raw.get("weights") or {}
        if not isinstance(weights, dict):
            faults.append("weights must be an object like {'time': 1.0, 'fairness': 1.0}")
            weights = {}
        if faults:
            raise ProblemError("invalid scheduling problem", faults)
        history = {str(k): {str(d): c for d, c in v.items()} for k, v in history.items()}
        return cls.build(devices, jobs, history, weights)


def check_feasible(problem: Problem) -> None:
    """Raise ProblemError unless every job can get ``per_round`` distinct eligible devices at once.

    Counting alone is not enough (two jobs may want the same few devices), so this solves the
    bipartite assignment as a maximum flow: source -> job (capacity per_round) -> eligible
    device (1) -> sink (1).
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    eligible = problem.eligible
    faults = []
    for m, job in enumerate(problem.jobs):
        have = int(eligible[m].sum())
        if have < problem.per_round[m]:
            faults.append(
                f"job {job.id!r} asks for {problem.per_round[m]} devices per round but only "
                f"{have} available devices hold its data"
            )
    total = int(problem.per_round.sum())
    n_avail = int(problem.available.sum())
    if total > n_avail:
        faults.append(f"jobs ask for {total} devices in all but only {n_avail} are available")
    if faults:
        raise ProblemError("infeasible scheduling problem", faults)
    M, K = eligible.shape
    source, sink = 0, 1 + M + K
    rows, cols, caps = [], [], []
    for m in range(M):
        rows.append(source)
        cols.append(1 + m)
        caps.append(int(problem.per_round[m]))
    jm, kk = np.nonzero(eligible)
    rows += list(1 + jm)
    cols += list(1 + M + kk)
    caps += [1] * len(jm)
    rows += [1 + M + k for k in range(K)]
    cols += [sink] * K
    caps += [1] * K
    graph = csr_matrix((np.array(caps, np.int32), (np.array(rows), np.array(cols))), shape=(sink + 1, sink + 1))
    flow = maximum_flow(graph, source, sink).flow_value
    if flow < total:
        raise ProblemError(
            "infeasible scheduling problem",
            [
                f"the jobs' eligible devices overlap too much: at most {flow} of the {total} requested "
                "device slots can be filled at once"
            ],
        )
