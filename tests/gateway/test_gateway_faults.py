"""Faults with real processes: every accepted leg ends in exactly one recorded outcome, the others
still return, nothing is delivered twice, and in-flight work drains to zero."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
from gateway_harness import Deployment
from helpers import wait_until

from trainmaster.gateway.initiator.client import Initiator
from trainmaster.gateway.initiator.taskfile import LegSpec
from trainmaster.gateway.crypto.envelope import make_header, seal
from trainmaster.gateway.net.tls import client_ssl_context

pytestmark = pytest.mark.timeout(240)
PARTIES = ["a", "slow", "skew", "silent", "victim", "starved"]


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    d = Deployment(
        tmp_path_factory.mktemp("faults"),
        PARTIES,
        overrides={
            "gateway": {"task_queue_depth": 1},
            "slow": {"fault_delay_s": 3.0},
            "skew": {"fault_clock_offset_s": 600.0},
            "silent": {"fault_executor_silent_starts": 1000, "executor_start_timeout_s": 1.5},
            "starved": {"fault_executor_silent_starts": 2, "executor_start_timeout_s": 1.0},
            "victim": {"fault_delay_s": 6.0},
        },
    ).start_all()
    yield d
    d.stop_all()


def _create(dep: Deployment, task_id: str, parties: list[str], deadline_s: float = 300.0) -> dict[str, dict[str, Any]]:
    ini = dep.initiator()
    try:
        legs = [LegSpec(data_id=f"m_{p}", party=p, rule="row_count") for p in parties]
        created = ini.create_task(task_id, legs, deadline_s)
        return {p: created[f"m_{p}"] for p in parties}
    finally:
        ini.close()


def _receive(dep: Deployment, task_id: str, parties: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    ini = dep.initiator()
    try:
        return ini.receive(
            task_id, [f"m_{p}" for p in parties], leg_timeout_s=timeout_s, parties={f"m_{p}": p for p in parties}
        )
    finally:
        ini.close()


def _in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except Exception as exc:  # recorded for the test to inspect
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_slow_party_times_out_and_others_return(dep: Deployment) -> None:
    """Per-leg timeout: a slow party's leg ends `timeout`; the fast party's leg returns its result."""
    assert all(c["ok"] for c in _create(dep, "slow1", ["a", "slow"]).values())
    out = _receive(dep, "slow1", ["a", "slow"], timeout_s=1.0)
    assert out["m_a"]["outcome"] == "result" and out["m_a"]["result"]["rows"] == len(dep.splits[0])
    assert out["m_slow"]["outcome"] == "timeout" and "did not answer" in out["m_slow"]["detail"]
    again = _receive(dep, "slow1", ["a", "slow"], timeout_s=10.0)  # outcomes are final: recorded once
    assert again["m_slow"]["outcome"] == "timeout"


def test_executor_that_never_reports_is_retried_until_the_deadline_then_its_leg_ends_in_timeout(
    dep: Deployment,
) -> None:
    """Executor start deadline: an executor that never reports readiness is killed and started
    again with backoff until the task's deadline; only then does its leg end `timeout`, with the
    attempts and the last error, before the gateway's own deadline (the failure report, not the
    gateway's "has not reported"). Nothing is left running."""
    began = time.monotonic()
    created = _create(dep, "silent1", ["a", "silent"], deadline_s=20.0)
    assert created["silent"]["status"] == 202 and "retries" in created["silent"]["detail"], created
    out = _receive(dep, "silent1", ["a", "silent"], timeout_s=30.0)
    assert out["m_a"]["outcome"] == "result"
    detail = out["m_silent"]["detail"]
    assert out["m_silent"]["outcome"] == "timeout" and out["m_silent"]["final"], out
    assert "attempts before the task's deadline" in detail and "did not report" in detail, detail
    assert 12.0 < time.monotonic() - began < 20.0  # retried until near the deadline, not given up at once
    health = dep.health("silent")
    assert health["executors"] == 0 and health["queued_legs"] == 0 and health["start_retries"] >= 2
    assert health["rule_runs"] == 0


def test_an_executor_that_does_not_come_up_is_started_again_and_its_leg_runs_once(dep: Deployment) -> None:
    """Executor start retries (a starved machine: the first two starts of the leg's executor never
    report ready): the party kills each and starts another, waiting twice as long each time, and the
    leg gets its result; the rule ran exactly once (the commit file counts the runs at the executor),
    the two silent executors never ran it, and both retries are in the party's audit log."""
    from trainmaster.gateway.executors.base import read_commits

    created = _create(dep, "starved1", ["a", "starved"])
    assert created["starved"]["ok"] and created["starved"]["status"] == 202, created
    out = _receive(dep, "starved1", ["a", "starved"], timeout_s=30.0)
    assert out["m_starved"]["outcome"] == "result", out
    assert out["m_starved"]["result"]["rows"] == len(dep.splits[PARTIES.index("starved")])
    state = Path(dep.cfg("starved").state_dir)
    assert len(read_commits(state / "legs" / "starved1" / "m_starved" / "commit")) == 1
    health = dep.health("starved")
    assert health["start_retries"] == 2 and health["rule_runs"] == 1 and health["executors"] == 0
    audit = [json.loads(line) for line in (state / "audit.log").read_text().splitlines()]
    retries = [e for e in audit if e["event"] == "executor.retry" and e.get("task_id") == "starved1"]
    assert [e["attempt"] for e in retries] == [2, 3] and "did not report" in retries[0]["detail"]


