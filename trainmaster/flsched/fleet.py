"""Large device pools in sparse form: 100,000 devices x 20 jobs, one decision in milliseconds.

``Problem`` holds a round as dense (jobs x devices) arrays, built and checked from objects:
right for a round of a few thousand devices, but at 100,000 devices x 20 jobs one such array is
2 million entries, and building, copying and max-flow-checking it at every decision costs
seconds. A deployed pool is also sparse: a job's data lives on some devices only.

``Fleet`` is the static part, stored per job: the devices that hold the job's data (sorted
indices), their sample counts and the exact cost's shift, scale and mean time (``ExactCost``'s
parameters), computed once. ``FleetState`` is what changes, updated *incrementally*: per job the
participation counts of its devices and their running sum and sum of squares (so the fairness
variance over all K devices is O(1) to read and O(n) to update), and which devices are busy or
unavailable. ``FleetCost`` prices a schedule exactly on the whole pool from those: E[max] of the
chosen devices (``pricing``) plus the variance over all K devices, never by sampling.

``Shortlist`` gives a job's best free candidates without scanning the pool: a device's *key*
w_t E[T_k] + w_f 2 h_k / K is a lower bound on what it adds to any schedule's cost (E[max] is at
least each member's mean; choosing a device of history h adds 2 h w_f / K to the variance), and
keys only grow (history only grows). So the lowest keys found at one full scan stay valid: a
device outside the cached list has a key at least the list's threshold, and a cached device
whose key has risen above it is set aside. The list is rescanned (one ``argpartition`` over the
job's devices) only when too few cached devices are free and below the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from trainmaster.flsched.model import Device, Job, Problem, ProblemError
from trainmaster.flsched.pricing import expected_max


SHORTLIST_FACTOR, SHORTLIST_MIN = 6, 48
"""A job wanting n devices is offered its max(6 n, 48) free devices of lowest key."""


def candidate_count(per_round: int, factor: int = SHORTLIST_FACTOR) -> int:
    """How many candidates a job of ``per_round`` devices gets from its shortlist."""
    return max(factor * int(per_round), SHORTLIST_MIN)


@dataclass(frozen=True)
class FleetJob:
    """One job of a fleet: ``tau`` local epochs, ``model_bytes`` per round, ``per_round`` devices."""

    id: str
    tau: float
    model_bytes: float
    per_round: int


class Fleet:
    """Devices as arrays (K,), jobs with their data-holding devices in sparse form (see module).

    ``members[m]`` are the sorted indices of the devices holding job m's data and
    ``samples[m]`` their sample counts (all positive). Raises ``ProblemError`` listing every
    fault of the description.
    """

    def __init__(
        self,
        a: np.ndarray,
        mu: np.ndarray,
        bandwidth: np.ndarray,
        jobs: list[FleetJob],
        members: list[np.ndarray],
        samples: list[np.ndarray],
        weight_time: float = 1.0,
        weight_fairness: float = 1.0,
        device_ids: list[str] | None = None,
    ) -> None:
        self.a = np.asarray(a, dtype=float)
        self.mu = np.asarray(mu, dtype=float)
        self.bandwidth = np.asarray(bandwidth, dtype=float)
        self.jobs = list(jobs)
        self.members = [np.asarray(x, dtype=np.int64) for x in members]
        self.samples = [np.asarray(x, dtype=float) for x in samples]
        self.weight_time, self.weight_fairness = float(weight_time), float(weight_fairness)
        self._ids = device_ids
        self._check()
        self.tau = np.array([j.tau for j in self.jobs], dtype=float)
        self.model_bytes = np.array([j.model_bytes for j in self.jobs], dtype=float)
        self.per_round = np.array([j.per_round for j in self.jobs], dtype=np.int64)
        self.shift, self.scale, self.mean = [], [], []
        for m, (k, d) in enumerate(zip(self.members, self.samples)):
            work = self.tau[m] * d
            shift = work * self.a[k] + self.model_bytes[m] / self.bandwidth[k]
            scale = work / self.mu[k]
            self.shift.append(shift)
            self.scale.append(scale)
            self.mean.append(shift + scale)
        self._devices: dict[int, Device] = {}

    def _check(self) -> None:
        faults: list[str] = []
        K = len(self.a)
        if K == 0:
            faults.append("no devices")
        for name in ("a", "mu", "bandwidth"):
            v = getattr(self, name)
            if v.shape != (K,):
                faults.append(f"{name} must have one value per device ({K}), got shape {v.shape}")
            elif not (np.all(np.isfinite(v)) and np.all(v > 0)):
                bad = int(np.flatnonzero(~(np.isfinite(v) & (v > 0)))[0])
                faults.append(f"device {bad}: {name} must be a positive number, got {v[bad]!r}")
        if not self.jobs:
            faults.append("no jobs")
        if not (len(self.members) == len(self.samples) == len(self.jobs)):
            faults.append("members and samples need one entry per job")
        if not (math.isfinite(self.weight_time) and self.weight_time >= 0):
            faults.append(f"weights.time must be a non-negative number, got {self.weight_time!r}")
        if not (math.isfinite(self.weight_fairness) and self.weight_fairness >= 0):
            faults.append(f"weights.fairness must be a non-negative number, got {self.weight_fairness!r}")
        seen: set[str] = set()
        for job, k, d in zip(self.jobs, self.members, self.samples):
            if job.id in seen:
                faults.append(f"job id {job.id!r} appears twice")
            seen.add(job.id)
            if not (
                math.isfinite(job.tau) and job.tau >= 0 and math.isfinite(job.model_bytes) and job.model_bytes >= 0
            ):
                faults.append(f"job {job.id!r}: tau and model_bytes must be non-negative numbers")
            if not isinstance(job.per_round, (int, np.integer)) or job.per_round < 1:
                faults.append(f"job {job.id!r}: per_round must be a positive integer, got {job.per_round!r}")
            elif job.per_round > len(k):
                faults.append(f"job {job.id!r} asks for {job.per_round} devices per round but {len(k)} hold its data")
            if k.shape != d.shape:
                faults.append(f"job {job.id!r}: one sample count per member device")
            elif len(k) and (k[0] < 0 or k[-1] >= K or np.any(np.diff(k) <= 0)):
                faults.append(f"job {job.id!r}: member devices must be distinct sorted indices in [0, {K})")
            elif not np.all(d > 0):
                faults.append(f"job {job.id!r}: every member device must hold samples (> 0)")
        if faults:
            raise ProblemError("invalid fleet", faults)

    @property
    def num_devices(self) -> int:
        return len(self.a)

    @property
    def num_jobs(self) -> int:
        return len(self.jobs)

    def device_id(self, k: int) -> str:
        return self._ids[k] if self._ids is not None else f"d{k}"

    def device(self, k: int) -> Device:
        """The device object of index k (made once, on first use)."""
        dev = self._devices.get(k)
        if dev is None:
            dev = self._devices[k] = Device(
                id=self.device_id(k), a=float(self.a[k]), mu=float(self.mu[k]), bandwidth=float(self.bandwidth[k])
            )
        return dev

    def positions(self, m: int, devices: np.ndarray) -> np.ndarray:
        """Where devices (indices, all members of job m) sit in ``members[m]``."""
        pos = np.searchsorted(self.members[m], devices)
        if np.any(pos >= len(self.members[m])) or np.any(
            self.members[m][np.minimum(pos, len(self.members[m]) - 1)] != devices
        ):
            raise ProblemError(f"job {self.jobs[m].id!r}: a chosen device holds none of its data")
        return pos

    @classmethod
    def from_problem(cls, problem: Problem) -> tuple[Fleet, FleetState]:
        """The sparse form of a dense problem, and its state (history, availability)."""
        members = [np.flatnonzero(problem.samples[m] > 0) for m in range(problem.num_jobs)]
        fleet = cls(
            problem.a,
            problem.mu,
            problem.bandwidth,
            [FleetJob(j.id, float(j.tau), float(j.model_bytes), int(j.per_round)) for j in problem.jobs],
            members,
            [problem.samples[m, k] for m, k in enumerate(members)],
            problem.weight_time,
            problem.weight_fairness,
            device_ids=[d.id for d in problem.devices],
        )
        state = FleetState(fleet, available=problem.available)
        for m, k in enumerate(members):
            state.history[m] = problem.history[m, k].astype(float)
        state.h_sum = problem.history.sum(axis=1).astype(float)
        state.h_sq = (problem.history**2).sum(axis=1).astype(float)
        return fleet, state


@dataclass
class FleetState:
    """What changes between decisions, updated in place: per job the participation count of each
    member device (``history[m]`` aligned with ``fleet.members[m]``) with its running sum and sum
    of squares over the whole pool, and which devices are busy or unavailable."""

    fleet: Fleet
    available: np.ndarray | None = None
    busy: np.ndarray = field(init=False)
    history: list[np.ndarray] = field(init=False)
    h_sum: np.ndarray = field(init=False)
    h_sq: np.ndarray = field(init=False)
    shortlists: dict[int, Shortlist] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        K = self.fleet.num_devices
        self.available = np.ones(K, dtype=bool) if self.available is None else np.asarray(self.available, dtype=bool)
        self.busy = np.zeros(K, dtype=bool)
        self.history = [np.zeros(len(k)) for k in self.fleet.members]
        self.h_sum = np.zeros(self.fleet.num_jobs)
        self.h_sq = np.zeros(self.fleet.num_jobs)

    def free(self) -> np.ndarray:
        """(K,) bool: available and not busy."""
        assert self.available is not None
        return self.available & ~self.busy

    def record(self, m: int, devices: np.ndarray) -> None:
        """Job m's round used these devices: their counts grow by one (O(n))."""
        pos = self.fleet.positions(m, np.asarray(devices, dtype=np.int64))
        h = self.history[m][pos]
        self.h_sum[m] += len(pos)
        self.h_sq[m] += float((2.0 * h + 1.0).sum())
        self.history[m][pos] = h + 1.0

    def prepare(self) -> None:
        """Build every job's candidate list now (one scan per job), so that no decision pays
        for the first scan: what a scheduler does when a pool is registered."""
        free = self.free()
        for m in range(self.fleet.num_jobs):
            self.shortlist(m).best(candidate_count(int(self.fleet.per_round[m])), free)

    def shortlist(self, m: int) -> Shortlist:
        """Job m's incremental candidate list (made on first use)."""
        if m not in self.shortlists:
            self.shortlists[m] = Shortlist(self.fleet, self, m)
        return self.shortlists[m]

    def counts(self, m: int) -> np.ndarray:
        """(K,) participation counts of job m over the whole pool (a dense copy, for reports)."""
        out = np.zeros(self.fleet.num_devices)
        out[self.fleet.members[m]] = self.history[m]
        return out


