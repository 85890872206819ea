"""Low-bit aggregation: int8 / int16 with a per-slice scale shared by every worker, negotiated
without a round trip, exact integer sums at the nodes, error feedback, and the spec's overflow
fallback, over real sockets (nodes in threads, or processes through the demo)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainmaster.aggregation.accumulator import IntSum
from trainmaster.aggregation.demo import DemoConfig, run_demo
from trainmaster.aggregation.fabric import query
from trainmaster.aggregation.kills import KillPlan
from trainmaster.aggregation.protocol import NO_PEAK, peak_exponent
from trainmaster.aggregation.quantize import SharedScale, quantize, requantize_int8
from trainmaster.aggregation.transport import FaultPlan
from trainmaster.aggregation.worker import WorkerConfig, quantizer_for

from aggregation_tier import assert_exact, random_inputs, reduce_all, tier_factory  # noqa: E402,F401

pytestmark = pytest.mark.timeout(180)


def test_int8_slices_are_summed_into_int16_and_saturation_is_overflow() -> None:
    """Wire types of low-bit sums: int8 contributions are summed exactly into int16 (room for
    256 workers at the int8 limit), int16 contributions with the shared scale's headroom stay
    int16; a contribution at its type's limit (saturated) or a sum beyond the wire type is the
    spec's overflow."""
    s = IntSum()
    for bit in range(8):
        assert s.add(np.full(1000, 126, np.int8), 3, 1 << bit)
    q, overflow = s.wire()
    assert q.dtype == np.int16 and not overflow and int(q[0]) == 8 * 126
    s = IntSum()
    s.add(np.array([127, 1], np.int8), 3, 1)  # 127: the int8 limit, a value that was clipped
    assert s.wire()[1] is True
    s = IntSum()
    s.add(np.array([20000, 1], np.int16), 3, 1)
    s.add(np.array([20000, 1], np.int16), 3, 2)  # 40000 does not fit int16
    q, overflow = s.wire()
    assert overflow and q.dtype == np.int16 and int(q[0]) == 32767


def test_shared_exponent_leaves_the_margin_and_the_headroom() -> None:
    """Shared scale from the previous round's magnitude: int8 values below 2**peak get one bit
    of margin under the int8 limit; int16 values also keep ceil(log2 fan_in) bits so that the
    sum of fan_in of them fits int16; the margin adapts per slice (one more bit after an
    overflow, one back after a run of clean rounds)."""
    assert peak_exponent(0.0) == NO_PEAK and peak_exponent(3.0) == 2 and peak_exponent(4.0) == 3
    for peak in (0.01, 1.0, 37.5):
        p = peak_exponent(peak)
        e8 = SharedScale(8).shared_exponent(p, 8)
        assert np.abs(quantize(np.array([peak, -peak], np.float32), e8, dtype="i1")).max() <= 64
        e16 = SharedScale(16).shared_exponent(p, 8)
        assert 8 * peak * 2.0**e16 <= 2**14
    # a slice that overflowed keeps one more bit free, given back after MARGIN_DECAY clean rounds
    scale = SharedScale(8)
    assert scale.shared_exponent(3, 8, margin=2) == scale.shared_exponent(3, 8) - 1
    margin, clean = scale.next_margin(1, 5, overflowed=True)
    assert (margin, clean) == (2, 0)
    for _ in range(SharedScale.MARGIN_DECAY - 1):
        margin, clean = scale.next_margin(margin, clean, overflowed=False)
    assert margin == 2
    assert scale.next_margin(margin, clean, overflowed=False) == (1, 0)
    assert scale.next_margin(1, 100, overflowed=False) == (1, 101)


