"""Benchmark: in-network aggregation (INA) against gloo's ring all-reduce, on a testbed of real
hosts (network namespaces) joined by rate-capped links, in one run.

Layout per worker count n: workers on hosts h1..hn; for INA the forwarding node runs on the
switch host (where a top-of-rack aggregator sits) and the parameter node on its own host (the
testbed's last host), all over UDP, the forwarding node sending each result once to the job's
multicast group for the bridge to replicate (``docs/aggregation.md``); gloo (torch.distributed, one process and one thread per
worker host) runs on the same worker hosts and the same links. Each link is capped in both
directions (``tc tbf``), at 100 Mbit/s, 1 Gbit/s, or not at all, at the MTU the link names
(``1gbit@1500``; default 9000): INA's slices are cut into datagrams that fit it (UDP GSO/GRO).
Variants: ``ina`` (int32), ``ina-int16`` / ``ina-int8`` (low-bit aggregation: the first
all-reduce of a tensor goes as int32 and sets the shared scale, so each low-bit cell is warmed
up with one full-size all-reduce) and ``gloo``.

Why INA should win on the wire: each worker sends its tensor once and receives the sum once,
while a ring all-reduce moves 2(n-1)/n times the tensor over each worker's link, so on a link
that is the bottleneck the ratio's limit is 2(n-1)/n (1.5 at 4 workers, 1.75 at 8).

For every (link, workers, size) it reports: algorithm bandwidth (tensor bytes / time of the
slowest rank, median of the timed repetitions after one warm-up), the ratio to gloo, the bytes
each link carried per all-reduce (from the interfaces' counters, as multiples of the tensor),
and the CPU-seconds each node used per all-reduce. Writes bench/results/aggregation.{json,md,png}.
Needs root (it builds testbeds); everything it creates is removed at the end, even on failure.

    .venv/bin/python bench/aggregation.py            # 100mbit/1gbit@1500/1gbit@9000 x 4/8 workers x 4,16,64 MiB
    .venv/bin/python bench/aggregation.py --quick    # 100mbit/1gbit x 2/4 workers x 4 MiB
    .venv/bin/python bench/aggregation.py --links 100mbit --workers 8 --sizes 16 --reps 5 --variants ina-int8,gloo
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as a script

from priority import DEFAULT_NICE, describe, own_session  # noqa: E402  (bench/priority.py, beside this script)

MiB = 1 << 20
WARM_UP = 4 * MiB
# The links' MTU unless a link says otherwise (``1gbit@1500``). INA's packets are cut into
# datagrams that fit it and handed to the kernel 64 KiB per system call (UDP GSO), received as
# runs (UDP GRO); gloo (TCP) gets the same links, with TCP's own segmentation offload.
MTU = 9000
SEG_HEADER = 16  # trainmaster.aggregation.segments.SEG_HEADER
HEADER = 36  # trainmaster.aggregation.protocol.HEADER_SIZE


# GSO sends per INA slice: a slice of four sends (about 256 KB) pays the per-slice Python cost
# of the nodes once per 256 KB; measured on loopback, 8 workers x 16 MiB x 4 rounds at MTU 9000,
# the forwarding node's CPU: 1.92 s with one send per slice, 0.75 s with four (the same as 64 KB
# slices unsegmented); a lost datagram costs the whole slice, which a lossless link never does
SENDS_PER_SLICE = 4
# Larger slices (``--sends-per-slice``, up to 16: about 1 MB, the transport's largest packet) lower
# the nodes' CPU per MB on loopback (8 workers, 16 MiB, MTU 1500, 16 sends: worker 1.90 -> 1.45
# ms, forwarding node 1.10-1.21 -> 0.93-1.01 ms per MB received) but not on the testbed, where
# the kernel's path through veth, bridge and tbf is paid per byte: three interleaved pairs under
# the benchmark lock (1 Gbit/s, MTU 1500 and 9000, 4 and 8 workers, 64 MiB, load 25-42), INA/gloo
# 0.77-0.87 with 4 sends and 0.79-0.90 with 16 at 8 workers, 1.12-1.34 and 1.07-1.25 at 4;
# CPU-s per all-reduce the same within the spread (worker 0.13-0.17, forwarding node 0.60-0.70
# at 8 workers). Four stay the default.


def sends_for(sends: int = 0) -> int:
    """GSO sends per INA slice: ``sends`` if given (> 0), else the default."""
    return sends or SENDS_PER_SLICE


def in_flight_for(sends: int, in_flight: int = 0) -> int:
    """Bytes in flight over all workers, in 64 KiB units (``in_flight`` > 0 overrides): at
    least ``IN_FLIGHT``, and enough for four slices per worker at 8 workers (the worker's own
    share of the forwarding node's socket buffer caps its window again)."""
    return in_flight or max(IN_FLIGHT, 32 * sends)


def chunk_for(mtu: int, sends: int = SENDS_PER_SLICE) -> int:
    """float32 elements per INA slice: as many as ``sends`` GSO sends carry at this MTU (64 KiB
    of datagrams each, at most 64 of them), so a slice leaves in that many system calls and
    arrives as that many runs of datagrams."""
    stride = min(65507, mtu - 28)
    per_send = max(1, min(64, 65507 // stride)) * (stride - SEG_HEADER)
    return (sends * per_send - HEADER) // 4


CHUNK = chunk_for(MTU)
# Bytes in flight, all workers together, in 64 KiB units: what the forwarding node's socket
# buffer holds (8 MB), so a burst from every worker at once is queued, not dropped. Measured on
# a 4-worker 100 Mbit/s testbed (4 MiB, 64 KiB slices): 16 per worker 1.25x gloo, 32 per
# worker 1.50x, 64 per worker 0.38x (the buffer overflowed: ~580 datagrams resent per
# all-reduce). With slices of 256 KB (four GSO sends) and the 32 MiB socket buffers asked for
# with SO_RCVBUFFORCE, twice that: 8 MiB gave 4 slices per worker at 8 workers, too few to
# cover the scheduling delays of a loaded machine (1 Gbit/s, 4 workers, 16 MiB, load ~15:
# 13.6 MB/s with 8 MiB in flight, 40.7 MB/s with 32 MiB).
IN_FLIGHT = 256
# A slice may wait a link queue's worth (the testbed's queue_ms, 200 ms) on its way up and
# down; resending sooner only adds load (measured: 528 resends per all-reduce at 50 ms, 0 at
# 300 ms, same setting as above).
MIN_RTO = 0.3
# ... and on a loaded machine a round trip can take seconds: a timer capped at 1 s (the
# library's default) then fires again and again for slices that are only late
MAX_RTO = 4.0
# ... and a stall of seconds is not a dead forwarding node (the library's 3 s moved every worker
# to the parameter node in a training run at load ~50)
FAILOVER_AFTER = 10.0
# INA's forwarding and parameter nodes run this many nice steps above the workers (higher
# priority; 0: the same). They stand for the network: on a real cluster a switch and a server
# of their own, and gloo's network path here (TCP, veth, bridge, tbf) runs in the kernel's
# softirq, ahead of every process. At equal priority the forwarding node, the one process every
# slice passes through, waits behind eight busy workers for one of the two cores. Measured at 8
# workers, 1 Gbit/s, 64 MiB, two alternating pairs under the benchmark lock (load 13 -> 5):
# MTU 9000 88.2/98.9 MB/s at equal priority, 93.3/105.8 with the nodes 7 steps up; MTU 1500
# 81.5/86.1 and 94.6/102.4 (docs/aggregation.md has the A/B at 10 steps; 15 was no better).
NODE_BOOST = 10


def window(workers: int, link_rate: int | None, queue_ms: int, in_flight: int = IN_FLIGHT, chunk: int = CHUNK) -> int:
    """Slices in flight per worker: a share of ``IN_FLIGHT`` x 64 KiB, and no more than 3/4 of
    what its link's queue holds (a full window must not overflow the tbf queue: dropped slices
    are resent through the parameter node, whose single link then carries every worker's
    resends; measured with 64 per worker at 2 workers on 100 Mbit/s: the queue dropped ~700
    datagrams, the parameter node's link queue ~8700, and the run stalled)."""
    slice_bytes = chunk * 4 + 64
    share = in_flight * 65536 // workers // slice_bytes
    if link_rate is not None:
        share = min(share, int(link_rate / 8 * queue_ms / 1000 * 0.75) // slice_bytes)
    return max(2, share)


PS_PORT, SWITCH_PORT, GLOO_PORT = 19000, 19001, 29500
PREFIX = "tmbench"
RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("ina", "ina-int16", "ina-int8", "gloo")
PRECISION = {"ina": "int32", "ina-int16": "int16", "ina-int8": "int8"}
# issue #32: (link, variant, workers, INA/gloo at every size)
TARGETS = [
    ("1gbit@1500", "ina", 4, 1.3),
    ("1gbit@1500", "ina", 8, 1.5),
    ("1gbit@9000", "ina", 4, 1.3),
    ("1gbit@9000", "ina", 8, 1.5),
    ("100mbit", "ina-int8", 8, 2.5),
]


@dataclass
class Cell:
    """One variant at one (link, workers, size): what was measured."""

    link: str
    workers: int
    size_MiB: float
    variant: str
    times_s: list[float]
    median_s: float
    algbw_MBps: float
    # bytes per all-reduce on each link, as multiples of the tensor: worker links (mean) and
    # the parameter node's link (INA only); up = host -> switch
    worker_link_up: float
    worker_link_down: float
    ps_link_up: float | None
    ps_link_down: float | None
    # CPU-seconds per all-reduce: one worker (mean over workers), forwarding node, parameter node
    cpu_worker_s: float
    cpu_switch_s: float | None
    cpu_ps_s: float | None
    retransmits: float | None  # INA: slices sent again per all-reduce, all workers
    ratio_vs_gloo: float | None = None
    line_rate: float | None = None  # algbw / the link's rate in bytes/s (a worker's tensor in and out)
    # the kernel's part of those CPU-seconds (system / (user + system)): workers (all together),
    # forwarding node; where the time goes when the CPU decides
    kernel_share_worker: float | None = None
    kernel_share_switch: float | None = None
    # how far apart the ranks started a repetition (the last rank's start less the first's,
    # median over repetitions): the slowest rank's time holds it, since no collective ends
    # before its last rank's data is in (issue #32: ~5-6 ms of a 4 MiB INA all-reduce at 8
    # workers, 1 Gbit/s, MTU 1500, the workers' first windows queueing for the 2 cores)
    start_spread_s: float | None = None


@dataclass
class Sync:
    """The barriers the parent and the ranks share: ``start`` brackets each size's timed
    repetitions (the parent reads counters there), ``inner`` lines the ranks up per repetition."""

    start: Any
    inner: Any
    out: Any
    wait_s: float


# ---- processes on testbed hosts ------------------------------------------------------------
def _on_host(namespace: str) -> None:
    from trainmaster.agent.netns import enter

    enter(namespace)


def _timed_loop(
    rank: int,
    sizes: list[int],
    reps: int,
    sync: Sync,
    allreduce: Any,
    retransmits: Any = lambda: 0,
    warm_full: bool = False,
) -> None:
    """One warm-up, then ``reps`` timed all-reduces per size, each rank reporting its times
    (and, for INA, how many slices it had to send again during them). ``warm_full``: warm up
    with the tensor itself (low-bit aggregation: its first all-reduce sets the shared scale)."""
    import numpy as np

    for size in sizes:
        x = np.random.default_rng(rank).standard_normal(size // 4).astype(np.float32)
        # warm-up: connections, buffers, the round-trip estimate; 4 MiB is enough for that
        # and a 64 MiB warm-up would cost a quarter of the sweep on a 100 Mbit/s link
        allreduce(x if warm_full else x[: WARM_UP // 4].copy())
        sync.start.wait(timeout=sync.wait_s)  # ready: the parent reads counters and CPU now
        sync.start.wait(timeout=sync.wait_s)  # read: go
        resent = retransmits()
        for _ in range(reps):
            sync.inner.wait(timeout=sync.wait_s)
            t0 = time.monotonic()  # one clock for every process of the machine
            allreduce(x)
            sync.out.put((rank, time.monotonic() - t0, t0))
        sync.out.put((rank, retransmits() - resent, None))
        sync.start.wait(timeout=sync.wait_s)  # done: the parent reads counters and CPU now
        sync.start.wait(timeout=sync.wait_s)  # read: go on (or exit)


def _ina_worker(
    namespace: str,
    address: str,
    switch: tuple[str, int],
    rank: int,
    world: int,
    sizes: list[int],
    reps: int,
    sync: Sync,
    per_worker_window: int,
    min_rto: float = MIN_RTO,
    precision: str = "int32",
    chunk: int = CHUNK,
) -> None:
    _on_host(namespace)
    import numpy as np

    from trainmaster.aggregation import AggregationClient, WorkerConfig
    from trainmaster.aggregation.worker import quantizer_for

    cfg = WorkerConfig(
        chunk=chunk,
        window=per_worker_window,
        min_retransmit_timeout=min_rto,
        max_retransmit_timeout=MAX_RTO,
        failover_after=FAILOVER_AFTER,
        timeout=max(60.0, sync.wait_s / 4),
        quantizer=quantizer_for(precision),
    )
    client = AggregationClient(switch, 1, rank, world, cfg, host=address)
    client.join()
    buffers: dict[int, Any] = {}

    def allreduce(x: Any) -> None:
        out = buffers.setdefault(x.size, np.empty_like(x))  # like gloo's in-place result
        client.allreduce(x, out=out, key=x.size)

    def retransmits() -> int:
        stats = client.stats()
        return int(stats.get("retransmits", 0)) + int(stats.get("gap_retransmits", 0))

    try:
        _timed_loop(rank, sizes, reps, sync, allreduce, retransmits, warm_full=precision != "int32")
    finally:
        client.close()


def _gloo_worker(namespace: str, master: str, rank: int, world: int, sizes: list[int], reps: int, sync: Sync) -> None:
    _on_host(namespace)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(GLOO_PORT), GLOO_SOCKET_IFNAME="eth0")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=sync.wait_s))

    tensors: dict[int, Any] = {}

    def allreduce(x: Any) -> None:
        # in place on one tensor per size, made before the timing starts (the growing sums
        # do not change gloo's work)
        dist.all_reduce(tensors.setdefault(x.size, torch.from_numpy(x.copy())))

    try:
        _timed_loop(rank, sizes, reps, sync, allreduce)
    finally:
        dist.destroy_process_group()


def _parameter_node(namespace: str, address: str, boost: int = 0) -> None:
    _on_host(namespace)
    os.nice(-boost)  # see NODE_BOOST
    from trainmaster.aggregation import ParameterNode

    ParameterNode(address, PS_PORT, dead_after=30.0).serve()


def _forwarding_node(namespace: str, address: str, parent: tuple[str, int], boost: int = 0) -> None:
    _on_host(namespace)
    os.nice(-boost)  # see NODE_BOOST
    from trainmaster.aggregation import ForwardingNode

    ForwardingNode(parent, slots=1024, name="switch", host=address, port=SWITCH_PORT).serve()


# ---- one variant on one testbed ------------------------------------------------------------
@dataclass
class Nodes:
    """The processes of one variant, by role, so CPU is reported per node."""

    workers: list[Any] = field(default_factory=list)
    switch: Any = None
    ps: Any = None

    def all(self) -> list[Any]:
        return [*self.workers, *[p for p in (self.switch, self.ps) if p is not None]]


def _cpu(proc: Any) -> float:
    return sum(_cpu_split(proc))


def _cpu_split(proc: Any) -> tuple[float, float]:
    """User and system CPU-seconds of a process and its waited-for children so far."""
    try:
        t = psutil.Process(proc.pid).cpu_times()
        return t.user + t.children_user, t.system + t.children_system
    except psutil.Error:
        return 0.0, 0.0


def _kernel_share(
    after: dict[int, tuple[float, float]], before: dict[int, tuple[float, float]], pids: list[int]
) -> float | None:
    user = sum(after[p][0] - before[p][0] for p in pids)
    system = sum(after[p][1] - before[p][1] for p in pids)
    return system / (user + system) if user + system > 0 else None


def run_variant(
    bed: Any,
    link: str,
    variant: str,
    world: int,
    sizes: list[int],
    reps: int,
    wait_s: float,
    in_flight: int = IN_FLIGHT,
    min_rto: float = MIN_RTO,
    chunk: int = CHUNK,
    node_boost: int = NODE_BOOST,
) -> list[Cell]:
    """Start ``variant`` with ``world`` workers on ``bed``, time every size, stop it."""
    from trainmaster.testbed import SWITCH

    ctx = mp.get_context("fork")
    sync = Sync(ctx.Barrier(world + 1), ctx.Barrier(world), ctx.Queue(), wait_s)
    hosts = bed.host_names[:world]
    ps_host = bed.host_names[-1]
    nodes = Nodes()
    ina = variant in PRECISION
    if ina:
        ps_addr, sw_addr = bed.address(ps_host), bed.address(SWITCH)
        nodes.ps = ctx.Process(target=_parameter_node, args=(bed.namespace(ps_host), ps_addr, node_boost))
        nodes.switch = ctx.Process(
            target=_forwarding_node, args=(bed.namespace(SWITCH), sw_addr, (ps_addr, PS_PORT), node_boost)
        )
        nodes.workers = [
            ctx.Process(
                target=_ina_worker,
                args=(
                    bed.namespace(h),
                    bed.address(h),
                    (sw_addr, SWITCH_PORT),
                    rank,
                    world,
                    sizes,
                    reps,
                    sync,
                    window(world, bed.options.link_rate, bed.options.queue_ms, in_flight, chunk),
                    min_rto,
                    PRECISION[variant],
                    chunk,
                ),
            )
            for rank, h in enumerate(hosts)
        ]
    else:
        nodes.workers = [
            ctx.Process(
                target=_gloo_worker, args=(bed.namespace(h), bed.address(hosts[0]), rank, world, sizes, reps, sync)
            )
            for rank, h in enumerate(hosts)
        ]
    for proc in nodes.all():
        proc.daemon = True
        proc.start()
    cells = []
    try:
        for size in sizes:
            sync.start.wait(timeout=wait_s)
            split0 = {p.pid: _cpu_split(p) for p in nodes.all()}
            cpu0 = {pid: sum(t) for pid, t in split0.items()}
            bytes0 = bed.counters()
            sync.start.wait(timeout=wait_s)
            by_rank: dict[int, list[float]] = {r: [] for r in range(world)}
            starts: dict[int, list[float]] = {r: [] for r in range(world)}
            resent = 0
            for _ in range((reps + 1) * world):
                rank, value, started = sync.out.get(timeout=wait_s)
                if started is not None:
                    by_rank[rank].append(value)
                    starts[rank].append(started)
                else:
                    resent += value
            sync.start.wait(timeout=wait_s)
            split1 = {p.pid: _cpu_split(p) for p in nodes.all()}
            cpu = {pid: (sum(t) - cpu0[pid]) / reps for pid, t in split1.items()}
            bytes1 = bed.counters()
            sync.start.wait(timeout=wait_s)
            per_rep = [max(by_rank[r][i] for r in range(world)) for i in range(reps)]
            med = statistics.median(per_rep)
            spread = statistics.median(
                max(starts[r][i] for r in range(world)) - min(starts[r][i] for r in range(world)) for i in range(reps)
            )

            def moved(host: str, direction: str) -> float:
                delta = getattr(bytes1[host], direction) - getattr(bytes0[host], direction)
                return delta / reps / size

            cells.append(
                Cell(
                    link=link,
                    workers=world,
                    size_MiB=size / MiB,
                    variant=variant,
                    times_s=per_rep,
                    median_s=med,
                    algbw_MBps=size / med / 1e6,
                    worker_link_up=statistics.mean(moved(h, "up_bytes") for h in hosts),
                    worker_link_down=statistics.mean(moved(h, "down_bytes") for h in hosts),
                    ps_link_up=moved(ps_host, "up_bytes") if ina else None,
                    ps_link_down=moved(ps_host, "down_bytes") if ina else None,
                    cpu_worker_s=statistics.mean(cpu[p.pid] for p in nodes.workers),
                    cpu_switch_s=cpu[nodes.switch.pid] if nodes.switch else None,
                    cpu_ps_s=cpu[nodes.ps.pid] if nodes.ps else None,
                    retransmits=resent / reps if ina else None,
                    line_rate=(size / med) / (bed.options.link_rate / 8) if bed.options.link_rate else None,
                    kernel_share_worker=_kernel_share(split1, split0, [p.pid for p in nodes.workers]),
                    kernel_share_switch=_kernel_share(split1, split0, [nodes.switch.pid]) if nodes.switch else None,
                    start_spread_s=spread,
                )
            )
    finally:
        for proc in nodes.workers:
            proc.join(timeout=30)
        for proc in nodes.all():
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return cells


# ---- the sweep -----------------------------------------------------------------------------
def link_spec(link: str, mtu: int = MTU) -> tuple[int | None, int]:
    """``"1gbit"`` -> (rate, ``mtu``); ``"1gbit@9000"`` -> (rate, 9000)."""
    from trainmaster.testbed import parse_rate

    rate, _, own = link.partition("@")
    return parse_rate(rate), int(own) if own else mtu


def sweep(
    links: list[str],
    workers: list[int],
    sizes: list[int],
    reps: int,
    failures: list[str],
    in_flight: int = 0,
    variants: tuple[str, ...] = VARIANTS,
    mtu: int = MTU,
    min_rto: float = MIN_RTO,
    save: Any = None,
    sends: int = 0,
    node_boost: int = NODE_BOOST,
) -> list[Cell]:
    """Every (link, workers) on a testbed per link; ``save(cells)`` after each link, so a run
    stopped later (a timeout, a loaded machine) keeps what it measured."""
    from trainmaster.testbed import Testbed, TestbedOptions

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns of unnamed hosts
    import torch.distributed  # noqa: F401  imported once here, not in every forked rank

    cells: list[Cell] = []
    for link in links:
        rate, link_mtu = link_spec(link, mtu)
        link_sends = sends_for(sends)
        chunk = chunk_for(link_mtu, link_sends)
        link_in_flight = in_flight_for(link_sends, in_flight)
        options = TestbedOptions(hosts=max(workers) + 1, link_rate=rate, prefix=PREFIX, mtu=link_mtu)
        bed = Testbed.up(options)
        try:
            for i, world in enumerate(workers):
                # the longest a step may take: the slowest cell's repetitions at a quarter of
                # the link's rate, plus start-up; a wait past it is a hang, reported as such
                slowest = 2 * max(sizes) * 8 / (rate or 1e9) * 4
                wait_s = 120 + slowest * (reps + 1)
                order = variants if i % 2 == 0 else variants[::-1]  # load falls on both alike
                got: dict[str, list[Cell]] = {}
                for variant in order:
                    try:
                        got[variant] = run_variant(
                            bed, link, variant, world, sizes, reps, wait_s, link_in_flight, min_rto, chunk, node_boost
                        )
                    except Exception as exc:  # a variant that fails is reported, not hidden
                        failures.append(f"{link} {world} workers {variant}: {type(exc).__name__}: {exc}")
                        print(failures[-1], flush=True)
                gloo = {c.size_MiB: c for c in got.get("gloo", [])}
                for variant in VARIANTS:
                    for c in got.get(variant, []):
                        if c.size_MiB in gloo:
                            c.ratio_vs_gloo = c.algbw_MBps / gloo[c.size_MiB].algbw_MBps
                        cells.append(c)
                        print(
                            f"{link:>8} {world}w {c.size_MiB:>4.0f} MiB {variant:>4}: "
                            f"{c.algbw_MBps:7.1f} MB/s  ratio "
                            f"{c.ratio_vs_gloo or 0:.2f}  link up/down "
                            f"{c.worker_link_up:.2f}/{c.worker_link_down:.2f} x tensor"
                            + (f", {c.retransmits:.0f} resent" if c.retransmits is not None else ""),
                            flush=True,
                        )
        finally:
            bed.down()
        if save is not None:
            save(cells)
    return cells


def target_status(cells: list[Cell]) -> list[dict[str, Any]]:
    """The issue's targets (``TARGETS``): INA/gloo algbw of a variant at every size."""
    status = []
    for link, variant, world, goal in TARGETS:
        ratios = {
            c.size_MiB: c.ratio_vs_gloo
            for c in cells
            if c.variant == variant and c.link == link and c.workers == world and c.ratio_vs_gloo is not None
        }
        status.append(
            {
                "link": link,
                "variant": variant,
                "workers": world,
                "target": goal,
                "ratios": {f"{s:g} MiB": round(r, 3) for s, r in sorted(ratios.items())},
                "measured": bool(ratios),
                "met_at_every_size": bool(ratios) and min(ratios.values()) >= goal,
            }
        )
    return status


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def write_markdown(report: dict[str, Any], cells: list[Cell], plotted: bool = True) -> str:
    load = report["load_average"]
    lines = [
        f"INA vs gloo's ring all-reduce on a testbed (hosts = network namespaces, every link "
        f"capped in both directions with tc tbf, MTU {report['mtu']} unless the link says "
        f"otherwise, e.g. 1gbit@1500), one invocation of "
        f"`bench/aggregation.py`: workers on h1..hn, INA's forwarding node on the switch host and "
        f"parameter node on its own host, UDP, slices of "
        f"{', '.join(f'{v} elements at {k}' for k, v in report['chunk'].items())} ("
        f"{', '.join(f'{v} at {k}' for k, v in report['sends_per_slice'].items())} GSO sends each: cut into "
        f"datagrams of the link's MTU), "
        f"{', '.join(f'{v} at {k}' for k, v in report['in_flight'].items())} x 64 KiB in flight "
        f"over all workers; gloo one process per worker host. {report['machine']['cpus']} CPUs "
        f"shared with other jobs (1-minute load average {load['start']:.2f} at start, "
        f"{load['end']:.2f} at end; {describe(report.get('priority'))}: "
        f"bench/priority.py; INA's forwarding and parameter nodes {report.get('node_boost', 0)} nice "
        f"steps above that, as the network they stand for): every process of every variant shares "
        f"them, so at 1 Gbit/s the CPU, not only the link, decides. algbw = tensor bytes / time of the slowest rank, "
        f"median of {report['reps']} runs after a warm-up. x gloo: algbw / gloo's; line: algbw / "
        f"the link's rate. Bytes per link per all-reduce as multiples of the tensor, worker link "
        f"up/down (mean over workers; the ring's is 2(n-1)/n each way), INA's parameter-node "
        f"link up/down. CPU-s per all-reduce: one worker (mean) / forwarding node / parameter "
        f"node. Start spread ms: how far apart the ranks started a repetition (median; INA/gloo), "
        f"which the slowest rank's time includes. int8/int16: low-bit aggregation (slices go up as int8/int16 with a shared "
        f"scale; int16 sums come down as int16, int8 ones re-quantised to int8 by the parameter "
        f"node, the job default).",
        "",
        "Targets (issue #32): "
        + "; ".join(
            f"{t['variant']} {t['link']} {t['workers']} workers >= {t['target']}x gloo: "
            + (
                "not measured"
                if not t["measured"]
                else ("met" if t["met_at_every_size"] else "NOT met")
                + " ("
                + ", ".join(f"{k} {v:.2f}x" for k, v in t["ratios"].items())
                + ")"
            )
            for t in report["targets"]
        )
        + ".",
        "",
        "| link | workers | size | variant | MB/s | gloo MB/s | x gloo | line | bytes/link up/down "
        "| gloo bytes/link | PS link up/down | CPU-s w/sw/ps | gloo CPU-s w | resent | start spread ms |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(c.link, c.workers, c.size_MiB, c.variant): c for c in cells}
    order = [v for v in VARIANTS if v != "gloo"]
    for link, world, size in sorted(
        {(c.link, c.workers, c.size_MiB) for c in cells}, key=lambda k: (report["links"].index(k[0]), k[1], k[2])
    ):
        gloo = by.get((link, world, size, "gloo"))
        for variant in order:
            ina = by.get((link, world, size, variant))
            if ina is None:
                continue
            lines.append(
                f"| {link} | {world} | {size:g} MiB | {variant} | {ina.algbw_MBps:.1f} | "
                f"{_fmt(gloo.algbw_MBps if gloo else None, 1)} | {_fmt(ina.ratio_vs_gloo)} | {_fmt(ina.line_rate)} | "
                f"{ina.worker_link_up:.2f}/{ina.worker_link_down:.2f} | "
                + (f"{gloo.worker_link_up:.2f}/{gloo.worker_link_down:.2f} | " if gloo else "- | ")
                + f"{_fmt(ina.ps_link_up)}/{_fmt(ina.ps_link_down)} | "
                + f"{ina.cpu_worker_s:.2f}/{_fmt(ina.cpu_switch_s)}/{_fmt(ina.cpu_ps_s)} | "
                + (f"{gloo.cpu_worker_s:.2f} | " if gloo else "- | ")
                + f"{_fmt(ina.retransmits, 0)} | "
                + f"{_ms(ina.start_spread_s)}/{_ms(gloo.start_spread_s if gloo else None)} |"
            )
    if report["failures"]:
        lines += ["", "Failures: " + "; ".join(report["failures"])]
    if not report.get("complete", True):
        lines += ["", "Partial: saved after the last link measured; the sweep did not finish."]
    if plotted:  # beside this file, whichever --output it went to
        lines += ["", "![algbw vs message size per worker count](aggregation.png)"]
    return "\n".join(lines) + "\n"


def plot(cells: list[Cell], links: list[str], workers: list[int], path: Path) -> bool:
    """algbw vs message size, one panel per (link, worker count), INA and gloo as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install 'trainmaster[bench]'): no plot", flush=True)
        return False
    fig, axes = plt.subplots(len(links), len(workers), squeeze=False, figsize=(3.6 * len(workers), 2.8 * len(links)))
    for i, link in enumerate(links):
        for j, world in enumerate(workers):
            ax = axes[i][j]
            for variant, style in (("ina", "o-"), ("ina-int16", "v-"), ("ina-int8", "^-"), ("gloo", "s--")):
                pts = sorted(
                    (c.size_MiB, c.algbw_MBps)
                    for c in cells
                    if c.link == link and c.workers == world and c.variant == variant
                )
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=variant)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{link}, {world} workers", fontsize=9)
            ax.set_xlabel("tensor MiB", fontsize=8)
            ax.set_ylabel("algbw MB/s", fontsize=8)
            ax.set_ylim(bottom=0)
            if handles := ax.get_legend_handles_labels()[0]:  # a partial save has empty panels
                ax.legend(handles=handles, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="development: 100mbit and 1gbit, 2 and 4 workers, 4 MiB, 2 reps"
    )
    parser.add_argument(
        "--links",
        default="100mbit,1gbit@1500,1gbit@9000",
        help="comma-separated link caps (tc units; none = uncapped), each optionally @MTU",
    )
    parser.add_argument("--mtu", type=int, default=MTU, help="MTU of links that do not name one")
    parser.add_argument("--workers", default="4,8", help="comma-separated worker counts")
    parser.add_argument("--sizes", default="4,16,64", help="comma-separated tensor sizes, MiB")
    parser.add_argument("--reps", type=int, default=3, help="timed all-reduces per cell")
    parser.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help=f"INA bytes in flight over all workers, in 64 KiB units (each worker's share is also bounded by "
        f"its link's queue); default max({IN_FLIGHT}, 32 x sends per slice)",
    )
    parser.add_argument(
        "--sends-per-slice",
        type=int,
        default=0,
        help=f"INA slice size, in GSO sends of 64 KiB at the link's MTU (1-16: at most 1 MiB per slice); default "
        f"{SENDS_PER_SLICE}",
    )
    parser.add_argument(
        "--min-rto", type=float, default=MIN_RTO, help="INA workers' floor of the retransmission timeout, seconds"
    )
    parser.add_argument(
        "--node-boost",
        type=int,
        default=NODE_BOOST,
        help=f"nice steps INA's forwarding and parameter nodes run above the workers (0-19; 0: the same "
        f"priority); default {NODE_BOOST}",
    )
    parser.add_argument(
        "--variants", default="ina,ina-int8,gloo", help="comma-separated subset of " + ", ".join(VARIANTS)
    )
    parser.add_argument(
        "--autogroup-nice",
        type=int,
        default=DEFAULT_NICE,
        help="nice value of the session the run moves into (bench/priority.py: with autogroups, a task's own nice "
        "only ranks it inside its session)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=RESULTS,
        help="directory for aggregation.{json,md,png} (a subset run should not replace the committed full run)",
    )
    args = parser.parse_args()
    if args.quick:
        args.links, args.workers, args.sizes, args.reps = "100mbit,1gbit", "2,4", "4", 2
    if os.geteuid() != 0:
        print(
            "error: this benchmark builds a testbed (network namespaces, tc), which needs root; run it as root",
            file=sys.stderr,
        )
        sys.exit(2)
    from trainmaster.errors import UserError
    from trainmaster.testbed import TestbedOptions

    links = [s.strip() for s in args.links.split(",") if s.strip()]
    workers = sorted(int(w) for w in args.workers.split(","))
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]
    if args.reps < 1 or min(workers) < 2 or max(workers) > 64 or min(sizes) < 1:
        parser.error("need --reps >= 1, workers between 2 and 64, sizes above 0")
    # a SIGTERM (timeout, Ctrl-C's cousin) unwinds through the finally blocks: the ranks are
    # stopped and the testbed removed
    priority = own_session(args.autogroup_nice)  # first: every process below inherits it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    failures: list[str] = []
    started, load_start = time.time(), os.getloadavg()
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if not variants or 0 < args.in_flight < 4:
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}; --in-flight >= 4")
    try:
        for link in links:
            link_spec(link, args.mtu)
        TestbedOptions(mtu=args.mtu)
    except (ValueError, UserError) as exc:
        parser.error(f"--links/--mtu: {exc}")
    if not 0 <= args.sends_per_slice <= 16:
        parser.error("--sends-per-slice must be between 1 and 16 (a slice is at most 1 MiB)")
    if not 0 <= args.node_boost <= 19:
        parser.error("--node-boost must be between 0 and 19 nice steps")
    if not 0.01 <= args.min_rto <= 5:
        parser.error("--min-rto must be between 0.01 and 5 seconds")

    sends = {link: sends_for(args.sends_per_slice) for link in links}

    def save(cells: list[Cell], final: bool = False) -> str:
        report: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            # 1-minute load average (the figures need a quiet machine), and all three as uptime says
            "load_average": {
                "start": load_start[0],
                "end": os.getloadavg()[0],
                "uptime_start": list(load_start),
                "uptime_end": list(os.getloadavg()),
            },
            "priority": priority,  # the run's session and nice values (bench/priority.py)
            "complete": final,  # False: saved after a link, the sweep went on (or was stopped)
            "links": links,
            "workers": workers,
            "sizes_MiB": [s / MiB for s in sizes],
            "reps": args.reps,
            "quick": args.quick,
            "seconds": round(time.time() - started),
            "chunk": {link: chunk_for(link_spec(link, args.mtu)[1], sends[link]) for link in links},
            "sends_per_slice": sends,
            "mtu": args.mtu,
            "in_flight": {link: in_flight_for(sends[link], args.in_flight) for link in links},
            "variants": list(variants),
            "window_per_worker": {
                link: {
                    w: window(
                        w,
                        link_spec(link)[0],
                        TestbedOptions().queue_ms,
                        in_flight_for(sends[link], args.in_flight),
                        chunk_for(link_spec(link, args.mtu)[1], sends[link]),
                    )
                    for w in workers
                }
                for link in links
            },
            "min_rto_s": args.min_rto,
            "node_boost": args.node_boost,
            "failures": failures,
            "cells": [asdict(c) for c in cells],
        }
        report["targets"] = target_status(cells)
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "aggregation.json").write_text(json.dumps(report, indent=1))
        plotted = plot(cells, links, workers, args.output / "aggregation.png")
        md = write_markdown(report, cells, plotted)
        (args.output / "aggregation.md").write_text(md)
        return md

    cells = sweep(
        links,
        workers,
        sizes,
        args.reps,
        failures,
        args.in_flight,
        variants,
        args.mtu,
        args.min_rto,
        save=save,
        sends=args.sends_per_slice,
        node_boost=args.node_boost,
    )
    print(save(cells, final=True))


if __name__ == "__main__":
    main()
