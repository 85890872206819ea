"""CLI of the partition capability: ``trainmaster partition GRAPH --devices K``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer

from trainmaster.errors import UserError


def _parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError:
        raise UserError(f"--input-shape {text!r}: expected integers like 1,3,32,32") from None
    if not shape or min(shape) < 1:
        raise UserError(f"--input-shape {text!r}: expected positive integers like 1,3,32,32")
    return shape


def _check_flags(devices: int, imbalance: float, delta: float, importer: str) -> None:
    """Flags are checked before the graph is loaded: tracing a model can take a while."""
    from trainmaster.partition.importers import IMPORTERS

    if devices < 1:
        raise UserError(f"--devices {devices}: give the number of devices, at least 1")
    if not (math.isfinite(imbalance) and 0 <= imbalance <= 10):
        raise UserError(f"--imbalance {imbalance}: give a fraction between 0 and 10, e.g. 0.05")
    if not (math.isfinite(delta) and delta >= 0):
        raise UserError(f"--delta {delta}: give a finite fraction >= 0, e.g. 0 or 0.05")
    if importer not in IMPORTERS:
        raise UserError(f"--importer {importer!r}: choose one of {', '.join(IMPORTERS)}")


def infeasible_message(metrics: dict, imbalance: float, method: str = "trainmaster") -> str:
    """What the text output says when no partition met the caps: which cap, by how much, and
    the --imbalance that the returned partition would meet (the JSON says feasible: false)."""
    over = []
    if not metrics["balanced"]:
        over.append(f"--imbalance {imbalance:g} (busiest device {metrics['balance']:.3g}x the average load)")
    if metrics.get("memory_cap") is not None and not metrics["memory_ok"]:
        over.append(
            f"the memory cap ({max(metrics['memory_per_device']):.4g} on one device, cap {metrics['memory_cap']:.4g})"
        )
    if method == "trainmaster":
        text = (
            "no partition found meets "
            + " or ".join(over or ["the caps"])
            + "; returned the least-violating one (among near-equal ones, the fastest)"
        )
    else:
        text = f"the {method} partition breaks " + " and ".join(over or ["the caps"])
    if not metrics["balanced"]:
        text += f"; --imbalance {metrics['balance'] - 1.0 + 1e-4:.4g} would accept it"
    notes = metrics.get("notes") or {}
    if notes.get("load_cap_unreachable"):
        least = notes["least_max_load"] / max(metrics["avg_load"], 1e-300)
        text += (
            f" (no partition can meet --imbalance {imbalance:g}: the heaviest operators leave some device "
            f">= {least:.4g}x the average load)"
        )
    return text


def partition_command(
    graph: str = typer.Argument(
        ...,
        help="A graph .json (profiled or Trainmaster format), an ONNX file, or module:callable returning an nn.Module.",
    ),
    devices: int = typer.Option(..., "--devices", "-k", help="Number of devices (parts)."),
    imbalance: float = typer.Option(0.05, help="Maximum load imbalance, e.g. 0.05 = 5%."),
    method: str = typer.Option("trainmaster", help="trainmaster | patent | metis | kahip | ilp"),
    out: Optional[Path] = typer.Option(None, help="Write {assignment, metrics} JSON here."),
    as_json: bool = typer.Option(False, "--json", help="Print the metrics as JSON."),
    input_shape: Optional[str] = typer.Option(None, help="Input shape for module:callable, e.g. 1,3,32,32."),
    bandwidth: float = typer.Option(
        1e9, help="Bytes per second between devices, for traced models (edge cost = tensor bytes / bandwidth)."
    ),
    delta: float = typer.Option(0.0, help="Critical when slack <= delta * critical-path length."),
    seed: int = typer.Option(0, help="Random seed (METIS, KaHIP, patent)."),
    acyclic: bool = typer.Option(
        False, "--acyclic", help="Keep the device graph acyclic, as a pipeline of stages needs (method trainmaster)."
    ),
    shared_links: bool = typer.Option(
        False,
        "--shared-links",
        help="Each device has one network link in and one out that its messages queue on (hosts on a switch): "
        "rank partitions on that makespan (method trainmaster); the metrics add shared_links_makespan.",
    ),
    importer: str = typer.Option(
        "export",  # importers.DEFAULT_IMPORTER (not imported here: the CLI starts light; a test ties them)
        help="How module:callable becomes a graph: export "
        "(torch.export, operator level), fx (torch.fx, module level) or "
        "onnx (ONNX exporter).",
    ),
    training: bool = typer.Option(
        False,
        "--training",
        help="For module:callable: one training step (forward, backward, SGD update) from one export.",
    ),
    costs: str = typer.Option(
        "flops",
        "--costs",
        help="For module:callable: operator costs from FLOP estimates (flops) or measured CPU "
        "times per operator with torch.profiler on this machine (profiler).",
    ),
    split_points: Optional[str] = typer.Option(
        None,
        "--split-points",
        help="For module:callable: K pipeline stages as torch.distributed.pipelining split points "
        "(module FQNs, SplitPoint.BEGINNING), by this splitter: trainmaster (least period, then "
        "latency), layers (torchtitan's equal layers) or params (PiPPy's equal parameters).",
    ),
    input_dtype: Optional[str] = typer.Option(
        None, help="For module:callable: tokens:V for token ids below V (language models); floats by default."
    ),
) -> None:
    """Split a DNN graph across K devices, cutting few costly critical edges, and report metrics."""
    import time

    if split_points is not None:
        _split_points(graph, devices, split_points, input_shape, input_dtype, bandwidth, costs, as_json, out)
        return

    from trainmaster.partition import evaluate, load_graph, partition

    from trainmaster.partition.importers import check_link

    _check_flags(devices, imbalance, delta, importer)
    check_link(bandwidth)
    from trainmaster.partition.importers import COSTS

    if costs not in COSTS:
        raise UserError(f"--costs {costs!r}: choose one of {', '.join(COSTS)}")
    t0 = time.perf_counter()
    g = load_graph(
        graph, _parse_shape(input_shape), bandwidth=bandwidth, importer=importer, training=training, costs=costs
    )
    from trainmaster.partition.methods import PartitionOptions
    from trainmaster.partition.simulate import finish_times

    options = PartitionOptions(shared_links=shared_links)
    result = partition(
        g, devices, method=method, imbalance=imbalance, seed=seed, delta=delta, acyclic=acyclic, options=options
    )
    metrics = evaluate(g, result.assignment, devices, imbalance)
    if shared_links:
        metrics["shared_links_makespan"] = max(finish_times(g, result.assignment, shared_links=True), default=0.0)
    metrics.update(
        method=method,
        feasible=result.feasible,
        overload=result.overload,
        partition_seconds=result.seconds,
        total_seconds=time.perf_counter() - t0,
        max_load_per_sample=metrics["max_load"],
    )
    if result.notes:
        metrics["notes"] = {k: v for k, v in result.notes.items() if k != "candidates"}
    if out is not None:
        out.write_text(json.dumps({"assignment": result.by_node_id(g), "metrics": metrics}, indent=1))
    if as_json:
        print(json.dumps(metrics, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{Path(graph).name}: {method}, k={devices}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in (
        "critical_cut_count",
        "critical_cut_cost",
        "cut_count",
        "cut_cost",
        "max_load",
        "avg_load",
        "balance",
        "makespan",
        "lower_bound",
        "path_cut_bound",
        "device_graph_acyclic",
        "memory_ok",
        "colocation_ok",
        "feasible",
        "partition_seconds",
        *(("shared_links_makespan",) if shared_links else ()),
    ):
        val = metrics[key]
        table.add_row(key, f"{val:.4g}" if isinstance(val, float) else str(val))
    Console().print(table)
    if not result.feasible:
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {infeasible_message(metrics, imbalance, method)}")
    if out is not None:
        Console().print(f"assignment written to {out}")


def _split_points(
    model: str,
    k: int,
    splitter: str,
    input_shape: str | None,
    input_dtype: str | None,
    bandwidth: float,
    costs: str,
    as_json: bool,
    out: Path | None,
) -> None:
    """``--split-points``: the stages' split points for torch.distributed.pipelining."""
    from trainmaster.partition.importers import check_link
    from trainmaster.partition.stages import SPLITTERS, plan_for_callable

    if splitter not in SPLITTERS:
        raise UserError(f"--split-points {splitter!r}: choose one of {', '.join(SPLITTERS)}")
    if ":" not in model:
        raise UserError(f"--split-points needs module:callable (a model to export), got {model!r}")
    if k < 1:
        raise UserError(f"--devices {k}: give the number of stages, at least 1")
    shape = _parse_shape(input_shape)
    if shape is None:
        raise UserError("--split-points needs --input-shape (one micro-batch), e.g. 1,3,32,32")
    check_link(bandwidth)
    plan = plan_for_callable(model, shape, k, splitter, bandwidth=bandwidth, costs=costs, input_dtype=input_dtype)
    summary = plan.summary()
    if out is not None:
        out.write_text(json.dumps(summary, indent=1))
    if as_json:
        print(json.dumps(summary, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{model}: {k} pipeline stages by {splitter}")
    for col in ("stage", "starts at (SplitPoint.BEGINNING)", "compute", "parameter MB", "sends KB"):
        table.add_column(col)
    sends = [*summary["boundary_bytes"], 0]
    for s in range(k):
        table.add_row(
            str(s),
            "(model start)" if s == 0 else summary["split_points"][s - 1],
            f"{summary['stage_compute'][s]:.4g} s",
            f"{summary['stage_param_bytes'][s] / 1e6:.3g}",
            f"{sends[s] / 1024:.4g}" if s < k - 1 else "-",
        )
    console = Console()
    console.print(table)
    console.print(f"period {plan.period:.4g} s (busiest stage or link), latency {plan.latency:.4g} s")
    spec = ", ".join(f"{fqn!r}: SplitPoint.BEGINNING" for fqn in summary["split_points"])
    console.print(f"split_spec = {{{spec}}}", markup=False)


def register(app: typer.Typer) -> None:
    """Add ``trainmaster partition`` (one top-level command) to the app."""
    app.command("partition")(partition_command)
