"""Training step graphs: how much of ours's distance to the lower bound is the bound's, how much ours's.

``python bench/partition_training_gap.py`` (issue 35: "training step graphs at k = 4 and 8 within
1.5x of the lower bound"). For each traced training step (the MLP 512 x 12 and the 4-layer
encoder of ``bench/partition.py``) and k = 4, 8, at the 5% cap, it reports

- LB, the compute-only bound (critical path without transfers, or work / k);
- B, the tightest valid bound for partitions within the caps (``simulate.path_cut_bound``, with
  the forced-cut bound and its exact packing check; tested against brute force);
- ours (the default, which never cuts more static critical cost than METIS's partition) and ours
  without that critical ceiling (``PartitionOptions(critical_ceiling=False)``);
- the best partition within the caps found by a **stage-aware layout search**: the graph's
  "layers" are the units its dearest edges (cost >= half the dearest) and the co-location classes
  join (on the MLP: a weight, its forward and backward readers and its update); groups of
  consecutive layers go to the devices (every order of the group sizes, each also with one pair of layers
  swapped; then, from the best, further swaps kept while they help; up to ``--evals`` layouts), every other operator follows its predecessor, and while a device is over the cap the
  operator that reads a dear edge latest (the input-gradient matmul of the earliest layer left,
  whose weight has had the whole forward to arrive) moves to the device where the simulated
  makespan is least. Any partition it finds within the caps is an upper bound on the optimum, so
  the optimum lies in [B, that]; where it beats ours, the rest of the gap is ours's.

Deterministic (no seed: fixed traced models, no random choice). Writes
bench/results/partition_training_gap.{json,md}. Example: ``python bench/partition_training_gap.py
--ks 4 --evals 100``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np

from trainmaster.partition import evaluate, partition
from trainmaster.partition.critical import critical_edges, levels
from trainmaster.partition.graph import Graph, clusters_of
from trainmaster.partition.methods import PartitionOptions
from trainmaster.partition.simulate import load_cap, makespan, memory_cap_enforced

RESULTS = Path(__file__).resolve().parent / "results"
IMBALANCE = 0.05


def training_graphs() -> list[tuple[str, Graph]]:
    import torch

    from trainmaster.partition.importers import from_module_training
    from trainmaster.partition.models import encoder, mlp

    out = []
    for name, build, inputs in [
        ("mlp-512x12-training", lambda: mlp(512, 12), lambda: (torch.randn(8, 64),)),
        ("encoder-128x4-training", lambda: encoder(128, 4, 4), lambda: (torch.randn(2, 32, 128),)),
    ]:
        torch.manual_seed(0)  # as bench/partition.py traces them
        out.append((name, from_module_training(build(), inputs())[0]))
    return out


def _units(graph: Graph, base: np.ndarray) -> np.ndarray:
    """Node -> unit: components of the dearest edges (>= half the dearest) and the co-location classes."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    dear = np.flatnonzero(graph.edge_cost >= 0.5 * graph.edge_cost.max(initial=0.0))
    order = np.argsort(base, kind="stable")
    same = base[order[1:]] == base[order[:-1]]
    a = np.concatenate([graph.src[dear], order[:-1][same]])
    b = np.concatenate([graph.dst[dear], order[1:][same]])
    _, unit = connected_components(coo_matrix((np.ones(len(a)), (a, b)), shape=(graph.n, graph.n)), directed=False)
    return unit


