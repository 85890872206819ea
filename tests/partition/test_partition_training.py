"""Training graphs: forward + backward + optimizer step from one export (aot_autograd's joint
graph), activations held for the backward, ``--training`` in the CLI."""

import json

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from trainmaster.cli.main import main
from trainmaster.partition import evaluate, partition
from trainmaster.partition.importers import DEFAULT_FLOPS_PER_SECOND, from_module_training
from trainmaster.partition.models import encoder, mlp

FAMILIES = {"mlp": (lambda: mlp(), (8, 64)), "encoder": (lambda: encoder(), (2, 16, 64))}


def fwd_bwd_flops(model, x) -> int:
    """FlopCounterMode's count of one forward and backward pass of the same scalar loss."""
    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).float().pow(2).mean().backward()
    return counter.get_total_flops()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def traced(request):
    build, shape = FAMILIES[request.param]
    torch.manual_seed(0)
    model, x = build(), torch.randn(*shape)
    graph, _ = from_module_training(model, (x,))
    return request.param, model, x, graph


def test_training_graph_has_forward_backward_and_optimizer_flops(traced):
    """Mechanism: training graph import: one joint export holds the forward and backward
    operators (FLOPs within 10% of FlopCounterMode on forward + backward) and one SGD update
    per parameter (2 FLOPs per element), co-located with that parameter's node."""
    name, model, x, g = traced
    names = g.names
    phases = {p: [i for i, n in enumerate(names) if n.startswith(p)] for p in ("fwd:", "bwd:", "opt:")}
    params = list(model.parameters())
    assert len(phases["opt:"]) == len(params) and phases["fwd:"] and phases["bwd:"]
    opt = g.cost[phases["opt:"]].sum() * DEFAULT_FLOPS_PER_SECOND
    assert opt == pytest.approx(2 * sum(p.numel() for p in params))
    ratio = (g.cost.sum() * DEFAULT_FLOPS_PER_SECOND - opt) / fwd_bwd_flops(model, x)
    assert 0.9 <= ratio <= 1.1, f"{name}: imported/counted forward+backward FLOPs = {ratio:.3f}"
    for i in phases["opt:"]:  # its class holds exactly the update and its parameter
        members = np.flatnonzero(g.group == g.group[i])
        assert len(members) == 2 and g.group[i] >= 0
        other = [m for m in members if m != i][0]
        assert names[other].startswith("fwd:placeholder")
        assert g.memory[other] > 0  # the parameter's bytes


def test_activations_are_held_until_the_backward_reads_them(traced):
    """Mechanism: activation memory: forward operators whose output the backward reads have an
    edge to a backward operator and keep their output bytes in memory (charged to their device
    whatever device runs the backward), so partitions pay for them."""
    _, _, _, g = traced
    fwd = np.array([n.startswith("fwd:call") for n in g.names])
    bwd = np.array([n.startswith("bwd:") for n in g.names])
    saved = np.unique(g.src[fwd[g.src] & bwd[g.dst]])
    assert len(saved) >= 3
    assert np.all(g.memory[saved] > 0)
    # their transfer is priced: an edge into the backward costs its tensor's bytes / bandwidth
    into = fwd[g.src] & bwd[g.dst]
    assert np.all(g.edge_cost[into] >= 0) and g.edge_cost[into].max() > 0


def test_training_graph_partitions_within_caps_no_slower_than_metis(traced):
    """Mechanism: ours on training graphs: within the caps at k = 2 and 4, each update on its
    parameter's device, makespan no worse than METIS's where METIS meets the caps."""
    _, _, _, g = traced
    for k in (2, 4):
        ours, metis = partition(g, k), partition(g, k, "metis")
        eo, em = evaluate(g, ours.assignment, k), evaluate(g, metis.assignment, k)
        assert ours.feasible and eo["colocation_ok"]
        if metis.feasible:
            assert eo["makespan"] <= em["makespan"] * (1 + 1e-9)


def run(args, capsys):
    with pytest.raises(SystemExit) as code:
        main(args)
    out = capsys.readouterr()
    return code.value.code or 0, out.out, out.err


def test_cli_training_switch(tmp_path, capsys):
    """Mechanism: --training in the CLI: a module:callable becomes its training step (more
    nodes than the forward alone); a graph file or a non-export importer is refused (exit 2)."""
    spec = "trainmaster.partition.models:mlp"
    code, out, _ = run(["partition", spec, "-k", "2", "--input-shape", "8,64", "--json"], capsys)
    forward_nodes = json.loads(out)["nodes"]
    code, out, err = run(["partition", spec, "-k", "2", "--input-shape", "8,64", "--json", "--training"], capsys)
    assert code == 0, err
    metrics = json.loads(out)
    assert metrics["nodes"] > 3 * forward_nodes and metrics["feasible"] is True
    file = tmp_path / "g.json"
    file.write_text(
        json.dumps(
            {
                "nodes": [{"id": "a", "cost": 1.0}, {"id": "b", "cost": 1.0}],
                "edges": [{"src": "a", "dst": "b", "cost": 1.0}],
            }
        )
    )
    code, _, err = run(["partition", str(file), "-k", "2", "--training"], capsys)
    assert code == 2 and "--training needs a model given as module:callable" in err
    assert "Traceback" not in err
    code, _, err = run(
        ["partition", spec, "-k", "2", "--input-shape", "8,64", "--training", "--importer", "fx"], capsys
    )
    assert code == 2 and "--importer fx cannot" in err.replace("\n", " ")


def test_returned_gradients_move_nothing(traced):
    """Mechanism: gradients stay where computed: the joint graph returns every gradient through
    its one output node; those edges order the step's end but cost no transfer (priced, they
    sent every weight-sized gradient to one device), while the forward's edges keep theirs."""
    _, _, _, g = traced
    out = [i for i, n in enumerate(g.names) if n.startswith("bwd:output") or n.endswith(":output")]
    assert len(out) == 1
    into = np.flatnonzero(g.dst == out[0])
    priced = into[g.edge_cost[into] > 0]
    assert len(into) > 2 and len(priced) == 1  # the loss: a scalar, still moved
    assert "mean" in g.names[g.src[priced[0]]] and g.edge_cost[priced[0]] < 1e-6
    fwd = np.array([n.startswith("fwd:call") for n in g.names])
    assert g.edge_cost[fwd[g.src] & fwd[g.dst]].max() > 0
