"""A real ``trainmaster server`` process for tests, on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``trainmaster server`` over ``db`` (default: a fresh SQLite store in ``tmp_path``)."""

    def __init__(self, tmp_path: Path, *extra: str, db: str | None = None, home: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "TRAINMASTER_HOME": str(home or tmp_path / "home"),
            "TRAINMASTER_DB": db or f"sqlite:///{tmp_path / 'store.db'}",
        }
        self.log = open(tmp_path / f"server-{self.port}.log", "wb")
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
                *extra,
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

    def submit(self, doc: dict[str, Any], **headers: str) -> int:
        response = httpx.post(f"{self.url}/api/v1/jobs", json=doc, headers=headers, timeout=30)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # the server only: its instances live on, as after a crash
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        self.log.close()
