"""Graphs shared by the partition tests."""

from __future__ import annotations

from trainmaster.partition import build_graph
from trainmaster.partition.graph import Graph


def weighted_layers(forward: list[float], backward: list[float], dear: float = 100.0) -> Graph:
    """A training step in miniature: per layer a weight w (no compute) read by its forward a and
    its backward b through dear edges; the forward chain, then the backward chain back, through
    cheap links (0.1). Cutting a layer's weight away from either of its readers costs ``dear``."""
    nodes, cost, src, dst, ecost = [], [], [], [], []
    for i, (fa, fb) in enumerate(zip(forward, backward)):
        nodes += [f"w{i}", f"a{i}", f"b{i}"]
        cost += [0.0, fa, fb]
        src += [f"w{i}", f"w{i}"]
        dst += [f"a{i}", f"b{i}"]
        ecost += [dear, dear]
    chain = [f"a{i}" for i in range(len(forward))] + [f"b{i}" for i in reversed(range(len(forward)))]
    return build_graph(nodes, cost, src + chain[:-1], dst + chain[1:], ecost + [0.1] * (len(chain) - 1))