def _exact_integer_sums(inputs, world: int, rounds: int, chunk: int, out, bits: int, int8_results: bool = False) -> int:
    """Recompute what every worker quantised (no error feedback) and check that each worker's
    result is exactly the integer sum, element by element (``int8_results``: re-quantised as
    the parameter node does, seeded by job, round and slice); returns the slices whose sum
    did not fit int8 (so the re-quantisation rounded)."""
    rounded = 0
    scale = SharedScale(bits)
    n = inputs[(1, 0)][0].size
    peaks = [NO_PEAK] * math.ceil(n / chunk)
    for rnd in range(rounds):
        for s in range(len(peaks)):
            part = [inputs[(1, r)][rnd][s * chunk : (s + 1) * chunk] for r in range(world)]
            if peaks[s] != NO_PEAK:  # (the first round goes as int32: bounded, not checked)
                e = scale.shared_exponent(peaks[s], world)
                qs = [quantize(p, e, dtype=scale.dtype.str).astype(np.int64) for p in part]
                total = np.sum(qs, axis=0)
                if int8_results:
                    rounded += int(np.abs(total).max() > 127)
                    total, e = requantize_int8(total, e, (1, rnd + 1, s))
                want = total.astype(np.float32) * np.float32(2.0**-e)
                for r in range(world):
                    assert np.array_equal(out[(1, r)][0][rnd][0][s * chunk : (s + 1) * chunk], want), (rnd, s, r)
            peaks[s] = max(peak_exponent(float(np.abs(p).max())) for p in part)
    return rounded


@pytest.mark.parametrize("bits", [8, 16])
def test_low_bit_sums_are_exact_integers_of_the_shared_scale(tier_factory, bits: int) -> None:
    """int8 / int16 with a per-slice shared scale: every worker quantises a slice with the same
    exponent (from the largest magnitude the previous round's RESULT carried), the nodes add
    integers without any alignment, and each result is exactly the sum of the workers'
    quantised values; results stay within their stated bound of the float sums."""
    tier = tier_factory()
    world, chunk, rounds = 3, 1000, 3
    inputs = random_inputs(1, world, 5_000, rounds, seed=11)
    # error feedback off here: the recomputation above then needs no carried error; the sums
    # come down as summed (int8 results: see the tests of re-quantisation below)
    cfg = WorkerConfig(chunk=chunk, quantizer=SharedScale(bits, error_feedback=False), results="exact")
    out = reduce_all(tier, inputs, world, cfg)
    assert_exact(inputs, out)
    _exact_integer_sums(inputs, world, rounds, chunk, out, bits)
    assert all(stats["low_bit_slices"] == (rounds - 1) * 5 for _, stats, _ in out.values())


def test_scale_negotiation_costs_no_extra_packet_and_int8_sends_a_quarter_of_the_bytes(tier_factory) -> None:
    """The scale is agreed without a round trip of its own: an int8 job sends exactly as many
    packets per round as an int32 one (one per slice, the peak rides in the header), and from
    the second round on each packet carries a quarter of the payload bytes."""
    tier = tier_factory()
    inputs = random_inputs(1, 2, 32_000, 3, seed=12)
    sent = {}
    # nothing is lost here: timers long enough that a late answer on a loaded machine is waited
    # for, not retransmitted (a retransmit would be a packet this count is not about)
    patient = {"retransmit_timeout": 10.0, "min_retransmit_timeout": 10.0, "max_retransmit_timeout": 10.0}
    for precision in ("int32", "int8"):
        out = reduce_all(
            tier,
            inputs,
            2,
            WorkerConfig(chunk=4000, quantizer=quantizer_for(precision), gap_threshold=10**6, **patient),
        )
        assert_exact(inputs, out)
        stats = out[(1, 0)][1]
        sent[precision] = (stats["packets_sent"], stats["transport"]["bytes_sent"], stats["retransmits"])
    assert sent["int8"][2] == sent["int32"][2] == 0
    assert sent["int8"][0] == sent["int32"][0] == 3 * 8
    payload32 = 3 * 32_000 * 4
    payload8 = 32_000 * 4 + 2 * 32_000  # the first round as int32, then int8
    assert sent["int8"][1] - sent["int32"][1] == pytest.approx(payload8 - payload32, rel=0.01)


def test_error_feedback_keeps_the_accumulated_error_to_one_rounds_worth(tier_factory) -> None:
    """Error feedback: each worker carries its rounding error into its next all-reduce of the
    same tensor, so over many rounds the sum of the results stays within one round's error of
    the sum of the inputs (the errors telescope); without it they add up."""
    world, rounds = 2, 12
    inputs = random_inputs(1, world, 4_000, rounds, seed=13)
    drift = {}
    for feedback in (True, False):
        tier = tier_factory()
        cfg = WorkerConfig(chunk=1000, quantizer=SharedScale(8, error_feedback=feedback), results="exact")
        out = reduce_all(tier, inputs, world, cfg)
        assert_exact(inputs, out)
        results = out[(1, 0)][0]
        total = np.sum([y.astype(np.float64) for y, _ in results], axis=0)
        exact = np.sum([inputs[(1, r)][k].astype(np.float64) for r in range(world) for k in range(rounds)], axis=0)
        last_bound = results[-1][1]
        drift[feedback] = float(np.abs(total - exact).max())
        if feedback:
            assert np.all(np.abs(total - exact) <= last_bound + 1e-4)
    assert drift[True] * 3 < drift[False]