def layout_search(graph: Graph, k: int, evals: int) -> tuple[float, np.ndarray | None, int]:
    """(best makespan within the caps, its assignment, layouts evaluated); (inf, None, n) if none fits."""
    base = clusters_of(graph)
    cap = load_cap(graph, k, IMBALANCE, base) * (1 + 1e-9)
    mem_cap = memory_cap_enforced(graph, k)
    flat = levels(graph.with_edges_costs(np.zeros(graph.m)))
    unit = _units(graph, base)
    load = np.bincount(unit, weights=graph.cost)
    # layers: units holding at least half the heaviest unit's load, in order of their first heavy operator
    heavy_units = np.flatnonzero(load >= 0.5 * load.max())
    heavy_op = graph.cost >= 0.1 * graph.cost.max()
    layers = sorted(heavy_units.tolist(), key=lambda u: float(flat.est[(unit == u) & heavy_op].min()))
    dear = graph.edge_cost >= 0.5 * graph.edge_cost.max(initial=0.0)
    reads_dear = np.zeros(graph.n, dtype=bool)
    reads_dear[graph.dst[dear]] = True
    # movable: heavy operators that read a dear edge, outside co-location classes, latest first
    free = graph.group < 0  # an operator in a co-location class stays with it
    movable = sorted(np.flatnonzero(reads_dear & heavy_op & free).tolist(), key=lambda v: -float(flat.est[v]))
    n_layers = len(layers)
    count = [0]

    def score(dev: np.ndarray) -> tuple[float, float, np.ndarray]:
        """(overload, makespan, assignment) of layers on ``dev``, the latest dear readers moved off over-cap devices."""
        count[0] += 1
        a = np.full(graph.n, -1, dtype=np.int64)
        for u, d in zip(layers, dev):
            a[unit == u] = d
        a = _follow(graph, a)
        for v in movable:
            loads = np.bincount(a, weights=graph.cost, minlength=k)
            if loads[a[v]] <= cap:
                continue
            fits = [t for t in range(k) if t != a[v] and loads[t] + graph.cost[v] <= cap]
            if fits:
                a[v] = min(fits, key=lambda t: makespan(graph, np.where(np.arange(graph.n) == v, t, a)))
        loads = np.bincount(a, weights=graph.cost, minlength=k)
        mem = np.bincount(a, weights=graph.memory, minlength=k)
        over = max(float(loads.max()) - cap, 0.0) + max(float(mem.max()) - mem_cap, 0.0) / max(mem_cap, 1e-300)
        return over, makespan(graph, a), a

    # starts: consecutive layers in groups of every order of the group sizes; then pairwise swaps
    sizes = [n_layers // k + (1 if i < n_layers % k else 0) for i in range(k)]
    best_dev = None
    best: tuple[float, float, np.ndarray] | None = None
    perms = sorted(set(itertools.permutations(sizes)))
    swaps = list(itertools.combinations(range(n_layers), 2))
    for swap in [None, *swaps]:  # every order's consecutive groups, then each with one swap
        for perm in perms:
            dev = np.repeat(np.arange(k), perm)
            if swap is not None:
                i, j = swap
                if dev[i] == dev[j] or count[0] >= evals:
                    continue
                dev[i], dev[j] = dev[j], dev[i]
            s = score(dev)
            if best is None or s[:2] < best[:2]:
                best, best_dev = s, dev
    assert best is not None and best_dev is not None
    improved = True
    while improved and count[0] < evals:
        improved = False
        for i, j in itertools.combinations(range(n_layers), 2):
            if best_dev[i] == best_dev[j] or count[0] >= evals:
                continue
            dev = best_dev.copy()
            dev[i], dev[j] = dev[j], dev[i]
            s = score(dev)
            if s[:2] < best[:2]:
                best, best_dev, improved = s, dev, True
    if best[0] > 0:
        return float("inf"), None, count[0]
    return best[1], best[2], count[0]


def _follow(graph: Graph, a: np.ndarray) -> np.ndarray:
    """Every operator not placed yet goes where its last placed predecessor is (else its first successor)."""
    for v in graph.topo.tolist():
        if a[v] < 0:
            preds = [int(graph.src[e]) for e in graph.in_edge[graph.in_ptr[v] : graph.in_ptr[v + 1]]]
            placed = [u for u in preds if a[u] >= 0]
            if placed:
                a[v] = a[placed[-1]]
    for v in graph.topo[::-1].tolist():
        if a[v] < 0:
            succ = [int(graph.dst[e]) for e in graph.out_edge[graph.out_ptr[v] : graph.out_ptr[v + 1]]]
            placed = [u for u in succ if a[u] >= 0]
            a[v] = a[placed[0]] if placed else 0
    return a


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n  python bench/partition_training_gap.py\n  python bench/partition_training_gap.py --ks 4 --evals 100",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ks", default="4,8", help="device counts, comma-separated (default 4,8)")
    parser.add_argument(
        "--evals", type=int, default=400, help="layouts the search may evaluate per graph and k (default 400)"
    )
    args = parser.parse_args()
    try:
        ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        parser.error(f"--ks {args.ks!r}: give integers separated by commas, e.g. 4,8")
    if any(k < 2 for k in ks) or args.evals < 1:
        parser.error("--ks needs values >= 2 and --evals >= 1")
    rows = []
    t_all = time.perf_counter()
    for name, g in training_graphs():
        crit = critical_edges(g)
        for k in ks:
            t0 = time.perf_counter()
            ours = partition(g, k, imbalance=IMBALANCE)
            free = partition(g, k, imbalance=IMBALANCE, options=PartitionOptions(critical_ceiling=False))
            metis = partition(g, k, "metis", imbalance=IMBALANCE)
            eo, ef, em = (evaluate(g, p.assignment, k, IMBALANCE, crit) for p in (ours, free, metis))
            span, layout, tried = layout_search(g, k, args.evals)
            el = evaluate(g, layout, k, IMBALANCE, crit) if layout is not None else None
            row = {
                "graph": name,
                "k": k,
                "lower_bound": eo["lower_bound"],
                "path_cut_bound": eo["path_cut_bound"],
                "ours": eo["makespan"],
                "ours_within_caps": bool(eo["balanced"]),
                "ours_critical_cut": eo["critical_cut_cost"],
                "ours_no_ceiling": ef["makespan"],
                "ours_no_ceiling_critical_cut": ef["critical_cut_cost"],
                "metis": em["makespan"],
                "metis_critical_cut": em["critical_cut_cost"],
                "layout_search": span if layout is not None else None,
                "layout_search_critical_cut": el["critical_cut_cost"] if el else None,
                "layouts_tried": tried,
                "seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    doc = {
        "command": f"python bench/partition_training_gap.py --ks {args.ks} --evals {args.evals}",
        "load_average_end": list(os.getloadavg()),
        "seconds": time.perf_counter() - t_all,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "partition_training_gap.json").write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / "partition_training_gap.md").write_text(markdown(doc))
    print(markdown(doc))


