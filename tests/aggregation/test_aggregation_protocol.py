"""Header encoding, quantisation and the aggregator's merge rule, tested without a network."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmaster.aggregation.accumulator import FloatSum, IntSum
from trainmaster.aggregation.protocol import (
    HEADER_SIZE,
    INT_SATURATED,
    MAX_ELEMENTS,
    Flag,
    Header,
    Kind,
    decode,
    encode,
    slot_id,
    values,
)
from trainmaster.aggregation.quantize import (
    BlockFloat,
    FixedScale,
    dequantize,
    error_bound,
    quantize,
)

_PAYLOAD = Flag.FLOAT | Flag.INT16 | Flag.INT8
headers = st.builds(
    Header,
    kind=st.sampled_from([Kind.DATA, Kind.RESULT]),
    job=st.integers(0, 2**32 - 1),
    round=st.integers(0, 2**32 - 1),
    seq=st.integers(0, 2**32 - 1),
    bitmap=st.integers(0, 2**64 - 1),
    fan_in=st.integers(1, 64),
    slot=st.integers(0, 0xFFFF),
    exponent=st.integers(-120, 120),
    flags=st.sampled_from([f for f in Flag if not f & _PAYLOAD]),
    peak=st.integers(-128, 127),
)


@settings(deadline=None)
@given(headers, st.sampled_from([Flag.NONE, Flag.INT16, Flag.INT8]), st.data())
def test_header_round_trip(header: Header, width: Flag, data: st.DataObject) -> None:
    """Binary header (struct): every field (version, job, seq, bitmap, fan-in, flags, slot,
    exponent, count, peak) survives encode/decode with its payload, int32, int16 or int8 (low-bit
    aggregation: the INT16 / INT8 flag names the payload's type)."""
    header = header.with_(flags=header.flags | width)
    limit = {Flag.NONE: 2**31 - 1, Flag.INT16: 2**15 - 1, Flag.INT8: 127}[width]
    ints = data.draw(st.lists(st.integers(-limit, limit), max_size=50))
    payload = np.array(ints, dtype=np.int64)
    h, body = decode(encode(header, payload))
    assert h == header.with_(count=len(ints))
    assert values(h, body).dtype == {Flag.NONE: "<i4", Flag.INT16: "<i2", Flag.INT8: "i1"}[width]
    assert np.array_equal(values(h, body), payload)
    assert HEADER_SIZE % 4 == 0  # the payload after it is aligned for int32/float32


def test_payload_sizes_up_to_the_udp_limit() -> None:
    """Payload size: up to the UDP datagram limit (65507 bytes) in one packet."""
    data = encode(Header(Kind.DATA, 1), np.zeros(MAX_ELEMENTS, dtype=np.int64))
    assert len(data) <= 65507
    assert len(data) == HEADER_SIZE + 4 * MAX_ELEMENTS


def test_slot_ids_hash_job_and_index_together() -> None:
    """Resource id = hash(job id, slice index) (the spec's dynamic slot allocation): identical
    for every worker of a job and slice; consecutive slices and neighbouring job ids are spread
    over the pool instead of the job's offset plus the index (the former rule, under which two
    tenants with close offsets collide on every slice of their windows)."""
    from trainmaster.aggregation.protocol import legacy_slot_id

    assert slot_id(7, 3) == slot_id(7, 3)
    assert len({slot_id(7, i) % 64 for i in range(64)}) > 32  # not a run of consecutive slots
    # the former rule: job 7's slice i+1 is always the slot next to slice i
    assert all((legacy_slot_id(7, i + 1) - legacy_slot_id(7, i)) % 0x10000 == 1 for i in range(10))
    # two tenants: the number of shared slots of their 8-slice windows is spread (about
    # 8 * 8 / 64 = 1 expected), never the legacy rule's all-or-nothing
    shared = [
        len({slot_id(a, i) % 64 for i in range(8)} & {slot_id(a + 1, i) % 64 for i in range(8)}) for a in range(1, 400)
    ]
    assert max(shared) <= 5 and 0.5 < sum(shared) / len(shared) < 1.5


def test_collision_rates_of_both_slot_rules_are_measured() -> None:
    """Collision spread (spec: multi-tenancy): the benchmark's model counts, per rule, the
    fraction of in-flight slices sharing a slot; the hashed rule has no tenant that collides on
    every slice at 4 tenants, the former rule does (its p99 is 1.0)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    from aggregation_slots import measure

    hashed = measure("hash(job, index)", 4, 64, 4, 200, 0)
    legacy = measure("hash(job) + index", 4, 64, 4, 200, 0)
    assert legacy.p99_tenant == 1.0 and legacy.self_collisions == 0.0
    assert hashed.p99_tenant < 1.0 and 0.0 < hashed.self_collisions < 0.1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.floats(1e-30, 1e30), st.integers(1, 200), st.integers(0, 2**32))
def test_block_float_never_overflows(fan_in: int, scale: float, n: int, seed: int) -> None:
    """Block-floating-point scale: the sum of fan_in workers at the chosen exponent fits int32,
    and de-quantisation stays within the stated error bound."""
    rng = np.random.default_rng(seed)
    chunks = [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(fan_in)]
    acc = IntSum()
    for r, c in enumerate(chunks):
        e = BlockFloat().choose_exponent(c, fan_in)
        assert acc.add(quantize(c, e), e, 1 << r)
    q, overflow = acc.wire()
    assert not overflow
    exact = sum(c.astype(np.float64) for c in chunks)
    assert np.all(np.abs(dequantize(q, acc.exponent) - exact) <= error_bound(acc.exponent, fan_in) * (1 + 1e-9))


def test_fixed_scale_overflow_is_detected_exactly() -> None:
    """Exact overflow detection: accumulate in int64 and check the int32 range; the forwarded
    value is saturated so the parameter node recognises it. A large intermediate that comes back
    into range is not an overflow."""
    e = FixedScale(16).exponent
    big = np.array([20000.0, 1.0], dtype=np.float32)
    acc = IntSum()
    acc.add(quantize(big, e), e, 1)
    acc.add(quantize(big, e), e, 2)
    q, overflow = acc.wire()
    assert overflow and q[0] == INT_SATURATED
    back = IntSum()
    back.add(quantize(big, e), e, 1)
    back.add(quantize(big, e), e, 2)
    back.add(quantize(-big, e), e, 4)
    assert back.wire()[1] is False
    assert quantize(np.array([1e6], np.float32), e)[0] == INT_SATURATED


def test_merge_refuses_overlapping_workers() -> None:
    """No double counting: a contribution whose workers are already in the sum is refused."""
    acc = IntSum()
    assert acc.add(np.array([1, 2]), 0, 0b011)
    assert not acc.add(np.array([5, 5]), 0, 0b010)
    assert acc.add(np.array([10, 20]), 0, 0b100)
    assert acc.values.tolist() == [11, 22] and acc.bitmap == 0b111
    f = FloatSum()
    assert f.add(np.array([1.5]), 1) and not f.add(np.array([1.5]), 1)


def test_exponent_alignment_rounds_within_bound() -> None:
    """Per-chunk exponents differ between workers; aggregators shift to the smaller one."""
    a = np.array([0.001, 3.0], dtype=np.float32)
    b = np.array([100.0, -7.25], dtype=np.float32)
    acc = IntSum()
    for r, c in enumerate((a, b)):
        e = BlockFloat().choose_exponent(c, 2)
        acc.add(quantize(c, e), e, 1 << r)
    got = dequantize(acc.values, acc.exponent)
    assert np.all(np.abs(got - (a.astype(np.float64) + b)) <= error_bound(acc.exponent, 2))
    assert math.isfinite(float(got.sum()))


def test_sum_stays_int32_while_peaks_fit_and_widens_exactly_otherwise() -> None:
    """Aggregator memory: while the contributions' peaks prove the sum fits int32 it is added
    in place in int32; past that bound it widens to int64 and overflow detection stays exact."""
    small = np.array([2**29, -(2**29), 5], dtype=np.int32)
    acc = IntSum()
    acc.add(small, 0, 1)
    acc.add(small, 0, 2)
    q, overflow = acc.wire()
    assert q.dtype == np.int32 and not overflow and q.tolist() == [2**30, -(2**30), 10]
    acc.add(small, 0, 4)
    acc.add(small, 0, 8)  # peaks now add to 2**31: widened, and 4 * 2**29 is out of range
    q, overflow = acc.wire()
    assert acc.values.dtype == np.int64 and overflow and q[0] == INT_SATURATED


def test_contributions_are_summed_once_into_the_outgoing_buffer() -> None:
    """Aggregator memory read in place: borrowed contributions are kept without a copy and
    summed once, at completion, straight into the destination (the packet that goes up); the
    result equals the int64 sum, and a sum that must widen is still written there exactly."""
    rng = np.random.default_rng(5)
    parts = [rng.integers(-(2**28), 2**28, 1000).astype(np.int32) for _ in range(4)]
    before = [q.copy() for q in parts]
    acc = IntSum()
    for r, q in enumerate(parts):
        assert acc.add(q, 7, 1 << r, borrow=True)
    assert all(a is q for a, q in zip(acc.parts, parts))  # borrowed: no copy yet
    out = np.empty(1000, np.int32)
    wire, overflow = acc.wire(out=out)
    assert wire is out and not overflow
    assert out.tolist() == sum(q.astype(np.int64) for q in parts).tolist()
    assert all(np.array_equal(q, b) for q, b in zip(parts, before))  # inputs untouched
    wide = IntSum()
    wide.add(parts[0], 7, 1, borrow=True)
    wide.add(parts[1], 6, 2, borrow=True)  # another exponent: aligned in int64
    got, _ = wide.wire(out=np.empty(1000, np.int32))
    expect = ((parts[0].astype(np.int64) + 1) >> 1) + parts[1]
    assert got.tolist() == expect.tolist()


def test_quantize_into_the_packet_equals_the_float64_rounding() -> None:
    """Workers quantise straight into the outgoing packet, block by block through a small
    scratch (several blocks and a partial one here): identical to rounding in float64, values
    beyond the int32 range saturate, and de-quantising block by block is exact too."""
    from trainmaster.aggregation.quantize import BLOCK, dequantize_into, quantize_into

    rng = np.random.default_rng(9)
    x = (rng.standard_normal(2 * BLOCK + 1234) * 1000).astype(np.float32)
    for e in (0, 10, 17):
        buf = bytearray(40 + 4 * x.size)
        out = np.frombuffer(buf, np.int32, x.size, 40)
        quantize_into(x, e, out)
        assert out.tolist() == np.rint(np.ldexp(x.astype(np.float64), e)).astype(np.int64).tolist()
        back = np.empty(x.size, np.float32)
        dequantize_into(out, e, back)
        assert np.array_equal(back, np.ldexp(out.astype(np.float64), -e).astype(np.float32))
    out = np.empty(x.size, np.int32)
    quantize_into(x, 40, out)
    assert set(np.abs(out[x != 0]).tolist()) == {int(INT_SATURATED)}