class FleetCost:
    """The exact cost of a round's schedule on a fleet (the ``ExactCost`` objective): per job
    w_t E[max of its devices' times] + w_f Var over all K devices of history + this round."""

    def __init__(self, fleet: Fleet, state: FleetState) -> None:
        self.fleet, self.state = fleet, state

    def job_time(self, m: int, devices: np.ndarray) -> float:
        if len(devices) == 0:
            return 0.0
        pos = self.fleet.positions(m, np.asarray(devices, dtype=np.int64))
        return expected_max(self.fleet.shift[m][pos], self.fleet.scale[m][pos])

    def job_fairness(self, m: int, devices: np.ndarray) -> float:
        K = self.fleet.num_devices
        pos = self.fleet.positions(m, np.asarray(devices, dtype=np.int64))
        total = self.state.h_sum[m] + len(pos)
        squares = self.state.h_sq[m] + float((2.0 * self.state.history[m][pos] + 1.0).sum())
        return squares / K - (total / K) ** 2

    def cost(self, jobs: list[int], assignment: list[np.ndarray]) -> float:
        f = self.fleet
        return float(
            sum(
                f.weight_time * self.job_time(m, s) + f.weight_fairness * self.job_fairness(m, s)
                for m, s in zip(jobs, assignment)
            )
        )


