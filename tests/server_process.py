"""A real ``trainmaster server`` process for tests, on a free loopback port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from helpers import free_port


class ServerProcess:
    """``trainmaster server`` over ``db`` (default: a fresh SQLite store in ``tmp_path``), started
    at once; ``start`` runs it again (same port, store and log) after ``kill9`` or ``stop``."""

    def __init__(
        self,
        tmp_path: Path,
        *extra: str,
        db: str | None = None,
        home: Path | None = None,
        token: str | None = None,
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        if token is not None:  # as an operator gives it: a file only its owner reads
            token_file = tmp_path / f"token-{self.port}"
            token_file.write_text(token + "\n")
            token_file.chmod(0o600)
            extra = (*extra, "--token-file", str(token_file))
        self.extra = extra
        self.env = {
            **os.environ,
            "TRAINMASTER_HOME": str(home or tmp_path / "home"),
            "TRAINMASTER_DB": db or f"sqlite:///{tmp_path / 'store.db'}",
            **(env or {}),
        }
        self.client_env = {**self.env, "TRAINMASTER_SERVER": self.url}  # CLI verbs aimed at this server
        self.log = open(tmp_path / f"server-{self.port}.log", "ab")
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainmaster",
                "server",
                "--port",
                str(self.port),
                "--interval",
                "0.2",
                "--grace",
                "2",
                *self.extra,
            ],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise AssertionError(f"the server did not answer /healthz on {self.url} within {timeout:g} s")

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/healthz", timeout=5).json()

    def auth(self) -> dict[str, str]:
        """The header a client of this server sends (none for an open server)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def submit(self, doc: dict[str, Any], **headers: str) -> int:
        response = httpx.post(f"{self.url}/api/v1/jobs", json=doc, headers={**self.auth(), **headers}, timeout=30)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``trainmaster ARGS`` as a user runs it against this server."""
        return subprocess.run(
            [sys.executable, "-m", "trainmaster", *args],
            capture_output=True,
            text=True,
            env=self.client_env,
            timeout=60,
        )

    def status(self, job: str | int) -> dict[str, Any]:
        return httpx.get(
            f"{self.url}/api/v1/jobs/{job}", params={"events": 500}, headers=self.auth(), timeout=10
        ).json()

    def wait_state(self, job: str | int, states: set[str], timeout: float = 60) -> dict[str, Any]:
        """The job's status once its state is one of ``states``."""
        deadline = time.monotonic() + timeout
        status = self.status(job)
        while status["state"] not in states:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job} still {status['state']} after {timeout:g} s, not {sorted(states)}: "
                    f"{status['events'][-5:]}"
                )
            time.sleep(0.2)
            status = self.status(job)
        return status

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # the server only: its instances live on, as after a crash
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 30 s); the log is closed: the server is not started again."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        self.log.close()
