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
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"graph file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"graph file {path} is not valid JSON: {exc}") from None
    return graph_from_dict(doc, source=str(path))


def graph_from_dict(doc: dict, source: str = "graph") -> Graph:
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise UserError(f"{source}: expected an object with a 'nodes' list and an 'edges' list")
    nodes, edges = doc["nodes"], doc.get("edges", [])
    if not nodes:
        raise UserError(f"{source}: the graph has no nodes")
    try:
        if "fpgaLatency" in nodes[0] or "sourceId" in (edges[0] if edges else {}):
            return _profiled(doc, nodes, edges)
        return _ours(doc, nodes, edges)
    except UserError as exc:
        raise UserError(f"{source}: {exc.message}", details=exc.details) from None
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise UserError(f"{source}: malformed graph entry ({type(exc).__name__}: {exc})") from None


def _profiled(doc: dict, nodes: list, edges: list) -> Graph:
    ids = [nd["id"] for nd in nodes]
    group = [int(nd["colorClass"]) if nd.get("colorClass") is not None else -1 for nd in nodes]
    return build_graph(
        ids, [float(nd["fpgaLatency"]) for nd in nodes],
        [e["sourceId"] for e in edges], [e["destId"] for e in edges],
        [float(e["cost"]) for e in edges],
        memory=[float(nd.get("size", 0.0)) for nd in nodes], group=group,
        memory_cap=float(doc.get("maxSizePerFPGA") or float("inf")),
        names=[str(nd.get("name", nd["id"])) for nd in nodes],
    )


def _ours(doc: dict, nodes: list, edges: list) -> Graph:
    ids = [nd["id"] for nd in nodes]
    groups = {}
    group = []
    for nd in nodes:
        g = nd.get("group")
        group.append(-1 if g is None else groups.setdefault(g, len(groups)))
    cap = doc.get("memory_cap")
    return build_graph(
        ids, [float(nd.get("cost", 0.0)) for nd in nodes],
        [e["src"] for e in edges], [e["dst"] for e in edges],
        [float(e.get("cost", 0.0)) for e in edges],
        memory=[float(nd.get("memory", 0.0)) for nd in nodes], group=group,
        memory_cap=float("inf") if cap is None else float(cap),
        names=[str(nd.get("name", nd["id"])) for nd in nodes],
        critical_label=[bool(e.get("critical", False)) for e in edges]
        if any("critical" in e for e in edges) else None,
    )


def graph_to_dict(graph: Graph) -> dict:
    """Our JSON format, e.g. to save a traced model's graph for later runs."""
    return {
        "nodes": [
            {"id": nid, "cost": float(graph.cost[i]), "memory": float(graph.memory[i]),
             "group": None if graph.group[i] < 0 else int(graph.group[i]),
             **({"name": graph.names[i]} if graph.names else {})}
            for i, nid in enumerate(graph.node_ids)
        ],
        "edges": [
            {"src": graph.node_ids[s], "dst": graph.node_ids[d], "cost": float(c)}
            for s, d, c in zip(graph.src.tolist(), graph.dst.tolist(), graph.edge_cost.tolist())
        ],
        "memory_cap": None if not np.isfinite(graph.memory_cap) else graph.memory_cap,
    }


def load_graph(spec: str, input_shape: tuple[int, ...] | None = None,
               bandwidth: float = 1e9, importer: str = "export") -> Graph:
    """Load GRAPH as the CLI names it: a .json file, a .onnx file, or ``module:callable``
    (imported with ``importer``: export, fx or onnx; see importers.IMPORTERS)."""
    path = Path(spec)
    if path.suffix.lower() == ".onnx":
        from trainmaster.partition.importers import from_onnx

        return from_onnx(path, bandwidth=bandwidth)
    if path.suffix.lower() == ".json" or path.exists():
        return load_json(path)
    if ":" in spec:
        from trainmaster.partition.importers import from_callable

        if input_shape is None:
            raise UserError(f"{spec}: a module:callable graph needs --input-shape, e.g. 1,3,32,32")
        return from_callable(spec, input_shape, bandwidth=bandwidth, importer=importer)
    raise UserError(f"graph {spec!r}: not a file, and not of the form module:callable")
