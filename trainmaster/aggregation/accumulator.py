"""Aggregator memory: the running sum of one slice, shared by forwarding and parameter nodes.

A sum is only ever extended by a contribution whose worker bitmap is disjoint from what it
already holds: that single rule is what makes duplicates, retransmits and flushed partial sums
safe (nothing is double counted; an overlapping piece is refused and its workers' own
retransmissions fill the gap later).
"""

from __future__ import annotations

import numpy as np

from trainmaster.aggregation.protocol import INT_SATURATED
from trainmaster.aggregation.quantize import shift_to


def saturated(q: np.ndarray) -> bool:
    """Any value at (or beyond) the saturation limit: two reductions, no temporary array."""
    limit = int(INT_SATURATED)
    return q.size > 0 and (int(q.max()) >= limit or int(q.min()) <= -limit)


class IntSum:
    """Wide (int64) sum of quantised values with exponent alignment and overflow detection.

    The first contribution is kept as int32 (a copy) and only widened when a second one
    arrives, so a complete sum that arrives in one piece (the parameter node's normal path)
    is checked and passed on without a wide copy."""

    __slots__ = ("values", "exponent", "bitmap", "overflow")

    def __init__(self) -> None:
        self.values: np.ndarray | None = None
        self.exponent = 0
        self.bitmap = 0
        self.overflow = False

    def add(self, q: np.ndarray, exponent: int, bitmap: int, overflow: bool = False) -> bool:
        """Add a contribution; False (and no change) if any of its workers is already in."""
        if self.bitmap & bitmap:
            return False
        if self.values is not None and q.size != self.values.size:
            return False
        overflow = overflow or saturated(q)
        if self.values is None:
            self.values = np.array(q, copy=True)
            self.exponent = exponent
        elif self.values.dtype != np.int64 and exponent == self.exponent:
            self.values = np.add(self.values, q, dtype=np.int64)  # widen and add in one pass
        else:
            if self.values.dtype != np.int64:
                self.values = self.values.astype(np.int64)
            if exponent < self.exponent:
                self.values = shift_to(self.values, self.exponent, exponent)
                self.exponent = exponent
            elif exponent > self.exponent:
                q = shift_to(q.astype(np.int64), exponent, self.exponent)
            self.values += q
        self.bitmap |= bitmap
        self.overflow = self.overflow or overflow
        return True

    def wire(self) -> tuple[np.ndarray, bool]:
        """Values as they leave this node (int32, saturated on overflow) and the flag."""
        assert self.values is not None
        if self.values.dtype != np.int64:
            return self.values, self.overflow  # one contribution: already checked by add
        out_of_range = saturated(self.values)
        wide = np.clip(self.values, -INT_SATURATED, INT_SATURATED) if out_of_range else self.values
        return wide.astype(np.int32), self.overflow or out_of_range


class FloatSum:
    """Float64 sum of float32 slices: the parameter node's exception-path aggregator."""

    __slots__ = ("values", "bitmap")

    def __init__(self) -> None:
        self.values: np.ndarray | None = None
        self.bitmap = 0

    def add(self, x: np.ndarray, bitmap: int) -> bool:
        if self.bitmap & bitmap:
            return False
        if self.values is None:
            self.values = x.astype(np.float64)
        elif x.size != self.values.size:
            return False
        else:
            self.values += x
        self.bitmap |= bitmap
        return True
