"""End-to-end demonstration: start the tier and the workers as processes, inject faults,
reduce random tensors and check every result against the exact float64 sum.

Each worker regenerates every rank's input from the seed, so it can check its own result
without shipping tensors around; only a small summary returns to the caller. Two checks, kept
apart in the output because they say different things:

* ``integer_sums``: the fabric sums integers, and those sums are exact. For every slice whose
  workers all used one exponent (low-bit aggregation's shared scale, ``FixedScale``, or block
  floating point when the workers' exponents happen to agree) the worker recomputes every
  rank's quantised integers (with their carried errors) and checks that its result is exactly
  their sum, element by element; a slice that overflowed is checked against the float sum of
  what the workers resent. A slice where only a partial sum of some ranks can pass the wire's
  limit is exact either way: as integers, or down the float path when the pieces that met at a
  forwarding node (or a retransmission's) overflowed, which depends on timing. Block floating
  point slices whose workers chose different exponents are aligned by rounding shifts in arrival
  order, so they are only bounded, not checked. With int8 results (``results``, the default
  of an int8 job) the expected sum is then re-quantised as the parameter node does it (its
  stochastic rounding is a function of job, round and slice): exact again, element by element.
* ``float_error``: the result against the exact float64 sum of the inputs; it is never zero
  (quantisation rounds every input) and must stay within the stated bound.

Reproducibility: the inputs, the fault injectors (one seeded generator per link) and the kill
moment (a packet count) depend only on the seed. The *counts* of faults and fallbacks also
depend on timing: which packet a link's n-th random draw falls on depends on how the processes
interleave (retransmit timers, gap detection and heartbeats fire by the clock), so two runs
with the same seed give the same results but counts that differ by a few percent. ``ok``,
``integer_sums``, ``float_error`` (for the same inputs) and ``slots_in_use_after`` are
reproducible.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import wait
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trainmaster.aggregation.fabric import Fabric
from trainmaster.aggregation.kills import KillPlan
from trainmaster.aggregation.parameter_node import process_stopped
from trainmaster.aggregation.protocol import NO_PEAK, peak_exponent
from trainmaster.aggregation.quantize import (
    LIMITS,
    BlockFloat,
    FixedScale,
    Quantizer,
    SharedScale,
    peak_magnitude,
    quantize,
    requantize_int8,
)
from trainmaster.aggregation.transport import Address, FaultPlan
from trainmaster.aggregation.worker import AggregationClient, AggregationError, WorkerConfig, quantizer_for

OVERFLOW_VALUE = 20000.0  # x * 2**16 fits int32, the sum of 2+ workers does not
OVERFLOW_EVERY = 5  # every 5th slice carries large gradients when --overflow is on
FIXED_EXPONENT = 16


@dataclass(frozen=True)
class DemoConfig:
    workers: int = 4
    jobs: int = 1
    elements: int = 100_000
    rounds: int = 2
    slots: int = 64
    levels: int = 1
    overflow: bool = False
    chunk: int = 4096
    seed: int = 0
    faults: FaultPlan = FaultPlan()
    timeout: float = 60.0
    transport: str = "udp"
    kill: KillPlan | None = None
    siblings: int = 1  # forwarding nodes directly under the parameter node
    # worker control-path timers: see WorkerConfig (shorter in tests of the kill cases)
    failover_after: float = 3.0
    parameter_node_dead_after: float = 10.0
    max_retransmit_timeout: float = 1.0  # cap of a slice's backed-off retransmit timer
    precision: str = "int32"  # int32 (block floating point), int16 or int8 (low-bit, shared scale)
    results: str | None = None  # how sums come down: exact or int8 (WorkerConfig.results)
    mtu: int | None = None  # cut packets into datagrams of at most this MTU (None: the path's)
    partitions: int = 0  # 0: the jobs share the slots; N: each node's pool split into N parts


def demo_input(cfg: DemoConfig, job: int, rank: int, rnd: int) -> np.ndarray:
    """Rank ``rank``'s input of round ``rnd``. With ``overflow``, every ``OVERFLOW_EVERY``-th
    slice (a different set each round) starts with a few large values: their sum overflows a
    fixed scale, and with low-bit aggregation they outgrow the scale the previous round set."""
    rng = np.random.default_rng([cfg.seed, job, rank, rnd])
    x = rng.standard_normal(cfg.elements).astype(np.float32)
    if cfg.overflow:
        starts = np.arange((rnd % OVERFLOW_EVERY) * cfg.chunk, cfg.elements, cfg.chunk * OVERFLOW_EVERY)
        for s in starts:
            x[s : s + 8] = OVERFLOW_VALUE * np.where(rng.random(len(x[s : s + 8])) < 0.5, -1, 1)
    return x


def demo_quantizer(cfg: DemoConfig) -> Quantizer:
    return FixedScale(FIXED_EXPONENT) if cfg.overflow and cfg.precision == "int32" else quantizer_for(cfg.precision)


@dataclass(frozen=True)
class Either:
    """A slice the fabric sums exactly as integers, or sends down the float path when a partial
    sum of some ranks passed the wire's limit (which pieces meet where depends on timing)."""

    integers: tuple[int, np.ndarray]
    floats: np.ndarray


