"""Float32 <-> integer quantisation with a power-of-two scale (``value = q * 2**-exponent``).

Three modes:

* ``FixedScale``: one exponent for everything. Large gradients saturate at the int32 limit, and
  sums of several workers can leave the int32 range: this is what exercises the overflow
  (exception-retransmit) path.
* ``BlockFloat``: a per-chunk exponent chosen from the chunk's largest magnitude with
  ``ceil(log2(fan_in))`` bits of headroom, so the sum of ``fan_in`` workers can never overflow.
  Workers may choose different exponents for the same slice; aggregators align them by
  shifting right (rounding), which adds at most half a unit in the last place per merge.
* ``SharedScale(bits)``: low-bit aggregation (int8 or int16 on the wire). Every worker of the
  job uses the *same* exponent for a slice, derived from the largest magnitude any worker sent
  for that slice in the previous round (the RESULT carries it, ``Header.peak``): the scale is
  agreed without a round trip of its own, the nodes add integers without any alignment, and
  the sums are exact integers. int8 slices are summed into int16 (room for 256 workers), int16
  slices keep ``ceil(log2 fan_in)`` bits of headroom so that their sum fits int16. A value that
  outgrew the agreed scale saturates, which is the spec's overflow: the slice takes the
  exception-retransmit path (floats). Each slice keeps ``margin`` bits free above the last
  magnitude; a slice that overflowed gets one more bit (up to ``MAX_MARGIN``), given back
  after ``MARGIN_DECAY`` clean rounds; every worker sees the same results, so they agree. A slice with no previous round (a tensor's first
  all-reduce) goes as ``BlockFloat`` int32. Error feedback (on by default) carries each
  worker's rounding error into its next round of the same tensor, so the rounding errors do not
  accumulate in the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainmaster.aggregation.protocol import INT_SATURATED

MIN_EXPONENT = -120
MAX_EXPONENT = 120


@dataclass(frozen=True)
class FixedScale:
    exponent: int = 16
    name: str = "fixed"

    def choose_exponent(self, chunk: np.ndarray, fan_in: int, peak: float | None = None) -> int:
        return self.exponent


@dataclass(frozen=True)
class BlockFloat:
    name: str = "block"

    def choose_exponent(self, chunk: np.ndarray, fan_in: int, peak: float | None = None) -> int:
        """``peak``: the chunk's largest magnitude if the caller already knows it."""
        peak = peak_magnitude(chunk) if peak is None else peak
        if peak == 0.0:
            return MAX_EXPONENT // 4
        headroom = max(1, math.ceil(math.log2(max(fan_in, 2))))
        # peak * 2**e <= 2**(31 - headroom) - 1  => the sum of fan_in of them fits int32
        e = math.floor(math.log2((2.0 ** (31 - headroom) - 1) / peak))
        return max(MIN_EXPONENT, min(MAX_EXPONENT, e))


@dataclass(frozen=True)
class SharedScale:
    """Low-bit aggregation: ``bits`` 8 or 16 per value on the way up, one exponent per slice
    shared by every worker (see the module docstring). ``margin``: bits left free above the
    previous round's largest magnitude (1: values may double before they saturate)."""

    bits: int = 8
    margin: int = 1
    error_feedback: bool = True
    name: str = "shared"

    MAX_MARGIN = 4
    MARGIN_DECAY = 16  # clean rounds of a slice before it gives one bit of margin back

    def __post_init__(self) -> None:
        if self.bits not in (8, 16):
            raise ValueError(f"low-bit aggregation uses 8 or 16 bits per value, not {self.bits}")
        if not 0 <= self.margin <= 4:
            raise ValueError(f"margin must be between 0 and 4 bits, not {self.margin}")

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("i1") if self.bits == 8 else np.dtype("<i2")

    def shared_exponent(self, peak: int, fan_in: int, margin: int | None = None) -> int:
        """The exponent every worker uses for a slice whose values stayed below ``2**peak``
        in the previous round (``peak``: the RESULT's ``Header.peak``), with ``margin`` bits
        free above it (default: ``self.margin``)."""
        free = self.margin if margin is None else margin
        if self.bits == 8:
            top = 7 - free  # int8 values, summed into int16 by the nodes
        else:
            top = 15 - max(1, math.ceil(math.log2(max(fan_in, 2)))) - free  # the sum fits int16
        return max(MIN_EXPONENT, min(MAX_EXPONENT, top - peak))

    def next_margin(self, margin: int, clean: int, overflowed: bool) -> tuple[int, int]:
        """A slice's (margin, clean rounds) after a round: one more bit after an overflow,
        one bit back after ``MARGIN_DECAY`` clean rounds, never below ``self.margin``."""
        if overflowed:
            return min(margin + 1, self.MAX_MARGIN), 0
        if margin > self.margin and clean + 1 >= self.MARGIN_DECAY:
            return margin - 1, 0
        return margin, clean + 1


Quantizer = FixedScale | BlockFloat | SharedScale

# the largest magnitude each integer type carries; a value at it is saturated (overflow)
LIMITS = {1: 127, 2: 32767, 4: int(INT_SATURATED)}


def peak_magnitude(x: np.ndarray) -> float:
    """Largest |x| in two allocation-free reductions (np.abs would copy the chunk)."""
    if x.size == 0:
        return 0.0
    return max(float(x.max()), -float(x.min()))


# the largest float32 below 2**31: scaled values up to it convert to int32 exactly
_F32_BELOW_2_31 = float(np.nextafter(np.float32(2.0**31), np.float32(0)))


