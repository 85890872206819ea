"""Benchmark: time to a test accuracy, training a CNN data-parallel on testbed hosts, with the
gradients all-reduced by in-network aggregation (int32, int8), gloo's ring, or PowerSGD.

The model: a CNN of 1.08 M parameters built in code (two 3x3 convolutions of 32 and 64
channels, 2x2 max pooling, a 1024 x 1024 fully connected layer and the classifier), random
initial weights from the run's seed. The data: scikit-learn's handwritten digits (1 797 8x8
images, 10 classes, bundled with scikit-learn: nothing is downloaded), the split and scaling
of ``trainmaster.workloads.digits`` (75/25, 450 test images). It is small enough that 8
workers on 2 shared cores spend most of a step on the network at 100 Mbit/s, which is the
situation aggregation is for; the images are used at their own 8x8 size (upscaling adds
compute, not information).

Every method runs the same loop under PyTorch DDP (one process per testbed host, one thread
each, one gradient bucket): the same seed for the initial weights and for each epoch's shuffle, the same global
batch (``--batch``, split evenly over the workers: the same optimisation at 4 and 8 workers),
SGD with momentum. Only DDP's gradient all-reduce differs:

* ``ina-int32`` / ``ina-int8``: the fabric's DDP communication hook
  (``trainmaster.aggregation.torch_hook``), forwarding node and parameter node on the switch
  host, int32 block floating point or int8 with a shared scale and error feedback; an int8
  job's sums come down re-quantised to int8 by the parameter node (stochastic rounding, the
  job default, ``WorkerConfig.results``); ``ina-int8-exact``: int8 up, the exact int16 sums
  down (the default before);
* ``ina-lowrank-int8`` / ``ina-lowrank-int16``: low-rank compression for in-network
  aggregation (``trainmaster.aggregation.lowrank``, our own PowerSGD-style power iteration, the
  same rank, warm start, error feedback and plain first steps as ``powersgd``) whose factor sums
  go through the fabric as int8 / int16 with a shared scale: not the must-show's ``ina-int8``,
  which sends every gradient;
* ``gloo``: DDP's own all-reduce (gloo's ring, TCP);
* ``powersgd``: PyTorch's PowerSGD hook (rank ``--powersgd-rank``, error feedback and warm
  start, plain all-reduce for the first ``--powersgd-start`` steps), over gloo.

The test accuracy is measured every ``--eval-every`` steps by rank 0 with the clock stopped
(every rank waits at a barrier), so the times are training time alone. Time to target: the
training time at the first evaluation at or above ``--target``. Writes
bench/results/aggregation_training.{json,md,png}: the curves, time to target per method and
seed, medians, final accuracies, and a plot of test accuracy against training time for every
method. Needs root (it builds a testbed); everything it creates is removed at the end.

    .venv/bin/python bench/aggregation_training.py
    .venv/bin/python bench/aggregation_training.py --workers 8 --seeds 1 --epochs 10 --output /tmp/train
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as a script

from priority import DEFAULT_NICE, own_session  # noqa: E402  (bench/priority.py, beside this script)

PREFIX = "tmaggtr"
PS_PORT, SWITCH_PORT, GLOO_PORT = 19200, 19201, 29600
RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("ina-int32", "ina-int8", "ina-int8-exact", "ina-lowrank-int8", "ina-lowrank-int16", "gloo", "powersgd")
CHUNK = 15_664  # float32 per slice: one GSO send at MTU 9000 (bench/aggregation.py chunk_for)
# ina-lowrank-*: each factor column starts a slice (lowrank.py); the longest columns are 1024
LOWRANK_CHUNK = 1024


@dataclass
class Curve:
    method: str
    workers: int
    seed: int
    points: list[dict[str, float]] = field(default_factory=list)  # step, epoch, seconds, accuracy
    time_to_target_s: float | None = None
    final_accuracy: float = 0.0
    seconds: float = 0.0  # training time of all epochs
    parameters: int = 0
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


def make_cnn(seed: int) -> Any:
    """The benchmark's CNN (1.08 M parameters), with the seed's initial weights."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4, x 64 channels = 1024
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def _on_host(namespace: str) -> None:
    from trainmaster.agent.netns import enter

    enter(namespace)


