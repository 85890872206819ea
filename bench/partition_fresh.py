"""The partitioner judged on graphs nobody tuned on: seeds drawn when the run starts.

``python bench/partition.py --fresh`` (this module) draws a run seed (or takes ``--run-seed``),
prints it and every graph seed derived from it, and runs:

1. **Exact checks** on small random DAGs of every synthetic family (14-18 operators, k = 2, 3, 4,
   a 25% load cap: a 5% cap cannot be met with a handful of operators): the exact makespan
   optimum (branch and bound, ``partition.exact``) and the exact minimum critical cut (the ILP),
   against ours after each of its phases (the best start, the chosen start, the descent, the
   final improvement) and METIS, so a lost decision shows where it was lost.
2. **The goals** on 300-operator DAGs of every family (k = 2, 4, 8, 5% cap), and on every
   traced model the project has (inference and training steps, k = 2, 4, 8): ours's makespan
   never above METIS's where both meet the caps; ours's cost-weighted critical cut no higher
   than METIS's in >= 95% of the cases; the median excess over the lower bound, (ours - LB) /
   (METIS - LB), <= 0.5; training step graphs at k = 4 and 8 within 1.5x of the lower bound.

Writes bench/results/partition_fresh.{json,md}. Nothing here is tuned on what it reports: the
synthetic graphs are new every run, and the traced models were not used to develop the method
(bench/partition_history.md says which graphs were).
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import time
from pathlib import Path

import numpy as np

from trainmaster.partition import evaluate, partition
from trainmaster.partition.exact import optimal_makespan
from trainmaster.partition.ilp import ilp_partition
from trainmaster.partition.synthetic import FAMILIES, synthetic_dag

SMALL_IMBALANCE = 0.25  # a handful of operators cannot be balanced within 5%
SMALL_KS = (2, 3, 4)
GOAL_KS = (2, 4, 8)
EXACT_NODE_LIMIT = 400_000  # branch-and-bound nodes per small case (~5 s); unsolved cases are counted
CRITICAL_GOAL = 0.95
EXCESS_GOAL = 0.5
TRAINING_GOAL = 1.5


def draw_seeds(run_seed: int, per_family: int, small_per_family: int) -> dict[str, dict[str, list[int]]]:
    """Per family, the graph seeds of the exact checks and of the goal graphs, derived from
    ``run_seed`` (so a run is reproduced from the one number it prints)."""
    rng = np.random.default_rng(run_seed)
    return {
        family: {
            "small": rng.integers(0, 2**31 - 1, small_per_family).tolist(),
            "goal": rng.integers(0, 2**31 - 1, per_family).tolist(),
        }
        for family in FAMILIES
    }


def exact_checks(seeds: dict[str, dict[str, list[int]]]) -> list[dict]:
    """Part 1: small DAGs, ours (each phase) and METIS against the exact optima."""
    rows = []
    for family, by in seeds.items():
        for seed in by["small"]:
            n = 14 + seed % 5
            g = synthetic_dag(family, n, seed)
            for k in SMALL_KS:
                ours = partition(g, k, imbalance=SMALL_IMBALANCE)
                metis = partition(g, k, "metis", imbalance=SMALL_IMBALANCE)
                row = {"family": family, "seed": seed, "nodes": g.n, "k": k, "feasible": ours.feasible}
                if not ours.feasible:
                    rows.append({**row, "skipped": "no partition within the cap found"})
                    continue
                t0 = time.perf_counter()
                opt = optimal_makespan(g, k, SMALL_IMBALANCE, incumbent=ours.assignment, node_limit=EXACT_NODE_LIMIT)
                exact_s = time.perf_counter() - t0
                ilp_a, ilp = ilp_partition(g, k, SMALL_IMBALANCE, time_limit=30.0)
                eo = evaluate(g, ours.assignment, k, SMALL_IMBALANCE)
                em = evaluate(g, metis.assignment, k, SMALL_IMBALANCE)
                cands = ours.notes.get("candidates", {})
                within = [c["makespan"] for c in cands.values() if c["overload"] == 0.0]
                phases = ours.notes.get("phases", {})
                row.update(
                    {
                        "optimal_makespan": opt.makespan if opt.optimal else None,
                        "exact_nodes": opt.nodes,
                        "exact_seconds": exact_s,
                        "ours": eo["makespan"],
                        "metis": em["makespan"],
                        "metis_balanced": _within(em, g, k),  # load and (where enforceable) memory
                        "best_start": min(within) if within else None,
                        "chosen": phases.get("chosen"),
                        "descended": phases.get("descended"),
                        "improved": phases.get("improved"),
                        "ours_label": ours.notes.get("chosen"),
                        "ours_critical_cut": eo["critical_cut_cost"],
                        "metis_critical_cut": em["critical_cut_cost"],
                        "ilp_critical_cut": float(ilp["objective"]) if ilp.get("optimal") else None,
                    }
                )
                rows.append(row)
            print(f"exact {family} seed {seed} done", flush=True)
    return rows


def goal_rows_synthetic(seeds: dict[str, dict[str, list[int]]], n: int = 300) -> list[dict]:
    rows = []
    for family, by in seeds.items():
        for seed in by["goal"]:
            g = synthetic_dag(family, n, seed)
            rows += _compare(g, f"synthetic/{family}-{seed}", GOAL_KS)
            print(f"goal synthetic/{family}-{seed} done", flush=True)
    return rows


def _compare(g, name: str, ks, imbalance: float = 0.05) -> list[dict]:
    rows = []
    for k in ks:
        if k > g.n:
            continue
        t0 = time.process_time()
        ours = partition(g, k, imbalance=imbalance)
        t_ours = time.process_time() - t0
        t0 = time.process_time()
        metis = partition(g, k, "metis", imbalance=imbalance)
        t_metis = time.process_time() - t0
        eo, em = evaluate(g, ours.assignment, k, imbalance), evaluate(g, metis.assignment, k, imbalance)
        rows.append(
            {
                "graph": name,
                "nodes": g.n,
                "k": k,
                "ours": eo["makespan"],
                "metis": em["makespan"],
                "lower_bound": eo["lower_bound"],
                "path_cut_bound": eo["path_cut_bound"],
                "ours_within_caps": _within(eo, g, k),
                "metis_within_caps": _within(em, g, k),
                "ours_critical_cut": eo["critical_cut_cost"],
                "metis_critical_cut": em["critical_cut_cost"],
                "ours_cpu_seconds": t_ours,
                "metis_cpu_seconds": t_metis,
                "ours_label": ours.notes.get("chosen"),
            }
        )
    return rows


def _within(ev: dict, g, k: int) -> bool:
    """Within the load cap, and the memory cap where k devices can hold the graph at all."""
    memory_feasible = bool(g.memory.sum() <= k * g.memory_cap)
    return bool(ev["balanced"]) and (bool(ev["memory_ok"]) or not memory_feasible)


def traced_rows(traced_models) -> list[dict]:
    """Every traced model of the project: ``traced_models()`` (bench/partition.py's list, given
    by the caller) and the pipeline benchmarks' models."""
    rows = []
    for name, make in traced_models() + _pipeline_models():
        t0 = time.perf_counter()
        g = make()
        rows += _compare(g, f"traced/{name}", GOAL_KS)
        print(f"traced/{name} ({g.n} nodes) done in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def _pipeline_models() -> list[tuple[str, object]]:
    """The models the pipeline benchmarks run (models.py), traced as they trace them."""
    try:
        import torch

        from trainmaster.partition.importers import from_module
        from trainmaster.partition.models import bert_small, gpt2_small, resnet_like
    except ImportError as exc:
        print(f"skipping the pipeline models: {exc}")
        return []

    def traced(build, inputs):
        def make():
            torch.manual_seed(0)
            return from_module(build().eval(), inputs())[0]

        return make

    tokens = lambda: (torch.randint(0, 1024, (1, 64)),)  # noqa: E731
    return [
        ("resnet-like", traced(resnet_like, lambda: (torch.randn(1, 3, 32, 32),))),
        ("gpt2-small-4x256", traced(gpt2_small, tokens)),
        ("bert-small-4x192", traced(bert_small, tokens)),
    ]


def summarise_goals(rows: list[dict]) -> dict:
    """The goals over ``rows`` (one per graph and k)."""
    both = [r for r in rows if r["ours_within_caps"] and r["metis_within_caps"]]
    worse = [r for r in both if r["ours"] > r["metis"] * (1 + 1e-9)]
    no_higher = [r for r in rows if r["ours_critical_cut"] <= r["metis_critical_cut"] * (1 + 1e-9) + 1e-15]
    excess = [
        (r["ours"] - r["lower_bound"]) / (r["metis"] - r["lower_bound"])
        for r in rows
        if r["metis"] - r["lower_bound"] > 1e-12 * max(r["metis"], 1e-300)
    ]
    ratio = [r["ours_cpu_seconds"] / max(r["metis_cpu_seconds"], 1e-6) for r in rows]
    # the path-cut bound B: no partition within the caps is faster, so (B - LB) / (METIS - LB)
    # is the least excess ratio any within-cap partition can have (METIS may be over a cap)
    best = [
        max(r["path_cut_bound"] - r["lower_bound"], 0.0) / (r["metis"] - r["lower_bound"])
        for r in rows
        if r["metis"] - r["lower_bound"] > 1e-12 * max(r["metis"], 1e-300)
    ]
    # against the tightest valid bound B (the path-cut bound, with the forced-cut bound: no
    # partition within the caps is faster), for ours within the caps; and how often ours and
    # METIS land on the same makespan (within 0.1%), where no bound can give a ratio below 1
    # unless it is exact
    vs_bound = [
        (r["ours"] - r["path_cut_bound"]) / (r["metis"] - r["path_cut_bound"])
        for r in rows
        if r["ours_within_caps"] and r["metis"] - r["path_cut_bound"] > 1e-12 * max(r["metis"], 1e-300)
    ]
    same = [r for r in rows if abs(r["ours"] - r["metis"]) <= 1e-3 * r["metis"]]
    return {
        "median_excess_ratio_vs_bound": statistics.median(vs_bound) if vs_bound else None,
        "excess_ratio_vs_bound_cases": len(vs_bound),
        "ours_equal_to_metis": f"{len(same)}/{len(rows)}",
        "median_best_possible_excess_ratio": statistics.median(best) if best else None,
        "best_possible_above_half": f"{sum(b > 0.5 for b in best)}/{len(best)}",
        "cases": len(rows),
        "makespan_above_metis_where_both_within_caps": f"{len(worse)}/{len(both)}",
        "makespan_above_metis_cases": [f"{r['graph']} k={r['k']}" for r in worse],
        "critical_cut_no_higher_than_metis": f"{len(no_higher)}/{len(rows)}",
        "critical_cut_no_higher_share": len(no_higher) / max(len(rows), 1),
        "critical_cut_higher_cases": [f"{r['graph']} k={r['k']}" for r in rows if r not in no_higher],
        "median_excess_ratio": statistics.median(excess) if excess else None,
        "excess_ratio_quartiles": _quartiles(excess),
        "median_cpu_ratio_vs_metis": statistics.median(ratio) if ratio else None,
        "max_cpu_ratio_vs_metis": max(ratio) if ratio else None,
        "ours_outside_caps": [f"{r['graph']} k={r['k']}" for r in rows if not r["ours_within_caps"]],
    }


def summarise_exact(rows: list[dict]) -> dict:
    solved = [r for r in rows if r.get("optimal_makespan")]

    def gaps(key: str) -> list[float]:
        return [r[key] / r["optimal_makespan"] - 1 for r in solved if r.get(key) is not None]

    phases = {key: _stats(gaps(key)) for key in ("best_start", "chosen", "descended", "improved", "ours")}
    metis_ok = [r for r in solved if r["metis_balanced"]]
    ilp = [r for r in solved if r.get("ilp_critical_cut") is not None]
    lost = sorted(solved, key=lambda r: r["ours"] / r["optimal_makespan"], reverse=True)[:8]
    return {
        "cases": len(rows),
        "solved": len(solved),
        "skipped_no_feasible_partition": sum(1 for r in rows if "skipped" in r),
        "unsolved_within_node_limit": sum(1 for r in rows if "skipped" not in r and not r.get("optimal_makespan")),
        "ours_optimal": sum(r["ours"] <= r["optimal_makespan"] * (1 + 1e-9) for r in solved),
        "gap_by_phase": phases,
        "metis_gap": _stats([r["metis"] / r["optimal_makespan"] - 1 for r in metis_ok]),
        "ours_not_above_metis": f"{sum(r['ours'] <= r['metis'] * (1 + 1e-9) for r in metis_ok)}/{len(metis_ok)}",
        "ours_critical_cut_over_ilp_optimum": _stats(
            [r["ours_critical_cut"] - r["ilp_critical_cut"] for r in ilp if r["ilp_critical_cut"] is not None]
        ),
        "ours_critical_cut_at_ilp_optimum": (
            f"{sum(r['ours_critical_cut'] <= r['ilp_critical_cut'] + 1e-9 for r in ilp)}/{len(ilp)}"
        ),
        "largest_losses": [
            {
                "case": f"{r['family']} seed {r['seed']} k={r['k']}",
                "gap": r["ours"] / r["optimal_makespan"] - 1,
                "label": r["ours_label"],
                "best_start_gap": (r["best_start"] / r["optimal_makespan"] - 1) if r.get("best_start") else None,
            }
            for r in lost
        ],
    }


def training_rows(rows: list[dict]) -> list[dict]:
    return [
        {**r, "ratio_to_lower_bound": r["ours"] / r["lower_bound"], "ratio_to_bound": r["ours"] / r["path_cut_bound"]}
        for r in rows
        if "training" in r["graph"] and r["k"] in (4, 8)
    ]


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "max": max(values), "n": len(values)}


