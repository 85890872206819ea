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

    def choose_exponent(self, chunk: np.ndarray, fan_in: int) -> int:
        return self.exponent


@dataclass(frozen=True)
class BlockFloat:
    name: str = "block"

    def choose_exponent(self, chunk: np.ndarray, fan_in: int) -> int:
        peak = float(np.max(np.abs(chunk))) if chunk.size else 0.0
        if peak == 0.0:
            return MAX_EXPONENT // 4
        headroom = max(1, math.ceil(math.log2(max(fan_in, 2))))
        # peak * 2**e <= 2**(31 - headroom) - 1  => the sum of fan_in of them fits int32
        e = math.floor(math.log2((2.0 ** (31 - headroom) - 1) / peak))
        return max(MIN_EXPONENT, min(MAX_EXPONENT, e))


Quantizer = FixedScale | BlockFloat


def quantize(chunk: np.ndarray, exponent: int) -> np.ndarray:
    """Round to nearest; values beyond the int32 range become the saturated value."""
    scaled = np.rint(np.ldexp(chunk.astype(np.float64), exponent))
    return np.clip(scaled, -INT_SATURATED, INT_SATURATED).astype(np.int64)


def dequantize(q: np.ndarray, exponent: int) -> np.ndarray:
    return np.ldexp(q.astype(np.float64), -exponent)


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
