"""Relax the load cap, then repair (relax.py): a start for graphs where the cap decides."""

from hypothesis import given, settings
from hypothesis import strategies as st

from trainmaster.partition import evaluate, partition
from trainmaster.partition.critical import critical_edges
from trainmaster.partition.graph import clusters_of
from trainmaster.partition.methods import PartitionOptions
from trainmaster.partition.relax import penalty_repair
from trainmaster.partition.simulate import load_cap
from trainmaster.partition.synthetic import FAMILIES, synthetic_dag
from partition_fixtures import weighted_layers


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(FAMILIES), st.integers(0, 10_000), st.sampled_from([2, 3, 4]))
def test_repair_lands_inside_the_caps_and_under_the_ceiling(family, seed, k):
    """Mechanism (relaxed-cap start): a partition made under a 25% cap, repaired to a 5% cap and
    to a ceiling on the static critical cut, either meets both or is refused (None), never
    returned over them."""
    g = synthetic_dag(family, 40, seed)
    loose = partition(g, k, imbalance=0.25, options=PartitionOptions(relaxed_imbalance=(), improve_work=0))
    cluster = clusters_of(g)
    cap = load_cap(g, k, 0.05, cluster)
    guarded = g.edge_cost * critical_edges(g)
    ceiling = float(guarded[loose.assignment[g.src] != loose.assignment[g.dst]].sum()) * 0.8
    repaired, used = penalty_repair(g, loose.assignment, k, cap, float("inf"), cluster, 5_000, guarded, ceiling)
    assert used <= 5_000
    if repaired is not None:
        assert evaluate(g, repaired, k, 0.05)["balanced"]
        cut = float(guarded[repaired[g.src] != repaired[g.dst]].sum())
        assert cut <= ceiling * (1 + 1e-9) + 1e-12


def test_relaxed_start_shortens_a_cap_bound_training_step():
    """Known case: the layered training toy (weights read by forward and backward through dear
    edges) at a tight cap, where every start inside the cap splits a layer early. With the
    relaxed start ours is no slower than without it, and within the caps."""
    g = weighted_layers([4.0, 2.0, 3.0, 2.0, 3.0, 4.0], [6.0, 2.0, 4.0, 3.0, 5.0, 6.0])
    for k in (2, 3):
        with_relax = partition(g, k, imbalance=0.05)
        without = partition(g, k, imbalance=0.05, options=PartitionOptions(relaxed_imbalance=()))
        a, b = evaluate(g, with_relax.assignment, k), evaluate(g, without.assignment, k)
        assert a["balanced"] and a["makespan"] <= b["makespan"] + 1e-9
