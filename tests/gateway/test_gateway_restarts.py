"""Restarts: a party killed at any moment comes back knowing its legs; a storm of tasks while the
gateway and two parties are killed -9 again and again ends with every leg's rule run exactly once
(counted at the executors), every task with its results or a clear error, and nothing lost."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from trainmaster.gateway.config import load_config
from trainmaster.gateway.crypto.provision import init_deployment
from trainmaster.gateway.executors.base import commit_line
from trainmaster.gateway.models import RuleCall, TaskCreate
from trainmaster.gateway.party.core import PartyAgent
from trainmaster.gateway.storm import StormOptions, run_storm

pytestmark = pytest.mark.timeout(600)


def _agent(tmp_path: Path) -> PartyAgent:
    configs = init_deployment(tmp_path / "d", ["a"], port_base=20000)
    data = tmp_path / "data"
    data.mkdir()
    (data / "m_a.csv").write_text("x\n" + "\n".join(str(i) for i in range(10)) + "\n")
    cfg = load_config(configs["a"]).model_copy(update={"isolation": "process"})
    return PartyAgent(cfg, data)


def test_a_restarted_party_adopts_a_run_its_executor_committed_and_reruns_one_it_did_not(tmp_path: Path) -> None:
    """Exactly once across a party's kill -9 (at the worst moment: after the run went to the
    executor, before the party recorded it): a run whose commit line the executor wrote is adopted
    as the leg's record, the rule not run again; a run without one had not happened, and the leg
    is queued to run (a new executor, reported again)."""
    agent = _agent(tmp_path)
    task = TaskCreate(task_id="t1", party="a", data_id="m_a", call=RuleCall(rule="row_count"), deadline_s=600)
    other = task.model_copy(update={"task_id": "t2"})
    for t in (task, other):
        agent.records.create(t, "initiator", time.time() + 600)
        agent.records.start_run(t.task_id, t.data_id)
    files = agent.files(task)
    result = json.dumps({"rows": 10}).encode()
    files.result.write_bytes(result)
    fd = os.open(files.commit, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, commit_line("t1", "m_a", len(result), hashlib.sha256(result).hexdigest()))
    os.close(fd)
    agent.files(other).result.write_bytes(b'{"ro')  # the executor died mid-write: no commit line

    async def restart() -> tuple[bool, bool]:
        agent.recover()
        queued = ("t2", "m_a") in agent.executors
        for held in agent.executors.values():
            if held.report is not None:
                held.report.cancel()
        return queued, ("t1", "m_a") in agent.executors

    queued, rerun_adopted = asyncio.run(restart())
    adopted = agent.records.get("t1", "m_a")
    assert adopted is not None and adopted.state == "done" and adopted.ok and adopted.size == len(result)
    assert adopted.sha256 == hashlib.sha256(result).hexdigest()
    assert not rerun_adopted and agent.counters["adopted_runs"] == 1
    undone = agent.records.get("t2", "m_a")
    assert undone is not None and undone.state == "created" and queued
    events = [json.loads(line)["event"] for line in agent.audit.path.read_text().splitlines()]
    assert events.count("rule.adopted") == 1 and events.count("leg.recover") == 1


def test_a_late_report_refused_for_a_finished_leg_keeps_the_partys_record(tmp_path: Path) -> None:
    """Exactly once, the record side (found by the 10,000-task storm: 3 legs had a result and no
    commit file left): a restarted party whose executor report reaches the gateway only after the
    leg was run and recorded is refused (the leg is finished); the party keeps that leg's record and
    files (its result stays fetchable and its run counted) and only drops a leg that never ran."""
    agent = _agent(tmp_path)
    ran = TaskCreate(task_id="t1", party="a", data_id="m_a", call=RuleCall(rule="row_count"), deadline_s=600)
    never = ran.model_copy(update={"task_id": "t2"})
    for t in (ran, never):
        agent.records.create(t, "initiator", time.time() + 600)
    agent.records.finish_run("t1", "m_a", ok=True, size=2, sha256="0" * 64)
    files = agent.files(ran)
    files.commit.write_bytes(commit_line("t1", "m_a", 2, "0" * 64))
    agent.refused(("t1", "m_a"))
    agent.refused(("t2", "m_a"))
    assert agent.records.get("t1", "m_a") is not None and files.commit.exists()
    assert agent.records.get("t2", "m_a") is None and not (agent.legs_root / "t2" / "m_a").exists()


def test_storm_with_the_gateway_and_two_parties_killed_every_leg_runs_once_nothing_lost(tmp_path: Path) -> None:
    """Restarts, storm (the CI size of bench/gateway_storm.py, same kills): tasks from 4 initiators
    over 8 parties while the gateway is killed -9 10 times and two parties 5 times each: every task
    ends with its results or a clear error, none is lost, every leg with a result had its rule run
    exactly once at its executor, the gateway's one outcome per leg is what its initiator got, and
    every service's audit log verifies."""
    opts = StormOptions(tasks=100, workers=12, deadline_s=600, leg_timeout_s=30, down_s=(0.1, 0.3))
    report = run_storm(tmp_path / "storm", opts, log=lambda _line: None)
    summary = json.dumps(report.as_dict(), indent=1)[:4000]
    assert len(report.kills) == 20, summary
    assert report.lost == 0 and report.results_not_run_once == 0 and report.gateway_outcomes_not_one == 0, summary
    assert report.tasks_done + report.tasks_failed_to_run == opts.tasks, summary
    assert all(int(runs) <= 1 for runs in report.failed_task_executions), summary  # an ended task's legs too
    assert report.legs_with_result >= 0.9 * report.legs, summary
    assert all(a["ok"] for a in report.audit.values()), summary