def test_party_with_skewed_clock_is_refused_with_a_clear_error(dep: Deployment) -> None:
    """Clock-skew window: a party whose clock runs 10 minutes ahead refuses (and is refused) — its leg
    has no route and ends `party_unavailable`, the creation error says why; the others return."""
    created = _create(dep, "skew1", ["a", "skew"])
    assert not created["skew"]["ok"] and "expired" in created["skew"]["detail"]
    out = _receive(dep, "skew1", ["a", "skew"], timeout_s=5.0)
    assert out["m_a"]["outcome"] == "result"
    assert out["m_skew"]["outcome"] == "party_unavailable"


def test_party_killed_mid_request_comes_back_and_its_leg_runs_once(dep: Deployment) -> None:
    """Party crash: a party killed -9 while serving a transfer leaves its leg open (a provisional,
    not final `party_unavailable`) while the other leg returns; restarted, the party resumes the
    leg from its own records (a new executor, reported again) and the next request gets the
    result, its rule run to completion exactly once (counted in the executor's commit file)."""
    from trainmaster.gateway.executors.base import read_commits

    assert all(c["ok"] for c in _create(dep, "kill1", ["a", "victim"]).values())
    thread, box = _in_background(lambda: _receive(dep, "kill1", ["a", "victim"], timeout_s=30.0))
    wait_until(
        lambda: dep.health("victim")["handled"].get("data_transfer", 0) >= 1, 20, "the victim to receive its transfer"
    )
    dep.kill("victim")
    thread.join(timeout=30)
    out = box["value"]
    assert out["m_a"]["outcome"] == "result"
    assert out["m_victim"]["outcome"] == "party_unavailable" and out["m_victim"]["final"] is False
    dep.start("victim")
    dep.wait_ready("victim")
    again = _receive(dep, "kill1", ["victim"], timeout_s=60.0)
    assert again["m_victim"]["outcome"] == "result", again
    assert again["m_victim"]["result"]["rows"] == len(dep.splits[PARTIES.index("victim")])
    commits = Path(dep.cfg("victim").state_dir) / "legs" / "kill1" / "m_victim" / "commit"
    assert len(read_commits(commits)) == 1
    assert dep.health("victim")["recovered_legs"] >= 1
    assert dep.health("gateway")["in_flight_legs"] == 0


def test_one_slow_task_does_not_block_another_and_overload_is_429(dep: Deployment) -> None:
    """Per-task queue and overload: a second request for a busy task gets 429 while another task
    completes; the slow task still finishes."""
    _create(dep, "busy1", ["slow"])
    _create(dep, "other1", ["a"])
    thread, box = _in_background(lambda: _receive(dep, "busy1", ["slow"], timeout_s=10.0))
    wait_until(lambda: dep.health("gateway")["in_flight_tasks"] >= 1, 20, "busy1 to be in flight")
    ini = dep.initiator()
    env = seal(
        ini.me,
        ini.roster["gateway"],
        make_header("initiator", "gateway", "data_receive", "busy1", "*"),
        {"task_id": "busy1", "data_ids": ["m_slow"]},
    )
    with httpx.Client(verify=client_ssl_context(dep.cfg("initiator")), timeout=10) as http:
        resp = http.post(
            f"{dep.url('gateway')}/v1/receive",
            content=env.model_dump_json(),
            headers={"content-type": "application/json"},
        )
    assert resp.status_code == 429 and resp.headers.get("retry-after") == "1"
    other = ini.receive("other1", ["m_a"], leg_timeout_s=5.0, parties={"m_a": "a"})
    assert other["m_a"]["outcome"] == "result"
    assert thread.is_alive()  # the slow task is still running while the other one finished
    ini.close()
    thread.join(timeout=30)
    assert box["value"]["m_slow"]["outcome"] == "result"


