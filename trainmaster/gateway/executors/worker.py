"""The executor process itself: loads one data file and answers rule calls on a Unix socket.

A request is a length-prefixed JSON rule call; the reply is a length-prefixed JSON head (ok,
error, size and SHA-256 of the result) followed by the result's JSON bytes. It never evaluates
anything but a registered rule. It exits when its stdin closes, so it cannot outlive the party that
started it.

Run as ``python -I -m trainmaster.gateway.executors.worker (--socket PATH | --listen-fd N) (--data FILE | --data-fd N --data-name NAME)``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from trainmaster.gateway.executors.base import encode_reply
from trainmaster.gateway.models import RuleCall

if TYPE_CHECKING:
    from trainmaster.gateway.rules.registry import Table

MAX_FRAME = 128 * 1024 * 1024


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _serve(srv: socket.socket, table: "Table", allowed: list[str] | None, silent: bool) -> None:
    from trainmaster.gateway.rules.registry import RuleError, run_call

    if not silent:
        print("READY", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                (size,) = struct.unpack(">I", _recv_exact(conn, 4))
                if size > MAX_FRAME:
                    raise ValueError("request too large")
                call = RuleCall.model_validate(json.loads(_recv_exact(conn, size)))
                head, body = encode_reply(run_call(table, call, allowed))
            except RuleError as exc:
                head, body = {"ok": False, "error": str(exc)}, b""
            except Exception as exc:  # a rule failing on this data: report, keep serving
                head, body = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, b""
            raw = json.dumps(head, separators=(",", ":")).encode()
            conn.sendall(struct.pack(">I", len(raw)) + raw)
            if body:
                conn.sendall(body)


def main() -> None:
    ap = argparse.ArgumentParser()
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="bind and listen on this Unix socket path (process isolation)")
    where.add_argument("--listen-fd", type=int, help="accept on this already-listening Unix socket (sandbox)")
    data = ap.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="the data file's path (process isolation)")
    data.add_argument("--data-fd", type=int, help="the data file, already open at this descriptor (sandbox)")
    ap.add_argument("--data-name", default="", help="with --data-fd: the file's name, which says its format")
    ap.add_argument("--allowed", default="")
    ap.add_argument("--silent", action="store_true", help="fault injection: never report readiness")
    a = ap.parse_args()

    def _exit_when_orphaned() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    from trainmaster.gateway.rules.registry import load_table

    if a.data_fd is not None:
        with os.fdopen(a.data_fd, "rb") as source:
            table = load_table(Path(a.data_name or "data.csv"), source)
    else:
        table = load_table(Path(a.data))
    if a.listen_fd is not None:
        srv = socket.socket(fileno=a.listen_fd)
    else:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(a.socket)
        srv.listen(8)
    _serve(srv, table, a.allowed.split(",") if a.allowed else None, a.silent)


if __name__ == "__main__":
    main()