def test_values_that_outgrow_the_shared_scale_take_the_exception_path(tier_factory) -> None:
    """Overflow with low-bit aggregation: values far larger than the previous round's (the
    scale the workers agreed on) saturate int8, the parameter node sees the saturated value and
    sends the exception-retransmit instruction, the workers resend those slices as floats, and
    the results are exact; their carried error is dropped (floats carry none)."""
    tier = tier_factory()
    inputs = random_inputs(1, 2, 8_000, 3, seed=14)
    for r in range(2):
        inputs[(1, r)][2][::500] = 5000.0  # round 3 only: round 2 set a scale for values near 4
    cfg = WorkerConfig(chunk=2000, quantizer=quantizer_for("int8"))
    out = reduce_all(tier, inputs, 2, cfg)
    assert_exact(inputs, out)
    assert query(tier.ps.address)["overflow_fallbacks"] == 4
    assert all(stats["float_resends"] == 4 for _, stats, _ in out.values())


@pytest.mark.parametrize(("levels", "results"), [(1, "int8"), (2, "int8"), (1, "exact")])
def test_int8_under_loss_duplication_and_reordering_is_exact(levels: int, results: str) -> None:
    """Every packet fault on the low-bit path (processes, two levels too), with int8 results
    (re-quantised by the parameter node) and exact ones: lost, duplicated and reordered
    packets, overflowing slices and slot collisions; every integer sum the demo can recompute
    is exact (re-quantised as the parameter node does, for int8 results), every result within
    its bound, every slot free."""
    cfg = DemoConfig(
        workers=4,
        jobs=2,
        elements=40_000,
        rounds=3,
        slots=16,
        levels=levels,
        overflow=True,
        chunk=2048,
        seed=3,
        faults=FaultPlan(drop=0.02, duplicate=0.02, reorder=0.05, seed=3),
        precision="int8",
        results=results,
        timeout=60.0,
    )
    result = run_demo(cfg)
    assert result["ok"], result["errors"]
    sums = result["integer_sums"]
    assert sums["all_exact"] and sums["checked"] > 0 and sums["float_path"] > 0
    assert result["low_bit_slices"] > 0 and result["overflow_fallbacks"] > 0
    assert (result["results_requantised"] > 0) == (results == "int8")
    assert result["slots_in_use_after"] == 0


@pytest.mark.parametrize(("precision", "mtu"), [("int8", None), ("int32", 1500)])
def test_killed_forwarding_node_with_int8_falls_back_and_stays_exact(precision: str, mtu: int | None) -> None:
    """A killed forwarding node on the low-bit path (and on segmented packets, MTU 1500): the
    workers fall back to the parameter node, which sums their int8 slices into int16 itself
    (or puts their segments together); the integer sums stay exact."""
    cfg = DemoConfig(
        workers=3,
        elements=60_000,
        rounds=3,
        chunk=4096,
        seed=2,
        precision=precision,
        mtu=mtu,
        kill=KillPlan("switch", after_packets=40),
        failover_after=1.0,
        parameter_node_dead_after=2.0,
        max_retransmit_timeout=0.3,
        timeout=30.0,
    )
    result = run_demo(cfg)
    assert result["ok"], result["errors"]
    assert result["fallbacks_to_parameter_node"] == 3
    # an int8 job's sums come down as int8: the parameter node re-quantises what it summed itself
    assert (result["results_requantised"] > 0) == (precision == "int8")
    assert result["integer_sums"]["all_exact"] and result["integer_sums"]["checked"] > 0
    assert (result["low_bit_slices"] > 0) == (precision == "int8")
    assert (result["segments"]["reassembled"] > 0) == (mtu is not None)


