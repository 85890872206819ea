"""Benchmark: several jobs sharing one forwarding node, its slots shared dynamically (the spec's
multi-tenant slots) against a static split of the same slots, on a testbed of real hosts.

Layout: three jobs of ``--workers`` workers each, every worker on its own testbed host, the
forwarding node and the parameter node on the switch host (a top-of-rack aggregator with its
server), every link capped (``tc tbf``, 100 Mbit/s by default, MTU 9000). Each job runs a
training-like loop for ``--seconds``: a compute phase (a sleep drawn from the job's own seeded
generator, uniform in 0.5-1.5x ``--compute``: what an accelerator would spend on a step; the
CPU is left to the network processes) and an all-reduce of ``--mib`` MiB. The jobs start
``--stagger`` seconds apart, so they overlap as independent jobs do.

The forwarding node's pool holds ``--slots`` slots, sized to about one job's bandwidth-delay
product (SwitchML's sizing: what one job needs in flight to fill its links). ``shared``: every
job's slices may use every slot (resource id mod pool; a slot held by another job is a
conflict, that slice is aggregated by the parameter node); ``static``: the pool is split into
three equal parts, one per job, and each job's window is its part. Reported: all-reduces
completed per second and MiB reduced per second, per job and in total, over the measured window
(after ``--warm-up`` seconds), for each mode, medians of ``--runs`` runs that alternate the
modes, and the ratio shared / static. Writes bench/results/aggregation_tenants.{json,md,png}.
Needs root (it builds a testbed); everything it creates is removed at the end, even on failure.

    .venv/bin/python bench/aggregation_tenants.py
    .venv/bin/python bench/aggregation_tenants.py --runs 1 --seconds 20 --output /tmp/tenants
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as a script

from priority import DEFAULT_NICE, describe, own_session  # noqa: E402  (bench/priority.py, beside this script)

MiB = 1 << 20
JOBS = 3
PREFIX = "tmaggten"
PS_PORT, SWITCH_PORT = 19100, 19101
RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("shared", "static")
# A slice's round trip, emulated by the nodes themselves (``FaultPlan.latency_s``): on the
# testbed's sub-millisecond links one slice in flight fills a 100 Mbit/s link, so no pool of
# slots ever limits a job and shared and static slots cannot differ. With 40 ms, one job's
# bandwidth-delay product is 500 KB, 8 slices: the pool then matters as on a switch whose
# slots hold about one job's worth (SwitchML's sizing), the same ratio as 100 Gbit/s x 40 us.
RTT_MS = 40.0
CHUNK = 15_664  # float32 per slice: one GSO send at MTU 9000 (bench/aggregation.py chunk_for)


@dataclass
class JobResult:
    job: int
    allreduces: int  # completed inside the measured window
    per_second: float
    MiB_per_second: float
    mean_allreduce_s: float


@dataclass
class Run:
    mode: str
    run: int
    jobs: list[JobResult]
    total_per_second: float
    total_MiB_per_second: float
    collisions: int
    conflicts_aggregated: int
    slots: int


def _on_host(namespace: str) -> None:
    from trainmaster.agent.netns import enter

    enter(namespace)


def _link(args: dict[str, Any]) -> Any:
    """Every node's sends wait a quarter of ``--rtt-ms``: a slice's round trip (worker ->
    forwarding node -> parameter node and back) crosses four such one-way latencies."""
    from trainmaster.aggregation.transport import FaultPlan

    return FaultPlan(latency_s=args["rtt_ms"] / 4000) if args["rtt_ms"] else None


def _parameter_node(namespace: str, address: str, args: dict[str, Any]) -> None:
    _on_host(namespace)
    from trainmaster.aggregation import ParameterNode

    ParameterNode(address, PS_PORT, faults=_link(args), dead_after=30.0).serve()


def _forwarding_node(namespace: str, address: str, slots: int, partitions: int, args: dict[str, Any]) -> None:
    _on_host(namespace)
    from trainmaster.aggregation import ForwardingNode

    ForwardingNode(
        (address, PS_PORT), slots=slots, host=address, port=SWITCH_PORT, partitions=partitions, faults=_link(args)
    ).serve()


def _worker(
    namespace: str,
    address: str,
    switch: tuple[str, int],
    job: int,
    rank: int,
    world: int,
    args: dict[str, Any],
    start: Any,
    out: Any,
) -> None:
    """One worker of one job: compute (a seeded sleep), all-reduce, until the run ends; rank
    0 reports when each all-reduce ended."""
    _on_host(namespace)
    import random

    import numpy as np

    from trainmaster.aggregation import AggregationClient, WorkerConfig

    # a loaded machine stalls for seconds: timers that do not take that for loss or death
    cfg = WorkerConfig(
        chunk=CHUNK, min_retransmit_timeout=0.3, max_retransmit_timeout=4.0, failover_after=10.0, timeout=60.0
    )
    client = AggregationClient(switch, job, rank, world, cfg, faults=_link(args), host=address)
    client.join()
    x = np.random.default_rng([job, rank]).standard_normal(int(args["mib"] * MiB) // 4).astype(np.float32)
    y = np.empty_like(x)
    rng = random.Random(f"{args['seed']}|{job}")  # the same draws at every rank of the job
    t0 = start.get()  # the common clock: every job starts at t0 + its stagger
    time.sleep(max(0.0, t0 + (job - 1) * args["stagger"] - time.time()))
    ends: list[tuple[float, float]] = []
    try:
        while time.time() < t0 + args["warm_up"] + args["seconds"]:
            time.sleep(args["compute"] * rng.uniform(0.5, 1.5))
            began = time.time()
            client.allreduce(x, out=y)
            ends.append((began, time.time()))
    finally:
        client.close()
        if rank == 0:
            out.put((job, ends))


def _query(namespace: str, addresses: list[tuple[str, int]], out: Any) -> None:
    """The nodes' counters, asked from their host (the testbed has no route from outside)."""
    _on_host(namespace)
    from trainmaster.aggregation.fabric import query

    out.put([query(a, attempts=3) or {} for a in addresses])


