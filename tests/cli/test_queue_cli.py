"""Mechanisms: `trainmaster queue create|list|show|delete` and `trainmaster job explain` on the
local store (as a server's store), and against a real server with `--server`; user mistakes
(bad amounts, limits without a cohort, a queue that exists or does not, an unknown job) exit 2
with `error:` naming what to fix, and no traceback."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from server_process import ServerProcess

from trainmaster.cli.main import main

pytestmark = pytest.mark.timeout(180)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def tm(capsys: pytest.CaptureFixture[str], *args: str) -> Run:
    """``trainmaster ARGS`` in this process (the entry point, exit codes and all): a subprocess
    per verb costs seconds on a loaded machine."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out = capsys.readouterr()
    return Run(code, out.out, out.err)


def user_error(out: Run, *words: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.startswith("error:") and "Traceback" not in out.stderr, out.stderr
    flat = " ".join(out.stderr.split())
    for word in words:
        assert word in flat, out.stderr


def test_queue_verbs_on_the_local_store(capsys: pytest.CaptureFixture[str]) -> None:
    """Queue objects from the CLI: create with quota, limits and cohort; list and show usage;
    --replace changes it; delete; each mistake exits 2 saying what to fix."""
    made = tm(
        capsys,
        "queue",
        "create",
        "team-a",
        "--cpu",
        "20",
        "--memory",
        "64Gi",
        "--cohort",
        "org",
        "--borrowing-limit",
        "cpu=100",
    )
    assert made.returncode == 0 and "queue team-a created" in made.stdout, made.stderr
    user_error(tm(capsys, "queue", "create", "team-a", "--cpu", "20"), "exists already", "--replace")
    user_error(tm(capsys, "queue", "create", "team-b"), "give at least one of --cpu, --memory, --gpu")
    user_error(tm(capsys, "queue", "create", "team-b", "--cpu", "2", "--borrowing-limit", "cpu=1"), "need a cohort")
    user_error(
        tm(capsys, "queue", "create", "team-b", "--cpu", "2", "--cohort", "org", "--borrowing-limit", "cpu"),
        "RESOURCE=AMOUNT",
    )
    user_error(tm(capsys, "queue", "create", "team-b", "--memory", "lots"), "not a memory quantity")
    user_error(tm(capsys, "queue", "create", "Team B", "--cpu", "1"), "name")
    listed = json.loads(tm(capsys, "queue", "list", "--json").stdout)
    assert [q["name"] for q in listed] == ["team-a"] and listed[0]["quota"]["cpu"]["borrowingLimit"] == 100
    table = tm(capsys, "queue", "list")
    assert "team-a" in table.stdout and "cpu 0 of 20" in table.stdout and "memory 0B of 64Gi" in table.stdout
    assert tm(capsys, "queue", "create", "team-a", "--cpu", "30", "--replace").returncode == 0
    shown = tm(capsys, "queue", "show", "team-a")
    assert shown.returncode == 0 and "no cohort" in shown.stdout and "waiting: 0 job(s)" in shown.stdout
    user_error(tm(capsys, "queue", "show", "nope"), "no queue 'nope'")
    assert tm(capsys, "queue", "delete", "team-a").returncode == 0
    user_error(tm(capsys, "queue", "delete", "team-a"), "no queue 'team-a'")
    user_error(tm(capsys, "job", "explain", "nope"), "no job 'nope'")


def test_queue_and_explain_over_a_server(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Against a server: a queue created over REST gates a submitted job, and `job explain` says
    what blocks it (queue maximum here) and its position."""
    job = tmp_path / "big.yaml"
    job.write_text(
        "apiVersion: trainmaster/v1\nkind: Job\nmetadata: {name: big}\n"
        "spec:\n  scheduling: {queue: small}\n  roles: [{name: w, command: [sleep, '60'], resources: {cpu: 2}}]\n"
    )
    server = ServerProcess(tmp_path)

    def remote(*args: str) -> Run:
        return tm(capsys, *args, "--server", server.url)

    try:
        assert remote("queue", "create", "small", "--cpu", "1").returncode == 0
        assert remote("job", "submit", str(job)).returncode == 0
        deadline = time.monotonic() + 30
        while server.status("big")["reason"] != "Inadmissible":
            assert time.monotonic() < deadline, server.status("big")
            time.sleep(0.2)
        assert "queue 'small' can never admit it: cpu needs 2" in server.status("big")["message"]
        why = remote("job", "explain", "big")
        assert why.returncode == 0, why.stderr
        assert "position 1 of 1 waiting in queue 'small'" in why.stdout
        assert "blocked by queue maximum: cpu needs 2" in why.stdout
        listed = json.loads(remote("queue", "list", "--json").stdout)
        assert listed[0]["waiting"] == 1
        user_error(remote("queue", "show", "nope"), "no queue 'nope'")
        user_error(remote("queue", "delete", "small"), "1 job(s) not ended")
        assert remote("job", "cancel", "big").returncode == 0
    finally:
        server.stop()
