"""Queue quotas: nominal quota per resource, cohorts that lend and borrow, fair sharing, preemption.

The model is Kueue's ClusterQueue and cohort, restated in our words:

- A **queue with quota** owns a *nominal* amount of each resource it names (cpu, memory in bytes,
  gpu). The jobs it admits hold their whole demand (every replica's request) until they end or
  are preempted. A resource the queue does not name is not limited by the queue (only by the
  backend's capacity).
- Queues naming the same **cohort** lend each other what they do not use. A queue lends at most
  its *lending limit* of its nominal quota (default: all of it; the rest is kept for itself) and
  borrows at most its *borrowing limit* beyond its nominal quota (default: as much as the cohort
  lends). A queue without a cohort uses its nominal quota only.
- **Fair sharing**: when several queues of a cohort want to borrow, the next admission goes to the
  queue whose *dominant-resource share* would be lowest after it: the largest, over resources,
  of what it borrows divided by what the cohort can lend, divided by the queue's weight.
- **Preemption within a queue**: a job that does not fit may evict admitted jobs of lower
  priority in its own queue.
- **Reclaim**: a job that would stay within its queue's nominal quota may evict jobs of other
  queues of the cohort that are borrowing, until it fits: lent quota comes back to its owner.
  Victims are chosen among borrowers first (the largest share first), then the lowest priority,
  then the newest; the set is then made minimal (a victim whose eviction is not needed is kept).

Everything here is plain arithmetic over :class:`Holder` records; the controller builds a
:class:`QuotaBook` once per reconcile pass from the queues in the store and the admitted jobs,
and asks it, job by job, whether a job fits, whom it would have to preempt, and in what order
waiting jobs of a cohort are tried.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Protocol, TypeVar

from trainmaster.spec.model import Job

RESOURCES = ("cpu", "memory", "gpu")
EPSILON = 1e-9

Amounts = dict[str, float]  # resource name -> amount (cpu: cores, memory: bytes, gpu: devices)


@dataclass(frozen=True)
class ResourceQuota:
    """One resource of a queue: its nominal quota and its borrowing and lending limits."""

    nominal: float
    borrowing_limit: float | None = None  # most it uses beyond nominal; None: what the cohort lends
    lending_limit: float | None = None  # most of its nominal it lends; None: all of it

    @property
    def lendable(self) -> float:
        return self.nominal if self.lending_limit is None else min(self.lending_limit, self.nominal)

    @property
    def guaranteed(self) -> float:
        """The part of its nominal quota it never lends."""
        return self.nominal - self.lendable


@dataclass(frozen=True)
class QueueQuota:
    """A queue with quota, as the controller reads it from the store."""

    name: str
    resources: dict[str, ResourceQuota]
    cohort: str | None = None
    weight: float = 1.0


@dataclass(frozen=True)
class Holder:
    """An admitted job holding quota in its queue."""

    id: int
    name: str
    queue: str
    priority: int
    demand: Amounts
    preemptible: bool = True  # False: another controller (a `trainmaster run`) drives it


@dataclass(frozen=True)
class Shortfall:
    """Why one resource of a job does not fit its queue: what blocks it and by how much."""

    resource: str
    needed: float
    available: float
    limit: str  # "nominal quota", "borrowing limit" or "cohort"
    detail: str

    @property
    def short_by(self) -> float:
        return self.needed - self.available

    def describe(self) -> str:
        return (
            f"{self.resource} needs {amount(self.resource, self.needed)}, "
            f"{amount(self.resource, max(self.available, 0.0))} available ({self.detail}): "
            f"short by {amount(self.resource, self.short_by)}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "resource": self.resource,
            "needed": self.needed,
            "available": max(self.available, 0.0),
            "shortBy": self.short_by,
            "limit": self.limit,
            "message": self.describe(),
        }


@dataclass(frozen=True)
class Preemption:
    """The victims that make room for a job, and why (for their events)."""

    victims: list[Holder]
    reclaim: bool  # some victim is in another queue (lent quota taken back)


def amount(resource: str, value: float) -> str:
    """A resource amount as a user reads it: cores as given, memory in binary units."""
    if resource != "memory":
        return f"{value:g}"
    for unit, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.4g}{unit}"
    return f"{value:g}B"


def job_demand(job: Job) -> Amounts:
    """What a job holds in its queue once admitted: every replica's request."""
    demand: Amounts = {r: 0.0 for r in RESOURCES}
    for role in job.spec.roles:
        demand["cpu"] += role.replicas * role.resources.cpu
        demand["memory"] += float(role.replicas * role.resources.memory_bytes)
        demand["gpu"] += float(role.replicas * role.resources.gpu)
    return demand


