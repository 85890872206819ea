"""Secrets at rest and in the open (issue 39, item 9): no token on the command line or in the
server's /proc environment, a generated token in a private file rather than in server.log, the
store and token files 0600 in 0700 folders (another user opens neither), and IPv4-mapped
loopback treated as loopback with IPv6 URLs printed in brackets.

Mechanism: the controller service's access rules (a token required beyond loopback)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import free_port
from server_process import ServerProcess
from trainmaster.service.dashboard.access import is_loopback

pytestmark = pytest.mark.timeout(240)

SECRET = "rest-secret-31415926"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def trainmaster(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmaster", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_a_token_on_the_command_line_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "TRAINMASTER_HOME": str(tmp_path / "home")}
    done = trainmaster(env, "server", "--port", str(free_port()), "--token", SECRET)
    assert done.returncode == 2 and "/proc/PID/cmdline" in done.stderr and "--token-file" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_server_keeps_its_token_and_store_out_of_proc(tmp_path: Path) -> None:
    """The token and the store's URL reach the server by file or environment; afterwards neither
    its command line nor /proc/PID/environ holds them; its store is 0600 in a 0700 home."""
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    token_file.chmod(0o644)
    home = tmp_path / "home"
    db = f"sqlite:///{home / 'trainmaster.db'}"
    lax = trainmaster({**os.environ, "TRAINMASTER_HOME": str(home)}, "server", "--token-file", str(token_file))
    assert lax.returncode == 2 and "chmod 600" in lax.stderr  # as ssh refuses a key others may read
    token_file.chmod(0o600)
    by_file = ServerProcess(tmp_path, "--token-file", str(token_file), db=db, home=home)
    try:
        cmdline = Path(f"/proc/{by_file.proc.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{by_file.proc.pid}/environ").read_bytes()
        assert SECRET.encode() not in cmdline and str(token_file).encode() in cmdline
        assert db.encode() not in environ
        headers = {"Authorization": f"Bearer {SECRET}"}
        assert httpx.get(f"{by_file.url}/api/v1/jobs", headers=headers, timeout=10).status_code == 200
    finally:
        by_file.stop()
    by_env = ServerProcess(tmp_path, db=db, home=home, env={"TRAINMASTER_TOKEN": SECRET})
    try:
        environ = Path(f"/proc/{by_env.proc.pid}/environ").read_bytes()
        assert SECRET.encode() not in environ and db.encode() not in environ
        assert b"TRAINMASTER_HOME=" in environ  # only the secrets are gone
        assert (
            httpx.get(
                f"{by_env.url}/api/v1/jobs", headers={"Authorization": f"Bearer {SECRET}"}, timeout=10
            ).status_code
            == 200
        )
    finally:
        by_env.stop()
    store = home / "trainmaster.db"
    assert mode(store) == 0o600 and mode(home) == 0o700
    for side in (home / "trainmaster.db-wal", home / "trainmaster.db-shm"):
        if side.exists():
            assert mode(side) & 0o077 == 0, side


def test_a_generated_token_lives_in_a_private_file_not_in_the_log(tmp_path: Path) -> None:
    """Beyond loopback without a token: one is generated into <home>/server.token (0600, home
    0700), kept for the next start, and neither the log of a detached server nor its banner
    carries it; another user can open neither the token nor the store."""
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    port = free_port()
    env = {**os.environ, "TRAINMASTER_HOME": str(home), "TRAINMASTER_DB": f"sqlite:///{home / 'trainmaster.db'}"}
    started = trainmaster(env, "server", "--host", "0.0.0.0", "--port", str(port), "--detach")
    assert started.returncode == 0, started.stderr
    pid = int((home / "server.pid").read_text())
    try:
        token_path = home / "server.token"
        token = token_path.read_text().strip()
        assert len(token) >= 24 and mode(token_path) == 0o600 and mode(home) == 0o700
        log = (home / "server.log").read_text()
        assert token not in log and token not in started.stdout and str(token_path) in log
        assert mode(home / "server.log") == 0o600
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/api/v1/jobs", timeout=10).status_code == 401
        assert (
            httpx.get(f"{url}/api/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code == 200
        )
        for secret in (token_path, home / "trainmaster.db"):
            other = subprocess.run(["cat", str(secret)], user=65534, capture_output=True, text=True)  # nobody
            assert other.returncode != 0 and "Permission denied" in other.stderr, secret
    finally:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    again = trainmaster(env, "server", "--host", "0.0.0.0", "--port", str(port), "--detach")
    assert again.returncode == 0, again.stderr
    try:
        assert (home / "server.token").read_text().strip() == token  # kept: logged-in users stay logged in
    finally:
        os.kill(int((home / "server.pid").read_text()), signal.SIGTERM)


def test_ipv4_mapped_loopback_is_loopback_and_ipv6_urls_have_brackets(tmp_path: Path) -> None:
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("::1") and is_loopback("127.0.0.2")
    assert not is_loopback("::ffff:10.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback("::")
    home = tmp_path / "home"
    env = {**os.environ, "TRAINMASTER_HOME": str(home), "TRAINMASTER_DB": f"sqlite:///{tmp_path / 'store.db'}"}
    hosts = ["::ffff:127.0.0.1"]
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        hosts.append("::1")
    except OSError:
        pass  # no IPv6 loopback in this container: the mapped address still runs on the v6 stack
    for host in hosts:
        port = free_port()
        done = trainmaster(env, "server", "--host", host, "--port", str(port), "--detach")
        assert done.returncode == 0, done.stderr
        pid = int((home / "server.pid").read_text())
        try:
            assert f"http://[{host}]:{port}" in done.stdout, done.stdout
            assert not (home / "server.token").exists()  # loopback: open, no token generated
            target = "127.0.0.1" if host.startswith("::ffff:") else "[::1]"
            assert httpx.get(f"http://{target}:{port}/api/v1/jobs", timeout=10).status_code == 200
        finally:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