def run_mode(bed: Any, mode: str, run: int, args: dict[str, Any], jobs_active: int = JOBS) -> Run:
    """Run the jobs (the first ``jobs_active`` of them) on a fresh pair of nodes in ``mode``."""
    from trainmaster.testbed import SWITCH

    ctx = mp.get_context("fork")
    sw_ns, sw_addr = bed.namespace(SWITCH), bed.address(SWITCH)
    partitions = JOBS if mode == "static" else 0
    nodes = [
        ctx.Process(target=_parameter_node, args=(sw_ns, sw_addr, args), daemon=True),
        ctx.Process(target=_forwarding_node, args=(sw_ns, sw_addr, args["slots"], partitions, args), daemon=True),
    ]
    for p in nodes:
        p.start()
    start, out = ctx.Queue(), ctx.Queue()
    workers = []
    for job in range(1, jobs_active + 1):
        for rank in range(args["workers"]):
            host = bed.host_names[(job - 1) * args["workers"] + rank]
            workers.append(
                ctx.Process(
                    target=_worker,
                    args=(
                        bed.namespace(host),
                        bed.address(host),
                        (sw_addr, SWITCH_PORT),
                        job,
                        rank,
                        args["workers"],
                        args,
                        start,
                        out,
                    ),
                    daemon=True,
                )
            )
    for p in workers:
        p.start()
    t0 = time.time() + 3.0  # time for every worker to join
    for _ in workers:
        start.put(t0)
    ends: dict[int, list[tuple[float, float]]] = {}
    stats: dict[str, Any] = {}
    ps: dict[str, Any] = {}
    try:
        deadline = t0 + args["warm_up"] + args["seconds"] + 120
        while len(ends) < jobs_active:
            job, times = out.get(timeout=max(1.0, deadline - time.time()))
            ends[job] = times
        asker = ctx.Process(target=_query, args=(sw_ns, [(sw_addr, SWITCH_PORT), (sw_addr, PS_PORT)], out))
        asker.start()
        stats, ps = out.get(timeout=30)
        asker.join(timeout=10)
    finally:
        for p in workers:
            p.join(timeout=30)
        for p in [*workers, *nodes]:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
    window = (t0 + args["warm_up"], t0 + args["warm_up"] + args["seconds"])
    jobs = []
    for job in range(1, jobs_active + 1):
        inside = [(b, e) for b, e in ends[job] if window[0] <= e <= window[1]]
        jobs.append(
            JobResult(
                job,
                len(inside),
                len(inside) / args["seconds"],
                len(inside) * args["mib"] / args["seconds"],
                statistics.mean(e - b for b, e in inside) if inside else float("nan"),
            )
        )
    return Run(
        mode,
        run,
        jobs,
        sum(j.per_second for j in jobs),
        sum(j.MiB_per_second for j in jobs),
        int(stats.get("collisions", 0)),
        int(ps.get("conflicts_aggregated", 0)),
        args["slots"],
    )


