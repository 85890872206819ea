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


_LIMIT = int(INT_SATURATED)


def saturated(q: np.ndarray) -> bool:
    """Any value at (or beyond) the saturation limit: two reductions, no temporary array."""
    return q.size > 0 and (int(q.max()) >= _LIMIT or int(q.min()) <= -_LIMIT)


class IntSum:
    """Exact sum of quantised values with exponent alignment and overflow detection.

    Values stay int32 while the sum provably fits: every contribution's peak magnitude is known
    from the saturation check, and while the peaks add up to less than the int32 limit the sum
    is added in place in int32 (exactly what block floating point's headroom guarantees). Only
    when that bound fails (fixed scale, large values) or exponents differ is the sum widened to
    int64 and checked against the range, so overflow detection stays exact either way."""

    __slots__ = ("values", "exponent", "bitmap", "overflow", "peak")

    def __init__(self) -> None:
        self.values: np.ndarray | None = None
        self.exponent = 0
        self.bitmap = 0
        self.overflow = False
        self.peak = 0  # upper bound of |values| while they are int32

    def add(self, q: np.ndarray, exponent: int, bitmap: int, overflow: bool = False) -> bool:
        """Add a contribution; False (and no change) if any of its workers is already in."""
        if self.bitmap & bitmap:
            return False
        if self.values is not None and q.size != self.values.size:
            return False
        hi, lo = (int(q.max()), int(q.min())) if q.size else (0, 0)
        peak = max(hi, -lo)
        overflow = overflow or hi >= _LIMIT or lo <= -_LIMIT
        if self.values is None:
            self.values = np.array(q, copy=True)
            self.exponent = exponent
            self.peak = peak
        elif (self.values.dtype != np.int64 and exponent == self.exponent
              and self.peak + peak < _LIMIT):
            np.add(self.values, q, out=self.values, casting="unsafe")  # cannot overflow
            self.peak += peak
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
            return self.values, self.overflow  # within range by the peak bound
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
