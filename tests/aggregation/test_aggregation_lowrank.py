"""Low-rank compression for in-network aggregation (trainmaster.aggregation.lowrank): the
factor sums go through the fabric as integers (exact sums of the workers' quantised factors),
the result equals a float reference of the same power iteration, and the path stays exact under
lost, duplicated and reordered packets and overflowing factors. Real sockets, nodes and workers
in threads."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from trainmaster.aggregation.lowrank import LowRankHookState, plan_layout
from trainmaster.aggregation.quantize import BlockFloat, SharedScale
from trainmaster.aggregation.transport import FaultPlan
from trainmaster.aggregation.worker import AggregationClient, WorkerConfig

from aggregation_tier import ThreadTier, tier_factory  # noqa: F401

pytestmark = pytest.mark.timeout(180)

# a bucket like a small CNN's: a conv weight, a vector, a wide matrix, a matrix too small to gain
SHAPES = [(8, 2, 3, 3), (8,), (40, 64), (3, 2)]
RANK, START, SEED, CHUNK = 2, 1, 5, 64


def _gradients(world: int, steps: int, seed: int = 0) -> list[list[np.ndarray]]:
    """Per step, per worker: a flat bucket whose matrices have a dominant low-rank part."""
    rng = np.random.default_rng(seed)
    n = sum(int(np.prod(s)) for s in SHAPES)
    low = rng.standard_normal((n, 3)) @ rng.standard_normal((3, 1))
    return [
        [(low[:, 0] * (1 + 0.1 * t) + 0.3 * rng.standard_normal(n)).astype(np.float32) for _ in range(world)]
        for t in range(steps)
    ]


def _reference(grads: list[list[np.ndarray]], world: int) -> list[np.ndarray]:
    """The same algorithm in float64 with exact sums: plain average for ``START`` steps, then
    P = sum M Q, orthonormalise, Q = sum M^T P, result P Q^T / world; each worker carries
    M - result; Q warm-starts from the previous sum (the first draw from the same seed)."""
    layout = plan_layout(SHAPES, RANK, 2.0, CHUNK)
    errors = [np.zeros_like(grads[0][0], dtype=np.float64) for _ in range(world)]
    qs: dict[int, torch.Tensor] = {}
    out = []
    for t, step in enumerate(grads):
        ms = [g.astype(np.float64) + e for g, e in zip(step, errors)]
        if t < START:
            result = sum(ms) / world
        else:
            result = np.empty_like(ms[0])
            for seg in layout.segments:
                part = slice(seg.offset, seg.offset + seg.numel)
                if not seg.rows:
                    result[part] = sum(m[part] for m in ms) / world
                    continue
                mats = [torch.from_numpy(m[part].reshape(seg.rows, seg.cols)) for m in ms]
                q = qs.get(seg.offset)
                if q is None:
                    q = torch.randn(seg.cols, RANK, generator=torch.Generator().manual_seed(SEED * 7919 + seg.offset))
                q = q.double()
                basis = torch.linalg.qr(sum(mat @ q for mat in mats), mode="reduced").Q
                q_sum = sum(mat.t() @ basis for mat in mats)
                qs[seg.offset] = q_sum
                result[part] = (basis @ q_sum.t() / world).reshape(-1).numpy()
        errors = [m - result for m in ms]
        out.append(result)
    return out


def _run(
    tier: ThreadTier, grads: list[list[np.ndarray]], world: int, quantizer: Any, faults: FaultPlan | None = None
) -> dict[int, Any]:
    """Every worker in a thread with its own client and hook state; each step's bucket goes
    through ``submit`` (the communication thread). Records every all-reduce the hook makes:
    its input, its result and the client's error bound."""
    out: dict[int, Any] = {}
    shapes = tuple(tuple(s) for s in SHAPES)

    def work(rank: int) -> None:
        cfg = WorkerConfig(chunk=CHUNK, quantizer=quantizer, timeout=60.0)
        with AggregationClient(tier.attach(rank), 1, rank, world, cfg, faults) as client:
            calls: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
            plain = client.allreduce

            def recording(array: Any, out: Any = None, key: Any = None) -> Any:
                sent = np.array(array, dtype=np.float32, copy=True)
                got = plain(array, out=out, key=key)
                calls.append((sent, np.array(got, copy=True), client.last_error_bound.copy()))
                return got

            client.allreduce = recording  # type: ignore[method-assign]
            state = LowRankHookState(client, rank=RANK, start=START, seed=SEED)
            results = []
            for t, step in enumerate(grads):
                bucket = torch.from_numpy(step[rank].copy())
                state.submit(bucket, (0, shapes, t)).wait()
                results.append(bucket.numpy().copy())
            state.close()
            out[rank] = (results, calls, client.stats(), state.compressed_buckets)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(out) == set(range(world)), f"workers without a result: {set(range(world)) - set(out)}"
    return out


