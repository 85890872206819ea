"""Pipeline split points for torch.distributed.pipelining, measured on real pipelines.

``python bench/partition.py --pipeline-splits`` (root): a GPT-2-like and a ResNet-like model
(built in code / from a transformers config, random weights), split into k = 2, 3, 4 stages by
ours (``stages.split``: least period, then least latency, on operator costs measured here with
torch.profiler and the link's bandwidth) and by the two splitters PyTorch users reach for:
equal layers (torchtitan's rule) and equal parameters (PiPPy's). Each split runs as a real
``torch.distributed.pipelining`` pipeline (``stage_runner``): rank r on testbed host h(r+1),
gloo over the hosts' links, every link capped by tc tbf; measured: samples per second with
micro-batches streaming (the steady period), the latency of one micro-batch alone, the outputs
against the unsplit model's. The prediction of the latency uses the stage compute and the gloo
message cost measured in the same run, and the boundary bytes over the link's bandwidth.

Goals (issue 35): ours's measured throughput >= 1.3x the better of the two baselines' in every
case; measured latency within 20% of its prediction. Writes
bench/results/partition_pipesplit.{json,md,png}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LINK_BITS = 100_000_000  # 100 Mbit/s, the links of every testbed benchmark of the project
MTU = 1500
# the payload a capped link carries: tc tbf counts each frame's bytes with its Ethernet header, and
# every MSS of data (MTU less 20 IP, 20 TCP and 12 timestamp-option bytes) rides in MTU + 14 of them
PAYLOAD_BYTES_PER_SECOND = LINK_BITS / 8 * (MTU - 52) / (MTU + 14)
MESSAGE_OVERHEAD = 3e-4  # the splitter's price of one gloo message besides its bytes (s)
THROUGHPUT_GOAL = 1.3
WITHIN = 0.2
KS = (2, 3, 4)
PORT = 29531  # each host is a fresh network namespace: nothing else listens there
GPT2_VOCAB = 14_400  # width 256: the head costs ~4.5 blocks, as GPT-2 small's does (V / (12 w + 2 S))


@dataclasses.dataclass(frozen=True)
class SplitCase:
    label: str
    model: str
    input_shape: tuple[int, ...]
    model_args: dict
    input_dtype: str | None = None


CASES = [
    SplitCase("resnet-like", "trainmaster.partition.models:resnet_like", (1, 3, 32, 32), {}),
    SplitCase(
        "gpt2-like 6x256",
        "trainmaster.partition.models:gpt2_lm",
        (1, 64),
        {"layers": 6, "width": 256, "heads": 4, "vocab": GPT2_VOCAB, "positions": 128},
        f"tokens:{GPT2_VOCAB}",
    ),
]


def plans_for(case: SplitCase, ks=KS, costs: str = "profiler") -> tuple[dict, dict]:
    """Every method's plan for every k, from one layout of the model (operator costs measured
    here); and the layout's summary."""
    import torch

    from trainmaster.partition.pipeline import build_model, example_input
    from trainmaster.partition.stages import SPLITTERS, build_pipe, calibrated, model_layout, split

    torch.set_num_threads(1)
    model = build_model(case.model, 0, case.model_args)
    example = example_input(case.input_shape, case.input_dtype, 1)
    profiled = model_layout(model, (example,), costs=costs)
    # the forward as the stages run it: the model as torch.distributed.pipelining's graph module
    wall = forward_seconds(build_pipe(model, (example,), []), example)
    layout = calibrated(profiled, wall)
    cores = os.cpu_count() or 1  # the testbed's hosts are namespaces of this machine: its cores
    plans = {
        k: {
            m: split(layout, k, m, bandwidth=PAYLOAD_BYTES_PER_SECOND, overhead=MESSAGE_OVERHEAD, cores=cores)
            for m in SPLITTERS
        }
        for k in ks
    }
    info = {
        "operators": layout.n,
        "split_points": len(layout.candidates),
        "profiled_compute_seconds": float(profiled.cost.sum()),
        "forward_seconds": wall,
        "compute_seconds": float(layout.cost.sum()),
        "cores": cores,
    }
    return plans, info


