"""The executor process itself: loads one data file and runs rule calls on a Unix socket.

A request is a length-prefixed JSON object (the rule call and the leg it is for) sent together
with two or three descriptors (``SCM_RIGHTS``): the leg's result file, its commit file and, for a
rule that reads one, its input. The rule writes its result into the result file (a stream rule as
it goes, any size), then the executor appends the run's commit line (``executors.base``) and only
then replies: a length-prefixed JSON head (ok, error, size and SHA-256 of the result). It never
evaluates anything but a registered rule. It exits when its stdin closes, so it cannot outlive the
party that started it.

Run as ``python -I -m trainmaster.gateway.executors.worker (--socket PATH | --listen-fd N)
(--data FILE | --data-fd N --data-name NAME) [--max-result-bytes N]``.
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
from typing import TYPE_CHECKING, Any

from trainmaster.gateway.executors.base import DigestWriter, ResultTooLarge, commit_line, run_rule
from trainmaster.gateway.models import RuleCall

if TYPE_CHECKING:
    from trainmaster.gateway.rules.registry import Table

MAX_FRAME = 1 << 20
"""A request (a rule call with its parameters, e.g. a model's weights) is refused past this."""
MAX_FDS = 3


def recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _handle(conn: socket.socket, table: "Table", allowed: list[str] | None, max_result: int) -> dict[str, Any]:
    """One call: read it with its descriptors, run the rule into the result file, commit, reply."""
    from trainmaster.gateway.rules.registry import RuleError

    head, fds, _flags, _addr = socket.recv_fds(conn, 4, MAX_FDS)
    try:
        if len(head) < 4:
            head += recv_exact(conn, 4 - len(head))
        (size,) = struct.unpack(">I", head)
        if size > MAX_FRAME:
            raise ValueError("request too large")
        request = json.loads(recv_exact(conn, size))
        call = RuleCall.model_validate(request["call"])
        if len(fds) not in (2, 3):
            raise ValueError(f"a call needs its result and commit descriptors, got {len(fds)}")
        out = DigestWriter(fds[0], max_result)
        source = os.fdopen(os.dup(fds[2]), "rb", buffering=0) if len(fds) == 3 else None
        try:
            run_rule(table, call, allowed, out, source)
        except (RuleError, ResultTooLarge) as exc:
            return {"ok": False, "error": str(exc)}
        except Exception as exc:  # a rule failing on this data: report, keep serving
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            if source is not None:
                source.close()
        os.write(fds[1], commit_line(str(request["task_id"]), str(request["data_id"]), out.size, out.sha256))
        return {"ok": True, "error": "", "size": out.size, "sha256": out.sha256}
    finally:
        for fd in fds:
            os.close(fd)


def _serve(srv: socket.socket, table: "Table", allowed: list[str] | None, silent: bool, max_result: int) -> None:
    if not silent:
        print("READY", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                reply = _handle(conn, table, allowed, max_result)
            except Exception as exc:  # a malformed call: report, keep serving
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            raw = json.dumps(reply, separators=(",", ":")).encode()
            conn.sendall(struct.pack(">I", len(raw)) + raw)


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
    ap.add_argument("--max-result-bytes", type=int, default=1 << 30)
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
    _serve(srv, table, a.allowed.split(",") if a.allowed else None, a.silent, a.max_result_bytes)


if __name__ == "__main__":
    main()
