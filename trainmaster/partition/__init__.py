"""Split a DNN computation graph across devices with few costly critical cross-device edges.

Public API: ``load_graph``/``graph_from_dict`` (io), ``Graph`` (CSR DAG), ``levels``,
``critical_edges``, ``edge_slack`` (slack), ``makespan``, ``max_load``, ``evaluate`` (simulation and
metrics), ``partition`` (methods ``trainmaster``, ``patent``, ``metis``, ``kahip``, ``ilp``).
"""

from trainmaster.partition.critical import critical_edges, edge_slack, levels
from trainmaster.partition.graph import Graph, build_graph, clusters_of
from trainmaster.partition.io import graph_from_dict, graph_to_dict, load_graph
from trainmaster.partition.methods import METHODS, Partition, partition
from trainmaster.partition.simulate import evaluate, makespan, max_load

__all__ = [
    "Graph",
    "build_graph",
    "clusters_of",
    "critical_edges",
    "edge_slack",
    "levels",
    "graph_from_dict",
    "graph_to_dict",
    "load_graph",
    "METHODS",
    "Partition",
    "partition",
    "evaluate",
    "makespan",
    "max_load",
]
