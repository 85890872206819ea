"""Loaders (profiled JSON, our JSON, torch.fx/torch.export, ONNX), the CLI and its errors."""

import json

import pytest
import torch

from trainmaster.cli.main import main
from trainmaster.errors import UserError
from trainmaster.partition import graph_from_dict, graph_to_dict, load_graph, partition
from trainmaster.partition.importers import from_module, from_onnx
from trainmaster.partition.io import data_graphs, shared_data_dir

PROFILED = {
    "maxSizePerFPGA": 100.0,
    "maxFPGAs": 2,
    "maxCPUs": 1,
    "nodes": [
        {
            "id": 1,
            "fpgaLatency": 1.0,
            "cpuLatency": 9,
            "size": 10.0,
            "colorClass": 1,
            "supportedOnFpga": 1,
            "isBackwardNode": False,
        },
        {"id": 2, "fpgaLatency": 2.0, "cpuLatency": 9, "size": 20.0, "colorClass": 7},
        {"id": 3, "fpgaLatency": 3.0, "cpuLatency": 9, "size": 30.0, "colorClass": 7},
    ],
    "edges": [{"sourceId": 1, "destId": 2, "cost": 0.5}, {"sourceId": 2, "destId": 3, "cost": 0.25}],
}


def test_profiled_format_fields():
    """Mechanism: loader for the shared profiled JSON (fpgaLatency, size, colorClass, cost)."""
    g = graph_from_dict(PROFILED)
    assert g.cost.tolist() == [1.0, 2.0, 3.0] and g.memory.tolist() == [10.0, 20.0, 30.0]
    assert g.edge_cost.tolist() == [0.5, 0.25] and g.memory_cap == 100.0
    assert g.group[1] == g.group[2] != g.group[0]


def test_our_format_roundtrip(tmp_path):
    """Mechanism: our own JSON graph format, written and read back."""
    g = graph_from_dict(PROFILED)
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph_to_dict(g)))
    h = load_graph(str(path))
    assert h.cost.tolist() == g.cost.tolist() and h.edge_cost.tolist() == g.edge_cost.tolist()
    assert (h.group[1] == h.group[2]) and h.memory_cap == 100.0


@pytest.mark.parametrize(
    "doc,msg",
    [
        ({"nodes": [{"id": "a"}, {"id": "b"}], "edges": [{"src": "a", "dst": "b"}, {"src": "b", "dst": "a"}]}, "cycle"),
        ({"nodes": [{"id": "a"}], "edges": [{"src": "a", "dst": "zz"}]}, "unknown node"),
        ({"nodes": [{"id": "a"}], "edges": [{"src": "a", "dst": "a"}]}, "cycle"),
        ({"edges": []}, "nodes"),
    ],
)
def test_invalid_graphs_are_user_errors(doc, msg):
    """Mechanism: invalid graphs (cycles, unknown node ids) give a clear error."""
    with pytest.raises(UserError, match=msg):
        graph_from_dict(doc)


def test_data_graphs_load_when_present():
    """Mechanism: the shared profiled graphs load (skipped where ../shared is absent)."""
    if shared_data_dir() is None:
        pytest.skip(
            "shared data folder ../shared/data/dnn-partitioning is absent (set TRAINMASTER_SHARED_DATA to use it)"
        )
    files = data_graphs()
    assert len(files) >= 8
    for f in files:
        g = load_graph(str(f))
        assert g.n >= 32 and len(g.topo) == g.n


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(16, 32)
        self.c = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.relu(self.a(x)) + torch.tanh(self.b(x)))


def test_fx_importer_costs_from_flops_and_bytes():
    """Mechanism: torch.fx trace, node cost from FLOPs (flop_counter), edge cost bytes/bandwidth."""
    g, gm = from_module(Block(), (torch.randn(8, 16),), bandwidth=1e6, flops_per_second=1e9, tracer="fx")
    idx = {n: i for i, n in enumerate(g.node_ids)}
    assert g.cost[idx["a"]] == pytest.approx(2 * 8 * 16 * 32 / 1e9)
    assert g.cost[idx["c"]] == pytest.approx(2 * 8 * 32 * 4 / 1e9)
    e = [i for i in range(g.m) if g.node_ids[g.src[i]] == "a"][0]
    assert g.edge_cost[e] == pytest.approx(8 * 32 * 4 / 1e6)
    assert g.memory[idx["a"]] >= (16 * 32 + 32) * 4
    res = partition(g, 2)
    assert set(res.assignment.tolist()) <= {0, 1}


