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
    is computed in int32 (exactly what block floating point's headroom guarantees). Only when
    that bound fails (fixed scale, large values) or exponents differ is the sum widened to
    int64 and checked against the range, so overflow detection stays exact either way.

    The int32 contributions are kept as they came and summed once, when the sum is read
    (``wire``, ``values``): each is then read once, and the sum can be written straight into
    its destination (the outgoing packet). A contribution may be *borrowed* (kept as the
    caller's array, e.g. a view of a received packet, without a copy) when the caller keeps
    that memory valid until it is done with the sum."""

    __slots__ = ("parts", "wide", "exponent", "bitmap", "overflow", "peak")

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []  # int32 contributions at ``exponent``, not yet summed
        self.wide: np.ndarray | None = None  # the int64 sum, once the int32 bound failed
        self.exponent = 0
        self.bitmap = 0
        self.overflow = False
        self.peak = 0  # upper bound of |sum of parts|

    @property
    def size(self) -> int | None:
        if self.wide is not None:
            return self.wide.size
        return self.parts[0].size if self.parts else None

    def add(self, q: np.ndarray, exponent: int, bitmap: int, overflow: bool = False, *, borrow: bool = False) -> bool:
        """Add a contribution; False (and no change) if any of its workers is already in."""
        if self.bitmap & bitmap or self.size not in (None, q.size):
            return False
        hi, lo = (int(q.max()), int(q.min())) if q.size else (0, 0)
        peak = max(hi, -lo)
        self.overflow = self.overflow or overflow or hi >= _LIMIT or lo <= -_LIMIT
        self.bitmap |= bitmap
        int32_sum = (
            self.wide is None
            and q.dtype == np.int32
            and (not self.parts or (exponent == self.exponent and self.peak + peak < _LIMIT))
        )
        if int32_sum:
            self.parts.append(q if borrow else np.array(q, copy=True))
            self.exponent = exponent
            self.peak += peak
            return True
        wide = self._widened()
        if wide is None:  # the first contribution, not int32
            self.wide = q.astype(np.int64)
            self.exponent = exponent
        elif exponent < self.exponent:
            self.wide = shift_to(wide, self.exponent, exponent) + q
            self.exponent = exponent
        else:
            wide += shift_to(q.astype(np.int64), exponent, self.exponent)
        return True

    def forget_values(self) -> None:
        """Drop the values (and any borrowed array); who contributed is kept."""
        self.parts, self.wide = [], None

    def _widened(self) -> np.ndarray | None:
        """Switch to the int64 sum (the parts summed into it); None while empty."""
        if self.wide is None and self.parts:
            self.wide = self.parts[0].astype(np.int64)
            for part in self.parts[1:]:
                self.wide += part
            self.parts = []
        return self.wide

    @property
    def values(self) -> np.ndarray | None:
        """The sum as it stands: int32 while it provably fits, else int64."""
        if self.wide is not None:
            return self.wide
        return self._sum32(None) if self.parts else None

    def _sum32(self, out: np.ndarray | None) -> np.ndarray:
        """The int32 parts summed in one pass per part (into ``out`` if given); the result
        replaces them."""
        first, rest = self.parts[0], self.parts[1:]
        if rest:
            total = np.add(first, rest[0], out=out)
        elif out is None:
            return first
        else:
            np.copyto(out, first)
            total = out
        for part in rest[1:]:
            np.add(total, part, out=total)  # cannot overflow: the peaks add up below the limit
        self.parts = [total]
        return total

    def wire(self, out: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """Values as they leave this node (int32, saturated on overflow) and the flag; with
        ``out`` (int32, e.g. the outgoing packet's payload) they are written there."""
        if self.wide is None:
            assert self.parts
            return self._sum32(out), self.overflow  # within range by the peak bound
        out_of_range = saturated(self.wide)
        wide = np.clip(self.wide, -INT_SATURATED, INT_SATURATED) if out_of_range else self.wide
        if out is None:
            return wide.astype(np.int32), self.overflow or out_of_range
        np.copyto(out, wide, casting="unsafe")
        return out, self.overflow or out_of_range


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
