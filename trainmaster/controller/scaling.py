"""Reconcile arithmetic: which replica indices to create and which instances to delete.

Surplus instances go failed first, then those that have run the shortest time (pending ones
have not run at all), as the controller spec says; replacements fill the lowest free indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Member:
    """What scaling needs to know of one existing instance."""

    key: int  # the instance's id
    index: int
    state: str
    started_at: datetime | None


def missing_indices(existing: list[Member], replicas: int) -> list[int]:
    """Indices to create so the role has ``replicas`` instances, lowest free indices first."""
    need = replicas - len(existing)
    used = {m.index for m in existing}
    out: list[int] = []
    candidate = 0
    while len(out) < need:
        if candidate not in used:
            out.append(candidate)
        candidate += 1
    return out


def surplus(existing: list[Member], replicas: int) -> list[Member]:
    """Instances to delete so the role keeps ``replicas``: failed first, then the youngest."""
    extra = len(existing) - replicas
    if extra <= 0:
        return []

    def order(m: Member) -> tuple[int, float, int]:
        if m.state == "failed":
            return (0, 0.0, -m.index)
        if m.started_at is None:  # never ran: the shortest run of all
            return (1, 0.0, -m.index)
        return (2, -m.started_at.timestamp(), -m.index)  # latest start = shortest run

    return sorted(existing, key=order)[:extra]