def test_a_failure_report_pending_when_the_party_is_killed_is_resent_after_its_restart(tmp_path: Path) -> None:
    """Exactly once, the failure side (issue 36, kill-safety of the retried failure report): a leg
    whose executor did not come up keeps its row (``start_failed``, with the reason) while the
    report to an unreachable gateway is retried; a party killed -9 meanwhile resends it after its
    restart, with the same reason, and forgets the leg only once the gateway has taken it."""
    from trainmaster.gateway.party.core import ReportAttempt

    task = TaskCreate(task_id="t1", party="a", data_id="m_a", call=RuleCall(rule="row_count"), deadline_s=600)
    sent: list[tuple[str, bool, str]] = []

    def reporting(agent: PartyAgent, status: str) -> None:
        async def report_once(t: TaskCreate, address: str, ready: bool, reason: str = "") -> ReportAttempt:
            sent.append((t.task_id, ready, reason))
            return ReportAttempt(status)

        agent.report_once = report_once  # type: ignore[method-assign]

    first = _agent(tmp_path)
    reporting(first, "unreachable")
    first.records.create(task, "initiator", time.time() + 600)

    async def fail_then_die() -> None:
        first.failed_start(("t1", "m_a"), task, "executor did not come up within 1.5 s", time.time() + 600)
        await asyncio.sleep(0.8)  # a try and a retry, both unreachable
        for job in list(first._background):
            job.cancel()  # killed -9 while it retries

    asyncio.run(fail_then_die())
    first.audit.close()
    assert len(sent) >= 2 and all(not ready and "did not come up" in why for _t, ready, why in sent)
    pending = first.records.get("t1", "m_a")
    assert pending is not None and pending.state == "start_failed" and "did not come up" in pending.error

    sent.clear()
    second = PartyAgent(first.cfg, first.data_dir)  # the restarted party, on the same state
    reporting(second, "ok")

    async def restart() -> None:
        second.recover()
        assert not second.executors  # no executor is started again for it
        for _ in range(100):
            if second.records.get("t1", "m_a") is None:
                return
            await asyncio.sleep(0.05)

    asyncio.run(restart())
    assert sent == [("t1", False, "executor did not come up within 1.5 s")]
    assert second.records.get("t1", "m_a") is None and not (second.legs_root / "t1" / "m_a").exists()
    events = [json.loads(line)["event"] for line in second.audit.path.read_text().splitlines()]
    assert events.count("leg.recover") == 1
