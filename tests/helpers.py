"""The small helpers every test folder shares: a free loopback port, a bounded wait that names
what it waited for, and the ``trainmaster`` command run as a user runs it.

The larger harnesses stay in their own modules at the root of ``tests/`` (a controller over a
fresh store: :mod:`controller_harness`; a real server process: :mod:`server_process`; a threaded
one: :mod:`api_server`; PostgreSQL, the node agent, containers, the Kubernetes cluster), so any
folder imports them by name.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port nobody listens on now, on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "the condition") -> Any:
    """The truthy value of ``predicate()``, polled with a growing pause; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 120,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m trainmaster ARGS`` as a separate process, its output captured as text;
    ``env`` replaces the environment (default: this process's)."""
    return subprocess.run(
        [sys.executable, "-m", "trainmaster", *args],
        capture_output=True,
        text=True,
        env=env if env is not None else dict(os.environ),
        cwd=cwd,
        timeout=timeout,
        input=input,
    )