def write_markdown(report: dict[str, Any]) -> str:
    load = report["load_average"]
    a = report["args"]
    lines = [
        f"Three jobs of {a['workers']} workers sharing one forwarding node of {a['slots']} slots "
        f"(testbed: every worker on its own host, links {a['link']} at MTU {a['mtu']}, the "
        f"forwarding and parameter nodes on the switch host; a slice's round trip emulated at "
        f"{a.get('rtt_ms', 0)} ms by the nodes, a quarter per hop). Each job: compute (a seeded sleep, "
        f"0.5-1.5 x {a['compute']} s) then an all-reduce of {a['mib']} MiB, for {a['seconds']} s "
        f"after {a['warm_up']} s of warm-up, jobs started {a['stagger']} s apart. shared: every "
        f"slot open to every job (the spec's multi-tenant slots); static: the same slots split "
        f"into three equal parts, one per job. {report['machine']['cpus']} CPUs shared with other "
        f"jobs (1-minute load average {load['start']:.2f} at start, {load['end']:.2f} at end; the run "
        f"{describe(report.get('priority'))}, bench/priority.py). "
        f"Medians of {a['runs']} runs per mode (alternating).",
        "",
        f"**Total throughput, shared / static: {report['ratio']:.2f}x** "
        f"(all-reduces per second: shared {report['median']['shared']:.3f}, static "
        f"{report['median']['static']:.3f}); target (issue #32) >= 1.35x: "
        + ("met." if report["ratio"] >= 1.35 else "NOT met."),
        "",
        "| mode | run | job 1 /s | job 2 /s | job 3 /s | total /s | total MiB/s | mean all-reduce s (jobs) "
        "| collisions | conflicts at ps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        per = [j["per_second"] for j in r["jobs"]]
        means = "/".join(f"{j['mean_allreduce_s']:.2f}" for j in r["jobs"])
        lines.append(
            f"| {r['mode']} | {r['run']} | {per[0]:.3f} | {per[1]:.3f} | {per[2]:.3f} | "
            f"{r['total_per_second']:.3f} | {r['total_MiB_per_second']:.1f} | {means} | "
            f"{r['collisions']} | {r['conflicts_aggregated']} |"
        )
    if report["calibration"]:
        lines += [
            "",
            "One job alone, all-reduces back to back, by pool size (how many slots one job needs): "
            + ", ".join(f"{c['slots']} slots {c['allreduces_per_second']:.3f}/s" for c in report["calibration"])
            + ".",
        ]
    lines += ["", "![throughput per mode](/bench/results/aggregation_tenants.png)"]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install 'trainmaster[bench]'): no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for i, mode in enumerate(MODES):
        runs = [r for r in report["runs"] if r["mode"] == mode]
        for job in range(JOBS):
            vals = [r["jobs"][job]["per_second"] for r in runs]
            ax.bar(
                i * (JOBS + 1) + job, statistics.median(vals), color=f"C{job}", label=f"job {job + 1}" if i else None
            )
    ax.set_xticks([1, JOBS + 2], [f"{m}\n{report['median'][m]:.3f} /s in total" for m in MODES])
    ax.set_ylabel("all-reduces per second")
    ax.set_title(f"3 jobs on one forwarding node: {report['ratio']:.2f}x", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="workers per job (3 jobs)")
    parser.add_argument(
        "--slots",
        type=int,
        default=9,
        help="the forwarding node's pool (static: a third each); 9: about one job's bandwidth-delay product at --rtt-ms 40",
    )
    parser.add_argument("--link", default="100mbit", help="every link's cap (tc units)")
    parser.add_argument("--mtu", type=int, default=9000)
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=RTT_MS,
        help="a slice's emulated round trip through the tier, ms (each node delays its sends by a quarter; 0: "
        "the testbed's own, below 1 ms)",
    )
    parser.add_argument("--mib", type=float, default=4.0, help="tensor per all-reduce, MiB")
    parser.add_argument("--compute", type=float, default=0.6, help="mean compute seconds per step")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured window per run")
    parser.add_argument("--warm-up", type=float, default=5.0, help="seconds before the measured window")
    parser.add_argument("--stagger", type=float, default=0.25, help="seconds between the jobs' starts")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode")
    parser.add_argument("--seed", type=int, default=0, help="the compute draws' seed")
    parser.add_argument(
        "--calibrate",
        default="",
        help="pool sizes (e.g. 2,3,4,6,8): first run one job alone, back to back, with each pool, "
        "to see how many slots one job needs (its bandwidth-delay product in slices)",
    )
    parser.add_argument(
        "--autogroup-nice",
        type=int,
        default=DEFAULT_NICE,
        help="nice value of the run's own session (bench/priority.py)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="directory for aggregation_tenants.*")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("error: this benchmark builds a testbed (network namespaces, tc), which needs root", file=sys.stderr)
        sys.exit(2)
    if args.workers < 1 or not JOBS <= args.slots <= 65535 or args.runs < 1 or args.seconds <= 0:
        parser.error("need --workers >= 1, --slots >= 3, --runs >= 1, --seconds > 0")
    if not 0 <= args.rtt_ms <= 2000:
        parser.error("--rtt-ms must be between 0 and 2000")
    from trainmaster.testbed import Testbed, TestbedOptions, parse_rate

    priority = own_session(args.autogroup_nice)  # first: every process below inherits it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_start, started = os.getloadavg(), time.time()
    options = TestbedOptions(hosts=JOBS * args.workers, link_rate=parse_rate(args.link), prefix=PREFIX, mtu=args.mtu)
    bed = Testbed.up(options)
    runs: list[Run] = []
    calibration: list[dict[str, Any]] = []
    try:
        for pool in [int(p) for p in args.calibrate.split(",") if p.strip()]:
            solo = {**vars(args), "slots": pool, "compute": 0.0}
            r = run_mode(bed, "shared", 0, solo, jobs_active=1)
            calibration.append({"slots": pool, "allreduces_per_second": r.total_per_second})
            print(f"one job alone, {pool} slots: {r.total_per_second:.3f} all-reduces/s", flush=True)
        for i in range(args.runs):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                r = run_mode(bed, mode, i, vars(args))
                runs.append(r)
                print(
                    f"{mode:>6} run {i}: {r.total_per_second:.3f} all-reduces/s "
                    f"({', '.join(f'{j.per_second:.3f}' for j in r.jobs)}), collisions {r.collisions}",
                    flush=True,
                )
    finally:
        bed.down()
    median = {m: statistics.median(r.total_per_second for r in runs if r.mode == m) for m in MODES}
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "priority": priority,  # the run's session and nice values (bench/priority.py)
        "load_average": {
            "start": load_start[0],
            "end": os.getloadavg()[0],
            "uptime_start": list(load_start),
            "uptime_end": list(os.getloadavg()),
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "seconds": round(time.time() - started),
        "median": median,
        "ratio": median["shared"] / median["static"] if median["static"] else float("nan"),
        "calibration": calibration,
        "runs": [asdict(r) for r in runs],
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "aggregation_tenants.json").write_text(json.dumps(report, indent=1))
    plot(report, args.output / "aggregation_tenants.png")
    md = write_markdown(report)
    (args.output / "aggregation_tenants.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