class IntegerSums:
    """Every rank's side of one job, recomputed by one worker: what each rank quantises
    (its input plus its carried error), with which exponent, and so what the fabric's exact
    integer sum of each slice must be.

    The shared scale of a slice is derived from the largest magnitude of the previous round
    (what the RESULT carries: the largest ``peak`` any rank sent); overflow (a saturated value,
    or a sum beyond the sum's type) sends the slice down the float path, where the expected
    result is the float sum of what the ranks resent."""

    def __init__(self, cfg: DemoConfig, quantizer: Quantizer, job: int, results: str):
        self.cfg, self.quantizer, self.job, self.int8_results = cfg, quantizer, job, results == "int8"
        self.slices = -(-cfg.elements // cfg.chunk)
        feedback = isinstance(quantizer, SharedScale) and quantizer.error_feedback
        self.residuals = [np.zeros(cfg.elements, np.float32) for _ in range(cfg.workers)] if feedback else None
        self.peaks = np.full(self.slices, NO_PEAK)
        base = quantizer.margin if isinstance(quantizer, SharedScale) else 0
        self.margins = [(base, 0)] * self.slices  # (margin, clean rounds) per slice, as the client
        # slices whose carried state (scale margin, errors) hangs on an Either's outcome: not
        # predictable after it, so bounded only
        self.uncertain: set[int] = set()

    def expected(self, inputs: list[np.ndarray], rnd: int) -> list[tuple[int, np.ndarray] | np.ndarray | Either | None]:
        """Per slice: (exponent, integer sum) when the sum is exact integers at one exponent
        (re-quantised as the parameter node does for int8 results; ``rnd``: the fabric's round
        number), the float32 result of the float path, or None (block floating point with
        differing exponents: bounded only). Advances the carried errors and peaks to the next
        round."""
        cfg, n = self.cfg, self.cfg.workers
        sent = [x + r for x, r in zip(inputs, self.residuals)] if self.residuals else inputs
        out: list[tuple[int, np.ndarray] | np.ndarray | Either | None] = []
        new_peaks = np.full(self.slices, NO_PEAK)
        for s in range(self.slices):
            part = [x[s * cfg.chunk : (s + 1) * cfg.chunk] for x in sent]
            peaks = [peak_magnitude(p) for p in part]
            new_peaks[s] = max(peak_exponent(p) for p in peaks)
            shared = isinstance(self.quantizer, SharedScale) and self.peaks[s] != NO_PEAK
            if shared:
                assert isinstance(self.quantizer, SharedScale)
                dtype = self.quantizer.dtype
                exps = [self.quantizer.shared_exponent(int(self.peaks[s]), n, self.margins[s][0])] * n
            else:
                dtype = np.dtype("<i4")
                rule = self.quantizer if isinstance(self.quantizer, FixedScale) else BlockFloat()
                exps = [rule.choose_exponent(p, n, pk) for p, pk in zip(part, peaks)]
            qs = [quantize(p, e, pk, dtype.str) for p, e, pk in zip(part, exps, peaks)]
            stacked = np.stack([q.astype(np.int64) for q in qs])  # ranks x elements
            total = stacked.sum(axis=0)
            wire = LIMITS[4] if dtype.itemsize == 4 else LIMITS[2]
            overflow = np.abs(stacked).max() >= LIMITS[dtype.itemsize] or np.abs(total).max() >= wire
            # a partial sum of some of the ranks (a forwarding node's, or pieces a retransmission
            # merged in another grouping) may pass the wire's limit while the whole sum does not:
            # then the fabric rightly falls back to floats, or not, as the pieces happened to meet
            partial = not overflow and (
                max(np.clip(stacked, 0, None).sum(axis=0).max(), -np.clip(stacked, None, 0).sum(axis=0).min()) >= wire
            )
            if shared:
                assert isinstance(self.quantizer, SharedScale)
                self.margins[s] = self.quantizer.next_margin(*self.margins[s], overflow)
            if partial and (shared or self.residuals is not None):
                self.uncertain.add(s)
            if s in self.uncertain:
                out.append(None)
            elif overflow:
                out.append(_float_path(part))
            elif partial and len(set(exps)) == 1:
                out.append(Either(self._down(exps[0], total, rnd, s), _float_path(part)))
            elif len(set(exps)) == 1:
                out.append(self._down(exps[0], total, rnd, s))
            else:
                out.append(None)
            if self.residuals is not None:
                for r, p, q, e in zip(self.residuals, part, qs, exps):
                    view = r[s * cfg.chunk : (s + 1) * cfg.chunk]
                    view[...] = 0.0 if overflow else p - q.astype(np.float32) * np.float32(2.0**-e)
        self.peaks = new_peaks
        return out

    def _down(self, exponent: int, total: np.ndarray, rnd: int, seq: int) -> tuple[int, np.ndarray]:
        """The integer sum as it comes down: as summed, or re-quantised to int8."""
        if not self.int8_results:
            return exponent, total
        q, e = requantize_int8(total, exponent, (self.job, rnd, seq))
        return e, q


def check_integer_sums(y: np.ndarray, chunk: int, expected: list[Any]) -> dict[str, int]:
    """Count the slices of ``y`` that equal their expected exact sums (see ``IntegerSums``)."""
    got = {"checked": 0, "exact": 0, "float_path": 0, "bounded_only": 0}
    for s, want in enumerate(expected):
        part = y[s * chunk : (s + 1) * chunk]
        if want is None:
            got["bounded_only"] += 1
            continue
        if isinstance(want, Either):
            exact = _integers_exact(part, *want.integers) or _floats_exact(part, want.floats)
        elif isinstance(want, tuple):
            exact = _integers_exact(part, *want)
        else:
            got["float_path"] += 1
            exact = _floats_exact(part, want)
        got["checked"] += 1
        got["exact"] += int(exact)
    return got


def _float_path(part: list[np.ndarray]) -> np.ndarray:
    """What the float path gives for a slice: the float32 of the float64 sum of what the ranks sent."""
    return np.sum([p.astype(np.float64) for p in part], axis=0).astype(np.float32)


def _integers_exact(part: np.ndarray, exponent: int, total: np.ndarray) -> bool:
    # the client converts the integer sum to float32 (one rounding) and scales it by a power of
    # two (exact): so the result is exactly that, element by element
    return bool(np.array_equal(part, total.astype(np.float32) * np.float32(2.0**-exponent)))


def _floats_exact(part: np.ndarray, want: np.ndarray) -> bool:
    # float64 sums of float32 values in another order may differ in the last place
    return bool(np.all(np.abs(part - want) <= np.abs(want) * 2.0**-22 + 1e-30))


def _worker_main(conn: Any, cfg: DemoConfig, switch: Address, job: int, rank: int) -> None:
    quantizer = demo_quantizer(cfg)
    wcfg = WorkerConfig(
        chunk=cfg.chunk,
        quantizer=quantizer,
        timeout=cfg.timeout,
        failover_after=cfg.failover_after,
        parameter_node_dead_after=cfg.parameter_node_dead_after,
        max_retransmit_timeout=cfg.max_retransmit_timeout,
        results=cfg.results,
    )
    report: dict[str, Any] = {
        "job": job,
        "rank": rank,
        "ok": True,
        "max_abs_error": 0.0,
        "bound": 0.0,
        "error": None,
        "integer_sums": {"checked": 0, "exact": 0, "float_path": 0, "bounded_only": 0},
    }
    client = AggregationClient(
        switch, job, rank, cfg.workers, wcfg, cfg.faults, transport=cfg.transport, kill=cfg.kill, mtu=cfg.mtu
    )
    sums = IntegerSums(cfg, quantizer, job, wcfg.result_precision)
    try:
        client.join()
        elapsed = 0.0
        for rnd in range(cfg.rounds):
            x = demo_input(cfg, job, rank, rnd)
            t0 = time.monotonic()
            y = client.allreduce(x, key="demo")
            elapsed += time.monotonic() - t0
            inputs = [demo_input(cfg, job, r, rnd) for r in range(cfg.workers)]
            for name, count in check_integer_sums(y, cfg.chunk, sums.expected(inputs, client.round)).items():
                report["integer_sums"][name] += count
            exact = np.zeros(cfg.elements, dtype=np.float64)
            for r in range(cfg.workers):
                exact += inputs[r].astype(np.float64)
            # quantisation bound of the scaling used plus float32 rounding of the result
            error_bound = client.last_error_bound
            assert error_bound is not None  # every allreduce that returns sets it
            bound = error_bound.astype(np.float64) + np.abs(exact) * 2.0**-23
            err = np.abs(y.astype(np.float64) - exact)
            report["ok"] = report["ok"] and bool(np.all(err <= bound))
            report["max_abs_error"] = max(report["max_abs_error"], float(err.max()))
            report["bound"] = max(report["bound"], float(bound.max()))
        report["seconds"] = elapsed
    except AggregationError as exc:
        report["ok"] = False
        report["error"] = str(exc)
    finally:
        report["stats"] = client.stats()
        client.close()
        conn.send(report)
        conn.close()


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the whole demo; the returned dict is what ``trainmaster aggregation demo`` prints."""
    ctx = mp.get_context("fork")
    with Fabric(
        slots=cfg.slots,
        levels=cfg.levels,
        faults=cfg.faults,
        transport=cfg.transport,
        dead_after=max(10.0, cfg.timeout / 4),
        siblings=cfg.siblings,
        kill=cfg.kill,
        mtu=cfg.mtu,
        partitions=cfg.partitions,
    ) as fabric:
        procs, pipes = [], []
        t0 = time.monotonic()
        for job in range(1, cfg.jobs + 1):
            for rank in range(cfg.workers):
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_worker_main, args=(child, cfg, fabric.attach_point(rank), job, rank), daemon=True
                )
                p.start()
                child.close()
                procs.append(p)
                pipes.append(parent)
        names = [(job, rank) for job in range(1, cfg.jobs + 1) for rank in range(cfg.workers)]
        reports = _collect(cfg, names, pipes, procs)
        wall = time.monotonic() - t0
        fabric_stats = fabric.stats()
    return _summarise(cfg, reports, fabric_stats, wall)


def _collect(cfg: DemoConfig, names: list[tuple[int, int]], pipes: list[Any], procs: list[Any]) -> list[dict[str, Any]]:
    """Each worker's report, or why there is none; every worker process is gone afterwards.

    Waits on the report pipes and the process sentinels together, so a killed worker is
    noticed when it dies. Once every worker still running is stopped (SIGSTOP: it will never
    report) or ``3 * timeout`` has passed, the rest are SIGKILLed (a stopped process ignores
    SIGTERM, and multiprocessing's exit handler would wait for it forever)."""
    reports: dict[int, dict[str, Any]] = {}
    open_ = set(range(len(procs)))
    deadline = time.monotonic() + cfg.timeout * 3
    while open_ and time.monotonic() < deadline:
        if all(process_stopped(procs[i].pid) for i in open_):
            break
        handles = {pipes[i]: i for i in open_} | {procs[i].sentinel: i for i in open_}
        for ready in wait(list(handles), timeout=min(1.0, deadline - time.monotonic())):
            i = handles[ready]
            if i not in open_:
                continue
            try:
                reports[i] = pipes[i].recv()
            except EOFError:  # the pipe closed without a report: the process is gone
                procs[i].join(5)
                code = procs[i].exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                reports[i] = _missing(f"worker {names[i][0]}.{names[i][1]} died ({how}) without a report")
            open_.discard(i)
    for i in open_:
        stopped = process_stopped(procs[i].pid)
        os.kill(procs[i].pid, signal.SIGKILL)
        reports[i] = _missing(
            f"worker {names[i][0]}.{names[i][1]} "
            + ("was stopped (SIGSTOP)" if stopped else "gave no report")
            + "; the demo killed it"
        )
    for proc in procs:
        proc.join(timeout=5)
    return [reports[i] for i in range(len(procs))]


def _missing(error: str) -> dict[str, Any]:
    return {"ok": False, "error": error, "stats": {}, "max_abs_error": float("inf"), "bound": 0.0}


def _summarise(cfg: DemoConfig, reports: list[dict[str, Any]], fabric: dict[str, Any], wall: float) -> dict[str, Any]:
    ps = fabric["ps"] or {}
    switches = [s for s in fabric["switches"] if s]
    nodes = [ps, *switches] + [r["stats"] for r in reports if r.get("stats")]
    transports = [n.get("transport", {}) for n in nodes]
    wstats = [r["stats"] for r in reports if r.get("stats")]
    low_bit = sum(int(w.get("low_bit_slices", 0)) for w in wstats)

    def total(items: list[dict[str, Any]], name: str) -> int:
        return int(sum(i.get(name, 0) for i in items))

    seconds = max((r.get("seconds", 0.0) for r in reports), default=0.0)
    tensor_bytes = cfg.jobs * cfg.workers * cfg.rounds * cfg.elements * 4
    within = all(r["ok"] for r in reports) and len(reports) == cfg.jobs * cfg.workers
    sums = {
        name: sum(r.get("integer_sums", {}).get(name, 0) for r in reports)
        for name in ("checked", "exact", "float_path", "bounded_only")
    }
    integer_exact = sums["exact"] == sums["checked"]
    return {
        # every worker finished, every result within its bound and every checked sum exact
        "ok": within and integer_exact,
        "integer_sums": {**sums, "all_exact": integer_exact},
        "float_error": {
            "max_abs": max(r["max_abs_error"] for r in reports),
            "bound": max(r["bound"] for r in reports),
            "within_bound": within,
        },
        "precision": cfg.precision,
        "results_requantised": int(ps.get("results_requantised", 0)),
        "low_bit_slices": low_bit,
        "packets": total(transports, "sent"),
        "retransmits": total(wstats, "retransmits"),
        "gap_retransmits": total(wstats, "gap_retransmits"),
        "overflow_fallbacks": int(ps.get("overflow_fallbacks", 0)),
        "collisions": total(switches, "collisions"),
        "duplicates_ignored": total(switches, "duplicates_ignored")
        + int(ps.get("duplicates_ignored", 0))
        + total(wstats, "duplicates_ignored"),
        "flushes": total(switches, "flushes"),
        "verified": int(ps.get("verified", 0)),
        "slots_in_use_after": total(switches, "slots_in_use"),
        "faults": {name: total(transports, name) for name in ("dropped", "duplicated", "reordered", "delayed")},
        # packets larger than a datagram of the path, cut into segments (see segments.py)
        "segments": {
            name: total(transports, name)
            for name in (
                "packets_segmented",
                "segments_sent",
                "gso_sends",
                "gro_batches",
                "reassembled",
                "reassembled_whole",
                "segment_duplicates",
                "partials_dropped",
            )
        },
        "goodput_MBps": tensor_bytes / seconds / 1e6 if seconds else 0.0,
        "seconds": round(wall, 3),
        "errors": [r["error"] for r in reports if r.get("error")],
        "fallbacks_to_parameter_node": total(wstats, "fallbacks_to_parameter_node"),
        "workers_moved": total(switches, "workers_moved"),
        "completeness_failures": int(ps.get("completeness_failures", 0)),
        "jobs_failed": int(ps.get("jobs_failed", 0)),
        "config": {
            **{k: v for k, v in asdict(cfg).items() if k not in ("faults", "kill")},
            "faults": asdict(cfg.faults),
            "kill": asdict(cfg.kill) if cfg.kill else None,
        },
    }
