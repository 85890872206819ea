"""Queue order: which waiting job gets the next chance to be admitted.

Queues share the controller by weight, as Volcano's proportion plugin shares a cluster: the
next waiting job comes from the queue whose admitted jobs per unit of weight are fewest, so a
queue flooded with jobs cannot starve another. Inside a queue, higher priority first, then the
oldest. Jobs already admitted are reconciled first, whatever their queue: they hold resources.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Protocol, TypeVar


class Queued(Protocol):
    admitted: bool
    queue: str


J = TypeVar("J", bound=Queued)


def parse_weights(items: list[str]) -> dict[str, float]:
    """``["research=2", "prod=3"]`` -> ``{"research": 2.0, "prod": 3.0}``; ValueError names the bad item."""
    weights: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = 0.0
        if not sep or not name.strip() or weight <= 0:
            raise ValueError(f"'{item}': expected QUEUE=WEIGHT with a weight > 0, e.g. research=2")
        weights[name.strip()] = weight
    return weights


def fair_order(jobs: list[J], weights: dict[str, float], also_served: dict[str, int] | None = None) -> list[J]:
    """``jobs`` (each queue's jobs already in priority-then-age order) in reconcile order:
    admitted ones first, then waiting ones drawn from the least-served queue by weight
    (unlisted queues weigh 1; ties go to the queue name, for a stable order). ``also_served``:
    admitted jobs per queue left out of ``jobs`` (a pass leaves out those that did not change)."""
    admitted = [j for j in jobs if j.admitted]
    served: dict[str, int] = defaultdict(int, also_served or {})
    for job in admitted:
        served[job.queue] += 1
    waiting: dict[str, deque[J]] = defaultdict(deque)
    for job in jobs:
        if not job.admitted:
            waiting[job.queue].append(job)
    order = list(admitted)
    while waiting:
        if len(waiting) == 1:  # one queue left: the rest of it as it stands (a long queue's tail)
            order += waiting.popitem()[1]
            break
        queue = min(waiting, key=lambda q: (served[q] / weights.get(q, 1.0), q))
        order.append(waiting[queue].popleft())
        served[queue] += 1
        if not waiting[queue]:
            del waiting[queue]
    return order
