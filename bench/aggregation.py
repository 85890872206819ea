"""Benchmark: our aggregation fabric (lossless and with 1% drop) against torch.distributed gloo
all-reduce, same number of processes, on this machine.

For each worker count and tensor size it runs every variant in the same invocation, takes the
median of >= 5 timed all-reduces (after one warm-up), and reports algorithm bandwidth (tensor
bytes / time) and CPU-seconds per GB of tensor (all processes of the variant: workers,
forwarding node and parameter node for ours). Writes bench/results/aggregation.{json,md}.

    .venv/bin/python bench/aggregation.py            # full: 2/4/8 workers, 1/4/16/64 MiB
    .venv/bin/python bench/aggregation.py --quick    # 2/4/8 workers, 1/4 MiB
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

MiB = 1 << 20
CHUNK = {"udp": 16000, "shm": 262144}  # elements per packet: ~64 KiB datagrams, 1 MiB in shm
VARIANTS = {"ours": ("udp", 0.0), "ours-drop1%": ("udp", 0.01), "ours-shm": ("shm", 0.0)}
RESULTS = Path(__file__).resolve().parent / "results"


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _ours_worker(rank: int, world: int, switch: Any, sizes: list[int], reps: int,
                 drop: float, transport: str, start: Any, inner: Any, out: Any) -> None:
    import numpy as np

    from trainmaster.aggregation.transport import FaultPlan
    from trainmaster.aggregation.worker import AggregationClient, WorkerConfig

    faults = FaultPlan(drop=drop, seed=rank) if drop else None
    cfg = WorkerConfig(chunk=CHUNK[transport], window=16)
    client = AggregationClient(switch, 1, rank, world, cfg, faults, transport=transport)
    client.join()
    for size in sizes:
        x = np.random.default_rng(rank).standard_normal(size // 4).astype(np.float32)
        client.allreduce(x)  # warm-up
        start.wait()
        for _ in range(reps):
            inner.wait()
            t0 = time.perf_counter()
            client.allreduce(x)
            out.put((size, rank, time.perf_counter() - t0))
        start.wait()
    client.close()


def _gloo_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, start: Any,
                 inner: Any, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for size in sizes:
        x = torch.randn(size // 4)
        dist.all_reduce(x.clone())  # warm-up
        start.wait()
        for _ in range(reps):
            y = x.clone()
            inner.wait()
            t0 = time.perf_counter()
            dist.all_reduce(y)
            out.put((size, rank, time.perf_counter() - t0))
        start.wait()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, world: int, sizes: list[int], reps: int) -> dict[int, dict]:
    """Run one variant for every size; returns size -> {median_s, bandwidth, cpu_s_per_GB}."""
    from trainmaster.aggregation.fabric import Fabric
    from trainmaster.aggregation.transport import FaultPlan

    ctx = mp.get_context("fork")
    start, inner, out = ctx.Barrier(world + 1), ctx.Barrier(world), ctx.Queue()
    fabric = None
    if variant == "gloo":
        port = _free_port()
        procs = [ctx.Process(target=_gloo_worker,
                             args=(r, world, port, sizes, reps, start, inner, out))
                 for r in range(world)]
    else:
        transport, drop = VARIANTS[variant]
        fabric = Fabric(slots=1024, faults=FaultPlan(drop=drop, seed=7),
                        transport=transport).start()
        procs = [ctx.Process(target=_ours_worker,
                             args=(r, world, fabric.attach_point(r), sizes, reps, drop,
                                   transport, start, inner, out))
                 for r in range(world)]
    for p in procs:
        p.start()
    pids = [p.pid for p in procs] + ([p.pid for p in fabric.processes] if fabric else [])
    results: dict[int, dict] = {}
    try:
        for size in sizes:
            start.wait(timeout=600)
            cpu0 = _cpu_seconds(pids)
            by_rank: dict[int, list[float]] = {r: [] for r in range(world)}
            for _ in range(reps * world):
                _, rank, dt = out.get(timeout=600)
                by_rank[rank].append(dt)  # each rank reports its repetitions in order
            start.wait(timeout=600)
            cpu = _cpu_seconds(pids) - cpu0
            # a repetition lasts until its slowest rank has the result
            per_rep = [max(by_rank[r][i] for r in range(world)) for i in range(reps)]
            med = statistics.median(per_rep)
            results[size] = {"median_s": med, "runs": len(per_rep),
                             "bandwidth_MBps": size / med / 1e6,
                             "cpu_s_per_GB": cpu / (reps * size / 1e9)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        if fabric:
            fabric.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 4 MiB only")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    workers = [2, 4, 8]
    sizes = [1 * MiB, 4 * MiB] if args.quick else [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    variants = ["ours", "ours-drop1%", "gloo"]
    rows = []
    started = time.time()
    for world in workers:
        measured = {}
        for variant in variants:
            measured[variant] = run_variant(variant, world, sizes, args.reps)
            print(f"{world} workers {variant}: " + ", ".join(
                f"{s // MiB} MiB {r['bandwidth_MBps']:.0f} MB/s"
                for s, r in measured[variant].items()), flush=True)
        for size in sizes:
            gloo = measured["gloo"][size]
            for variant in variants:
                r = measured[variant][size]
                rows.append({"workers": world, "size_MiB": size // MiB, "variant": variant,
                             **r, "ratio_vs_gloo": r["bandwidth_MBps"] / gloo["bandwidth_MBps"]})
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()},
              "note": "shared machine, other jobs running: numbers are noisy",
              "reps": args.reps, "quick": args.quick, "seconds": round(time.time() - started),
              "transport": "UDP over loopback", "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "aggregation.json").write_text(json.dumps(report, indent=2))
    lines = [f"Aggregation vs gloo all-reduce ({os.cpu_count()} CPUs, shared and busy machine: "
             f"noisy; median of {args.reps} runs; UDP loopback)", "",
             "| workers | size | variant | bandwidth MB/s | CPU-s/GB | ours/gloo |",
             "|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['size_MiB']} MiB | {r['variant']} | "
                     f"{r['bandwidth_MBps']:.1f} | {r['cpu_s_per_GB']:.1f} | "
                     f"{r['ratio_vs_gloo']:.3f} |")
    (RESULTS / "aggregation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