class Waiting(Protocol):
    admitted: bool
    queue: str


W = TypeVar("W", bound=Waiting)


@dataclass
class QuotaBook:
    """The quota of every queue and what its admitted jobs use, for one reconcile pass."""

    queues: dict[str, QueueQuota]
    holders: dict[int, Holder] = field(default_factory=dict)
    usage: dict[str, Amounts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        held = list(self.holders.values())
        self.holders = {}
        self.version = 0  # grows with every hold and release: memoised answers stay valid until then
        self._no_preemption: set[tuple[str, int, tuple[float, ...], int]] = set()
        self.usage = {name: {r: 0.0 for r in RESOURCES} for name in self.queues}
        members: dict[str, list[str]] = defaultdict(list)
        for queue in self.queues.values():
            members[self._cohort_key(queue)].append(queue.name)
        # fixed for the book's life (the queues do not change within a pass): asked per waiting
        # job, thousands of times a pass, so looked up rather than summed each time
        self._members = {name: members[self._cohort_key(q)] for name, q in self.queues.items()}
        self._pools = {
            (name, r): sum(
                self.queues[m].resources[r].lendable for m in self._members[name] if r in self.queues[m].resources
            )
            for name in self.queues
            for r in RESOURCES
        }
        self._kept = {  # (queue, resource) -> (member, what it keeps for itself) for the cohort's members naming it
            (name, r): [
                (m, self.queues[m].resources[r].guaranteed)
                for m in self._members[name]
                if r in self.queues[m].resources
            ]
            for name in self.queues
            for r in RESOURCES
        }
        for holder in held:
            self.hold(holder)

    @staticmethod
    def _cohort_key(queue: QueueQuota) -> str:
        return f"cohort/{queue.cohort}" if queue.cohort else f"queue/{queue.name}"

    def governs(self, queue: str) -> bool:
        return queue in self.queues

    def members(self, queue: str) -> list[str]:
        """The queues sharing ``queue``'s cohort (itself included; alone without a cohort)."""
        return self._members[queue]

    # ---- usage --------------------------------------------------------------------------------
    def hold(self, holder: Holder) -> None:
        if holder.queue not in self.queues or holder.id in self.holders:
            return
        self.holders[holder.id] = holder
        self.version += 1
        for r in RESOURCES:
            self.usage[holder.queue][r] += holder.demand.get(r, 0.0)

    def release(self, holder: Holder) -> None:
        if self.holders.pop(holder.id, None) is None:
            return
        self.version += 1
        for r in RESOURCES:
            self.usage[holder.queue][r] -= holder.demand.get(r, 0.0)

    def release_job(self, job_id: int) -> None:
        """A job that ended or was suspended gives its quota back (no-op for one holding none)."""
        holder = self.holders.get(job_id)
        if holder is not None:
            self.release(holder)

    def pool(self, queue: str, resource: str) -> float:
        """What the queues of ``queue``'s cohort lend of ``resource`` in all."""
        return self._pools[(queue, resource)]

    def pool_used(self, queue: str, resource: str) -> float:
        """What the cohort's queues use of the lent pool (beyond what each keeps for itself)."""
        usage = self.usage
        return sum(max(0.0, usage[m][resource] - kept) for m, kept in self._kept[(queue, resource)])

    def borrowed(self, queue: str, resource: str) -> float:
        quota = self.queues[queue].resources.get(resource)
        return 0.0 if quota is None else max(0.0, self.usage[queue][resource] - quota.nominal)

    def borrowing(self, queue: str) -> bool:
        return any(self.borrowed(queue, r) > EPSILON for r in self.queues[queue].resources)

    def share(self, queue: str, extra: Amounts | None = None) -> float:
        """The queue's dominant-resource share of borrowed quota, by weight (with ``extra``
        admitted): the largest, over its resources, of borrowed / what the cohort lends."""
        quota = self.queues[queue]
        dominant = 0.0
        for r, rq in quota.resources.items():
            used = self.usage[queue][r] + (extra or {}).get(r, 0.0)
            borrowed = max(0.0, used - rq.nominal)
            pool = self.pool(queue, r)
            if borrowed > EPSILON:
                dominant = max(dominant, borrowed / pool if pool > 0 else math.inf)
        if dominant == 0.0:
            return 0.0
        return dominant / quota.weight if quota.weight > 0 else math.inf

    # ---- admission ----------------------------------------------------------------------------
    def shortfalls(self, queue: str, demand: Amounts) -> list[Shortfall]:
        """What keeps ``demand`` out of ``queue`` now, one entry per blocked resource (empty: it fits)."""
        quota = self.queues[queue]
        out: list[Shortfall] = []
        for r, rq in quota.resources.items():
            need = demand.get(r, 0.0)
            if need <= 0:
                continue
            used = self.usage[queue][r]
            if quota.cohort is None:
                ceiling, limit = rq.nominal, "nominal quota"
                detail = f"nominal {amount(r, rq.nominal)}, in use {amount(r, used)}"
            else:
                borrow = math.inf if rq.borrowing_limit is None else rq.borrowing_limit
                ceiling, limit = rq.nominal + borrow, "borrowing limit"
                detail = (
                    f"nominal {amount(r, rq.nominal)} + borrowing limit {amount(r, borrow)}, in use {amount(r, used)}"
                )
            room = ceiling - used
            # what the cohort's lent pool leaves for this queue (beyond what it keeps for itself)
            lent_free = self.pool(queue, r) - self.pool_used(queue, r)
            pool_room = rq.guaranteed - used + lent_free
            if quota.cohort is not None:
                pool_room += max(0.0, used - rq.guaranteed)  # its own borrowing is in pool_used
            if pool_room < room and quota.cohort is not None:
                room, limit = pool_room, "cohort"
                detail = (
                    f"nominal {amount(r, rq.nominal)}, in use {amount(r, used)}; cohort '{quota.cohort}' "
                    f"has {amount(r, max(lent_free, 0.0))} unused of {amount(r, self.pool(queue, r))} lent"
                )
            if need > room + EPSILON:
                out.append(Shortfall(r, need, room, limit, detail))
        return out

    def fits(self, queue: str, demand: Amounts) -> bool:
        return not self.shortfalls(queue, demand)

    def never_fits(self, queue: str, demand: Amounts) -> list[Shortfall]:
        """The resources ``demand`` exceeds even with the queue's cohort empty: the most the
        queue may ever use (nominal + borrowing limit, within what the cohort lends)."""
        quota = self.queues[queue]
        out = []
        for r, rq in quota.resources.items():
            need = demand.get(r, 0.0)
            if quota.cohort is None:
                most = rq.nominal
            else:
                borrow = math.inf if rq.borrowing_limit is None else rq.borrowing_limit
                most = min(rq.nominal + borrow, rq.guaranteed + self.pool(queue, r))
            if need > most + EPSILON:
                out.append(
                    Shortfall(
                        r, need, most, "queue maximum", f"the most queue '{queue}' may ever use is {amount(r, most)}"
                    )
                )
        return out

    def within_nominal(self, queue: str, demand: Amounts) -> bool:
        quota = self.queues[queue]
        return all(
            self.usage[queue][r] + demand.get(r, 0.0) <= rq.nominal + EPSILON for r, rq in quota.resources.items()
        )

    def preemption(self, queue: str, priority: int, demand: Amounts) -> Preemption | None:
        """The fewest admitted jobs whose eviction lets ``demand`` into ``queue``; None when no
        allowed set does. Allowed: lower-priority jobs of the same queue; and, when the job stays
        within its queue's nominal quota, any job of a cohort queue that is borrowing.

        A question that found no set is remembered until the usage changes: a long queue of
        like jobs, blocked pass after pass, costs one search per pass, not one per job."""
        key = (queue, priority, tuple(demand.get(r, 0.0) for r in RESOURCES), self.version)
        if key in self._no_preemption:
            return None
        found = self._preemption(queue, priority, demand)
        if found is None:
            self._no_preemption.add(key)
        return found

    def _preemption(self, queue: str, priority: int, demand: Amounts) -> Preemption | None:
        holders = [h for h in self.holders.values() if h.preemptible]
        own = [h for h in holders if h.queue == queue and h.priority < priority]
        others: list[Holder] = []
        quota = self.queues[queue]
        if quota.cohort is not None and self.within_nominal(queue, demand):
            borrowers = [m for m in self.members(queue) if m != queue and self.borrowing(m)]
            rank = {m: self.share(m) for m in borrowers}
            others = sorted(
                (h for h in holders if h.queue in rank),
                key=lambda h: (-rank[h.queue], h.priority, -h.id),
            )
        candidates = others + sorted(own, key=lambda h: (h.priority, -h.id))
        if not candidates:
            return None
        removed: list[Holder] = []
        try:
            for holder in candidates:
                if holder.queue != queue and not self.borrowing(holder.queue):
                    continue  # that queue is back within its nominal quota: nothing more to reclaim
                self.release(holder)
                removed.append(holder)
                if self.fits(queue, demand):
                    break
            else:
                return None
            for holder in reversed(removed[:-1]):  # keep whom the others' eviction already makes room for
                self.hold(holder)
                if self.fits(queue, demand):
                    removed.remove(holder)
                else:
                    self.release(holder)
            return Preemption(list(removed), any(h.queue != queue for h in removed))
        finally:
            for holder in removed:
                self.hold(holder)

    # ---- order --------------------------------------------------------------------------------
    def order(self, jobs: list[W], facts: Callable[[W], tuple[int, int, Amounts]]) -> list[W]:
        """``jobs`` in reconcile order with the waiting jobs of queues with quota re-sequenced by
        fair sharing: in each cohort the next is the head (priority, then age, within its queue)
        of the queue whose dominant-resource share would be lowest after admitting it. Every
        other job keeps its place; the quota queues' jobs take the places theirs held.
        ``facts`` gives a waiting job's (id, priority, demand)."""
        slots = [i for i, j in enumerate(jobs) if not j.admitted and j.queue in self.queues]
        if not slots:
            return jobs
        by_queue: dict[str, list[W]] = defaultdict(list)
        for i in slots:
            by_queue[jobs[i].queue].append(jobs[i])
        heads: dict[str, int] = {q: 0 for q in by_queue}
        usage = {q: dict(u) for q, u in self.usage.items()}
        saved = self.usage
        self.usage = usage  # tentative admissions below change a copy
        try:
            heap: list[tuple[float, int, int, str]] = []

            def push(queue: str) -> None:
                if heads[queue] < len(by_queue[queue]):
                    job_id, priority, demand = facts(by_queue[queue][heads[queue]])
                    heapq.heappush(heap, (self.share(queue, demand), -priority, job_id, queue))

            for queue in by_queue:
                push(queue)
            ordered: list[W] = []
            while heap:
                _, _, _, queue = heapq.heappop(heap)
                head = by_queue[queue][heads[queue]]
                heads[queue] += 1
                demand = facts(head)[2]
                if self.fits(queue, demand):
                    for r in RESOURCES:
                        usage[queue][r] += demand.get(r, 0.0)
                ordered.append(head)
                push(queue)
        finally:
            self.usage = saved
        out = list(jobs)
        for slot, job in zip(slots, ordered):
            out[slot] = job
        return out