def test_gateway_killed_mid_leg_every_leg_completes_exactly_once(dep: Deployment) -> None:
    """Faults, kill -9 the gateway while legs run: the initiator retries with backoff (clear stderr
    lines, no traceback); after the restart the journaled (dispatched) leg is delivered again and
    the party answers it from its once-only record: every leg completes, its rule ran exactly once,
    its one outcome stands on later fetches, and nothing stays in flight."""
    from trainmaster.gateway.relay.mapping import MappingTable

    assert all(c["ok"] for c in _create(dep, "crash1", ["a", "slow"]).values())
    runs_before = dep.health("slow")["rule_runs"]
    transfers_before = dep.health("slow")["handled"].get("data_transfer", 0)
    thread, box = _in_background(lambda: _receive(dep, "crash1", ["a", "slow"], timeout_s=20.0))
    wait_until(
        lambda: dep.health("slow")["handled"].get("data_transfer", 0) > transfers_before,
        20,
        "the slow party to receive its transfer",
    )
    dep.kill("gateway")
    dep.start("gateway")
    dep.wait_ready("gateway")
    thread.join(timeout=90)
    assert "error" not in box, box.get("error")
    out = box["value"]
    assert {k: v["outcome"] for k, v in out.items()} == {"m_a": "result", "m_slow": "result"}
    assert out["m_slow"]["result"]["rows"] == len(dep.splits[PARTIES.index("slow")])
    slow = dep.health("slow")
    assert slow["handled"]["data_transfer"] == transfers_before + 2  # delivered twice ...
    assert slow["rule_runs"] == runs_before + 1  # ... ran once
    assert MappingTable(dep.cfg("gateway").db_url).legs("crash1")["m_slow"].dispatches == 2
    again = _receive(dep, "crash1", ["a", "slow"], timeout_s=10.0)
    assert again["m_slow"]["result"] == out["m_slow"]["result"]
    assert dep.health("gateway")["in_flight_legs"] == 0


def test_gateway_down_when_a_task_is_created_its_legs_are_delivered_when_it_returns(dep: Deployment, tmp_path) -> None:
    """Faults, gateway down at task creation (and item 11: no 500 at the party): the party accepts
    the leg (202, report pending) and keeps reporting with backoff; the CLI retries with clear
    lines and, past the task's deadline, exits 3 with a message and no traceback; once the gateway
    is back, the leg is delivered within the deadline, and an initiator started while the gateway
    was down completes its task."""
    import subprocess
    import sys

    from trainmaster.gateway.initiator.taskfile import TaskSpec

    ini = dep.initiator()
    ini.register_task("down1", [LegSpec(data_id="m_a", party="a", rule="row_count")])
    dep.kill("gateway")
    try:
        created = ini.create_leg("down1", LegSpec(data_id="m_a", party="a", rule="row_count"))
        assert created["status"] == 202 and "keeps reporting" in created["detail"], created
        task = tmp_path / "task.yaml"
        task.write_text("deadline_s: 2\nlegs:\n  - {data_id: m_b, party: a, rule: row_count}\n")
        out = subprocess.run(
            [sys.executable, "-m", "trainmaster", "task", "run", "--config", str(dep.configs["initiator"]), str(task)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 3, out.stderr
        assert "retrying in" in out.stderr and "stayed unreachable" in out.stderr and "Traceback" not in out.stderr
        thread, box = _in_background(
            lambda: dep.initiator().run_task(
                TaskSpec(task_id="down2", deadline_s=120, legs=[LegSpec(data_id="m_a", party="a", rule="row_count")])
            )
        )
        time.sleep(1.0)
    finally:
        dep.start("gateway")
        dep.wait_ready("gateway")
    got = ini.receive("down1", ["m_a"], leg_timeout_s=30)
    ini.close()
    assert got["m_a"]["outcome"] == "result" and got["m_a"]["result"]["rows"] == len(dep.splits[0])
    thread.join(timeout=90)
    assert box["value"]["legs"]["m_a"]["outcome"] == "result", box
    assert dep.health("a")["report_retries"] >= 1


def test_initiator_that_gives_up_and_asks_again_follows_the_same_run(dep: Deployment) -> None:
    """Exactly once when the initiator's own request times out: its HTTP timeout (1 s) is shorter
    than the slow party's rule (3 s), so it gives up on its data receive request and asks again
    (freshly sealed) while the gateway still runs the leg. The gateway follows the run already
    under way instead of sending the party a second transfer: one transfer, one rule run, one
    result."""
    _create(dep, "gaveup1", ["slow"])
    before = dep.health("slow")
    ini = Initiator(dep.cfg("initiator"), timeout_s=1.0, results_dir=dep.root / "results" / "gaveup")
    try:
        got = ini.receive(
            "gaveup1", ["m_slow"], leg_timeout_s=15.0, parties={"m_slow": "slow"}, deadline=time.time() + 60
        )
    finally:
        ini.close()
    assert got["m_slow"]["outcome"] == "result", got
    after = dep.health("slow")
    assert after["handled"]["data_transfer"] == before["handled"].get("data_transfer", 0) + 1
    assert after["rule_runs"] == before["rule_runs"] + 1
    assert dep.health("gateway")["in_flight_legs"] == 0
