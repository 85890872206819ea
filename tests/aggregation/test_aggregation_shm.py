"""The shared-memory transport: rings, descriptors, and the whole protocol running over it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmaster.aggregation.fabric import query
from trainmaster.aggregation.protocol import Header, Kind, decode, encode_parts, values
from trainmaster.aggregation.quantize import FixedScale
from trainmaster.aggregation.transport import (
    _DESC,
    _DESC_MAGIC,
    FaultPlan,
    ShmTransport,
    UdpTransport,
    make_transport,
)
from trainmaster.aggregation.worker import AggregationClient, WorkerConfig

from aggregation_tier import assert_exact, random_inputs, reduce_all, start_tier, tier_factory  # noqa: E402,F401

pytestmark = pytest.mark.timeout(120)


def test_ring_carries_large_packets_and_reuses_its_space() -> None:
    """Transport: packets far above the UDP limit go through the sender's ring; the ring wraps
    many times (the receiver frees what it consumed) and every packet arrives intact, to a
    shared-memory receiver and to a plain UDP one alike."""
    sender = ShmTransport("a", ring_bytes=8 << 20)
    receivers = [ShmTransport("b"), UdpTransport("c")]
    try:
        rng = np.random.default_rng(0)
        for receiver in receivers:
            for i in range(40):  # 40 x 1 MiB through an 8 MiB ring
                x = rng.integers(-(2**31) + 1, 2**31 - 1, 262_144, dtype=np.int64).astype(np.int32)
                sender.send(encode_parts(Header(Kind.DATA, 1, seq=i), x), receiver.address)
                got = receiver.recv(10.0)
                assert got is not None
                h, body = decode(got[0])
                assert h.seq == i and np.array_equal(values(h, body), x)
            assert receiver.counters.shm_received == 40
        assert sender.counters.shm_sent == 80 and sender.counters.ring_full_drops == 0
    finally:
        sender.close()
        for receiver in receivers:
            receiver.close()


def test_small_packets_stay_inline_and_stale_descriptors_are_dropped() -> None:
    """Transport: small packets are plain datagrams; a descriptor for ring space already
    consumed (a duplicated or late one) is dropped like a lost datagram, never misread."""
    a, b = ShmTransport("a"), ShmTransport("b")
    try:
        a.send(b"x" * 100, b.address)
        got = b.recv(5.0)
        assert got is not None and bytes(got[0]) == b"x" * 100
        assert a.counters.shm_sent == 0
        a.send(b"y" * 100_000, b.address)
        got = b.recv(5.0)
        assert got is not None and bytes(got[0]) == b"y" * 100_000
        ring = a._rings[b.address]
        stale = _DESC.pack(_DESC_MAGIC, __import__("os").getpid(), ring.fd, ring.id, 0, 100_000)
        a.sock.sendto(stale, b.address)
        assert b.recv(1.0) is None  # releases the first packet, then sees the stale copy
        assert b.counters.stale_descriptors == 1
    finally:
        a.close()
        b.close()


def test_packet_built_in_the_ring_is_sent_without_a_copy() -> None:
    """Zero-copy send: a packet written into ``packet()`` lies in the ring already, so only
    its descriptor is sent; with faults, a duplicate is written out as a real second packet,
    a dropped one just leaves its space unused, and everything that arrives is intact."""
    rng = np.random.default_rng(1)
    plain, dup, drop = (
        ShmTransport("a"),
        ShmTransport("d", faults=FaultPlan(duplicate=1.0)),
        ShmTransport("x", faults=FaultPlan(drop=1.0)),
    )
    receivers = [ShmTransport("b"), UdpTransport("c")]
    try:
        for receiver in receivers:
            for i in range(12):  # 12 x 4 MiB through a 32 MiB ring: it wraps
                x = rng.integers(-(2**31) + 1, 2**31 - 1, 1 << 20, dtype=np.int64).astype(np.int32)
                buf = plain.packet(receiver.address, 40 + x.nbytes)
                np.frombuffer(buf, np.int32, x.size, 40)[:] = x
                buf[:40] = bytes([i]) * 40
                plain.send(buf, receiver.address)
                got = receiver.recv(10.0)
                assert got is not None and bytes(got[0][:40]) == bytes([i]) * 40
                assert np.array_equal(np.frombuffer(got[0], np.int32, x.size, 40), x)
        assert plain.counters.shm_sent == 24
        buf = dup.packet(receivers[0].address, 100_000)
        buf[:] = b"z" * 100_000
        dup.send(buf, receivers[0].address)
        copies = [receivers[0].recv(5.0) for _ in range(2)]
        assert all(c is not None and bytes(c[0]) == b"z" * 100_000 for c in copies)
        assert dup.counters.shm_sent == 2 and dup.counters.duplicated == 1
        buf = drop.packet(receivers[0].address, 100_000)
        drop.send(buf, receivers[0].address)
        assert receivers[0].recv(0.3) is None and drop.counters.dropped == 1
    finally:
        for t in (plain, dup, drop, *receivers):
            t.close()


def test_retained_packets_keep_their_ring_space_until_released() -> None:
    """Forwarding nodes read contributions in place: a retained packet's ring space is not
    given back to the sender (its bytes stay intact while later packets are consumed) until
    it is released; a sender that finds the ring full meanwhile drops, then gets the space."""
    a = ShmTransport("a", ring_bytes=4 << 20, full_wait=0.05)
    b = ShmTransport("b")
    try:

        def send(i: int) -> None:
            a.send(bytes([i]) * (1 << 20), b.address)

        send(1)
        first = b.recv(5.0)
        assert first is not None
        token = b.retain()
        for i in (2, 3):
            send(i)
            got = b.recv(5.0)
            assert got is not None and bytes(got[0][:1]) == bytes([i])
        b.recv(0.05)  # consumes packet 3; the ring still holds packet 1 (retained)
        send(4)
        send(5)  # 1 (retained) + 4 + 5 would need more than the ring: dropped
        assert a.counters.ring_full_drops == 1
        assert bytes(first[0]) == b"\x01" * (1 << 20)
        b.release(token)
        b.recv(0.05)
        send(6)
        assert a.counters.ring_full_drops == 1
    finally:
        a.close()
        b.close()


def test_result_store_references_are_read_in_place_and_go_stale_when_reused() -> None:
    """Zero-copy multicast: a verified sum written once into the result store is read in place
    through its reference by any process of the host; once its space is freed and reused the
    reference reads as gone (or, if the reuse happened during the read, as not intact), never
    as other values; a store without room says so (the sender then sends the values)."""
    owner = ShmTransport("ps", store_bytes=1 << 20)
    readers = [ShmTransport("w"), UdpTransport("u")]
    assert readers[1].share(10) is None  # UDP has no store: the values travel themselves
    try:
        view, ref = owner.share(4000)
        np.frombuffer(view, np.int32)[:] = np.arange(1000)
        for reader in readers:
            got = reader.shared(ref)
            assert got is not None and np.frombuffer(got, np.int32).tolist() == list(range(1000))
            assert reader.shared_intact(ref)
        assert owner.share(1 << 20) is None  # no room next to the live block
        owner.unshare(ref)
        again, ref2 = owner.share(4000)  # empty store: the same memory again
        np.frombuffer(again, np.int32)[:] = -1
        for reader in readers:
            assert reader.shared(ref) is None and not reader.shared_intact(ref)
            assert np.frombuffer(reader.shared(ref2), np.int32)[0] == -1
    finally:
        owner.close()
        for reader in readers:
            reader.close()


def test_verified_sums_are_multicast_as_references_and_fall_back_to_values(tier_factory) -> None:
    """Zero-copy multicast end to end: with every worker on the parameter node's host, each
    RESULT carries a reference to the shared store, so the forwarding node's rings carry only
    up-going sums; exact, slots free. With a store too small for a slice the parameter node
    sends the values themselves, still exact."""
    for store_bytes, shared in ((64 << 20, True), (1000, False)):
        tier = tier_factory(transport="shm")
        tier.ps.transport.store_bytes = store_bytes
        inputs = random_inputs(1, 3, 200_000, 3, seed=store_bytes % 7)
        out = reduce_all(tier, inputs, 3, WorkerConfig(chunk=65_536))
        assert_exact(inputs, out)
        ps = query(tier.ps.address)
        sw = query(tier.switches[0].address)
        slices = 3 * 4  # rounds x slices per round
        assert (ps["results_shared"] == ps["verified"] >= slices) is shared
        assert (sw["transport"]["shm_sent"] == ps["transport"]["shm_received"]) is shared
        assert sw["slots_in_use"] == 0


def test_unknown_transport_and_oversized_chunk_are_clear_errors() -> None:
    """User mistakes: an unknown transport name, or a slice larger than the transport carries."""
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        make_transport("tcp", "x")
    with pytest.raises(ValueError, match="chunk must be between 1 and"):
        AggregationClient(("127.0.0.1", 9), 1, 0, 2, WorkerConfig(chunk=300_000))
    with pytest.raises(ValueError, match="chunk must be between 1 and"):
        AggregationClient(("127.0.0.1", 9), 1, 0, 2, WorkerConfig(chunk=1 << 30), transport="shm")


def test_normal_path_over_shared_memory_is_exact_and_frees_slots(tier_factory) -> None:
    """Normal path on shared memory: large slices summed in slots, verified, multicast; the
    payloads travelled through rings; every slot free afterwards."""
    tier = tier_factory(transport="shm")
    inputs = random_inputs(1, 3, 300_000, 3)
    out = reduce_all(tier, inputs, 3, WorkerConfig(chunk=65_536))
    assert_exact(inputs, out)
    ps = query(tier.ps.address)
    sw = query(tier.switches[0].address)
    assert ps["verified"] >= 3 * 5 and ps["overflow_fallbacks"] == 0
    assert sw["transport"]["shm_sent"] > 0 and ps["transport"]["shm_received"] > 0
    assert sw["slots_in_use"] == 0


def test_overflow_and_two_levels_over_shared_memory(tier_factory) -> None:
    """Exception retransmit and two levels on shared memory: fixed scale overflows, floats go
    to the parameter node through the rings, results are exact, slots free."""
    tier = tier_factory(transport="shm", levels=2)
    inputs = random_inputs(1, 3, 50_000, 1, big=30_000.0)
    cfg = WorkerConfig(chunk=8192, quantizer=FixedScale(16), retransmit_timeout=0.3)
    out = reduce_all(tier, inputs, 3, cfg)
    assert_exact(inputs, out)
    assert query(tier.ps.address)["overflow_fallbacks"] > 0
    assert sum(s["float_resends"] for _, s, _ in out.values()) > 0
    for s in tier.switches:
        assert query(s.address)["slots_in_use"] == 0


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    drop=st.floats(0, 0.15),
    duplicate=st.floats(0, 0.2),
    reorder=st.floats(0, 0.3),
    seed=st.integers(0, 2**16),
    world=st.integers(1, 3),
    levels=st.sampled_from([1, 2]),
)
def test_any_fault_schedule_over_shared_memory_is_exact(drop, duplicate, reorder, seed, world, levels) -> None:
    """Property on shared memory: faults are injected on whole packets before the ring (drop,
    duplicate, reorder); any schedule gives the exact result and leaves every slot free."""
    faults = FaultPlan(drop=drop, duplicate=duplicate, reorder=reorder, seed=seed)
    tier = start_tier(levels=levels, faults=faults, transport="shm")
    try:
        inputs = random_inputs(1, world, 40_000, 2, seed=seed)
        cfg = WorkerConfig(chunk=4096, retransmit_timeout=0.1, max_retransmit_timeout=0.4)
        out = reduce_all(tier, inputs, world, cfg, faults)
        assert_exact(inputs, out)
        for s in tier.switches:
            assert query(s.address)["slots_in_use"] == 0
    finally:
        tier.stop()


def test_in_place_result_and_error_bound(tier_factory) -> None:
    """Library interface: allreduce(x, out=x) writes the sum in place (as gloo's all_reduce
    does); last_error_bound is the per-element bound of that result, within which it is exact."""
    import threading

    tier = tier_factory(transport="shm")
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((300, 700)).astype(np.float32) for _ in range(2)]
    exact = xs[0].astype(np.float64) + xs[1]
    got: dict[int, tuple[np.ndarray, np.ndarray, bool]] = {}

    def work(rank: int) -> None:
        x = xs[rank].copy()
        with AggregationClient(tier.attach(rank), 6, rank, 2, WorkerConfig(chunk=50_000), transport="shm") as c:
            y = c.allreduce(x, out=x)
            got[rank] = (x, c.last_error_bound, y is x)

    ts = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    for x, bound, same in got.values():
        assert same and bound.shape == x.shape
        assert np.all(np.abs(x - exact) <= bound + np.abs(exact) * 2.0**-23)
    client = AggregationClient(("127.0.0.1", 9), 1, 0, 1)
    try:
        with pytest.raises(ValueError, match="out must be"):
            client.allreduce(np.ones(4, np.float32), out=np.ones(3, np.float32))
    finally:
        client.close()


@pytest.mark.parametrize("precision", ["int32", "int8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_infinity_are_refused_before_any_packet(precision: str, bad: float) -> None:
    """Library interface: an input with NaN or infinity anywhere (here in the last slice) is a
    ValueError before the client contacts anyone (the per-slice peaks that choose the scales
    carry them), on the int32 path and with low-bit aggregation's carried error."""
    from trainmaster.aggregation.worker import quantizer_for

    client = AggregationClient(("127.0.0.1", 9), 1, 0, 1, WorkerConfig(chunk=1000, quantizer=quantizer_for(precision)))
    try:
        x = np.ones(2500, np.float32)
        x[-1] = bad
        with pytest.raises(ValueError, match="NaN or infinity"):
            client.allreduce(x)
        assert client.stats()["packets_sent"] == 0
    finally:
        client.close()
