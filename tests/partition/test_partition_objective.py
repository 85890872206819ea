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
from trainmaster.partition.initial import packed
from trainmaster.partition.models import mlp
from trainmaster.partition.coarse import cluster_graph
from trainmaster.partition.graph import clusters_of
from trainmaster.partition.simulate import least_max_load, load_cap


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
    assert "no partition can meet --imbalance 0.05" in " ".join(err.split())  # proven: least_max_load
    with pytest.raises(SystemExit) as code:
        main(["partition", str(file), "--devices", "2", "--json"])
    assert json.loads(capsys.readouterr().out)["feasible"] is True


def test_unreachable_load_cap_is_proven(deep_mlp):
    """Mechanism: balance as a constraint, infeasible request: the pigeonhole bound
    (``least_max_load``) proves the 5% cap unreachable for 12 layers on 8 devices (some device
    runs two of the ten heaviest, 1.58x the average) and on 4 (three of them), and the result
    says so; ours's load is at that bound. At 2 devices the bound is below the cap: not flagged."""
    g = deep_mlp
    for k in (4, 8):
        ours = partition(g, k)
        avg = float(g.cost.sum()) / k
        assert not ours.feasible and ours.load_cap_unreachable
        assert ours.notes["least_max_load"] > load_cap(g, k, 0.05, clusters_of(g))
        top = np.bincount(ours.assignment, weights=g.cost, minlength=k).max()
        assert top <= ours.notes["least_max_load"] + 0.01 * avg
    fits = partition(g, 2)
    assert fits.feasible and not fits.load_cap_unreachable
    assert least_max_load(g, 2) < load_cap(g, 2, 0.05)


def test_least_max_load_pigeonhole():
    """Mechanism: the bound on the busiest device: 5 equal operators on 2 devices -> 3 on one;
    with a co-location class of two, that class plus the heaviest other."""
    g = build_graph(list("abcde"), [1.0] * 5, [], [], [])
    assert least_max_load(g, 2) == pytest.approx(3.0)
    assert least_max_load(g, 5) == pytest.approx(1.0)
    grouped = build_graph(list("abcde"), [1.0] * 5, [], [], [], group=[0, 0, -1, -1, -1])
    assert least_max_load(grouped, 4, clusters_of(grouped)) == pytest.approx(2.0)


def test_packing_meets_a_tight_cap_that_lpt_misses():
    """Mechanism: balance as a hard constraint, tight caps: the unit loads of traced inception-6
    at 8 devices (in average loads: 6 x 0.6563, 6 x 0.2363, 24 x 0.105, 0.0886 and crumbs)
    pack within a 5% cap (0.6563 + 0.2363 + 0.105 six times, nine 0.105 twice), but
    longest-processing-time packing leaves a device at 1.060; the bin packing start finds a
    within-cap packing, and ours returns a feasible partition."""
    loads = [0.6563] * 6 + [0.2363] * 6 + [0.105] * 24 + [0.0886] + [0.0016] * 19 + [0.0004] * 12
    n = len(loads)
    g = build_graph([f"v{i}" for i in range(n)], loads, [], [], [])
    k = 8
    cap = load_cap(g, k, 0.05)
    cg = cluster_graph(g, clusters_of(g), g.edge_cost)
    part = cg.expand(packed(cg, k, cap))
    assert np.bincount(part, weights=g.cost, minlength=k).max() <= cap * (1 + 1e-9)
    assert partition(g, k).feasible
