"""Float32 <-> int32 quantisation with a power-of-two scale (``value = q * 2**-exponent``).

Two modes:

* ``FixedScale``: one exponent for everything. Large gradients saturate at the int32 limit, and
  sums of several workers can leave the int32 range: this is what exercises the overflow
  (exception-retransmit) path.
* ``BlockFloat``: a per-chunk exponent chosen from the chunk's largest magnitude with
  ``ceil(log2(fan_in))`` bits of headroom, so the sum of ``fan_in`` workers can never overflow.
  Workers may choose different exponents for the same slice; aggregators align them by
  shifting right (rounding), which adds at most half a unit in the last place per merge.
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


Quantizer = FixedScale | BlockFloat


def peak_magnitude(x: np.ndarray) -> float:
    """Largest |x| in two allocation-free reductions (np.abs would copy the chunk)."""
    if x.size == 0:
        return 0.0
    return max(float(x.max()), -float(x.min()))


# the largest float32 below 2**31: scaled values up to it convert to int32 exactly
_F32_BELOW_2_31 = float(np.nextafter(np.float32(2.0**31), np.float32(0)))


def quantize(chunk: np.ndarray, exponent: int, peak: float | None = None) -> np.ndarray:
    """Round to nearest (int32); values beyond the int32 range become the saturated value."""
    flat = np.ascontiguousarray(chunk, dtype=np.float32).ravel()
    out = np.empty(flat.size, dtype=np.int32)
    quantize_into(flat, exponent, out, peak)
    return out.reshape(np.shape(chunk))


# elements per pass of the quantiser and de-quantiser: their float32 intermediate (256 KiB)
# stays in the core's L2 cache instead of streaming a slice-sized temporary through the cache
# the other processes share (2 workers, 64 MiB, in the running fabric: ~10% less time)
BLOCK = 1 << 16


def quantize_into(
    chunk: np.ndarray, exponent: int, out: np.ndarray, peak: float | None = None, scratch: np.ndarray | None = None
) -> None:
    """``quantize`` written into the int32 array ``out`` (e.g. the payload of the outgoing
    packet, so no temporary is copied there afterwards).

    Fast path in float32: multiplying by a power of two is exact in float32 and ``rint`` of a
    float32 is exact, so the result equals the float64 computation whenever every scaled value
    stays below 2**31 (checked from the chunk's peak); otherwise the float64 path clips. It
    runs block by block through ``scratch`` (float32, at least ``BLOCK`` elements; allocated
    if None)."""
    peak = peak_magnitude(chunk) if peak is None else peak
    if -126 <= exponent <= 127 and peak * 2.0**exponent <= _F32_BELOW_2_31:
        scale = np.float32(2.0**exponent)
        work = np.empty(BLOCK, np.float32) if scratch is None else scratch
        for i in range(0, chunk.size, BLOCK):
            scaled = work[: min(BLOCK, chunk.size - i)]
            np.multiply(chunk[i : i + BLOCK], scale, out=scaled)
            np.rint(scaled, out=scaled)
            np.copyto(out[i : i + BLOCK], scaled, casting="unsafe")
        return
    wide = np.rint(np.ldexp(chunk.astype(np.float64), exponent))
    np.copyto(out, np.clip(wide, -INT_SATURATED, INT_SATURATED), casting="unsafe")


def dequantize(q: np.ndarray, exponent: int) -> np.ndarray:
    """Exact float64 values ``q * 2**-exponent``."""
    return np.ldexp(q.astype(np.float64), -exponent)


def dequantize_into(q: np.ndarray, exponent: int, out: np.ndarray) -> None:
    """Write ``q * 2**-exponent`` into the float32 array ``out`` in one pass.

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


def error_bound(exponent: int, fan_in: int) -> float:
    """Largest absolute error of a de-quantised sum of ``fan_in`` workers at ``exponent``.

    Each worker rounds once (half a unit) and each of at most ``2 * fan_in`` merges in a
    two-level tree rounds once more when exponents differ: ``fan_in * 1.5`` units; we state
    ``2 * fan_in`` units to keep the bound simple and safe.
    """
    return 2.0 * fan_in * math.ldexp(1.0, -exponent)
