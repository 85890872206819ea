"""The audit log: append-only, hash-chained, signed; every edit, removal, reordering or cut-off
tail is found by `trainmaster gateway audit verify`; the services log who asked for what."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_harness import Deployment

from trainmaster.gateway.audit.log import SELF, AuditLog, Requester, entry_hash, verify
from trainmaster.gateway.crypto.envelope import Identity
from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec
from trainmaster.gateway.net.tls import client_ssl_context

pytestmark = pytest.mark.timeout(240)


def _log(tmp_path: Path, n: int = 6) -> tuple[Path, Identity]:
    me = Identity.generate("gateway")
    log = AuditLog(tmp_path / "audit.log", me)
    alice = Requester("alice", "initiator", "ab" * 16, "c2lnbmF0dXJl")
    for i in range(n):
        log.append("task.register", alice, task_id=f"t{i}", legs={"m": {"party": "a", "rule": "row_count"}})
    log.close()
    return tmp_path / "audit.log", me


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def test_audit_log_detects_an_edited_line(tmp_path: Path) -> None:
    """Audit trail, editing: a changed field breaks the line's hash; a line edited and rehashed
    (by someone without the service's key) fails its signature and still breaks nothing else."""
    path, me = _log(tmp_path)
    assert verify(path, me.public("gateway")).ok
    lines = _lines(path)
    edited = json.loads(lines[2])
    edited["requester"] = "mallory"
    path.write_text("".join(lines[:2] + [json.dumps(edited, separators=(",", ":")) + "\n"] + lines[3:]))
    verdict = verify(path, me.public("gateway"))
    assert not verdict.ok and any("line 3" in p and "edited" in p for p in verdict.problems), verdict.problems
    edited["hash"] = entry_hash(edited)  # rehashed: the chain after it breaks, the signature does not match
    path.write_text("".join(lines[:2] + [json.dumps(edited, separators=(",", ":")) + "\n"] + lines[3:]))
    problems = verify(path, me.public("gateway")).problems
    assert any("line 3" in p and "forged" in p for p in problems), problems
    assert any("line 4" in p and "does not chain" in p for p in problems), problems


def test_audit_log_detects_a_removed_line_and_a_cut_off_tail(tmp_path: Path) -> None:
    """Audit trail, removal: a line taken out of the middle leaves a seq gap and a broken chain; the
    last lines taken off are found against the head recorded at the last group commit."""
    path, me = _log(tmp_path)
    lines = _lines(path)
    path.write_text("".join(lines[:3] + lines[4:]))
    problems = verify(path, me.public("gateway")).problems
    assert any("removed before it" in p for p in problems) and any("does not chain" in p for p in problems), problems
    path.write_text("".join(lines[:-2]))
    problems = verify(path, me.public("gateway")).problems
    assert problems == [
        f"the log ends at seq {len(lines) - 2}; its head says seq {len(lines)}: lines removed from the end"
    ]


def test_audit_log_detects_reordered_lines(tmp_path: Path) -> None:
    """Audit trail, reordering: two lines swapped break the seq order and the chain."""
    path, me = _log(tmp_path)
    lines = _lines(path)
    lines[1], lines[2] = lines[2], lines[1]
    path.write_text("".join(lines))
    problems = verify(path, me.public("gateway")).problems
    assert any("reordered" in p for p in problems) and any("does not chain" in p for p in problems), problems


def test_a_restarted_service_records_a_lost_tail_in_its_log(tmp_path: Path) -> None:
    """Audit trail across restarts: a service that finds its log shorter than its recorded head says
    so in a new line, which verify reports (the loss cannot be hidden by appending after it)."""
    path, me = _log(tmp_path)
    lines = _lines(path)
    path.write_text("".join(lines[:-1]))
    log = AuditLog(path, me)
    log.append("service.start", SELF)
    log.close()
    problems = verify(path, me.public("gateway")).problems
    assert any("missing at a restart" in p for p in problems), problems


def test_audit_verify_cli_exit_codes(tmp_path: Path) -> None:
    """`trainmaster gateway audit verify`: 0 and the head for an intact log (signatures checked with
    the roster), 1 and each problem for a damaged one, 2 and one line for a missing file."""
    from trainmaster.gateway.crypto.provision import init_deployment

    configs = init_deployment(tmp_path / "d", ["a"], port_base=20000)
    from trainmaster.gateway.config import load_config
    from trainmaster.gateway.crypto.provision import load_identity

    me = load_identity(load_config(configs["gateway"]))
    log = AuditLog(tmp_path / "audit.log", me)
    for i in range(3):
        log.append("leg.dispatch", SELF, task_id=f"t{i}", data_id="m")
    log.close()
    run = [sys.executable, "-m", "trainmaster", "gateway", "audit", "verify", str(tmp_path / "audit.log")]
    roster = ["--roster", str(tmp_path / "d" / "roster.json")]
    good = subprocess.run(run + roster, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stdout + good.stderr
    report = json.loads(good.stdout)
    assert report["ok"] and report["lines"] == 3 and report["signatures"] == "checked"
    lines = _lines(tmp_path / "audit.log")
    (tmp_path / "audit.log").write_text(lines[0] + lines[2])
    bad = subprocess.run(run + roster, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and json.loads(bad.stdout)["problems"], bad.stdout
    missing = subprocess.run(run[:-1] + [str(tmp_path / "nope.log")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "audit log not found" in missing.stderr and "Traceback" not in missing.stderr


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    d = Deployment(tmp_path_factory.mktemp("audit"), ["a", "b"], initiators=["initiator", "bob"]).start_all()
    yield d
    d.stop_all()


def _entries(dep: Deployment, who: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(dep.cfg(who).state_dir) / "audit.log").read_text().splitlines()]


def test_every_party_and_the_gateway_log_who_asked_for_what(dep: Deployment) -> None:
    """Audit trail at every service: the gateway logs the task's creation, the data receive request,
    each leg's dispatch and outcome; each party logs the leg's creation and its rule run with the
    initiator, and the transfer; each line names its requester with the id and signature of the
    signed request; every log verifies against its service's key from the roster."""
    ini = dep.initiator()
    out = ini.run_task(
        TaskSpec(
            task_id="aud1",
            legs=[
                LegSpec(data_id="m_a", party="a", rule="row_count"),
                LegSpec(data_id="m_b", party="b", rule="row_count"),
            ],
        )
    )
    ini.close()
    assert all(leg["outcome"] == "result" for leg in out["legs"].values())
    gateway = [e for e in _entries(dep, "gateway") if e.get("task_id") == "aud1"]
    events = [e["event"] for e in gateway]
    for event in ("task.register", "data.receive", "leg.dispatch", "leg.outcome"):
        assert event in events, events
    register = next(e for e in gateway if e["event"] == "task.register")
    assert register["requester"] == "initiator" and register["role"] == "initiator"
    assert len(register["msg_id"]) == 32 and register["msg_sig"]
    for party in ("a", "b"):
        mine = [e for e in _entries(dep, party) if e.get("task_id") == "aud1"]
        by_event = {e["event"]: e for e in mine}
        assert by_event["task.create"]["requester"] == "initiator"
        assert by_event["rule.run"]["requester"] == "gateway" and by_event["rule.run"]["initiator"] == "initiator"
        assert by_event["rule.run"]["rule"] == "row_count" and by_event["rule.run"]["ok"] is True
        assert by_event["transfer"]["requester"] == "gateway"
    from trainmaster.gateway.crypto.provision import load_roster

    roster = load_roster(dep.cfg("gateway").roster)
    for who in ("gateway", "a", "b"):
        verdict = verify(Path(dep.cfg(who).state_dir) / "audit.log", roster[who])
        assert verdict.ok, (who, verdict.problems)


def test_the_audit_endpoint_is_for_the_operator_only(dep: Deployment) -> None:
    """`GET /v1/audit` (the dashboard view's source): the operator gets a task's entries and the
    service's own check of its log; an initiator is refused (403)."""
    ini = dep.initiator()
    ini.run_task(TaskSpec(task_id="aud2", legs=[LegSpec(data_id="m_a", party="a", rule="row_count")]))
    ini.close()
    with httpx.Client(verify=client_ssl_context(dep.cfg("operator")), timeout=30) as http:
        body = http.get(f"{dep.url('a')}/v1/audit", params={"task_id": "aud2", "verify": "true"}).json()
    assert body["verify"]["ok"] and {e["event"] for e in body["entries"]} >= {"task.create", "rule.run", "transfer"}
    with httpx.Client(verify=client_ssl_context(dep.cfg("initiator")), timeout=30) as http:
        assert http.get(f"{dep.url('gateway')}/v1/audit").status_code == 403
    show = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmaster",
            "gateway",
            "audit",
            "show",
            "--config",
            str(dep.configs["operator"]),
            "--task",
            "aud2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert show.returncode == 0, show.stderr
    assert {e["event"] for e in json.loads(show.stdout)["entries"]} >= {"task.register", "leg.outcome"}
