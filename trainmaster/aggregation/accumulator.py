"""Aggregator memory: the running sum of one slice, shared by forwarding and parameter nodes.

A sum is only ever extended by a contribution whose worker bitmap is disjoint from what it
already holds: that single rule is what makes duplicates, retransmits and flushed partial sums
safe (nothing is double counted; an overlapping piece is refused and its workers' own
retransmissions fill the gap later).
"""

from __future__ import annotations

import numpy as np

from trainmaster.aggregation.protocol import INT_SATURATED, NO_PEAK
from trainmaster.aggregation.quantize import LIMITS, shift_to


_LIMIT = int(INT_SATURATED)
_INT16 = np.dtype("<i2")
_INT32 = np.dtype("<i4")


def saturated(q: np.ndarray, limit: int = _LIMIT) -> bool:
    """Any value at (or beyond) the saturation limit: two reductions, no temporary array."""
    return q.size > 0 and (int(q.max()) >= limit or int(q.min()) <= -limit)


class IntSum:
    """Exact sum of quantised values with exponent alignment and overflow detection.

    The sum leaves a node in its *wire type*: int16 while every contribution is int8 or int16
    (low-bit aggregation: an int8 slice's sum of up to 256 workers fits), int32 otherwise.
    Values stay in the wire type while the sum provably fits: every contribution's peak
    magnitude is known from the saturation check, and while the peaks add up to less than the
    wire type's limit the sum is computed in it (what block floating point's headroom and the
    shared scale's guarantee). Only when that bound fails (fixed scale, large values) or
    exponents differ is the sum widened to int64 and checked against the range, so overflow
    detection stays exact either way. A contribution at its own type's limit is saturated:
    overflow too.

    The contributions are kept as they came and summed once, when the sum is read (``wire``,
    ``values``): each is then read once, and the sum can be written straight into its
    destination (the outgoing packet). A contribution may be *borrowed* (kept as the caller's
    array, e.g. a view of a received packet, without a copy) when the caller keeps that memory
    valid until it is done with the sum. ``top`` is the largest ``Header.peak`` of the
    contributions (what the RESULT tells the workers for the next round's shared scale)."""

    __slots__ = ("parts", "wide", "exponent", "bitmap", "overflow", "peak", "top", "itemsize")

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []  # contributions at ``exponent``, not yet summed
        self.wide: np.ndarray | None = None  # the int64 sum, once the narrow bound failed
        self.exponent = 0
        self.bitmap = 0
        self.overflow = False
        self.peak = 0  # upper bound of |sum of parts|
        self.top = NO_PEAK
        self.itemsize = 0  # bytes per value of the widest contribution

    @property
    def wire_dtype(self) -> np.dtype:
        """int16 while every contribution is int8 or int16, else int32."""
        return _INT16 if self.itemsize <= 2 else _INT32

    @property
    def size(self) -> int | None:
        if self.wide is not None:
            return self.wide.size
        return self.parts[0].size if self.parts else None

    def add(
        self,
        q: np.ndarray,
        exponent: int,
        bitmap: int,
        overflow: bool = False,
        *,
        borrow: bool = False,
        top: int = NO_PEAK,
    ) -> bool:
        """Add a contribution (int8, int16 or int32); False (and no change) if any of its
        workers is already in. ``top``: its ``Header.peak``."""
        if self.bitmap & bitmap or self.size not in (None, q.size) or q.dtype.kind != "i":
            return False
        hi, lo = (int(q.max()), int(q.min())) if q.size else (0, 0)
        peak = max(hi, -lo)
        own = LIMITS.get(q.dtype.itemsize, _LIMIT)
        self.overflow = self.overflow or overflow or hi >= own or lo <= -own
        self.bitmap |= bitmap
        self.top = max(self.top, top)
        self.itemsize = max(self.itemsize, q.dtype.itemsize)
        narrow_sum = (
            self.wide is None
            and q.dtype.itemsize <= 4
            and (not self.parts or (exponent == self.exponent and self.peak + peak < LIMITS[self.wire_dtype.itemsize]))
        )
        if narrow_sum:
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
        """The sum as it stands: in the wire type while it provably fits, else int64."""
        if self.wide is not None:
            return self.wide
        return self._sum_parts(None) if self.parts else None

    def _sum_parts(self, out: np.ndarray | None) -> np.ndarray:
        """The parts summed in the wire type, one pass per part (into ``out`` if given); the
        result replaces them."""
        dtype = self.wire_dtype
        first, rest = self.parts[0], self.parts[1:]
        if out is None:
            if not rest and first.dtype == dtype:
                return first
            out = np.empty(first.size, dtype)
        if rest:
            total = np.add(first, rest[0], out=out, dtype=dtype)
        else:
            np.copyto(out, first)
            total = out
        for part in rest[1:]:
            # cannot overflow: the peaks add up below the limit
            np.add(total, part, out=total, dtype=dtype)
        self.parts = [total]
        return total

    def wire(self, out: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """Values as they leave this node (the wire type, saturated on overflow) and the flag;
        with ``out`` (of ``wire_dtype``, e.g. the outgoing packet's payload) they are written
        there."""
        if self.wide is None:
            assert self.parts
            return self._sum_parts(out), self.overflow  # within range by the peak bound
        limit = LIMITS[self.wire_dtype.itemsize]
        out_of_range = saturated(self.wide, limit)
        wide = np.clip(self.wide, -limit, limit) if out_of_range else self.wide
        if out is None:
            return wide.astype(self.wire_dtype), self.overflow or out_of_range
        np.copyto(out, wide, casting="unsafe")
        return out, self.overflow or out_of_range


class FloatSum:
    """Float64 sum of float32 slices: the parameter node's exception-path aggregator."""

    __slots__ = ("values", "bitmap", "top")

    def __init__(self) -> None:
        self.values: np.ndarray | None = None
        self.bitmap = 0
        self.top = NO_PEAK  # as ``IntSum.top``

    def add(self, x: np.ndarray, bitmap: int, top: int = NO_PEAK) -> bool:
        if self.bitmap & bitmap:
            return False
        if self.values is None:
            self.values = x.astype(np.float64)
        elif x.size != self.values.size:
            return False
        else:
            self.values += x
        self.bitmap |= bitmap
        self.top = max(self.top, top)
        return True
