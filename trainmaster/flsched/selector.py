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

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

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

    def __init__(self, job: Job, devices: Sequence[Device] | Mapping[str, Device], scheduler: str | Scheduler = "sa",
                 seed: int | None = None, weights: dict[str, float] | None = None,
                 pool: DevicePool | None = None) -> None:
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
            free = [c for c in sorted(client_ids) if c in self.pool.profiles and c not in self.pool.holder
                    and self.job.data.get(self.pool.profiles[c].id, 0) > 0]
            if len(free) < n:
                raise ProblemError(f"job {self.job.id!r} wants {n} clients but only {len(free)} idle clients "
                                   "with its data and a device profile are connected")
            devices = [self.pool.profiles[c] for c in free]
            by_device = {d.id: c for d, c in zip(devices, free)}
            job = replace(self.job, per_round=n, data={d.id: self.job.data[d.id] for d in devices})
            problem = Problem.build(devices, [job], history={job.id: {d: self.history.get(d, 0) for d in by_device}},
                                    weights=self.weights)
            chosen = [free[int(k)] for k in self.scheduler.schedule(problem)[0]]
            for cid in chosen:
                self.pool.holder[cid] = self.job.id
                dev = self.pool.profiles[cid].id
                self.history[dev] = self.history.get(dev, 0) + 1
        self.rounds.append(chosen)
        return chosen

    def release(self) -> None:
        """The job's round is over: its devices are free for other jobs."""
        with self.pool.lock:
            for cid in [c for c, j in self.pool.holder.items() if j == self.job.id]:
                del self.pool.holder[cid]
