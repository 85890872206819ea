"""Reading graphs: the profiled-DNN JSON format, our own JSON format, ONNX files and PyTorch modules.

Profiled format (msr-fiddle/dnn-partitioning): nodes carry ``fpgaLatency`` (compute time),
``size`` (bytes, against ``maxSizePerFPGA``) and ``colorClass`` (co-location); edges carry
``sourceId``/``destId``/``cost`` (transfer time). Our format::

    {"nodes": [{"id": "a", "cost": 1.0, "memory": 0, "group": null}, ...],
     "edges": [{"src": "a", "dst": "b", "cost": 0.5, "critical": false}, ...],
     "memory_cap": null}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from trainmaster.errors import UserError
from trainmaster.partition.graph import Graph, build_graph


def shared_data_dir() -> Path | None:
    """The shared profiled-graph folder: $TRAINMASTER_SHARED_DATA or ../shared/data next to the repo."""
    env = os.environ.get("TRAINMASTER_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"
    folder = base / "dnn-partitioning"
    return folder if folder.is_dir() else None


def data_graphs() -> list[Path]:
    """Every profiled graph in the shared folder (empty when the folder is absent)."""
    folder = shared_data_dir()
    if folder is None:
        return []
    return sorted((folder / "latency-inputs").glob("*/*.json"))


def load_json(path: str | Path) -> Graph:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"graph file not found: {path}") from None
    except UnicodeDecodeError:
        raise UserError(f"graph file {path} is not text (not UTF-8): expected a JSON graph") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"graph file {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise UserError(f"graph file {path} nests too deeply to be a graph") from None
    return graph_from_dict(doc, source=str(path))


def graph_from_dict(doc: dict, source: str = "graph") -> Graph:
    """A Graph from a parsed JSON document (profiled or our format). Every mistake is a UserError
    that names ``source`` and the entry (``nodes[3]``, ``edges[0]``) or the node/edge ids."""
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise UserError(f"{source}: expected an object with a 'nodes' list and an 'edges' list")
    nodes, edges = doc["nodes"], doc.get("edges", [])
    if not isinstance(edges, list):
        raise UserError(f"{source}: 'edges' is {_shown(edges)}, expected a list")
    if not nodes:
        raise UserError(f"{source}: the graph has no nodes")
    try:
        for kind, entries in (("nodes", nodes), ("edges", edges)):
            for i, entry in enumerate(entries):
                if not isinstance(entry, dict):
                    raise UserError(f"{kind}[{i}] is {_shown(entry)}, expected an object")
        if "fpgaLatency" in nodes[0] or "sourceId" in (edges[0] if edges else {}):
            return _profiled(doc, nodes, edges)
        return _ours(doc, nodes, edges)
    except UserError as exc:
        raise UserError(f"{source}: {exc.message}", details=exc.details) from None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_MISSING = object()


def _number(entry: dict, key: str, where: str, default=_MISSING) -> float:
    """A JSON number (ints beyond float range become inf, refused later as not finite)."""
    value = entry.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise UserError(f"{where} has no '{key}'; it needs a number there")
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: '{key}' is {_shown(value)}, expected a number")
    try:
        return float(value)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


def _node_id(entry: dict, key: str, where: str):
    value = entry.get(key, _MISSING)
    if value is _MISSING:
        raise UserError(f"{where} has no '{key}'; it needs a node id there")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise UserError(f"{where}: '{key}' is {_shown(value)}, expected a string or integer id")
    return value


def _memory_cap(value, key: str) -> float:
    """None (or, in the profiled format, 0) means unlimited."""
    if value is None:
        return float("inf")
    return _number({key: value}, key, "the graph")


def _profiled(doc: dict, nodes: list, edges: list) -> Graph:
    ids = [_node_id(nd, "id", f"nodes[{i}]") for i, nd in enumerate(nodes)]
    group = []
    for i, nd in enumerate(nodes):
        color = nd.get("colorClass")
        integral = (isinstance(color, int) and not isinstance(color, bool)) or (
            isinstance(color, float) and color.is_integer()
        )
        if color is not None and not (integral and abs(color) < 2**62):
            raise UserError(f"nodes[{i}]: 'colorClass' is {_shown(color)}, expected an integer")
        group.append(-1 if color is None else int(color))
    return build_graph(
        ids,
        [_number(nd, "fpgaLatency", f"node {ids[i]!r}") for i, nd in enumerate(nodes)],
        [_node_id(e, "sourceId", f"edges[{j}]") for j, e in enumerate(edges)],
        [_node_id(e, "destId", f"edges[{j}]") for j, e in enumerate(edges)],
        [_number(e, "cost", f"edges[{j}]") for j, e in enumerate(edges)],
        memory=[_number(nd, "size", f"node {ids[i]!r}", 0.0) for i, nd in enumerate(nodes)],
        group=group,
        memory_cap=_memory_cap(doc.get("maxSizePerFPGA") or None, "maxSizePerFPGA"),
        names=[str(nd.get("name", nd["id"])) for nd in nodes],
    )


def _ours(doc: dict, nodes: list, edges: list) -> Graph:
    ids = [_node_id(nd, "id", f"nodes[{i}]") for i, nd in enumerate(nodes)]
    groups: dict = {}
    group = []
    for i, nd in enumerate(nodes):
        g = nd.get("group")
        if isinstance(g, (list, dict)):
            raise UserError(f"node {ids[i]!r}: 'group' is {_shown(g)}, expected a name, a number or null")
        group.append(-1 if g is None else groups.setdefault(g, len(groups)))
    critical = None
    if any("critical" in e for e in edges):
        critical = []
        for j, e in enumerate(edges):
            label = e.get("critical", False)
            if not isinstance(label, bool):
                raise UserError(f"edges[{j}]: 'critical' is {_shown(label)}, expected true or false")
            critical.append(label)
    return build_graph(
        ids,
        [_number(nd, "cost", f"node {ids[i]!r}", 0.0) for i, nd in enumerate(nodes)],
        [_node_id(e, "src", f"edges[{j}]") for j, e in enumerate(edges)],
        [_node_id(e, "dst", f"edges[{j}]") for j, e in enumerate(edges)],
        [_number(e, "cost", f"edges[{j}]", 0.0) for j, e in enumerate(edges)],
        memory=[_number(nd, "memory", f"node {ids[i]!r}", 0.0) for i, nd in enumerate(nodes)],
        group=group,
        memory_cap=_memory_cap(doc.get("memory_cap"), "memory_cap"),
        names=[str(nd.get("name", nd["id"])) for nd in nodes],
        critical_label=critical,
    )


def graph_to_dict(graph: Graph) -> dict:
    """Our JSON format, e.g. to save a traced model's graph for later runs."""
    return {
        "nodes": [
            {
                "id": nid,
                "cost": float(graph.cost[i]),
                "memory": float(graph.memory[i]),
                "group": None if graph.group[i] < 0 else int(graph.group[i]),
                **({"name": graph.names[i]} if graph.names else {}),
            }
            for i, nid in enumerate(graph.node_ids)
        ],
        "edges": [
            {"src": graph.node_ids[s], "dst": graph.node_ids[d], "cost": float(c)}
            for s, d, c in zip(graph.src.tolist(), graph.dst.tolist(), graph.edge_cost.tolist())
        ],
        "memory_cap": None if not np.isfinite(graph.memory_cap) else graph.memory_cap,
    }


