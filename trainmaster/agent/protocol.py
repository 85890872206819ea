"""The wire form of ``NodeAgentAPI`` between a controller and a local agent daemon.

One request per line, one answer per line, JSON: ``{"op": "start", "specs": [...]}`` ->
``{"ok": true, "result": [...]}`` or ``{"ok": false, "error": "..."}``. A batch (one ``start``
with 64 specs) is one round trip. The socket lives in the agent's state dir; where that path is
longer than a Unix socket address allows, it is reached through ``/proc/self/fd/<dir fd>/``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

SOCKET_NAME = "agent.sock"
LOCK_NAME = "agent.lock"
PID_NAME = "agent.pid"
LOG_NAME = "agent.log"
ALREADY_RUNNING_EXIT = 3  # the daemon found another agent holding the state dir's lock
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes


def socket_address(state_dir: Path) -> tuple[str, int | None]:
    """A connectable/bindable path for the agent's socket, and a directory fd to close after."""
    path = state_dir / SOCKET_NAME
    if len(str(path)) <= MAX_SOCKET_PATH:
        return str(path), None
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{SOCKET_NAME}", fd


def connect(state_dir: Path, timeout: float) -> socket.socket:
    address, fd = socket_address(state_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return sock