def forward_seconds(model, example, runs: int = 30) -> float:
    """``model``'s forward on one micro-batch, one intra-op thread as every stage runs:
    the median of ``runs`` after a warm-up (the scale the profiled operator costs are set to)."""
    import torch

    with torch.no_grad():
        model(example)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            model(example)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_on_testbed(bed, case: SplitCase, split_points: list[str], k: int, out_dir: Path) -> dict:
    """One pipeline: k ranks on h1..hk; rank 0's report."""
    from trainmaster.partition.stage_runner import StageRun
    from trainmaster.testbed.testbed import HOST_DEVICE

    run = StageRun(
        model=case.model,
        input_shape=list(case.input_shape),
        split_points=split_points,
        model_args=dict(case.model_args),
        input_dtype=case.input_dtype,
    )
    report = out_dir / f"report-{time.time_ns()}.json"
    hosts = bed.host_names[:k]
    env = {
        **os.environ,
        "TM_WORLD": str(k),
        "TM_MASTER": bed.address(hosts[0]),
        "TM_PORT": str(PORT),
        "TM_STAGE_RUN": json.dumps(dataclasses.asdict(run)),
        "TM_OUTPUT": str(report),
        "GLOO_SOCKET_IFNAME": HOST_DEVICE,
    }
    argv = [sys.executable, "-m", "trainmaster.partition.stage_runner"]
    procs = [
        bed.exec(h, argv, env={**env, "TM_RANK": str(r)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for r, h in enumerate(hosts)
    ]
    errors = []
    try:
        for r, proc in enumerate(procs):
            _, err = proc.communicate(timeout=1200)
            if proc.returncode:
                errors.append(f"rank {r} exited {proc.returncode}: {err.decode(errors='replace')[-800:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    if not report.exists():
        raise RuntimeError("the pipeline wrote no report; " + "; ".join(errors))
    return json.loads(report.read_text())


def predicted_latency(plan_summary: dict, measured: dict) -> float:
    """One micro-batch alone: the stages' compute measured in the run (each rank timed alone, its
    cache swept first),
    plus each boundary's tensors at the measured gloo message cost and its bytes over the link
    at its payload rate (a receive is posted before the bytes leave: one trip per message)."""
    fixed = measured["message_fixed_seconds"]
    links = [
        fixed * t + b / PAYLOAD_BYTES_PER_SECOND
        for t, b in zip(plan_summary["boundary_tensors"], plan_summary["boundary_bytes"])
    ]
    return sum(_stage_compute(measured)) + sum(links)


def _stage_compute(measured: dict) -> list[float]:
    """Each stage's compute as the prediction takes it: timed alone after the cache was swept
    (a stage's weights do not stay cached between its micro-batches while other stages run)."""
    return measured.get("stage_compute_cold_seconds") or measured["stage_compute_seconds"]


def predicted_period(plan_summary: dict, measured: dict, cores: int) -> float:
    """Micro-batches streaming: the busiest stage, its compute (measured alone in the run) after
    its input's transfer. The schedule posts a stage's receive only after its previous forward
    and gloo sends the bytes only once told of it, so each message costs a trip to the sender
    and one back (2 x the measured message cost) besides bytes / payload rate. With more stages
    than cores, no less than the stages' whole compute over the cores."""
    fixed = measured["message_fixed_seconds"]
    compute = _stage_compute(measured)
    links = [
        2 * fixed * t + b / PAYLOAD_BYTES_PER_SECOND
        for t, b in zip(plan_summary["boundary_tensors"], plan_summary["boundary_bytes"])
    ]
    busiest = max([compute[0]] + [x + c for x, c in zip(links, compute[1:])])
    return max(busiest, sum(compute) / cores) if cores < len(compute) else busiest


def bench(bed, rounds: int = 2, cases=CASES, ks=KS, save=None) -> dict:
    """Every case, k and method, ``rounds`` times; ``save(doc)`` after every run, so a run cut short
    (a kill, a deadline) still leaves the figures it measured."""
    rows: list[dict] = []
    failed: list[dict] = []
    doc = {"rows": rows, "failed": failed, "layouts": {}, "link_bits": LINK_BITS, "message_overhead": MESSAGE_OVERHEAD}
    out_dir = Path(tempfile.mkdtemp(prefix="tm-pipesplit-"))
    try:  # the stage runners' scratch files go with the run
        for case in cases:
            plans, info = plans_for(case, ks)
            doc["layouts"][case.label] = info
            for k in ks:
                for r in range(rounds):
                    order = list(plans[k]) if r % 2 == 0 else list(plans[k])[::-1]  # alternate the methods
                    for method in order:
                        plan = plans[k][method]
                        load = os.getloadavg()[0]
                        t0 = time.perf_counter()
                        try:
                            measured = run_on_testbed(bed, case, plan.split_points, k, out_dir)
                        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # recorded, the others still run
                            failed.append({"case": case.label, "k": k, "method": method, "round": r, "error": str(exc)})
                            print(f"{case.label} k={k} {method} round {r} failed: {exc}", flush=True)
                            if save:
                                save(doc)
                            continue
                        summary = plan.summary()
                        rows.append(
                            {
                                "case": case.label,
                                "k": k,
                                "method": method,
                                "round": r,
                                "load": max(load, os.getloadavg()[0]),
                                "seconds": time.perf_counter() - t0,
                                "plan": summary,
                                "measured": {x: v for x, v in measured.items() if x != "run"},
                                "predicted_latency": predicted_latency(summary, measured),
                                "predicted_period": predicted_period(summary, measured, info["cores"]),
                            }
                        )
                        print(
                            f"{case.label} k={k} {method} round {r}: {measured['samples_per_second']:.1f}/s, "
                            f"latency {measured['latency_seconds'] * 1e3:.1f} ms "
                            f"(predicted {rows[-1]['predicted_latency'] * 1e3:.1f}), period "
                            f"{measured['period_seconds'] * 1e3:.1f} ms (planned {summary['period'] * 1e3:.1f}, "
                            f"predicted {rows[-1]['predicted_period'] * 1e3:.1f}), "
                            f"stage compute {[round(x * 1e3, 1) for x in measured['stage_compute_seconds']]} ms "
                            f"(cold {[round(x * 1e3, 1) for x in _stage_compute(measured)]}), "
                            f"transfers streaming {[round(x * 1e3, 1) for x in measured['boundary_transfer_stream_seconds']]}"
                            f" alone {[round(x * 1e3, 1) for x in measured['boundary_transfer_lone_seconds']]} ms, "
                            "per rank streaming (ms) "
                            + "; ".join(
                                " ".join(f"{p} {v * 1e3:.1f}" for p, v in b.items() if p != "timeline")
                                for b in measured["stage_streaming_seconds"]
                            )
                            + f", load {rows[-1]['load']:.1f}",
                            flush=True,
                        )
                        if save:
                            save(doc)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return doc


def summarise(doc: dict) -> list[dict]:
    """Per (case, k): each method's median samples per second and latency over its rounds,
    ours over the better baseline, measured / predicted latency."""
    groups: dict[tuple[str, int], dict[str, list[dict]]] = {}
    for r in doc["rows"]:
        groups.setdefault((r["case"], r["k"]), {}).setdefault(r["method"], []).append(r)
    out = []
    for (case, k), by in groups.items():
        med = {
            m: {
                "samples_per_second": statistics.median(x["measured"]["samples_per_second"] for x in rs),
                "latency": statistics.median(x["measured"]["latency_seconds"] for x in rs),
                "period": statistics.median(x["measured"]["period_seconds"] for x in rs),
                "predicted_latency": statistics.median(x["predicted_latency"] for x in rs),
                "predicted_period": statistics.median(x["predicted_period"] for x in rs),
                "period_step_difference": statistics.median(
                    x["measured"].get("period_step_difference_seconds", x["measured"]["period_seconds"]) for x in rs
                ),
                "planned_period": rs[0]["plan"]["period"],
                "planned_latency": rs[0]["plan"]["latency"],
                "split_points": rs[0]["plan"]["split_points"],
                "boundary_bytes": rs[0]["plan"]["boundary_bytes"],
                "outputs_equal": all(x["measured"]["outputs_equal_unsplit"] for x in rs),
                "load": max(x["load"] for x in rs),
            }
            for m, rs in by.items()
        }
        for m in med.values():
            m["latency_ratio"] = m["latency"] / m["predicted_latency"]
            m["period_ratio"] = m["period"] / m["planned_period"]
            m["period_vs_prediction"] = m["period"] / m["predicted_period"]
        layout = doc["layouts"].get(case, {})
        # no split of the model can stream faster than its whole compute over the cores the
        # stages share (or over k, a core each): the better baseline's measured period over
        # that bound is the most any split point choice could gain
        bound = layout["compute_seconds"] / min(k, layout["cores"]) if "cores" in layout else None
        base_period = min((med[m]["period"] for m in ("layers", "params") if m in med), default=None)
        # (a run cut short may have no baseline yet for its last case)
        base = max((med[m]["samples_per_second"] for m in ("layers", "params") if m in med), default=None)
        ours = med.get("trainmaster", {}).get("samples_per_second")
        # the cost model's own view: ours's period is the least over every split at module
        # boundaries, so the better baseline's period over it bounds what any split could gain
        planned_base = min((med[m]["planned_period"] for m in ("layers", "params") if m in med), default=None)
        planned_ours = med.get("trainmaster", {}).get("planned_period")
        out.append(
            {
                "case": case,
                "k": k,
                "methods": med,
                "throughput_vs_best_baseline": (ours / base) if ours and base else None,
                "planned_vs_best_baseline": (planned_base / planned_ours) if planned_ours and planned_base else None,
                "period_lower_bound": bound,
                "best_baseline_vs_bound": (base_period / bound) if bound and base_period else None,
            }
        )
    return out


def write(doc: dict, out: Path) -> None:
    doc["summary"] = summarise(doc)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    s = doc["summary"]
    wins = sum((x["throughput_vs_best_baseline"] or 0) >= THROUGHPUT_GOAL for x in s)
    within = [
        (x["case"], x["k"], m, v["latency_ratio"])
        for x in s
        for m, v in x["methods"].items()
        if abs(v["latency_ratio"] - 1) <= WITHIN
    ]
    ours_within = [w for w in within if w[2] == "trainmaster"]
    lines = [
        "# Pipeline split points (torch.distributed.pipelining) on testbed hosts",
        "",
        f"Command: `{doc.get('command', 'python bench/partition.py --pipeline-splits')}`; load average "
        f"{doc.get('load', '?')} at the end on {os.cpu_count()} CPU cores (per case below). Each stage a "
        f"rank of a gloo process group on its own testbed host, every host's link capped at "
        f"{doc['link_bits'] / 1e6:.0f} Mbit/s by tc tbf; `ScheduleGPipe` (forward); ours: "
        "`stages.split` on operator costs measured here (torch.profiler), least period then least "
        "latency; layers: torchtitan's equal-layers rule; params: PiPPy's equal-parameter rule.",
        "",
        "Throughput: the steady period of micro-batches streaming (the extra micro-batches of a "
        "step twice as long over their count; fill and drain cancel), as samples per second. "
        "Latency: one micro-batch alone, rank 0's step start to the last rank's output. Predicted: "
        "the stages' compute measured in the run + per boundary (the measured gloo message cost x "
        "tensors + bytes / bandwidth).",
        "",
        "| goal | result |",
        "|---|---|",
        f"| ours's throughput >= {THROUGHPUT_GOAL}x the better baseline | {wins} of {len(s)} cases |",
        f"| ours's latency within {WITHIN:.0%} of its prediction | {len(ours_within)} of {len(s)} |",
        f"| every split's latency within {WITHIN:.0%} of its prediction | {len(within)} of "
        f"{sum(len(x['methods']) for x in s)} |",
        f"| ours's measured period within {WITHIN:.0%} of its planned period | "
        f"{sum(abs(x['methods']['trainmaster']['period_ratio'] - 1) <= WITHIN for x in s if 'trainmaster' in x['methods'])}"
        f" of {len(s)} |",
        f"| every split's measured period within {WITHIN:.0%} of its planned period | "
        f"{sum(abs(v['period_ratio'] - 1) <= WITHIN for x in s for v in x['methods'].values())} of "
        f"{sum(len(x['methods']) for x in s)} |",
        f"| ours's measured period within {WITHIN:.0%} of its prediction from the run's stage compute | "
        f"{sum(abs(x['methods']['trainmaster']['period_vs_prediction'] - 1) <= WITHIN for x in s if 'trainmaster' in x['methods'])}"
        f" of {len(s)} |",
        f"| every split's measured period within {WITHIN:.0%} of that prediction | "
        f"{sum(abs(v['period_vs_prediction'] - 1) <= WITHIN for x in s for v in x['methods'].values())} of "
        f"{sum(len(x['methods']) for x in s)} |",
        f"| runs that failed (recorded in the JSON) | {len(doc.get('failed', []))} |",
        "",
        f"| cases where the cost model itself allows {THROUGHPUT_GOAL}x (ours's planned period is the "
        f"least of any split; best baseline's planned period / ours's) | "
        f"{sum((x['planned_vs_best_baseline'] or 0) >= THROUGHPUT_GOAL for x in s)} of {len(s)}: "
        + ", ".join(f"{x['case']} k={x['k']} {_fmt(x['planned_vs_best_baseline'])}" for x in s)
        + " |",
        f"| cases where any split could reach {THROUGHPUT_GOAL}x (the better baseline's measured period over "
        "the bound: the model's forward time over min(k, cores)) | "
        f"{sum((x.get('best_baseline_vs_bound') or 0) >= THROUGHPUT_GOAL for x in s)} of {len(s)}: "
        + ", ".join(f"{x['case']} k={x['k']} {_fmt(x.get('best_baseline_vs_bound'))}" for x in s)
        + " |",
        "",
        "Planned: operator costs profiled (torch.profiler, one thread), scaled to the unsplit forward's "
        "wall time measured just before (one thread); the period is the busiest stage, its input's "
        "transfer included (the schedule posts a receive after the previous forward, and gloo moves "
        "the bytes only then), or the whole compute over the cores the stages share (the testbed's "
        "hosts are namespaces of one machine).",
        "",
        "Period: the last rank's median gap between forward ends while streaming; in brackets the "
        "plan's period and the prediction from the stages' compute measured in the run (busiest stage "
        "after its input's transfer at 2 message costs + bytes / payload rate, or the compute over the "
        "cores); the step-difference estimate beside it.",
        "",
        "| model | k | method | split points | boundary KB | period ms (planned; predicted) | step diff ms | samples/s | ours vs best "
        "baseline | latency ms (predicted) | measured / predicted | outputs equal | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in s:
        for m, v in x["methods"].items():
            lines.append(
                f"| {x['case']} | {x['k']} | {m} | {', '.join(v['split_points'])} | "
                f"{', '.join(f'{b / 1024:.0f}' for b in v['boundary_bytes'])} | {v['period'] * 1e3:.1f} "
                f"({v['planned_period'] * 1e3:.1f}; {v['predicted_period'] * 1e3:.1f}) | "
                f"{v['period_step_difference'] * 1e3:.1f} | "
                f"{v['samples_per_second']:.1f} | "
                f"{_fmt(x['throughput_vs_best_baseline']) if m == 'trainmaster' else ''} | "
                f"{v['latency'] * 1e3:.1f} ({v['predicted_latency'] * 1e3:.1f}) | {v['latency_ratio']:.2f} | "
                f"{'y' if v['outputs_equal'] else 'n'} | {v['load']:.1f} |"
            )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(s, out.with_suffix(".png"))


def _plot(summary: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"no plot: {exc}")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{x['case']}\nk={x['k']}" for x in summary]
    width = 0.27
    for i, (m, colour) in enumerate((("trainmaster", "tab:blue"), ("layers", "tab:orange"), ("params", "tab:green"))):
        ys = [x["methods"].get(m, {}).get("samples_per_second", 0.0) for x in summary]
        ax.bar([j + (i - 1) * width for j in range(len(summary))], ys, width, label=m, color=colour)
    ax.set_xticks(range(len(summary)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("samples per second (measured)")
    ax.set_title("torch.distributed.pipelining on testbed hosts: ours vs equal layers / equal parameters", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def main(argv: list[str], out: Path, rounds: int = 2, ks=KS, cases: str | None = None) -> None:
    """``ks``: the stage counts to run; ``cases``: comma-separated case labels' prefixes (e.g.
    ``gpt2``), all by default. Results are written after every run."""
    from trainmaster.testbed import Testbed, TestbedOptions

    if os.geteuid() != 0:
        sys.exit("--pipeline-splits needs root: a testbed is network namespaces, veth links and tc qdiscs")
    chosen = [c for c in CASES if not cases or any(c.label.startswith(x.strip()) for x in cases.split(","))]
    if not chosen:
        sys.exit(f"--cases {cases!r} names none of: " + ", ".join(c.label for c in CASES))
    command = "python bench/partition.py " + " ".join(argv)

    def save(doc: dict) -> None:
        if not doc["rows"]:
            return
        doc["command"] = command
        doc["load"] = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        write(doc, out)

    bed = Testbed.up(TestbedOptions(hosts=max(ks), link_rate=LINK_BITS, prefix="tmsplit"))
    try:
        doc = bench(bed, rounds=rounds, cases=chosen, ks=tuple(ks), save=save)
    finally:
        bed.down()
    save(doc)
    print(out.with_suffix(".md").read_text())