def _quartiles(values: list[float]) -> list[float] | None:
    if len(values) < 2:
        return None
    return [float(x) for x in statistics.quantiles(values, n=4, method="inclusive")]


def run(run_seed: int | None, per_family: int, small_per_family: int, out: Path, traced_models=None) -> dict:
    """The whole run (module docstring); ``traced_models``: the caller's list of traced models
    (None: leave them out)."""
    seed = secrets.randbits(31) if run_seed is None else run_seed
    seeds = draw_seeds(seed, per_family, small_per_family)
    print(f"run seed {seed} (rerun with --run-seed {seed})", flush=True)
    for family, by in seeds.items():
        print(f"  {family}: exact-check seeds {by['small']}; goal seeds {by['goal']}", flush=True)
    started = time.perf_counter()
    doc: dict = {"run_seed": seed, "seeds": seeds, "load_start": os.getloadavg()[0]}
    doc["exact"] = exact_checks(seeds)
    doc["exact_summary"] = summarise_exact(doc["exact"])
    doc["synthetic"] = goal_rows_synthetic(seeds)
    doc["synthetic_summary"] = summarise_goals(doc["synthetic"])
    doc["traced"] = traced_rows(traced_models) if traced_models is not None else []
    doc["traced_summary"] = summarise_goals(doc["traced"]) if doc["traced"] else {}
    doc["combined_summary"] = summarise_goals(doc["synthetic"] + doc["traced"])
    doc["training"] = training_rows(doc["traced"])
    doc["seconds"] = time.perf_counter() - started
    doc["load"] = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    write_markdown(doc, out.with_suffix(".md"))
    return doc