def _parameter_node(namespace: str, address: str) -> None:
    _on_host(namespace)
    from trainmaster.aggregation import ParameterNode

    ParameterNode(address, PS_PORT, dead_after=60.0).serve()


def _forwarding_node(namespace: str, address: str) -> None:
    _on_host(namespace)
    from trainmaster.aggregation import ForwardingNode

    ForwardingNode((address, PS_PORT), slots=1024, host=address, port=SWITCH_PORT).serve()


def _rank(
    namespace: str,
    address: str,
    master: str,
    switch: tuple[str, int],
    method: str,
    rank: int,
    world: int,
    seed: int,
    args: dict[str, Any],
    out: Any,
) -> None:
    """One worker: DDP training with ``method``'s all-reduce; rank 0 reports the curve."""
    _on_host(namespace)
    import faulthandler
    import signal as signals
    from datetime import timedelta

    faulthandler.register(signals.SIGUSR1)  # kill -USR1 <pid>: every thread's stack, to stderr

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainmaster.workloads.digits import load_digits_split

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(GLOO_PORT), GLOO_SOCKET_IFNAME="eth0")
    curve = Curve(method, world, seed)
    client = state = None
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        x_train, y_train, x_test, y_test = load_digits_split()
        x_train, x_test = x_train.view(-1, 1, 8, 8), x_test.view(-1, 1, 8, 8)
        model = make_cnn(seed)
        curve.parameters = sum(p.numel() for p in model.parameters())
        # one bucket for every method: PowerSGD's hook over gloo issues its second all-reduce
        # from a callback thread, and with DDP's default small first bucket the two buckets'
        # collectives can start in different orders on different ranks (a collective
        # mismatch, measured: gloo aborts at the first compressed step)
        ddp = DDP(model, bucket_cap_mb=32)
        if method.startswith("ina-"):
            from trainmaster.aggregation import AggregationClient, WorkerConfig
            from trainmaster.aggregation.lowrank import LowRankHookState, fabric_lowrank_hook
            from trainmaster.aggregation.quantize import SharedScale
            from trainmaster.aggregation.torch_hook import FabricHookState, fabric_allreduce_hook
            from trainmaster.aggregation.worker import quantizer_for

            lowrank = method.startswith("ina-lowrank-")
            precision = "int8" if method == "ina-int8-exact" else method.rsplit("-", 1)[1]
            quantizer = quantizer_for(precision)
            if lowrank and isinstance(quantizer, SharedScale):
                quantizer = SharedScale(quantizer.bits, error_feedback=False)  # the hook carries the error
            cfg = WorkerConfig(
                chunk=LOWRANK_CHUNK if lowrank else CHUNK,
                min_retransmit_timeout=0.3,
                max_retransmit_timeout=4.0,  # round trips of seconds on a loaded machine
                failover_after=10.0,  # ... and stalls of seconds: not a dead forwarding node
                timeout=120.0,
                quantizer=quantizer,
                # None: the job default; the low-rank factors are a few KB down, nothing to halve
                results="exact" if method == "ina-int8-exact" or lowrank else None,
            )
            client = AggregationClient(switch, 1, rank, world, cfg, host=address)
            client.join()
            if lowrank:
                state = LowRankHookState(client, rank=args["powersgd_rank"], start=args["powersgd_start"], seed=seed)
                ddp.register_comm_hook(state, fabric_lowrank_hook)
            else:
                state = FabricHookState(client)
                ddp.register_comm_hook(state, fabric_allreduce_hook)
        elif method == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

            ddp.register_comm_hook(
                powersgd.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=args["powersgd_rank"],
                    start_powerSGD_iter=args["powersgd_start"],
                    use_error_feedback=True,
                    warm_start=True,
                    random_seed=seed,
                ),
                powersgd.powerSGD_hook,
            )
        optimiser = torch.optim.SGD(ddp.parameters(), lr=args["lr"], momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        batch = args["batch"] // world
        steps_per_epoch = len(x_train) // args["batch"]
        clock, step, cpu = 0.0, 0, 0.0
        for epoch in range(args["epochs"]):
            # the same global order for every world size: each rank takes its share of every batch
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
            for i in range(steps_per_epoch):
                began, began_cpu = time.perf_counter(), time.process_time()
                idx = order[i * args["batch"] : (i + 1) * args["batch"]][rank * batch : (rank + 1) * batch]
                optimiser.zero_grad()
                loss_fn(ddp(x_train[idx]), y_train[idx]).backward()
                optimiser.step()
                clock += time.perf_counter() - began
                cpu += time.process_time() - began_cpu
                step += 1
                if step % args["eval_every"] == 0 or step == steps_per_epoch * args["epochs"]:
                    if rank == 0:
                        with torch.no_grad():
                            acc = float((model(x_test).argmax(1) == y_test).float().mean())
                        curve.points.append({"step": step, "epoch": epoch + 1, "seconds": clock, "accuracy": acc})
                    dist.barrier()  # the clock is stopped while rank 0 evaluates
        curve.seconds = clock
        # where a step's time goes (rank 0): this process' CPU seconds in the timed steps (all
        # its threads: the communication thread's quantising and packet handling too)
        curve.stats = {"steps": step, "cpu_seconds": round(cpu, 2)}
        if client is not None:
            transport = client.stats().get("transport", {})
            curve.stats["bytes_sent"] = transport.get("bytes_sent", 0)
            curve.stats |= {
                k: v
                for k, v in client.stats().items()
                if k
                in (
                    "retransmits",
                    "spurious_retransmits",
                    "window_cuts",
                    "low_bit_slices",
                    "float_resends",
                    "packets_sent",
                    "seconds_in_allreduce",
                )
            }
    except Exception as exc:  # reported with the curve, not hidden
        curve.error = f"{type(exc).__name__}: {exc}"
    finally:
        if state is not None:
            state.close()
        if client is not None:
            client.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if rank == 0 or curve.error:
            out.put(asdict(curve))


def run_method(bed: Any, method: str, world: int, seed: int, args: dict[str, Any]) -> Curve:
    from trainmaster.testbed import SWITCH

    ctx = mp.get_context("fork")
    hosts = bed.host_names[:world]
    sw_ns, sw_addr = bed.namespace(SWITCH), bed.address(SWITCH)
    nodes = []
    if method.startswith("ina-"):
        nodes = [
            ctx.Process(target=_parameter_node, args=(sw_ns, sw_addr), daemon=True),
            ctx.Process(target=_forwarding_node, args=(sw_ns, sw_addr), daemon=True),
        ]
    out = ctx.Queue()
    ranks = [
        ctx.Process(
            target=_rank,
            args=(
                bed.namespace(h),
                bed.address(h),
                bed.address(hosts[0]),
                (sw_addr, SWITCH_PORT),
                method,
                r,
                world,
                seed,
                args,
                out,
            ),
            daemon=True,
        )
        for r, h in enumerate(hosts)
    ]
    for p in [*nodes, *ranks]:
        p.start()
    try:
        got = out.get(timeout=args["timeout"])
        curve = Curve(**{**got})
    finally:
        deadline = time.monotonic() + 60  # every rank together, not 60 s each
        for p in ranks:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in [*ranks, *nodes]:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
    reached = [pt["seconds"] for pt in curve.points if pt["accuracy"] >= args["target"]]
    curve.time_to_target_s = reached[0] if reached else None
    curve.final_accuracy = curve.points[-1]["accuracy"] if curve.points else 0.0
    return curve


def _median_stat(curves: list[Curve], name: str, per_step: bool = False, scale: float = 1.0) -> float | None:
    got = [c.stats[name] * scale / (c.stats["steps"] if per_step else 1) for c in curves if name in c.stats]
    return statistics.median(got) if got and (not per_step or all(c.stats.get("steps") for c in curves)) else None


def summarise(curves: list[Curve], args: dict[str, Any]) -> dict[str, Any]:
    """Per worker count and method: median time to target over the seeds, mean final accuracy,
    and the ratios the issue asks for."""
    out: dict[str, Any] = {}
    for world in sorted({c.workers for c in curves}):
        per: dict[str, Any] = {}
        for method in METHODS:
            mine = [c for c in curves if c.workers == world and c.method == method and not c.error]
            if not mine:
                continue
            times = [c.time_to_target_s for c in mine]
            reached = [t for t in times if t is not None]
            per[method] = {
                "time_to_target_s": times,
                "median_time_to_target_s": statistics.median(reached) if len(reached) == len(times) else None,
                "final_accuracy": [c.final_accuracy for c in mine],
                "mean_final_accuracy": statistics.mean(c.final_accuracy for c in mine),
                "median_seconds": statistics.median(c.seconds for c in mine),
                # where rank 0's training time went (medians): CPU seconds of its process, seconds
                # waiting in the fabric's all-reduce (ina-*), bytes it sent per step (ina-*)
                "median_cpu_seconds": _median_stat(mine, "cpu_seconds"),
                "median_allreduce_seconds": _median_stat(mine, "seconds_in_allreduce"),
                "median_kb_sent_per_step": _median_stat(mine, "bytes_sent", per_step=True, scale=1e-3),
            }
        gloo = per.get("gloo", {})
        for method, row in per.items():
            if row["median_time_to_target_s"] and gloo.get("median_time_to_target_s"):
                row["speedup_vs_gloo"] = gloo["median_time_to_target_s"] / row["median_time_to_target_s"]
            if "mean_final_accuracy" in gloo:
                row["accuracy_vs_gloo_points"] = 100 * (row["mean_final_accuracy"] - gloo["mean_final_accuracy"])
        out[str(world)] = per
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_markdown(report: dict[str, Any]) -> str:
    a, load = report["args"], report["load_average"]
    lines = [
        f"Time to {a['target']:.2f} test accuracy: a CNN of {report['parameters']:,} parameters on "
        f"scikit-learn's digits (8x8, 1 347 training / 450 test images), data-parallel under DDP on "
        f"testbed hosts (one worker per host, links {a['link']} at MTU {a['mtu']}), global batch "
        f"{a['batch']}, SGD lr {a['lr']} momentum 0.9, {a['epochs']} epochs, seeds "
        f"{', '.join(str(s) for s in report['seeds'])}; accuracy every {a['eval_every']} steps with "
        f"the clock stopped. ina-*: the fabric's DDP hook (forwarding and parameter node on the "
        f"switch host); ina-lowrank-*: rank-{a['powersgd_rank']} factors (our power iteration, "
        f"as powersgd's) summed by the fabric as int8 / int16; gloo: DDP's all-reduce; powersgd: PyTorch's PowerSGD hook (rank "
        f"{a['powersgd_rank']}, error feedback, warm start, plain all-reduce for the first "
        f"{a['powersgd_start']} steps). {report['machine']['cpus']} CPUs shared with other jobs "
        f"(1-minute load average {load['start']:.2f} at start, {load['end']:.2f} at end).",
        "",
        "| workers | method | time to target, s (per seed) | median s | x gloo | final accuracy (mean) "
        "| vs gloo, points | training s (median) | rank 0 CPU s | rank 0 s in fabric all-reduce "
        "| rank 0 KB sent per step |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, per in report["summary"].items():
        for method, row in per.items():
            times = ", ".join("-" if t is None else f"{t:.1f}" for t in row["time_to_target_s"])
            med = row["median_time_to_target_s"]
            lines.append(
                f"| {world} | {method} | {times} | {'-' if med is None else f'{med:.1f}'} | "
                f"{row.get('speedup_vs_gloo', float('nan')):.2f} | {row['mean_final_accuracy']:.4f} | "
                f"{row.get('accuracy_vs_gloo_points', 0.0):+.2f} | {row['median_seconds']:.1f} | "
                f"{_fmt(row.get('median_cpu_seconds'))} | {_fmt(row.get('median_allreduce_seconds'))} | "
                f"{_fmt(row.get('median_kb_sent_per_step'), 0)} |"
            )
    if report["failures"]:
        lines += ["", "Failures: " + "; ".join(report["failures"])]
    lines += ["", "![test accuracy against training time](/bench/results/aggregation_training.png)"]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install 'trainmaster[bench]'): no plot", flush=True)
        return
    worlds = sorted({c["workers"] for c in report["curves"]})
    fig, axes = plt.subplots(1, len(worlds), squeeze=False, figsize=(5 * len(worlds), 3.6))
    for ax, world in zip(axes[0], worlds):
        for i, method in enumerate(METHODS):
            for j, c in enumerate(x for x in report["curves"] if x["workers"] == world and x["method"] == method):
                pts = c["points"]
                ax.plot(
                    [p["seconds"] for p in pts],
                    [p["accuracy"] for p in pts],
                    color=f"C{i}",
                    alpha=0.8,
                    linewidth=1,
                    label=method if j == 0 else None,
                )
        ax.axhline(report["args"]["target"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{world} workers, {report['args']['link']} links", fontsize=9)
        ax.set_xlabel("training time, s")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.5, 1.0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="4,8", help="comma-separated worker counts")
    parser.add_argument("--methods", default=",".join(METHODS), help="subset of " + ", ".join(METHODS))
    parser.add_argument("--seeds", type=int, default=3, help="seeds per method (1, 2, ...)")
    parser.add_argument("--first-seed", type=int, default=2, help="seed 1 chose --lr and --target")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=128, help="global batch (split over the workers)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--target", type=float, default=0.97, help="test accuracy to reach")
    parser.add_argument("--eval-every", type=int, default=4, help="steps between accuracy measurements")
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument("--powersgd-start", type=int, default=10, help="plain all-reduce steps before PowerSGD")
    parser.add_argument("--link", default="100mbit")
    parser.add_argument("--mtu", type=int, default=9000)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one training run may take")
    parser.add_argument(
        "--autogroup-nice",
        type=int,
        default=DEFAULT_NICE,
        help="nice value of the run's own session (bench/priority.py)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("error: this benchmark builds a testbed (network namespaces, tc), which needs root", file=sys.stderr)
        sys.exit(2)
    workers = sorted(int(w) for w in args.workers.split(","))
    methods = [m for m in METHODS if m in args.methods.split(",")]
    if not methods or min(workers) < 2 or any(args.batch % w for w in workers) or args.powersgd_start < 2:
        parser.error("choose methods; workers >= 2 dividing --batch; --powersgd-start >= 2")
    from trainmaster.testbed import Testbed, TestbedOptions, parse_rate

    priority = own_session(args.autogroup_nice)  # first: every process below inherits it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # imported once here, before the ranks are forked: 8 processes importing torch's DDP (and
    # the compiler modules it pulls in) at once took minutes on the loaded 2 cores
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import trainmaster.aggregation.torch_hook  # noqa: F401
    from trainmaster.workloads.digits import load_digits_split

    load_digits_split()  # scikit-learn's loader and data, once
    load_start, started = os.getloadavg(), time.time()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    bed = Testbed.up(TestbedOptions(hosts=max(workers), link_rate=parse_rate(args.link), prefix=PREFIX, mtu=args.mtu))
    curves: list[Curve] = []
    failures: list[str] = []
    try:
        for world in workers:
            for seed in seeds:
                # the methods' order rotates with the seed: load from other jobs falls on all alike
                for method in methods[seed % len(methods) :] + methods[: seed % len(methods)]:
                    try:
                        c = run_method(bed, method, world, seed, vars(args))
                    except Exception as exc:
                        failures.append(f"{world} workers {method} seed {seed}: {type(exc).__name__}: {exc}")
                        print(failures[-1], flush=True)
                        continue
                    if c.error:
                        failures.append(f"{world} workers {method} seed {seed}: {c.error}")
                    curves.append(c)
                    print(
                        f"{world}w seed {seed} {method:>9}: target at "
                        f"{'-' if c.time_to_target_s is None else f'{c.time_to_target_s:.1f}'} s, final "
                        f"{c.final_accuracy:.4f}, {c.seconds:.1f} s in all {c.stats or ''}",
                        flush=True,
                    )
    finally:
        bed.down()
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
        "seeds": seeds,
        "seconds": round(time.time() - started),
        "parameters": next((c.parameters for c in curves if c.parameters), 0),
        "failures": failures,
        "summary": summarise(curves, vars(args)),
        "curves": [asdict(c) for c in curves],
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "aggregation_training.json").write_text(json.dumps(report, indent=1))
    plot(report, args.output / "aggregation_training.png")
    md = write_markdown(report)
    (args.output / "aggregation_training.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
