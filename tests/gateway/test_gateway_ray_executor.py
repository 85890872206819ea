"""The Ray executor behind the party's executor interface, over real processes."""

from __future__ import annotations

from pathlib import Path

import time

import psutil
import pytest
from gateway_harness import Deployment

from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec
from trainmaster.gateway.models import RuleCall
from trainmaster.gateway.relay.mapping import MappingTable
from trainmaster.gateway.rules.registry import run_call
from trainmaster.gateway.executors.sandbox.bubblewrap import SANDBOX_UID, parent_dirs

pytest.importorskip(
    "ray", reason="Ray is not installed (pip install 'trainmaster[ray]'), so the Ray executor cannot run"
)
pytestmark = pytest.mark.timeout(300)


def test_rule_runs_in_a_ray_actor_executor(tmp_path: Path) -> None:
    """Per-task isolated executor, Ray kind ("a Ray actor where available", same interface): a party
    configured with `executor: ray` runs each leg in its own actor, reports a ray: address to the
    mapping table, and returns the same results as computing the rule on its data directly.

    Isolation on Ray: with the default ``isolation: sandbox`` the actor runs the rule in the same
    bubblewrap sandbox as a local executor (its own cgroups, uid 65534); the test finds that
    sandbox's processes while the leg's executor lives, and its cgroups gone once the leg has run
    (executors are released as soon as their leg is done) and after the party stops."""
    dep = Deployment(tmp_path, ["a", "b"], overrides={"a": {"executor": "ray", "executor_start_timeout_s": 180}})
    sandboxed = dep.isolation_fallback is None
    dep.start_all()
    try:
        ini = dep.initiator(timeout_s=240)
        call = RuleCall(rule="summary_stats", params={"columns": ["mean_radius", "label"]})
        legs = [LegSpec(data_id=f"m_{p}", party=p, rule=call.rule, params=call.params) for p in ("a", "b")]
        created = ini.create_task("ray1", legs)
        assert all(c["ok"] for c in created.values()), created
        if sandboxed:  # the leg's executor is up: it runs in a sandbox, as uid 65534
            groups = _sandbox_groups("ray1.m_a")
            assert groups, "no sandbox cgroup for the Ray leg ray1/m_a"
            pids = [int(x) for g in groups for x in (g / "cgroup.procs").read_text().split()]
            executors = [
                psutil.Process(pid)
                for pid in pids
                if "-m trainmaster.gateway.executors.worker" in _cmdline(pid)
                and "bwrap" not in _cmdline(pid).split()[0]
            ]
            assert executors and all(p.uids().real == SANDBOX_UID for p in executors)
        out = {"legs": ini.receive("ray1", [leg.data_id for leg in legs], 120)}
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
        if sandboxed:  # the leg's rule ran: its executor (and sandbox) was released at once
            deadline = time.monotonic() + 15
            while _sandbox_groups("ray1.m_a") and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not _sandbox_groups("ray1.m_a"), "the Ray leg's sandbox outlived its leg"
    finally:
        dep.stop_all()
    if sandboxed:
        assert not _sandbox_groups("ray1.m_a"), "the Ray actor's sandbox cgroups outlived the party"


def _sandbox_groups(label: str) -> list[Path]:
    return [g for parent in parent_dirs() if parent.is_dir() for g in parent.glob(f"tm-exec-{label}.*")]


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""