def test_requantize_int8_is_unbiased_within_one_unit_and_a_function_of_its_seed() -> None:
    """Int8 results, the arithmetic against a float64 reference: integer sums that do not fit
    int8 are shifted by the fewest bits that make them fit, with stochastic rounding; every
    value is within one unit of the new exponent of the exact sum (the documented bound), never
    beyond +-127, unbiased (the mean over many draws is the exact sum), exact when the sums fit
    int8 already, and the same for the same seed whatever the sums' integer type."""
    rng = np.random.default_rng(5)
    q = np.concatenate([[-1000, 1000, 0, 1, -1], rng.integers(-1000, 1001, 5000)]).astype(np.int16)
    r, e = requantize_int8(q, 12, (1, 2, 3))
    assert r.dtype == np.int8 and e == 12 - 3  # 1000 <= 127 * 2**3
    assert np.abs(r.astype(np.int64)).max() <= 127
    exact = np.ldexp(q.astype(np.float64), -12)
    got = np.ldexp(r.astype(np.float64), -e)
    assert np.all(np.abs(got - exact) < math.ldexp(1.0, -e))
    for wide in (np.int32, np.int64):
        again, e2 = requantize_int8(q.astype(wide), 12, (1, 2, 3))
        assert e2 == e and np.array_equal(again, r)
    assert not np.array_equal(requantize_int8(q, 12, (1, 2, 4))[0], r)
    mean = np.mean([np.ldexp(requantize_int8(q, 12, (k,))[0].astype(np.float64), -e) for k in range(400)], axis=0)
    # standard error of 400 draws of at most one unit: 0.025 units; 6 of them
    assert np.all(np.abs(mean - exact) < 0.15 * math.ldexp(1.0, -e))
    small = np.array([-127, 127, 5, 0], np.int16)
    r, e = requantize_int8(small, 7, (0,))
    assert e == 7 and np.array_equal(r, small)
    r, e = requantize_int8(np.array([32767, -32767], np.int16), 0, (0,))
    assert e == -9 and np.abs(r.astype(int)).max() <= 127


def test_int8_results_are_the_requantised_exact_sums_and_half_the_bytes_down(tier_factory) -> None:
    """Int8 results over real sockets, 8 workers: the forwarding node still sums int8 into
    exact int16; the parameter node re-quantises each verified sum to int8 (the scale rides in
    the RESULT's header) and every worker's result is exactly that re-quantisation of the exact
    integer sum (recomputed here), within the stated bound of the float sums; the parameter
    node sends half the bytes of the int16 sums (``exact``, the same inputs)."""
    world, chunk, rounds = 8, 1000, 3
    inputs = random_inputs(1, world, 5_000, rounds, seed=15)
    sent = {}
    for results in ("int8", "exact"):
        tier = tier_factory()
        cfg = WorkerConfig(chunk=chunk, quantizer=SharedScale(8, error_feedback=False), results=results)
        out = reduce_all(tier, inputs, world, cfg)
        assert_exact(inputs, out)
        rounded = _exact_integer_sums(inputs, world, rounds, chunk, out, 8, int8_results=results == "int8")
        stats = query(tier.ps.address)
        sent[results] = stats["transport"]["bytes_sent"]
        assert stats["results_requantised"] == (rounds * 5 if results == "int8" else 0)
        if results == "int8":
            assert rounded > 0  # 8 workers' sums of int8 do not fit int8: these were rounded
    # rounds 2 and 3 carry int8 sums up; the first round's int32 sums come down as int8 too
    int16_down = 2 * 5_000 * 2 + 5_000 * 4
    assert sent["exact"] - sent["int8"] == pytest.approx(int16_down - rounds * 5_000, rel=0.05)


def test_results_precision_is_checked_and_follows_the_jobs_precision() -> None:
    """``WorkerConfig.results``: int8 by default for an int8 job, exact otherwise; anything but
    exact or int8 is refused when the client is made."""
    assert WorkerConfig(quantizer=quantizer_for("int8")).result_precision == "int8"
    assert WorkerConfig(quantizer=quantizer_for("int16")).result_precision == "exact"
    assert WorkerConfig().result_precision == "exact"
    assert WorkerConfig(quantizer=quantizer_for("int8"), results="exact").result_precision == "exact"
    from trainmaster.aggregation.worker import AggregationClient

    with pytest.raises(ValueError, match="results 'int4'"):
        AggregationClient(("127.0.0.1", 9), 1, 0, 1, WorkerConfig(results="int4"))