def test_export_importer():
    """Mechanism: torch.export trace of a real module."""
    g, _ = from_module(Block(), (torch.randn(8, 16),), tracer="export")
    assert g.cost.sum() > 0 and g.m >= 6


def test_onnx_importer(tmp_path):
    """Mechanism: ONNX loader with shape-inferred FLOP and tensor-byte costs."""
    path = tmp_path / "m.onnx"
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)
    )
    torch.onnx.export(model, (torch.randn(1, 3, 8, 8),), str(path), dynamo=False)
    g = from_onnx(path, bandwidth=1.0, flops_per_second=1.0)
    ops = g.names
    conv = ops.index("Conv")
    assert g.cost[conv] == pytest.approx(2 * 8 * 6 * 6 * 3 * 3 * 3)
    assert g.edge_cost[0] == pytest.approx(8 * 6 * 6 * 4)
    assert load_graph(str(path)).n == g.n


def run_cli(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr()


def test_cli_out_and_json(tmp_path, capsys):
    """Mechanism: `trainmaster partition GRAPH --devices K --out --json` for every method."""
    path = tmp_path / "g.json"
    path.write_text(json.dumps(PROFILED))
    for method in ("trainmaster", "patent", "metis", "kahip"):
        out = tmp_path / f"{method}.json"
        code, cap = run_cli(
            ["partition", str(path), "--devices", "2", "--method", method, "--out", str(out), "--json"], capsys
        )
        assert code == 0, cap.err
        metrics = json.loads(cap.out)
        doc = json.loads(out.read_text())
        assert set(doc["assignment"]) == {"1", "2", "3"}
        assert doc["assignment"]["2"] == doc["assignment"]["3"]  # colorClass 7
        for key in (
            "critical_cut_count",
            "critical_cut_cost",
            "cut_count",
            "cut_cost",
            "max_load",
            "avg_load",
            "memory_per_device",
            "makespan",
            "device_graph_acyclic",
            "partition_seconds",
        ):
            assert key in metrics


def test_cli_module_callable(capsys):
    """Mechanism: GRAPH as module:callable with --input-shape."""
    code, cap = run_cli(
        ["partition", "trainmaster.partition.models:inception", "-k", "2", "--input-shape", "1,3,16,16", "--json"],
        capsys,
    )
    assert code == 0, cap.err
    metrics = json.loads(cap.out)
    assert metrics["nodes"] > 30 and metrics["makespan"] > 0


@pytest.mark.parametrize(
    "doc,args,msg",
    [
        (
            {"nodes": [{"id": "a"}, {"id": "b"}], "edges": [{"src": "a", "dst": "b"}, {"src": "b", "dst": "a"}]},
            [],
            "cycle",
        ),
        ({"nodes": [{"id": "a"}], "edges": [{"src": "a", "dst": "q"}]}, [], "unknown node"),
        (PROFILED, ["--devices", "5"], "larger than"),
        (PROFILED, ["--method", "nope"], "unknown method"),
    ],
)
def test_cli_invalid_input_exits_2(tmp_path, capsys, doc, args, msg):
    """Mechanism: invalid graphs / k > nodes get a clear error and exit code 2."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    argv = ["partition", str(path), "--devices", "2"] + args
    code, cap = run_cli(argv, capsys)
    assert code == 2
    assert msg in cap.err and "Traceback" not in cap.err


def test_cli_on_every_data_graph_all_methods(tmp_path, capsys):
    """Mechanism: the CLI with --out and --json on every shared graph, all four methods
    (skipped where ../shared/data/dnn-partitioning is absent)."""
    files = data_graphs()
    if not files:
        pytest.skip(
            "shared data folder ../shared/data/dnn-partitioning is absent (set TRAINMASTER_SHARED_DATA to use it)"
        )
    for f in files:
        ids = {str(n["id"]) for n in json.loads(f.read_text())["nodes"]}
        for method in ("trainmaster", "patent", "metis", "kahip"):
            out = tmp_path / f"{f.stem}-{method}.json"
            code, cap = run_cli(
                ["partition", str(f), "--devices", "4", "--method", method, "--out", str(out), "--json"], capsys
            )
            assert code == 0, cap.err
            doc = json.loads(out.read_text())
            assert set(doc["assignment"]) == ids
            assert set(doc["assignment"].values()) <= {0, 1, 2, 3}
            assert json.loads(cap.out)["colocation_ok"] is True
