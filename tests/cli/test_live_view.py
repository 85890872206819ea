"""The live view of ``trainmaster run`` in a real pseudo-terminal: it fits 80x24 (job state, one
line per role with per-state counts, restarts, elapsed time and progress from what the roles
report), uses a taller terminal for the instances table, and Ctrl-C cancels the job."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import yaml

pyte = pytest.importorskip("pyte", reason="pyte is not installed (pip install -e '.[test]')")

from trainmaster.cli.view import render_status  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def reporting_job(path: Path, ticks: int = 400, roles: int = 2) -> Path:
    code = (
        "import time, trainmaster\n"
        f"for s in range(1, {ticks}):\n"
        f"    trainmaster.report(step=s, total={ticks}, loss=1.0 / s)\n"
        "    time.sleep(0.2)\n"
    )
    doc = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "liveview"},
        "spec": {
            "framework": "command",
            "roles": [
                {"name": f"role{n}", "replicas": 2, "command": [sys.executable, "-c", code]} for n in range(roles)
            ],
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def _own_terminal() -> None:
    """In the child: a new session whose controlling terminal is the pty, so Ctrl-C is SIGINT."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """`trainmaster run` on a pseudo-terminal of a given size, read through a VT100 emulator."""

    def __init__(self, argv: list[str], columns: int, lines: int, env: dict[str, str]):
        self.screen = pyte.Screen(columns, lines)
        self.stream = pyte.ByteStream(self.screen)
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            close_fds=True,
            env={**env, "TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": str(lines)},
            preexec_fn=_own_terminal,
        )
        os.close(slave)
        self.master = master

    def read_until(self, predicate, what: str, timeout: float = 60) -> list[str]:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    self.stream.feed(os.read(self.master, 65536))
                except OSError:  # the command ended and closed the terminal
                    break
            if predicate(self.screen.display):
                return self.screen.display
        raise AssertionError(f"waited {timeout}s for {what}; screen:\n" + "\n".join(self.screen.display))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        os.close(self.master)


def _has_progress(display: list[str]) -> bool:
    """A whole frame (Live redraws in place, so a read can land mid-frame): both roles with their
    progress and metrics, and the events below them."""
    text = "\n".join(display)
    return (
        all(
            any(line.lstrip().startswith(role) and "%" in line and "loss=" in line for line in display)
            for role in ("role0", "role1")
        )
        and "events" in text
        and display[0].startswith("job liveview")
    )


def test_live_view_fits_80x24_and_shows_progress(tmp_path: Path) -> None:
    env = {**os.environ, "TRAINMASTER_HOME": str(tmp_path / "home")}
    term = Terminal(
        [sys.executable, "-m", "trainmaster", "run", str(reporting_job(tmp_path / "job.yaml"))], 80, 24, env
    )
    try:
        display = term.read_until(_has_progress, "both roles' progress in the live view")
        text = "\n".join(display)
        assert display[0].startswith("job liveview (id 1) running"), display[0]
        header = next(line for line in display if line.lstrip().startswith("role "))
        for column in ("state", "pend", "start", "run", "ok", "fail", "rst", "progress"):
            assert column in header.split(), header  # every column fits at 80 wide
        assert "role0" in text and "events" in text
        assert len([line for line in display if line.strip()]) <= 24
        os.write(term.master, b"\x03")  # Ctrl-C cancels the job and ends the command
        term.read_until(lambda d: "cancelled" in "\n".join(d), "the job cancelled after Ctrl-C")
        assert term.proc.wait(timeout=30) == 1
    finally:
        term.close()


def test_taller_terminal_adds_the_instances_table() -> None:
    status = {
        "id": 3,
        "name": "wide",
        "state": "running",
        "reason": "Running",
        "message": "all good",
        "startedAt": "2026-01-01T00:00:00+00:00",
        "createdAt": "2026-01-01T00:00:00+00:00",
        "completedAt": "2026-01-01T00:01:05+00:00",
        "roles": [{"name": "worker", "state": "running", "counts": {"running": 20}, "replicas": 20}],
        "instances": [
            {
                "role": "worker",
                "index": i,
                "state": "running",
                "attempt": 1,
                "restarts": 0,
                "address": f"127.0.0.1:{9000 + i}",
                "exitCode": None,
                "reason": "Running",
                "metrics": {"step": 5, "epoch": None, "total": 10, "values": {"loss": 0.5}},
            }
            for i in range(20)
        ],
        "events": [
            {"time": "2026-01-01T00:00:0%d" % i, "object": "job", "type": "Normal", "reason": "R", "message": "m" * 200}
            for i in range(9)
        ],
    }
    from rich.console import Console

    def draw(width: int, height: int) -> list[str]:
        console = Console(width=width, height=height, record=True, color_system=None)
        console.print(render_status(status, width=width, height=height))
        return console.export_text().splitlines()

    small = draw(80, 24)
    assert len(small) <= 24 and all(len(line) <= 80 for line in small)
    assert "1:05" in small[0] and not any("worker-19" in line for line in small)  # no room for 20 rows
    assert any("50%" in line and "loss=0.5" in line for line in small)
    tall = draw(120, 40)
    assert len(tall) <= 40 and any("worker-19" in line and "127.0.0.1:9019" in line for line in tall)


def test_status_from_a_server_says_who_leads() -> None:
    """A status answered by a standby names the leader (servers sharing a PostgreSQL store)."""
    from rich.console import Console

    status = {
        "id": 1,
        "name": "j",
        "state": "running",
        "reason": "Running",
        "message": "",
        "roles": [],
        "instances": [],
        "events": [],
        "controller": {"leading": False, "leader": "hostA-1-abc", "server": "hostB-2-def"},
    }
    console = Console(width=100, record=True, color_system=None)
    console.print(render_status(status, width=100, height=40))
    assert "controller: leader hostA-1-abc (answered by hostB-2-def)" in console.export_text()


def test_a_succeeded_job_reads_as_one_stopped_instances_show_their_signal_and_counts_add_up() -> None:
    """The view of a succeeded job whose worker was stopped at the job's end (issue 38): the role
    line counts the stopped instance in its own column (the counts add up to the table), and the
    table shows the signal it was stopped with and why, not a bare exit 143."""
    from rich.console import Console

    instance = {"attempt": 1, "restarts": 0, "address": "127.0.0.1:9000", "metrics": None}
    status = {
        "id": 1,
        "name": "digits",
        "state": "succeeded",
        "reason": "Succeeded",
        "message": "the job's success condition is met",
        "roles": [
            {"name": "master", "state": "succeeded", "counts": {"succeeded": 1}, "replicas": 1},
            {"name": "worker", "state": "succeeded", "counts": {"succeeded": 1, "stopped": 1}, "replicas": 2},
        ],
        "instances": [
            {**instance, "role": "master", "index": 0, "state": "succeeded", "exitCode": 0, "reason": "Completed"},
            {**instance, "role": "worker", "index": 0, "state": "stopped", "exitCode": 143, "reason": "JobSucceeded"},
            {**instance, "role": "worker", "index": 1, "state": "succeeded", "exitCode": 0, "reason": "Completed"},
        ],
        "events": [],
    }
    console = Console(width=100, record=True, color_system=None)
    console.print(render_status(status, width=100, height=40))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if line.lstrip().startswith("role "))
    assert "stop" in header.split() and "term" not in header.split()
    worker = next(line for line in lines if line.startswith("worker "))
    columns = header.split()
    values = dict(zip(columns[2:9], worker.split()[2:9]))  # role, state, then the counts and restarts
    assert (values["ok"], values["stop"], values["run"]) == ("1", "1", "0"), (header, worker)
    stopped = next(line for line in lines if line.lstrip().startswith("worker-0"))
    assert "SIGTERM" in stopped and "JobSucceeded" in stopped and "143" not in stopped
