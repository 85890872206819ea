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


class IntSum:
    """Wide (int64) sum of quantised values with exponent alignment and overflow detection."""

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
        saturated = bool(np.any(np.abs(q) >= INT_SATURATED)) if not overflow else True
        if self.values is None:
            self.values = q.astype(np.int64, copy=True)
            self.exponent = exponent
        else:
            if q.size != self.values.size:
                return False
            if exponent < self.exponent:
                self.values = shift_to(self.values, self.exponent, exponent)
                self.exponent = exponent
            elif exponent > self.exponent:
                q = shift_to(q, exponent, self.exponent)
            self.values += q
        self.bitmap |= bitmap
        self.overflow = self.overflow or overflow or saturated
        return True

    def wire(self) -> tuple[np.ndarray, bool]:
        """Values as they leave this node (int32 range, saturated on overflow) and the flag."""
        assert self.values is not None
        out_of_range = bool(np.any(np.abs(self.values) >= INT_SATURATED))
        clipped = np.clip(self.values, -INT_SATURATED, INT_SATURATED)
        return clipped, self.overflow or out_of_range


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
            self.values = x.astype(np.float64, copy=True)
        elif x.size != self.values.size:
            return False
        else:
            self.values += x
        self.bitmap |= bitmap
        return True
