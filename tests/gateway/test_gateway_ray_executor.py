"""The Ray executor behind the party's executor interface, over real processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_harness import Deployment

from trainmaster.gateway.client import LegSpec, TaskSpec
from trainmaster.gateway.models import RuleCall
from trainmaster.gateway.routing import MappingTable
from trainmaster.gateway.rules import run_call

pytest.importorskip(
    "ray", reason="Ray is not installed (pip install 'trainmaster[ray]'), so the Ray executor cannot run"
)
pytestmark = pytest.mark.timeout(300)


def test_rule_runs_in_a_ray_actor_executor(tmp_path: Path) -> None:
    """Per-task isolated executor, Ray kind ("a Ray actor where available", same interface): a party
    configured with `executor: ray` runs each leg in its own actor, reports a ray: address to the
    mapping table, and returns the same results as computing the rule on its data directly."""
    dep = Deployment(tmp_path, ["a", "b"], overrides={"a": {"executor": "ray", "executor_start_timeout_s": 180}})
    dep.start_all()
    try:
        ini = dep.initiator(timeout_s=240)
        call = RuleCall(rule="summary_stats", params={"columns": ["mean_radius", "label"]})
        legs = [LegSpec(data_id=f"m_{p}", party=p, rule=call.rule, params=call.params) for p in ("a", "b")]
        out = ini.run_task(TaskSpec(task_id="ray1", leg_timeout_s=120, legs=legs))
        bad = ini.run_task(
            TaskSpec(
                task_id="ray2",
                leg_timeout_s=120,
                legs=[LegSpec(data_id="m_a", party="a", rule="summary_stats", params={"columns": ["no_such_column"]})],
            )
        )
        ini.close()
        for p, rows in zip(("a", "b"), dep.splits):
            table = {n: rows[:, i] for i, n in enumerate(dep.names)}
            assert out["legs"][f"m_{p}"]["result"] == run_call(table, call)
        routed = MappingTable(dep.cfg("gateway").db_url).legs("ray1")
        assert routed["m_a"].address.startswith("ray:") and not routed["m_b"].address.startswith("ray:")
        assert bad["legs"]["m_a"]["outcome"] == "rejected" and "unknown column" in bad["legs"]["m_a"]["detail"]
    finally:
        dep.stop_all()