def resummarise(doc: dict) -> dict:
    """The summaries again from the rows (``--render``: a changed summary, the same run)."""
    doc["exact_summary"] = summarise_exact(doc["exact"])
    doc["synthetic_summary"] = summarise_goals(doc["synthetic"])
    doc["traced_summary"] = summarise_goals(doc["traced"]) if doc["traced"] else {}
    doc["combined_summary"] = summarise_goals(doc["synthetic"] + doc["traced"])
    return doc


def write_markdown(doc: dict, path: Path) -> None:
    ex, syn, tr = doc["exact_summary"], doc["synthetic_summary"], doc.get("traced_summary") or {}
    both_sets = doc.get("combined_summary") or {}
    lines = [
        "# Partition on fresh graphs (seeds drawn at run time)",
        "",
        f"Command: `{doc.get('command', 'python bench/partition.py --fresh')}`; run seed **{doc['run_seed']}** "
        f"(rerun: `--run-seed {doc['run_seed']}`); load average {doc['load']} at the end; "
        f"{doc['seconds']:.0f} s. Graph seeds per family: "
        + "; ".join(f"{f}: {by['goal']}" for f, by in doc["seeds"].items())
        + ".",
        "",
        "Makespan: the simulator's (simulate.py) single-sample latency; LB = max(critical path without "
        "transfers, work / k); excess ratio = (ours - LB) / (METIS - LB); critical cut: transfer cost of "
        "the static critical edges cut. METIS is run as `partition(g, k, 'metis')` with the same cap.",
        "",
        "## Goals",
        "",
        "| goal | synthetic (fresh) | traced models | both together |",
        "|---|---|---|---|",
    ]

    def both(key: str, fmt=str) -> str:
        a = syn.get(key)
        b = tr.get(key) if tr else None
        c = both_sets.get(key) if both_sets else None
        return f"| {fmt(a)} | {fmt(b) if b is not None else 'n/a'} | {fmt(c) if c is not None else 'n/a'} |"

    lines += [
        "| makespan above METIS's where both meet the caps (goal 0) "
        + both("makespan_above_metis_where_both_within_caps"),
        f"| critical cut no higher than METIS's (goal >= {CRITICAL_GOAL:.0%}) "
        + both("critical_cut_no_higher_than_metis"),
        f"| median excess ratio (goal <= {EXCESS_GOAL}) " + both("median_excess_ratio", _fmt),
        "| median excess ratio against the tightest valid bound B, (ours - B) / (METIS - B), ours within "
        "the caps " + both("median_excess_ratio_vs_bound", _fmt),
        "| ours's makespan equal to METIS's (within 0.1%) " + both("ours_equal_to_metis"),
        "| excess ratio quartiles " + both("excess_ratio_quartiles", _fmt_list),
        "| CPU time vs METIS, median / max " + f"| {_fmt(syn.get('median_cpu_ratio_vs_metis'))}x / "
        f"{_fmt(syn.get('max_cpu_ratio_vs_metis'))}x | {_fmt(tr.get('median_cpu_ratio_vs_metis'))}x / "
        f"{_fmt(tr.get('max_cpu_ratio_vs_metis'))}x | {_fmt(both_sets.get('median_cpu_ratio_vs_metis'))}x / "
        f"{_fmt(both_sets.get('max_cpu_ratio_vs_metis'))}x |",
        "| the best excess ratio any within-cap partition could reach, (B - LB) / (METIS - LB) with B the "
        "path-cut bound: median; cases where it is above 0.5 "
        + "".join(
            f"| {_fmt(x.get('median_best_possible_excess_ratio'))}; {x.get('best_possible_above_half', 'n/a')} "
            for x in (syn, tr, both_sets)
        )
        + "|",
        "",
    ]
    for label, s in (("synthetic", syn), ("traced", tr)):
        if s and s.get("makespan_above_metis_cases"):
            lines += [f"{label}: makespan above METIS in " + ", ".join(s["makespan_above_metis_cases"]), ""]
        if s and s.get("critical_cut_higher_cases"):
            lines += [f"{label}: critical cut above METIS's in " + ", ".join(s["critical_cut_higher_cases"]), ""]
        if s and s.get("ours_outside_caps"):
            lines += [f"{label}: ours outside the caps in " + ", ".join(s["ours_outside_caps"]), ""]
    if doc.get("training"):
        lines += [
            f"## Training step graphs (goal: within {TRAINING_GOAL}x of the lower bound)",
            "",
            "LB = max(critical path without transfers, work / k); B = the tightest valid bound for "
            "partitions within the caps (simulate.path_cut_bound, with the forced-cut bound and its exact "
            "packing check).",
            "",
            "| graph | k | ours | METIS | LB | B | ours / LB | ours / B | within caps |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in doc["training"]:
            ratio_b = r.get("ratio_to_bound", r["ours"] / r["path_cut_bound"])
            lines.append(
                f"| {r['graph']} | {r['k']} | {r['ours']:.4g} | {r['metis']:.4g} | {r['lower_bound']:.4g} | "
                f"{r['path_cut_bound']:.4g} | {r['ratio_to_lower_bound']:.2f} | {ratio_b:.2f} | "
                f"{_yn(r['ours_within_caps'])} |"
            )
        lines.append("")
    lines += [
        "## Exact checks on small DAGs",
        "",
        f"{ex['cases']} cases (every family, 14-18 operators, k = {', '.join(map(str, SMALL_KS))}, "
        f"{SMALL_IMBALANCE:.0%} cap); solved exactly: {ex['solved']} (no partition within the cap: "
        f"{ex['skipped_no_feasible_partition']}; branch and bound stopped at {EXACT_NODE_LIMIT:,} nodes: "
        f"{ex['unsolved_within_node_limit']}). Ours optimal in **{ex['ours_optimal']}/{ex['solved']}**; ours "
        f"not above METIS (METIS within the cap): {ex['ours_not_above_metis']}; ours's critical cut at the "
        f"ILP's minimum: {ex['ours_critical_cut_at_ilp_optimum']}.",
        "",
        "Makespan over the optimum - 1, after each phase of ours (best start: the fastest start within the "
        "caps; chosen: the final choice's pick; descended: after the critical-chain descent; improved: after "
        "the final improvement phase):",
        "",
        "| phase | median | mean | max |",
        "|---|---|---|---|",
    ]
    for key, st in list(ex["gap_by_phase"].items()) + [("METIS", ex["metis_gap"])]:
        if st:
            lines.append(f"| {key} | {st['median']:.4f} | {st['mean']:.4f} | {st['max']:.4f} |")
    lines += ["", "Largest losses (ours over the optimum):", ""]
    for loss in ex["largest_losses"]:
        lines.append(
            f"- {loss['case']}: {loss['gap']:.3f} (chosen {loss['label']}; best start {_fmt(loss['best_start_gap'])})"
        )
    lines += [
        "",
        "## Per case",
        "",
        "| graph | k | ours | METIS | LB | crit cut ours / METIS | ours chosen |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["synthetic"] + doc["traced"]:
        lines.append(
            f"| {r['graph']} | {r['k']} | {r['ours']:.4g}{'' if r['ours_within_caps'] else ' (over cap)'} | "
            f"{r['metis']:.4g}{'' if r['metis_within_caps'] else ' (over cap)'} | {r['lower_bound']:.4g} | "
            f"{r['ours_critical_cut']:.4g} / {r['metis_critical_cut']:.4g} | {r['ours_label']} |"
        )
    path.write_text("\n".join(lines) + "\n")


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _fmt_list(xs) -> str:
    return "n/a" if not xs else ", ".join(f"{x:.3g}" for x in xs)


def _yn(flag) -> str:
    return "y" if flag else "n"
