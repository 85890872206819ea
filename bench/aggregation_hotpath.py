"""Per-packet speed of the UDP aggregation path on loopback: how many MB/s of gradients one
forwarding node sums with 4 and 8 workers (no link cap: what Python costs per packet).

Starts a parameter node and one forwarding node (``Fabric``) and ``workers`` worker processes;
each reduces a float32 tensor of ``--mib`` MiB ``--rounds`` times into a preallocated result.
Reported per worker count: the median over rounds of the slowest worker's time, as algorithm
bandwidth (tensor bytes / time, what one worker gets) and as the forwarding node's intake
(workers x tensor bytes / time: what it sums per second). A 100 Mbit/s link carries 12.5 MB/s,
1 Gbit/s 125 MB/s: the path is link-bound when the algorithm bandwidth is above that.

    .venv/bin/python bench/aggregation_hotpath.py [--workers 4,8] [--mib 16] [--chunk 16367]
    .venv/bin/python bench/aggregation_hotpath.py --mtu 1500 --chunk 16007 --precision int8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from trainmaster.aggregation.fabric import Fabric, query
from trainmaster.aggregation.worker import AggregationClient, WorkerConfig

MIN_RTO = float(os.environ.get("TM_BENCH_MIN_RTO", "0.05"))  # the library default on udp


def _worker(
    conn: Any,
    switch: tuple[str, int],
    rank: int,
    world: int,
    elements: int,
    rounds: int,
    chunk: int,
    mtu: int | None,
    precision: str,
) -> None:
    from trainmaster.aggregation.worker import quantizer_for

    x = np.random.default_rng(rank).standard_normal(elements).astype(np.float32)
    out = np.empty_like(x)
    cfg = WorkerConfig(chunk=chunk, quantizer=quantizer_for(precision), min_retransmit_timeout=MIN_RTO)
    with AggregationClient(switch, 1, rank, world, cfg, mtu=mtu) as client:
        client.allreduce(x, out=out, key="x")  # warm-up: routes, buffers, the shared scale
        times = []
        for _ in range(rounds):
            conn.send("ready")
            conn.recv()  # start together
            t0 = time.perf_counter()
            client.allreduce(x, out=out, key="x")
            times.append(time.perf_counter() - t0)
        conn.send(times)
        conn.send(client.stats())


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    world: int, mib: float, rounds: int, chunk: int, mtu: int | None = None, precision: str = "int32"
) -> dict[str, Any]:
    elements = int(mib * (1 << 20)) // 4
    ctx = mp.get_context("fork")
    with Fabric(slots=256, mtu=mtu) as fabric:
        pipes, procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(child, fabric.switches[0], rank, world, elements, rounds, chunk, mtu, precision),
            )
            p.start()
            pipes.append(parent)
            procs.append(p)
        roles = {"ps": fabric.processes[0].pid, "switch": fabric.processes[1].pid}
        cpu0: dict[str, float] = {}
        for i in range(rounds):
            for pipe in pipes:
                assert pipe.recv() == "ready"
            if i == 0:  # after the warm-up: CPU of the timed rounds only
                cpu0 = {r: _cpu_seconds(pid) for r, pid in roles.items()}
                cpu0["workers"] = sum(_cpu_seconds(p.pid) for p in procs)
            for pipe in pipes:
                pipe.send("go")
        per_worker = [pipe.recv() for pipe in pipes]
        cpu = {r: _cpu_seconds(pid) - cpu0[r] for r, pid in roles.items()}
        cpu["workers"] = sum(_cpu_seconds(p.pid) for p in procs) - cpu0["workers"]
        stats = [pipe.recv() for pipe in pipes]
        switch = query(fabric.switches[0]) or {}
        for p in procs:
            p.join(30)
    slowest = [max(ts[i] for ts in per_worker) for i in range(rounds)]
    t = statistics.median(slowest)
    nbytes = elements * 4
    return {
        "workers": world,
        "MiB": mib,
        "chunk": chunk,
        "mtu": mtu,
        "precision": precision,
        "rounds": rounds,
        "median_s": round(t, 4),
        "algbw_MBps": round(nbytes / t / 1e6, 1),
        "switch_intake_MBps": round(world * nbytes / t / 1e6, 1),
        "retransmits": sum(s["retransmits"] for s in stats),
        "switch_collisions": switch.get("collisions"),
        "cpu_s_per_round": {r: round(c / rounds, 3) for r, c in cpu.items()},
        "load_avg_1min": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="4,8")
    ap.add_argument("--mib", type=float, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="elements per packet")
    ap.add_argument("--mtu", type=int, default=None, help="cut packets into datagrams of this MTU")
    ap.add_argument("--precision", default="int32", help="int32, int16 or int8")
    args = ap.parse_args()
    from trainmaster.aggregation.worker import DEFAULT_CHUNK

    chunk = args.chunk or DEFAULT_CHUNK["udp"]
    for w in args.workers.split(","):
        print(json.dumps(measure(int(w), args.mib, args.rounds, chunk, args.mtu, args.precision)), flush=True)


if __name__ == "__main__":
    main()