class Shortlist:
    """A job's free devices with the lowest keys w_t E[T_k] + w_f 2 h_k / K, kept incrementally
    (module docstring): exact, and a full scan of the job's devices only now and then."""

    def __init__(self, fleet: Fleet, state: FleetState, m: int) -> None:
        self.fleet, self.state, self.m = fleet, state, m
        self.cached = np.zeros(0, dtype=np.int64)  # positions in members[m]
        self.threshold = -np.inf
        self.rescans = 0

    def _keys(self, pos: np.ndarray | None = None) -> np.ndarray:
        f, m = self.fleet, self.m
        mean = f.mean[m] if pos is None else f.mean[m][pos]
        h = self.state.history[m] if pos is None else self.state.history[m][pos]
        return f.weight_time * mean + f.weight_fairness * 2.0 * h / f.num_devices

    def _rescan(self, size: int) -> None:
        keys = self._keys()
        size = min(size, len(keys))
        pick = np.argpartition(keys, size - 1)[:size] if size < len(keys) else np.arange(len(keys))
        self.cached = pick[np.argsort(keys[pick], kind="stable")]
        self.threshold = float(keys[self.cached[-1]]) if size < len(keys) else np.inf
        self.rescans += 1

    def best(self, count: int, free: np.ndarray, taken: np.ndarray | None = None) -> np.ndarray:
        """Device indices of up to ``count`` free (and not ``taken``) devices of the job with
        the lowest keys, best first (fewer only when the job has fewer such devices)."""
        members = self.fleet.members[self.m]
        while True:
            keys = self._keys(self.cached)
            devs = members[self.cached]
            ok = free[devs] & (keys <= self.threshold)
            if taken is not None:
                ok &= ~taken[devs]
            if ok.sum() >= count or self.threshold == np.inf:
                order = np.argsort(keys[ok], kind="stable")[:count]
                return devs[ok][order]
            blocked = len(devs) - int(ok.sum())
            self._rescan(max(2 * len(devs), 4 * count, 2 * (count + blocked), 64))


