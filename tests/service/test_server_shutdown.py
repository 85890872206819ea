"""The controller as a service stops on SIGTERM even while a dashboard tab is open: its live
streams (server-sent events) never end on their own, so the server tells them it stops and they
end themselves within the drain, instead of being cancelled (an error in the log) or waited for."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

from trainmaster.cli.server import SHUTDOWN_DRAIN_S

pytestmark = pytest.mark.timeout(120)


def test_sigterm_stops_the_server_with_a_live_stream_open(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path)
    opened = threading.Event()

    def watch() -> None:  # a dashboard tab: one long-lived /ui/stream request
        try:
            with httpx.stream("GET", server.url + "/ui/stream", timeout=httpx.Timeout(5, read=None)) as response:
                opened.set()
                for _ in response.iter_raw():
                    pass
        except httpx.HTTPError:
            pass  # the server went away: what this test waits for

    tab = threading.Thread(target=watch, daemon=True)
    tab.start()
    try:
        assert opened.wait(30), "the live stream did not open"
        began = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=SHUTDOWN_DRAIN_S + 20)
        took = time.monotonic() - began
    finally:
        server.stop()
    assert code in (0, -signal.SIGTERM), server.log.name  # uvicorn re-raises the signal once it has shut down
    assert took < SHUTDOWN_DRAIN_S + 15, f"the server took {took:.1f} s to stop with a stream open"
    tab.join(timeout=10)
    assert not tab.is_alive(), "the stream did not end with the server"
    log = Path(server.log.name).read_text()
    assert "ERROR" not in log and "Traceback" not in log, log  # nothing was cancelled


def test_a_detached_server_removes_its_pid_file_when_it_exits(tmp_path: Path) -> None:
    """`trainmaster server --detach` returns once the server listens, with its pid in
    server.pid (what the README's kill line reads); the server removes that file as it exits,
    so a later kill of a stale pid cannot hit an unrelated process that reused it (issue 38)."""
    import os
    import subprocess
    import sys

    from helpers import free_port

    home = tmp_path / "home"
    env = {**os.environ, "TRAINMASTER_HOME": str(home), "TRAINMASTER_DB": f"sqlite:///{tmp_path / 'store.db'}"}
    started = subprocess.run(
        [sys.executable, "-m", "trainmaster", "server", "--detach", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    pid_file = home / "server.pid"
    pid = int(pid_file.read_text())
    assert f"stop it: kill {pid}" in started.stdout
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists(), "the detached server did not exit on SIGTERM"
        assert not pid_file.exists()
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