def _assert_factor_sums_exact(out: dict[int, Any], world: int) -> None:
    """Every all-reduce of the hook (plain steps, P, Q) came back, on every worker, within the
    client's stated bound of the exact float sum of what the workers sent."""
    calls = [out[r][1] for r in range(world)]
    assert len({len(c) for c in calls}) == 1
    for k in range(len(calls[0])):
        exact = sum(c[k][0].astype(np.float64) for c in calls)
        for c in calls:
            _, got, bound = c[k]
            assert np.array_equal(got, calls[0][k][1]), "workers disagree on a sum"
            err = np.abs(got.astype(np.float64) - exact)
            assert np.all(err <= bound + np.abs(exact) * 2.0**-23), (k, float(err.max()))


def test_layout_gives_each_factor_column_its_own_slices() -> None:
    """Which gradients are compressed (two or more dimensions, factors at least ``rate`` times
    smaller) and where each goes: the uncompressed part first, then every column of P (and of
    Q, in the second all-reduce) starting a slice of its own."""
    layout = plan_layout(SHAPES, RANK, 2.0, CHUNK)
    plain = [s for s in layout.segments if not s.rows]
    packed = {s.offset: s for s in layout.segments if s.rows}
    assert [(s.offset, s.numel) for s in plain] == [(144, 8), (2712, 6)]  # the vector, the 3 x 2 matrix
    conv, wide = packed[0], packed[152]
    assert (conv.rows, conv.cols, wide.rows, wide.cols) == (8, 18, 40, 64)
    assert conv.p_at == (64, 128) and wide.p_at == (192, 256) and layout.p_size == 320
    assert conv.q_at == (0, 64) and wide.q_at == (128, 192) and layout.q_size == 256
    assert all(at % CHUNK == 0 for s in packed.values() for at in (*s.p_at, *s.q_at))


def test_lowrank_over_the_fabric_matches_a_float_reference(tier_factory) -> None:
    """int32 factors (block floating point): the hook's averaged buckets match the same power
    iteration (warm start, error feedback, a plain first step) computed in float64 with exact
    sums, step after step; every factor sum is within the fabric's bound of the exact sum."""
    world, steps = 3, 5
    grads = _gradients(world, steps)
    out = _run(tier_factory(), grads, world, BlockFloat())
    _assert_factor_sums_exact(out, world)
    ref = _reference(grads, world)
    for rank in range(world):
        results, calls, _, compressed = out[rank]
        assert compressed == steps - START and len(calls) == START + 2 * (steps - START)
        for t in range(steps):
            assert np.abs(results[t] - ref[t]).max() <= 1e-4 * np.abs(ref[t]).max(), (rank, t)


def test_int8_factors_are_exact_integer_sums_and_send_a_fraction_of_the_bytes(tier_factory) -> None:
    """int8 factors with the shared scale: after the first round of each factor (int32) the
    columns go as int8, the nodes' sums are exact (within the fabric's bound of the float sums of
    what the workers sent), every worker gets the same bucket, and it stays close to the float
    reference (the rounding is fed back by the hook's error feedback). A compressed step sends a
    fraction of a plain int8 all-reduce's bytes."""
    world, steps = 3, 8
    grads = _gradients(world, steps, seed=1)
    out = _run(tier_factory(), grads, world, SharedScale(8, error_feedback=False))
    _assert_factor_sums_exact(out, world)
    ref = _reference(grads, world)
    for t in range(steps):
        assert all(np.array_equal(out[r][0][t], out[0][0][t]) for r in range(world))
        err = np.linalg.norm(out[0][0][t] - ref[t]) / np.linalg.norm(ref[t])
        assert err < 0.1, (t, err)
    stats = out[0][2]
    assert stats["low_bit_slices"] > 0
    bucket = sum(int(np.prod(s)) for s in SHAPES)
    factors = plan_layout(SHAPES, RANK, 2.0, CHUNK)
    assert factors.p_size + factors.q_size < bucket / 4  # what one compressed step carries


def test_int8_lowrank_under_loss_duplication_reordering_and_overflow_is_exact(tier_factory) -> None:
    """Faults on the low-rank path: lost, duplicated and reordered packets (retransmissions,
    the parameter node aggregating resent slices) and factors that outgrow the shared scale
    (gradients 1000 times larger at one step: the spec's overflow, floats): every factor sum
    stays within the fabric's bound of the exact one, every worker gets the same bucket."""
    world, steps = 3, 6
    grads = _gradients(world, steps, seed=2)
    for g in grads[4]:
        g *= 1000.0
    faults = FaultPlan(drop=0.05, duplicate=0.05, reorder=0.1, seed=7)
    out = _run(tier_factory(faults=faults), grads, world, SharedScale(8, error_feedback=False), faults)
    _assert_factor_sums_exact(out, world)
    for t in range(steps):
        assert all(np.array_equal(out[r][0][t], out[0][0][t]) for r in range(world))
    stats = [out[r][2] for r in range(world)]
    assert sum(s["retransmits"] for s in stats) > 0
    assert all(s["float_resends"] > 0 for s in stats)


def test_quantiser_with_its_own_error_feedback_is_refused(tier_factory) -> None:
    """The hook carries each worker's error itself: a client whose quantiser also does would
    feed the rounding back twice, so it is refused with a clear error."""
    tier = tier_factory()
    client = AggregationClient(tier.attach(0), 1, 0, 1, WorkerConfig(quantizer=SharedScale(8)))
    try:
        with pytest.raises(ValueError, match="error feedback"):
            LowRankHookState(client)
    finally:
        client.close()