def quantize(chunk: np.ndarray, exponent: int, peak: float | None = None, dtype: str = "<i4") -> np.ndarray:
    """Round to nearest (int32 by default); values beyond the type's range become its
    saturated value (``LIMITS``)."""
    flat = np.ascontiguousarray(chunk, dtype=np.float32).ravel()
    out = np.empty(flat.size, dtype=dtype)
    quantize_into(flat, exponent, out, peak)
    return out.reshape(np.shape(chunk))


# elements per pass of the quantiser and de-quantiser: their float32 intermediate (256 KiB)
# stays in the core's L2 cache instead of streaming a slice-sized temporary through the cache
# the other processes share (2 workers, 64 MiB, in the running fabric: ~10% less time)
BLOCK = 1 << 16


def quantize_into(
    chunk: np.ndarray, exponent: int, out: np.ndarray, peak: float | None = None, scratch: np.ndarray | None = None
) -> None:
    """``quantize`` written into the integer array ``out`` (int32, int16 or int8: e.g. the
    payload of the outgoing packet, so no temporary is copied there afterwards).

    Fast path in float32: multiplying by a power of two is exact in float32 and ``rint`` of a
    float32 is exact, so the result equals the float64 computation whenever every scaled value
    stays within the type's range (checked from the chunk's peak); a narrow type whose range
    some values leave is clipped in float32 (exact too: its limit is a float32), int32 takes
    the float64 path. It runs block by block through ``scratch`` (float32, at least ``BLOCK``
    elements; allocated if None)."""
    peak = peak_magnitude(chunk) if peak is None else peak
    limit = LIMITS[out.dtype.itemsize]
    scaled_peak = peak * 2.0**exponent if -1100 < exponent < 1100 else math.inf
    fits = scaled_peak <= (_F32_BELOW_2_31 if limit == LIMITS[4] else limit)
    if -126 <= exponent <= 127 and (fits or limit < LIMITS[4]):
        scale = np.float32(2.0**exponent)
        work = np.empty(BLOCK, np.float32) if scratch is None else scratch
        for i in range(0, chunk.size, BLOCK):
            scaled = work[: min(BLOCK, chunk.size - i)]
            np.multiply(chunk[i : i + BLOCK], scale, out=scaled)
            np.rint(scaled, out=scaled)
            if not fits:
                np.clip(scaled, -limit, limit, out=scaled)
            np.copyto(out[i : i + BLOCK], scaled, casting="unsafe")
        return
    wide = np.rint(np.ldexp(chunk.astype(np.float64), exponent))
    np.copyto(out, np.clip(wide, -limit, limit), casting="unsafe")


def dequantize(q: np.ndarray, exponent: int) -> np.ndarray:
    """Exact float64 values ``q * 2**-exponent``."""
    return np.ldexp(q.astype(np.float64), -exponent)


def dequantize_into(q: np.ndarray, exponent: int, out: np.ndarray) -> None:
    """Write ``q * 2**-exponent`` (any integer type) into the float32 array ``out`` in one pass.

    Converting the integer to float32 rounds once and scaling by a power of two is exact, so
    this equals rounding the exact float64 value to float32 (outside float32's normal range
    of scales it goes through float64)."""
    if -126 <= -exponent <= 127:
        # convert, then scale in place, block by block (see BLOCK): a mixed int32 * float32
        # multiply converts through a buffer and is slower
        scale = np.float32(2.0**-exponent)
        for i in range(0, q.size, BLOCK):
            block = out[i : i + BLOCK]
            np.copyto(block, q[i : i + BLOCK], casting="unsafe")
            np.multiply(block, scale, out=block)
    else:
        out[...] = dequantize(q, exponent)


def shift_to(q: np.ndarray, from_exponent: int, to_exponent: int) -> np.ndarray:
    """Re-express int values at a smaller exponent (coarser scale), rounding half up."""
    s = from_exponent - to_exponent
    if s <= 0:
        return q
    if s >= 62:
        return np.zeros_like(q)
    return (q + (np.int64(1) << np.int64(s - 1))) >> np.int64(s)


def requantize_int8(q: np.ndarray, exponent: int, seed: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """Integer sums ``q`` at ``exponent`` re-expressed as int8 at ``exponent - shift``, with
    the smallest ``shift`` that fits them, by stochastic rounding: ``(q + u) >> shift`` with
    ``u`` uniform in ``[0, 2**shift)``, so the expected value is exactly ``q * 2**-shift``
    (unbiased: the errors of successive steps average out instead of adding up, which is
    what lets the parameter node send the sums down at half the int16 bytes). The error is
    below one unit of the new exponent (none when the sums already fit int8).

    ``seed``: the draws, so the result is a function of the slice (the parameter node uses
    job, round, slice: every worker gets the same values, a resent result is the same, and a
    test can recompute it). Values never reach -128: ``|result| <= 127``."""
    peak = int(max(int(q.max()), -int(q.min()))) if q.size else 0
    shift = max(0, (peak - 1) // LIMITS[1]).bit_length()  # smallest s with peak <= 127 * 2**s
    if shift == 0:
        return q.astype(np.int8), exponent
    wide = q.astype(np.int64)  # the same draws whatever the sums' type: int16, int32, int64
    wide += np.random.default_rng(seed).integers(0, 1 << shift, wide.size, dtype=np.int64)
    wide >>= shift
    return wide.astype(np.int8), exponent - shift


def error_bound(exponent: int, fan_in: int) -> float:
    """Largest absolute error of a de-quantised sum of ``fan_in`` workers at ``exponent``.

    Each worker rounds once (half a unit) and each of at most ``2 * fan_in`` merges in a
    two-level tree rounds once more when exponents differ: ``fan_in * 1.5`` units; we state
    ``2 * fan_in`` units to keep the bound simple and safe.
    """
    return 2.0 * fan_in * math.ldexp(1.0, -exponent)