def markdown(doc: dict) -> str:
    def ms(x):
        return "none found" if x is None else f"{x * 1e3:.3f}"

    lines = [
        "# Training step graphs: the bound's share of the gap and ours's",
        "",
        f"Command: `{doc['command']}`; load average {', '.join(f'{x:.1f}' for x in doc['load_average_end'])} "
        f"at the end; {doc['seconds']:.0f} s. Makespans in ms (simulated). LB: compute-only bound; B: the "
        "tightest valid bound within the caps; layout: the best stage-aware layout found within the caps "
        "(an upper bound on the optimum); crit: static critical transfer cost cut, in us.",
        "",
        "| graph | k | LB | B | layout | ours | ours, no ceiling | METIS | ours / LB | ours / B | layout / B | crit: ours / no ceiling / layout / METIS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lay = r["layout_search"]
        ratio = "-" if lay is None else f"{lay / r['path_cut_bound']:.2f}"
        crit = [
            r["ours_critical_cut"],
            r["ours_no_ceiling_critical_cut"],
            r["layout_search_critical_cut"],
            r["metis_critical_cut"],
        ]
        lines.append(
            f"| {r['graph']} | {r['k']} | {ms(r['lower_bound'])} | {ms(r['path_cut_bound'])} | {ms(lay)} | "
            f"{ms(r['ours'])} | {ms(r['ours_no_ceiling'])} | {ms(r['metis'])} | {r['ours'] / r['lower_bound']:.2f} | "
            f"{r['ours'] / r['path_cut_bound']:.2f} | {ratio} | "
            + " / ".join("-" if c is None else f"{c * 1e6:.0f}" for c in crit)
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