def load_graph(
    spec: str,
    input_shape: tuple[int, ...] | None = None,
    bandwidth: float = 1e9,
    importer: str = "export",
    training: bool = False,
    costs: str = "flops",
) -> Graph:
    """Load GRAPH as the CLI names it: a .json file, a .onnx file, or ``module:callable``
    (imported with ``importer``: export, fx or onnx; see importers.IMPORTERS; ``training``:
    forward + backward + optimizer step, module:callable only; ``costs``: ``flops`` estimates or
    ``profiler`` times, module:callable only)."""
    path = Path(spec)
    if training and ":" not in spec:
        raise UserError(
            f"--training needs a model given as module:callable, not {spec!r} (a "
            "graph file is partitioned as it is: export the training graph into it)"
        )
    if costs != "flops" and ":" not in spec:
        raise UserError(f"--costs {costs} profiles a model given as module:callable; {spec!r} keeps its own costs")
    if path.suffix.lower() == ".onnx":
        from trainmaster.partition.importers import from_onnx

        return from_onnx(path, bandwidth=bandwidth)
    if path.suffix.lower() == ".json" or path.exists():
        return load_json(path)
    if ":" in spec:
        from trainmaster.partition.importers import from_callable

        if input_shape is None:
            raise UserError(f"{spec}: a module:callable graph needs --input-shape, e.g. 1,3,32,32")
        return from_callable(spec, input_shape, bandwidth=bandwidth, importer=importer, training=training, costs=costs)
    raise UserError(f"graph {spec!r}: not a file, and not of the form module:callable")