def quick_feasible(fleet: Fleet, jobs: list[int], candidates: list[np.ndarray]) -> bool:
    """True when jobs taking their first free candidates in turn (fewest candidates per wanted
    device first) all get enough: a sufficient test, so that the max-flow check
    (``model.check_feasible``) runs only when it fails."""
    taken: set[int] = set()
    order = sorted(range(len(jobs)), key=lambda i: len(candidates[i]) / int(fleet.per_round[jobs[i]]))
    for i in order:
        need = int(fleet.per_round[jobs[i]])
        for k in candidates[i].tolist():
            if k not in taken:
                taken.add(k)
                need -= 1
                if need == 0:
                    break
        if need:
            return False
    return True


def subproblem(
    fleet: Fleet, state: FleetState, jobs: list[int], candidates: list[np.ndarray]
) -> tuple[Problem, np.ndarray]:
    """A dense ``Problem`` over the union of the jobs' candidate devices, whose optimum is the
    fleet's optimum restricted to those candidates: the fairness weight is scaled by
    K_sub / K so that every move's fairness change (2 w_f (h_in - h_out) / K) is the fleet's;
    the variance's constant part differs, which no choice can change. Returns the problem and
    the device index of each of its columns."""
    union = np.unique(np.concatenate(candidates)) if candidates else np.zeros(0, dtype=np.int64)
    M, Ks = len(jobs), len(union)
    samples = np.zeros((M, Ks))
    history = np.zeros((M, Ks))
    for row, (m, cand) in enumerate(zip(jobs, candidates)):
        cols = np.searchsorted(union, cand)
        pos = fleet.positions(m, cand)
        samples[row, cols] = fleet.samples[m][pos]
        history[row, cols] = state.history[m][pos]
    sub_jobs = [fleet.jobs[m] for m in jobs]
    problem = Problem(
        devices=_FleetDevices(fleet, union),  # type: ignore[arg-type]  # a lazy list: made on access
        jobs=[Job(id=j.id, tau=j.tau, model_bytes=j.model_bytes, per_round=j.per_round) for j in sub_jobs],
        a=fleet.a[union],
        mu=fleet.mu[union],
        bandwidth=fleet.bandwidth[union],
        available=np.ones(Ks, dtype=bool),
        samples=samples,
        history=history,
        per_round=fleet.per_round[jobs],
        tau=fleet.tau[jobs],
        model_bytes=fleet.model_bytes[jobs],
        weight_time=fleet.weight_time,
        weight_fairness=fleet.weight_fairness * Ks / fleet.num_devices,
    )
    return problem, union


class _FleetDevices(Sequence[Device]):
    """The device objects of some fleet indices, made only when a scheduler looks at one
    (most never do: thousands of objects per decision would cost milliseconds)."""

    def __init__(self, fleet: Fleet, rows: np.ndarray) -> None:
        self.fleet, self.rows = fleet, rows

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Device: ...

    @overload
    def __getitem__(self, i: slice) -> list[Device]: ...

    def __getitem__(self, i: int | slice) -> Device | list[Device]:
        if isinstance(i, slice):
            return [self.fleet.device(int(k)) for k in self.rows[i]]
        return self.fleet.device(int(self.rows[i]))
