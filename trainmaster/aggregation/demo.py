"""End-to-end demonstration: start the tier and the workers as processes, inject faults,
reduce random tensors and check every result against the exact float64 sum.

Each worker regenerates every rank's input from the seed, so it can check its own result
without shipping tensors around; only a small summary returns to the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trainmaster.aggregation.fabric import Fabric
from trainmaster.aggregation.quantize import BlockFloat, FixedScale
from trainmaster.aggregation.transport import Address, FaultPlan
from trainmaster.aggregation.worker import AggregationClient, AggregationError, WorkerConfig

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


def demo_input(cfg: DemoConfig, job: int, rank: int, rnd: int) -> np.ndarray:
    rng = np.random.default_rng([cfg.seed, job, rank, rnd])
    x = rng.standard_normal(cfg.elements).astype(np.float32)
    if cfg.overflow:
        starts = np.arange(0, cfg.elements, cfg.chunk * OVERFLOW_EVERY)
        for s in starts:
            x[s:s + 8] = OVERFLOW_VALUE * np.where(rng.random(len(x[s:s + 8])) < 0.5, -1, 1)
    return x


def _worker_main(conn: Any, cfg: DemoConfig, switch: Address, job: int, rank: int) -> None:
    quantizer = FixedScale(FIXED_EXPONENT) if cfg.overflow else BlockFloat()
    wcfg = WorkerConfig(chunk=cfg.chunk, quantizer=quantizer, timeout=cfg.timeout)
    report: dict[str, Any] = {"job": job, "rank": rank, "ok": True, "max_abs_error": 0.0,
                              "bound": 0.0, "error": None}
    client = AggregationClient(switch, job, rank, cfg.workers, wcfg, cfg.faults,
                               transport=cfg.transport)
    try:
        client.join()
        elapsed = 0.0
        for rnd in range(cfg.rounds):
            x = demo_input(cfg, job, rank, rnd)
            t0 = time.monotonic()
            y = client.allreduce(x)
            elapsed += time.monotonic() - t0
            exact = np.zeros(cfg.elements, dtype=np.float64)
            for r in range(cfg.workers):
                exact += demo_input(cfg, job, r, rnd).astype(np.float64)
            # quantisation bound of the scaling used plus float32 rounding of the result
            bound = client.last_error_bound.astype(np.float64) + np.abs(exact) * 2.0**-23
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
    with Fabric(slots=cfg.slots, levels=cfg.levels, faults=cfg.faults, transport=cfg.transport,
                dead_after=max(10.0, cfg.timeout / 4)) as fabric:
        procs, pipes = [], []
        t0 = time.monotonic()
        for job in range(1, cfg.jobs + 1):
            for rank in range(cfg.workers):
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_main,
                                args=(child, cfg, fabric.attach_point(rank), job, rank),
                                daemon=True)
                p.start()
                child.close()
                procs.append(p)
                pipes.append(parent)
        reports = []
        for pipe, proc in zip(pipes, procs):
            if pipe.poll(cfg.timeout * 3):
                reports.append(pipe.recv())
            else:
                reports.append({"ok": False, "error": "worker process gave no report",
                                "stats": {}, "max_abs_error": float("inf"), "bound": 0.0})
            proc.join(timeout=5)
        wall = time.monotonic() - t0
        fabric_stats = fabric.stats()
    return _summarise(cfg, reports, fabric_stats, wall)


def _summarise(cfg: DemoConfig, reports: list[dict[str, Any]], fabric: dict[str, Any],
               wall: float) -> dict[str, Any]:
    ps = fabric["ps"] or {}
    switches = [s for s in fabric["switches"] if s]
    nodes = [ps, *switches] + [r["stats"] for r in reports if r.get("stats")]
    transports = [n.get("transport", {}) for n in nodes]
    wstats = [r["stats"] for r in reports if r.get("stats")]

    def total(items: list[dict[str, Any]], name: str) -> int:
        return int(sum(i.get(name, 0) for i in items))

    seconds = max((r.get("seconds", 0.0) for r in reports), default=0.0)
    tensor_bytes = cfg.jobs * cfg.workers * cfg.rounds * cfg.elements * 4
    return {
        "exact": all(r["ok"] for r in reports) and len(reports) == cfg.jobs * cfg.workers,
        "max_abs_error": max(r["max_abs_error"] for r in reports),
        "bound": max(r["bound"] for r in reports),
        "packets": total(transports, "sent"),
        "retransmits": total(wstats, "retransmits"),
        "gap_retransmits": total(wstats, "gap_retransmits"),
        "overflow_fallbacks": int(ps.get("overflow_fallbacks", 0)),
        "collisions": total(switches, "collisions"),
        "duplicates_ignored": total(switches, "duplicates_ignored")
        + int(ps.get("duplicates_ignored", 0)) + total(wstats, "duplicates_ignored"),
        "flushes": total(switches, "flushes"),
        "verified": int(ps.get("verified", 0)),
        "slots_in_use_after": total(switches, "slots_in_use"),
        "faults": {name: total(transports, name)
                   for name in ("dropped", "duplicated", "reordered", "delayed")},
        "goodput_MBps": tensor_bytes / seconds / 1e6 if seconds else 0.0,
        "seconds": round(wall, 3),
        "errors": [r["error"] for r in reports if r.get("error")],
        "config": {**{k: v for k, v in asdict(cfg).items() if k != "faults"},
                   "faults": asdict(cfg.faults)},
    }
