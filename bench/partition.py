"""Benchmark of the partitioner: ours vs the disclosure's method, METIS, KaHIP and the ILP optimum.

For every profiled graph in the shared data folder and k in {2, 4, 8} at 5% imbalance: critical
cut (count, cost; static slack, delta = 0), total cut cost, balance, simulated makespan, pipeline
max-load and end-to-end wall time (load the JSON file, build the graph, partition; median of
--repeats runs) for each method; the ILP optimum of the cost-weighted critical cut where it
finishes within --ilp-time seconds. Then the scaling of ours vs METIS on synthetic
series-parallel DAGs. Writes bench/results/partition.json and bench/results/partition.md.

    .venv/bin/python bench/partition.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainmaster.partition import build_graph, evaluate, load_graph, partition  # noqa: E402
from trainmaster.partition.io import data_graphs, shared_data_dir  # noqa: E402

METHODS = ("trainmaster", "patent", "metis", "kahip")


def series_parallel_dag(n: int, seed: int = 0):
    """A chain of blocks; 30% of blocks fan out into 2-4 parallel chains of 1-3 ops that join."""
    rng = np.random.default_rng(seed)
    src: list[int] = []
    dst: list[int] = []
    last, nid = 0, 1
    while nid < n:
        if rng.random() < 0.3 and n - nid > 13:
            ends = []
            for _ in range(int(rng.integers(2, 5))):
                prev = last
                for _ in range(int(rng.integers(1, 4))):
                    src.append(prev)
                    dst.append(nid)
                    prev, nid = nid, nid + 1
                ends.append(prev)
            for e in ends:
                src.append(e)
                dst.append(nid)
            last, nid = nid, nid + 1
        else:
            src.append(last)
            dst.append(nid)
            last, nid = nid, nid + 1
    return build_graph(list(range(nid)), rng.uniform(0.1, 2.0, nid), src, dst,
                       rng.uniform(0.0, 1.0, len(src)))


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def bench_graphs(ks, repeats, ilp_time, ilp_max_nodes):
    rows = []
    for path in data_graphs():
        g = load_graph(str(path))
        name = f"{path.parent.name}/{path.stem}"
        for k in ks:
            for method in METHODS:
                res, secs = timed(lambda: partition(load_graph(str(path)), k, method), repeats)
                ev = evaluate(g, res.assignment, k, 0.05)
                rows.append({"graph": name, "nodes": g.n, "k": k, "method": method,
                             "seconds": secs, **_pick(ev)})
            if g.n <= ilp_max_nodes:
                from trainmaster.partition.ilp import ilp_partition

                t0 = time.perf_counter()
                a, notes = ilp_partition(g, k, 0.05, time_limit=ilp_time)
                secs = time.perf_counter() - t0
                if notes.get("optimal"):
                    ev = evaluate(g, a, k, 0.05)
                    rows.append({"graph": name, "nodes": g.n, "k": k, "method": "ilp",
                                 "seconds": secs, **_pick(ev)})
                else:
                    rows.append({"graph": name, "nodes": g.n, "k": k, "method": "ilp",
                                 "seconds": secs, "unsolved": str(notes.get("status"))})
            print(f"{name} k={k} done", flush=True)
    return rows


def _pick(ev: dict) -> dict:
    keys = ("critical_cut_count", "critical_cut_cost", "cut_count", "cut_cost", "balance",
            "load_cap", "balanced", "memory_ok", "makespan", "lower_bound", "max_load",
            "avg_load", "device_graph_acyclic", "colocation_ok")
    out = {k: ev[k] for k in keys}
    out["load_cap_ratio"] = ev["load_cap"] / ev["avg_load"] if ev["avg_load"] else 1.0
    return out


def bench_scaling(sizes, repeats, k=8):
    rows = []
    for n in sizes:
        reps = repeats if n <= 20_000 else 1
        for method in ("trainmaster", "metis"):
            def run():
                g = series_parallel_dag(n)
                return g, partition(g, k, method)
            (g, res), secs = timed(run, reps)
            ev = evaluate(g, res.assignment, k) if n <= 200_000 else {}
            rows.append({"nodes": g.n, "k": k, "method": method, "seconds": secs, "runs": reps,
                         "makespan": ev.get("makespan"), "lower_bound": ev.get("lower_bound"),
                         "balance": ev.get("balance")})
            print(f"scaling n={n} {method} {secs:.3f}s", flush=True)
    return rows


def summarise(rows):
    cases = {}
    for r in rows:
        cases.setdefault((r["graph"], r["k"]), {})[r["method"]] = r
    beat_ccut, excess_ratio, never_worse, worse_cases, ilp_gaps, time_ratio = [], [], [], [], [], []
    for (graph, k), c in cases.items():
        o, m = c["trainmaster"], c["metis"]
        beat_ccut.append(o["critical_cut_cost"] < m["critical_cut_cost"] - 1e-9
                         or (m["critical_cut_cost"] == 0 and o["critical_cut_cost"] == 0))
        lb = o["lower_bound"]
        if m["makespan"] - lb > 1e-9:
            excess_ratio.append((o["makespan"] - lb) / (m["makespan"] - lb))
        never_worse.append(o["makespan"] <= m["makespan"] + 1e-9)
        if o["makespan"] > m["makespan"] + 1e-9:
            worse_cases.append(f"{graph} k={k} (METIS memory_ok={m['memory_ok']}, "
                               f"ours memory_ok={o['memory_ok']})")
        ilp = c.get("ilp")
        if ilp and "unsolved" not in ilp:
            base = max(ilp["critical_cut_cost"], 1e-9)
            ilp_gaps.append((o["critical_cut_cost"] - ilp["critical_cut_cost"]) / base)
        time_ratio.append(o["seconds"] / m["seconds"])
    balanced = [r["balanced"] for r in rows if r["method"] == "trainmaster"]
    return {
        "cases": len(cases),
        "makespan_not_worse_than_metis": f"{sum(never_worse)}/{len(never_worse)}",
        "makespan_worse_cases": worse_cases,
        "median_excess_ratio_vs_metis": statistics.median(excess_ratio) if excess_ratio else None,
        "critical_cut_cost_below_metis": f"{sum(beat_ccut)}/{len(beat_ccut)}",
        "within_balance_cap": f"{sum(balanced)}/{len(balanced)}",
        "ilp_cases_solved": len(ilp_gaps),
        "ilp_within_5pct": f"{sum(g <= 0.05 + 1e-9 for g in ilp_gaps)}/{len(ilp_gaps)}",
        "median_ilp_gap": statistics.median(ilp_gaps) if ilp_gaps else None,
        "median_time_ratio_vs_metis": statistics.median(time_ratio) if time_ratio else None,
        "max_time_ratio_vs_metis": max(time_ratio) if time_ratio else None,
    }


def write_markdown(doc, path: Path):
    lines = [
        "# Partition benchmark (numbers noisy: measured on a shared 2-core machine while other "
        "jobs ran; times are medians, ratios within one run are the meaningful part)",
        "",
        f"Command: `{doc['command']}`; k in {doc['ks']}, imbalance 5%, repeats {doc['repeats']}.",
        "Makespan: list-scheduling simulation; critical = static slack 0 (every edge charged). "
        "Time: load JSON + build graph + partition, end to end.",
        "",
    ]
    s = doc["summary"]
    if s:
        lines += ["## Goals", "", "| goal | result |", "|---|---|",
                  f"| makespan never worse than METIS | {s['makespan_not_worse_than_metis']} |",
                  f"| median (ours - LB) / (METIS - LB), goal <= 0.5 | "
                  f"{_fmt(s['median_excess_ratio_vs_metis'])} |",
                  f"| cost-weighted critical cut below METIS, goal >= 80% | "
                  f"{s['critical_cut_cost_below_metis']} |",
                  f"| within the balance cap | {s['within_balance_cap']} |",
                  f"| critical cut within 5% of the ILP optimum (solved cases) | "
                  f"{s['ilp_within_5pct']} (median gap {_fmt(s['median_ilp_gap'])}) |",
                  f"| time vs METIS end to end, goal <= 10x | median {_fmt(s['median_time_ratio_vs_metis'])}x, "
                  f"max {_fmt(s['max_time_ratio_vs_metis'])}x |", ""]
        if s["makespan_worse_cases"]:
            lines += ["Cases where our makespan is above METIS's: "
                      + "; ".join(s["makespan_worse_cases"]), ""]
        lines += ["## Per graph", "",
                  "| graph | k | method | crit cut (n / cost) | cut cost | balance (cap) | mem ok | "
                  "makespan (LB) | max-load | acyclic | time ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in doc["graphs"]:
            if "unsolved" in r:
                lines.append(f"| {r['graph']} | {r['k']} | ilp | no optimum: {r['unsolved'][:60]} "
                             f"| | | | | | | {r['seconds'] * 1000:.0f} |")
                continue
            lines.append(
                f"| {r['graph']} | {r['k']} | {r['method']} | {r['critical_cut_count']} / "
                f"{r['critical_cut_cost']:.1f} | {r['cut_cost']:.1f} | {r['balance']:.3f} "
                f"({r['load_cap_ratio']:.2f}) | {'y' if r['memory_ok'] else 'n'} | "
                f"{r['makespan']:.1f} ({r['lower_bound']:.1f}) | {r['max_load']:.1f} | "
                f"{'y' if r['device_graph_acyclic'] else 'n'} | {r['seconds'] * 1000:.1f} |")
        lines.append("")
    else:
        lines += [f"Data graphs skipped: {doc['skipped']}", ""]
    lines += ["## Scaling on synthetic series-parallel DAGs (k = 8)", "",
              "| nodes | method | time s | makespan | balance |", "|---|---|---|---|---|"]
    for r in doc["scaling"]:
        lines.append(f"| {r['nodes']} | {r['method']} | {r['seconds']:.4f} | "
                     f"{_fmt(r['makespan'])} | {_fmt(r['balance'])} |")
    path.write_text("\n".join(lines) + "\n")


def _fmt(x):
    return "n/a" if x is None else f"{x:.3g}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="k in {2, 4}, 3 repeats, small ILPs")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--ilp-time", type=float, default=None)
    ap.add_argument("--ilp-max-nodes", type=int, default=None)
    ap.add_argument("--sizes", default=None, help="comma-separated synthetic DAG sizes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "partition"))
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the markdown from the existing JSON results")
    args = ap.parse_args(argv)
    if args.render:
        out = Path(args.out)
        doc = json.loads(out.with_suffix(".json").read_text())
        doc["summary"] = summarise(doc["graphs"]) if doc["graphs"] else {}
        write_markdown(doc, out.with_suffix(".md"))
        return
    ks = [2, 4] if args.quick else [2, 4, 8]
    repeats = args.repeats or (3 if args.quick else 5)
    ilp_time = args.ilp_time or (20.0 if args.quick else 120.0)
    ilp_max = args.ilp_max_nodes or (100 if args.quick else 200)
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes else
             ([1000, 2000, 10000] if args.quick else [1000, 2000, 10000, 100000, 1000000]))
    doc = {"command": "python bench/partition.py " + " ".join(argv or sys.argv[1:]),
           "ks": ks, "repeats": repeats, "python": platform.python_version(),
           "machine": platform.machine(), "graphs": [], "summary": {}, "skipped": None}
    if shared_data_dir() is None:
        doc["skipped"] = ("shared data folder ../shared/data/dnn-partitioning not found "
                          "(set TRAINMASTER_SHARED_DATA)")
        print("skipping data graphs:", doc["skipped"])
    else:
        doc["graphs"] = bench_graphs(ks, repeats, ilp_time, ilp_max)
        doc["summary"] = summarise(doc["graphs"])
    doc["scaling"] = bench_scaling(sizes, repeats)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    write_markdown(doc, out.with_suffix(".md"))
    print(json.dumps(doc["summary"], indent=1))


if __name__ == "__main__":
    main()
