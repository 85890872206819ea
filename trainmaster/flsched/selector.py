"""Client selection for one FL job by a flsched scheduler, independent of any FL framework.

Frameworks such as Flower hand the server a set of connected clients (by their own ids) and ask
for n of them each round. ``JobSelector`` answers with the devices our scheduler picks for the
job, from each client's device profile and the job's participation history, which it keeps.
Several jobs (one framework server each) can share a ``DevicePool`` so that a device serves one
job at a time, the multi-job constraint of the model: a job leases its devices when it selects
them and gives them back when its round ends (``release``) or when it selects again.

The Flower glue lives in ``trainmaster.flsched.flower``; this module needs no Flower.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainmaster.flsched.model import Device, Job, Problem, ProblemError
from trainmaster.flsched.schedulers import Scheduler, make_scheduler


@dataclass
class DevicePool:
    """Device profiles by framework client id, and which job holds each device now."""

    profiles: dict[str, Device] = field(default_factory=dict)
    holder: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bind(self, client_ids: Sequence[str], devices: Sequence[Device] | Mapping[str, Device]) -> None:
        """Attach profiles to client ids: a mapping by client id, or a list given to the sorted
        ids not yet bound (frameworks name clients arbitrarily, e.g. Flower's node ids)."""
        with self.lock:
            if isinstance(devices, Mapping):
                self.profiles.update(devices)
                return
            unbound = sorted(c for c in client_ids if c not in self.profiles)
            used = {d.id for d in self.profiles.values()}
            spare = [d for d in devices if d.id not in used]
            for cid, dev in zip(unbound, spare):
                self.profiles[cid] = dev


class JobSelector:
    """Picks ``n`` clients per round for ``job`` with scheduler ``scheduler`` (default ``sa``).

    ``job.data`` is keyed by *device* id (the profiles' ids); clients without a profile or
    without data for the job are never chosen. ``weights`` are the cost weights of the problem.
    """

    def __init__(
        self,
        job: Job,
        devices: Sequence[Device] | Mapping[str, Device],
        scheduler: str | Scheduler = "sa",
        seed: int | None = None,
        weights: dict[str, float] | None = None,
        pool: DevicePool | None = None,
    ) -> None:
        self.job, self.devices = job, devices
        self.scheduler = make_scheduler(scheduler, seed=seed) if isinstance(scheduler, str) else scheduler
        self.weights = weights or {"time": 1.0, "fairness": 30.0}
        self.pool = pool or DevicePool()
        self.history: dict[str, int] = {}  # device id -> rounds served for this job
        self.rounds: list[list[str]] = []  # client ids chosen, per round

    def select(self, client_ids: Sequence[str], n: int) -> list[str]:
        """The n client ids to train this round (raises ProblemError when n cannot be met)."""
        self.release()
        self.pool.bind(client_ids, self.devices)
        with self.pool.lock:
            free = [
                c
                for c in sorted(client_ids)
                if c in self.pool.profiles
                and c not in self.pool.holder
                and self.job.data.get(self.pool.profiles[c].id, 0) > 0
            ]
            if len(free) < n:
                raise ProblemError(
                    f"job {self.job.id!r} wants {n} clients but only {len(free)} idle clients "
                    "with its data and a device profile are connected"
                )
            devices = [self.pool.profiles[c] for c in free]
            by_device = {d.id: c for d, c in zip(devices, free)}
            job = replace(self.job, per_round=n, data={d.id: self.job.data[d.id] for d in devices})
            problem = Problem.build(
                devices, [job], history={job.id: {d: self.history.get(d, 0) for d in by_device}}, weights=self.weights
            )
            chosen = [free[int(k)] for k in self.scheduler.schedule(problem)[0]]
            for cid in chosen:
                self.pool.holder[cid] = self.job.id
                dev = self.pool.profiles[cid].id
                self.history[dev] = self.history.get(dev, 0) + 1
        self.rounds.append(chosen)
        return chosen

    def release(self, clients: Sequence[str] | None = None) -> None:
        """The job's round is over: its devices (or only ``clients``) are free for other jobs."""
        with self.pool.lock:
            for cid in [c for c, j in self.pool.holder.items() if j == self.job.id]:
                if clients is None or cid in clients:
                    del self.pool.holder[cid]

    def forget(self, clients: Sequence[str]) -> None:
        """These clients disappeared: whatever holds them lets them go."""
        with self.pool.lock:
            for cid in clients:
                self.pool.holder.pop(cid, None)


@dataclass
class RoundRequest:
    """One job's request for its next round's clients, answered by ``JointScheduler``."""

    job_id: str
    client_ids: list[str]
    n: int
    chosen: list[str] | None = None
    error: ProblemError | None = None


@dataclass
class Lease:
    """One client held by one job from ``start`` until ``end`` (None: still held), monotonic
    seconds; ``why`` the lease ended: released, expired, vanished (the client disappeared) or
    job-ended."""

    job: str
    client: str
    start: float
    end: float | None = None
    why: str = ""


class JointScheduler:
    """One scheduling service for every job of a shared pool (each job's FL server asks it).

    The spec schedules all jobs of a round together, so that one job's choice takes devices
    from the others knowingly. Jobs served by separate framework servers (Flower runs) ask
    independently, so the service *gathers*: a request waits until every registered job that
    holds no lease has asked, or ``gather_s`` has passed, and then all gathered requests are
    scheduled in one problem over the idle clients. Each job gets a *lease* on each of its
    clients until it releases them (its round's results are in, failures included), the
    client *vanishes* (it is missing from the connected clients a job reports, or a job reports
    it unreachable: ``forget``), the job ends (``remove_job``), or ``lease_s`` passes (a job
    server that died does not hold devices forever). A client is never leased to two jobs at
    once: every grant takes only clients no lease holds, under one lock.

    Jobs and device profiles may be given up front or arrive later (``add_job``,
    ``add_devices``: runs start and stop, devices enrol). A round that cannot be scheduled
    raises ``ProblemError`` naming the job and the numbers, for that round only.
    ``leases_log`` records every lease for checks.

    With ``state_path`` every change (profiles, jobs, history, the leases held and until when)
    is written to that JSON file atomically (a temporary file renamed over it) before the call
    returns, and a service started on an existing file resumes from it: killed at any moment, a
    restarted service still knows which nodes are leased to which run, so it cannot hand a node
    that is out on a round to another run.
    """

    def __init__(
        self,
        jobs: Sequence[Job] = (),
        devices: Sequence[Device] | Mapping[str, Device] = (),
        scheduler: str | Scheduler = "sa",
        seed: int | None = None,
        weights: dict[str, float] | None = None,
        gather_s: float = 0.5,
        lease_s: float = 600.0,
        state_path: str | Path | None = None,
    ) -> None:
        self.jobs = {j.id: j for j in jobs}
        self.devices = devices
        self.scheduler = make_scheduler(scheduler, seed=seed) if isinstance(scheduler, str) else scheduler
        self.weights = weights or {"time": 1.0, "fairness": 30.0}
        self.gather_s, self.lease_s = gather_s, lease_s
        self.pool = DevicePool()
        if isinstance(devices, Mapping):
            self.pool.profiles.update(devices)
        self.cond = threading.Condition(self.pool.lock)
        self.history: dict[str, dict[str, int]] = {j: {} for j in self.jobs}
        self.pending: dict[str, RoundRequest] = {}
        self.lease_until: dict[str, float] = {}
        self.leases_log: list[Lease] = []
        self.state_path = None if state_path is None else Path(state_path)
        if self.state_path is not None and self.state_path.exists():
            self._load()

    # ------------------------------------------------------------------ persistence
    def _save(self) -> None:
        """Write the state (under the lock) atomically: a reader sees the old file or the new."""
        if self.state_path is None:
            return
        now_mono, now_wall = time.monotonic(), time.time()
        state = {
            "profiles": {c: vars(d) for c, d in self.pool.profiles.items()},
            "jobs": {j.id: vars(j) for j in self.jobs.values()},
            "history": self.history,
            "holders": self.pool.holder,
            "lease_until_wall": {j: now_wall + (t - now_mono) for j, t in self.lease_until.items()},
        }
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)

    def _load(self) -> None:
        assert self.state_path is not None
        try:
            state = json.loads(self.state_path.read_text())
            profiles = {c: Device(**d) for c, d in state["profiles"].items()}
            jobs = {j: Job(**spec) for j, spec in state["jobs"].items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise ProblemError(
                f"the arbiter's state file {self.state_path} cannot be read: {exc}",
                ["move it away to start afresh (leases it records would be forgotten)"],
            ) from None
        now_mono, now_wall = time.monotonic(), time.time()
        self.pool.profiles.update(profiles)
        self.jobs.update(jobs)
        self.history.update({j: {d: int(c) for d, c in h.items()} for j, h in state.get("history", {}).items()})
        self.pool.holder.update(state.get("holders", {}))
        for job, until in state.get("lease_until_wall", {}).items():
            self.lease_until[job] = now_mono + (float(until) - now_wall)
        for client, job in self.pool.holder.items():  # leases resumed: their start is the restart
            self.leases_log.append(Lease(job, client, now_mono, why="resumed"))

    # ------------------------------------------------------------------ jobs and devices
    def add_job(self, job: Job) -> None:
        """Register a job (a run that starts); its history starts empty unless it was known."""
        with self.cond:
            self.jobs[job.id] = job
            self.history.setdefault(job.id, {})
            self._save()
            self.cond.notify_all()

    def remove_job(self, job_id: str) -> None:
        """The job is over: its leases end and it no longer holds up other jobs' gathering."""
        with self.cond:
            self._end_lease(job_id, time.monotonic(), "job-ended")
            self.jobs.pop(job_id, None)
            self.pending.pop(job_id, None)
            self.history.pop(job_id, None)
            self._save()
            self.cond.notify_all()

    def add_devices(self, profiles: Mapping[str, Device]) -> None:
        """Device profiles by client id (devices enrolling, or reporting their state)."""
        with self.cond:
            self.pool.profiles.update(profiles)
            self._save()

    def forget(self, client_ids: Sequence[str]) -> None:
        """These clients disappeared: whatever holds them lets them go now."""
        with self.cond:
            self._vanish(set(client_ids), time.monotonic())
            self._save()
            self.cond.notify_all()

    def holders(self) -> dict[str, str]:
        """Which job holds each leased client now."""
        with self.cond:
            return dict(self.pool.holder)

    # ------------------------------------------------------------------ rounds
    def select(self, job_id: str, client_ids: Sequence[str], n: int) -> list[str]:
        """This job's n clients for its next round among ``client_ids`` (the clients connected
        now: a leased client missing from them has vanished and is released). Blocks at most
        ``gather_s`` for the other jobs' requests; raises ProblemError when the round cannot
        be scheduled."""
        with self.cond:
            if job_id not in self.jobs:
                raise ProblemError(f"unknown job {job_id!r}", [f"registered jobs: {', '.join(sorted(self.jobs))}"])
        self.release(job_id)
        self.pool.bind(client_ids, self.devices)
        request = RoundRequest(job_id, sorted(client_ids), int(n))
        with self.cond:
            self._vanish(set(self.pool.holder) - set(request.client_ids), time.monotonic())
            self.pending[job_id] = request
            deadline = time.monotonic() + self.gather_s
            self.cond.notify_all()
            while request.chosen is None and request.error is None:
                self._expire_leases(time.monotonic())
                idle_jobs = {j for j in self.jobs if j not in self.lease_until}
                if idle_jobs <= set(self.pending) or time.monotonic() >= deadline:
                    self._schedule_pending()
                    break
                self.cond.wait(timeout=max(0.0, deadline - time.monotonic()))
        if request.error is not None:
            raise request.error
        return list(request.chosen or [])

    def release(self, job_id: str, clients: Sequence[str] | None = None) -> None:
        """The job's round is over (results and failures in): its clients (or only ``clients``)
        are free again."""
        with self.cond:
            self._end_lease(job_id, time.monotonic(), "released", None if clients is None else set(clients))
            self._save()
            self.cond.notify_all()

    # ------------------------------------------------------------------ under the lock
    def _end_lease(self, job_id: str, now: float, why: str, clients: set[str] | None = None) -> None:
        ending = {c for c, j in self.pool.holder.items() if j == job_id and (clients is None or c in clients)}
        for cid in ending:
            del self.pool.holder[cid]
        for lease in self.leases_log:
            if lease.end is None and lease.job == job_id and lease.client in ending:
                lease.end, lease.why = now, why
        if job_id not in self.pool.holder.values():
            self.lease_until.pop(job_id, None)

    def _vanish(self, clients: set[str], now: float) -> None:
        for job_id in {self.pool.holder[c] for c in clients if c in self.pool.holder}:
            self._end_lease(job_id, now, "vanished", clients)

    def _expire_leases(self, now: float) -> None:
        for job_id, until in list(self.lease_until.items()):
            if now >= until:
                self._end_lease(job_id, now, "expired")

    def _schedule_pending(self) -> None:
        """Schedule every gathered request in one problem (the spec's joint round)."""
        requests = [r for r in self.pending.values() if r.job_id in self.jobs]
        self.pending.clear()
        offered = sorted(set().union(*(r.client_ids for r in requests))) if requests else []
        free = [c for c in offered if c in self.pool.profiles and c not in self.pool.holder]
        devices = [self.pool.profiles[c] for c in free]
        by_device = {d.id: c for d, c in zip(devices, free)}
        jobs = []
        for r in requests:
            job = self.jobs[r.job_id]
            data = {d.id: job.data.get(d.id, 0) for d in devices if by_device[d.id] in r.client_ids}
            jobs.append(replace(job, per_round=r.n, data={k: v for k, v in data.items() if v > 0}))
        try:
            if not devices:
                raise ProblemError(
                    "no idle client with a device profile is connected",
                    [f"jobs waiting: {', '.join(r.job_id for r in requests)}"],
                )
            history = {r.job_id: {d: self.history[r.job_id].get(d, 0) for d in by_device} for r in requests}
            problem = Problem.build(devices, jobs, history=history, weights=self.weights)
            assignment = self.scheduler.schedule(problem)
        except ProblemError as exc:
            reasons = list(getattr(exc, "details", None) or []) or [str(exc)]
            for r in requests:
                r.error = ProblemError(
                    f"round of job {r.job_id!r} cannot be scheduled now (it is skipped; the next round tries again)",
                    reasons,
                )
            self._save()
            self.cond.notify_all()
            return
        granted = time.monotonic()  # the lease runs from the hand-out, not from the request (scheduling takes time)
        for r, chosen in zip(requests, assignment):
            r.chosen = [free[int(k)] for k in chosen]
            for cid in r.chosen:
                assert cid not in self.pool.holder, f"client {cid} granted twice"  # the invariant, checked
                self.pool.holder[cid] = r.job_id
                dev = self.pool.profiles[cid].id
                self.history[r.job_id][dev] = self.history[r.job_id].get(dev, 0) + 1
                self.leases_log.append(Lease(r.job_id, cid, granted))
            self.lease_until[r.job_id] = granted + self.lease_s
        self._save()  # before any request returns: a grant survives a crash of the service
        self.cond.notify_all()


@dataclass
class JointJob:
    """One job's handle on a ``JointScheduler``: the same ``select``/``release`` as a
    ``JobSelector``, so a framework adapter takes either."""

    service: JointScheduler
    job_id: str

    def select(self, client_ids: Sequence[str], n: int) -> list[str]:
        return self.service.select(self.job_id, client_ids, n)

    def release(self, clients: Sequence[str] | None = None) -> None:
        self.service.release(self.job_id, clients)

    def forget(self, clients: Sequence[str]) -> None:
        self.service.forget(clients)
