"""The objective the user controls: balance (``--imbalance``) and memory are constraints; among
partitions that meet them ours minimises makespan (then critical cut); when none meets them the
least-violating one is returned, flagged (``feasible: false`` in JSON, a warning in text)."""

import json

import numpy as np
import pytest
import torch

from trainmaster.cli.main import main
from trainmaster.partition import evaluate, graph_to_dict, partition
from trainmaster.partition.graph import build_graph
from trainmaster.partition.importers import from_module
from trainmaster.partition.models import mlp


@pytest.fixture(scope="module")
def deep_mlp():
    """12 equal 512-wide layers traced operator by operator: at 8 devices some device must hold
    two layers (1.33x the average), so no partition meets a 5% imbalance: the issue's case,
    where the old ranking (least overload first) returned a partition 2.3x slower than METIS's
    for 0.1% less overload."""
    torch.manual_seed(0)
    graph, _ = from_module(mlp(512, 12), (torch.randn(8, 64),), tracer="export")
    return graph


def test_infeasible_balance_is_flagged_and_ranked_by_makespan(deep_mlp):
    """Mechanism: infeasible request: no candidate meets the load cap, so the candidates within
    ``infeasible_slack`` of the least-loaded one are ranked by makespan; the result is flagged
    infeasible with its overload, and is no slower than METIS's (which breaks the cap as much)."""
    g, k = deep_mlp, 8
    ours, metis = partition(g, k), partition(g, k, "metis")
    assert not ours.feasible and not metis.feasible
    assert ours.overload > 0.3 and ours.overload <= metis.overload + 0.01 * 1.05
    assert "relaxed_load_cap" in ours.notes
    eo, em = evaluate(g, ours.assignment, k), evaluate(g, metis.assignment, k)
    assert eo["makespan"] <= em["makespan"] * (1 + 1e-9)
    assert not eo["balanced"]


def test_loosened_imbalance_makes_the_same_graph_feasible(deep_mlp):
    """Mechanism: the balance constraint is the user's: at the imbalance the infeasible result
    reached, a partition meeting it exists and ours returns one, no slower than METIS's."""
    g, k = deep_mlp, 8
    first = partition(g, k)
    reached = evaluate(g, first.assignment, k)["balance"] - 1.0 + 1e-6
    ours = partition(g, k, imbalance=reached)
    assert ours.feasible and ours.overload == 0.0
    metis = partition(g, k, "metis", imbalance=reached)
    if metis.feasible:
        assert evaluate(g, ours.assignment, k, reached)["makespan"] <= evaluate(g, metis.assignment, k, reached)[
            "makespan"
        ] * (1 + 1e-9)


def test_feasible_candidate_beats_a_faster_one_over_the_cap():
    """Mechanism: balance is a constraint, not a cost: on a chain whose transfers cost more than
    its compute, the fastest partition keeps it on one device (twice the average load); at
    imbalance 0.05 ours splits it (slower, within the cap), at imbalance 1.0 it keeps it whole."""
    g = build_graph(["a", "b", "c", "d"], [1.0, 1.0, 1.0, 1.0], ["a", "b", "c"], ["b", "c", "d"], [10.0, 10.0, 10.0])
    strict = partition(g, 2, imbalance=0.05)
    assert strict.feasible
    assert np.bincount(strict.assignment, weights=g.cost, minlength=2).max() <= 2.1
    assert evaluate(g, strict.assignment, 2)["makespan"] == pytest.approx(14.0)
    loose = partition(g, 2, imbalance=1.0)
    assert loose.feasible and evaluate(g, loose.assignment, 2, 1.0)["makespan"] == pytest.approx(4.0)


def test_cli_reports_infeasible_in_json_and_text(deep_mlp, tmp_path, capsys):
    """Mechanism: infeasible output: --json carries feasible: false and the overload; the text
    output ends with a warning naming the cap and the --imbalance that would accept it."""
    file = tmp_path / "mlp.json"
    file.write_text(json.dumps(graph_to_dict(deep_mlp)))
    with pytest.raises(SystemExit) as code:
        main(["partition", str(file), "--devices", "8", "--json"])
    assert (code.value.code or 0) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["feasible"] is False and metrics["overload"] > 0.3
    with pytest.raises(SystemExit) as code:
        main(["partition", str(file), "--devices", "8"])
    err = capsys.readouterr().err.replace("\n", " ")
    assert "warning" in err and "--imbalance 0.05" in err and "would accept it" in err
    with pytest.raises(SystemExit) as code:
        main(["partition", str(file), "--devices", "2", "--json"])
    assert json.loads(capsys.readouterr().out)["feasible"] is True
