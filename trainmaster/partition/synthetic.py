"""Synthetic DNN-like DAGs with random costs, so the benchmark's goals are judged beyond the
shared graphs (and nothing is tuned to them).

Four families, three built from the block structure real networks repeat:
``series_parallel`` (a chain of blocks, some fanning out into parallel chains that join),
``inception`` (every block fans out into 3-4 branches of 1-3 operators joined by a concat), and
``transformer`` (layers of norm -> Q/K/V in parallel -> attention -> projection -> residual add
-> norm -> two feed-forward operators -> residual add); and one with no block structure at all,
``random_layered`` (layers of 1-4 operators, each reading 1-3 operators of the two layers before
it, as the cells a network architecture search draws), so that nothing is judged only on the
shapes the method was developed on. Operator costs are log-normal; edge
(transfer) costs are log-normal times a communication ratio drawn per graph from
{0.05, 0.3, 1, 3}, so graphs range from compute-bound to transfer-bound. Memory is log-normal
with a per-device cap of a third of the total: too small for k = 2, tight-ish at k = 4.
"""

from __future__ import annotations

import numpy as np

from trainmaster.partition.graph import Graph, build_graph

FAMILIES = ("series_parallel", "inception", "transformer", "random_layered")


class _Builder:
    def __init__(self) -> None:
        self.src: list[int] = []
        self.dst: list[int] = []
        self.n = 0

    def node(self, *preds: int) -> int:
        v = self.n
        self.n += 1
        for p in preds:
            self.src.append(p)
            self.dst.append(v)
        return v


def _fork_join(b: _Builder, last: int, branches: int, rng: np.random.Generator) -> int:
    """``branches`` chains of 1-3 nodes from ``last``, joined by one node; returns the join."""
    ends = []
    for _ in range(branches):
        prev = last
        for _ in range(int(rng.integers(1, 4))):
            prev = b.node(prev)
        ends.append(prev)
    return b.node(*ends)


def _series_parallel(b: _Builder, n: int, rng: np.random.Generator) -> None:
    last = b.node()
    while b.n < n:
        if rng.random() < 0.3:
            last = _fork_join(b, last, int(rng.integers(2, 5)), rng)
        else:
            last = b.node(last)


def _inception(b: _Builder, n: int, rng: np.random.Generator) -> None:
    last = b.node()
    while b.n < n:
        last = _fork_join(b, last, int(rng.integers(3, 5)), rng)  # branches, then concat
        if rng.random() < 0.5:
            last = b.node(last)  # pooling / reduction between blocks


def _transformer(b: _Builder, n: int, rng: np.random.Generator) -> None:
    x = b.node()
    while b.n < n:
        ln = b.node(x)
        q, k, v = b.node(ln), b.node(ln), b.node(ln)
        scores = b.node(q, k)
        attn = b.node(scores, v)
        x = b.node(b.node(attn), x)  # projection, residual add
        ln2 = b.node(x)
        x = b.node(b.node(b.node(ln2)), x)  # feed-forward 1, 2, residual add


def _random_layered(b: _Builder, n: int, rng: np.random.Generator) -> None:
    previous = [b.node()]
    before: list[int] = []
    while b.n < n:
        pool = previous + before
        layer = []
        for _ in range(int(rng.integers(1, 5))):
            reads = rng.choice(len(pool), size=min(len(pool), int(rng.integers(1, 4))), replace=False)
            # at least one input from the layer just before, so the layers stay in sequence
            inputs = {previous[int(rng.integers(len(previous)))]} | {pool[int(i)] for i in reads}
            layer.append(b.node(*sorted(inputs)))
        before, previous = previous, layer
    if len(previous) > 1:
        b.node(*previous)  # one output


def synthetic_dag(family: str, n: int, seed: int = 0, comm_ratio: float | None = None) -> Graph:
    """A DNN-like DAG of about ``n`` operators from ``family`` (see module docstring)."""
    rng = np.random.default_rng(seed)
    b = _Builder()
    builders = {
        "series_parallel": _series_parallel,
        "inception": _inception,
        "transformer": _transformer,
        "random_layered": _random_layered,
    }
    if family not in builders:
        raise ValueError(f"unknown synthetic family {family!r}: choose one of {', '.join(FAMILIES)}")
    builders[family](b, n, rng)
    ratio = float(rng.choice([0.05, 0.3, 1.0, 3.0])) if comm_ratio is None else comm_ratio
    cost = rng.lognormal(0.0, 0.7, b.n)
    edge_cost = ratio * rng.lognormal(0.0, 0.7, len(b.src))
    memory = rng.lognormal(0.0, 1.0, b.n)
    return build_graph(
        list(range(b.n)), cost, b.src, b.dst, edge_cost, memory=memory, memory_cap=float(memory.sum()) / 3.0
    )
