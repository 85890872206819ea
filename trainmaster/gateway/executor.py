"""The per-task isolated executor: one subprocess per (task, data id), holding one data file.

The party starts it in its own session (``start_new_session``), with a clean environment, resource
limits (address space, CPU seconds, open files, no file writes) and a deadline after which the
party kills its process group. It listens on a Unix socket inside a private (0700) directory; that
socket path is the executor address the party reports to the gateway. A request is a length-prefixed
JSON rule call; the reply is a length-prefixed JSON head (ok, error, size and SHA-256 of the result)
followed by the result's JSON bytes, which the party reads in chunks, so a result of tens of MB is
never held twice. It never evaluates anything but a registered rule. It exits when its stdin closes,
so it cannot outlive the party that started it.

:class:`Executor` is the interface the party uses; :class:`ExecutorHandle` (a subprocess) and
``rayexec.RayExecutor`` (a Ray actor) implement it.

Run as ``python -I -m trainmaster.gateway.executor --socket PATH --data FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import struct
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from trainmaster.gateway.models import RuleCall

MAX_FRAME = 128 * 1024 * 1024


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _serve(sock_path: str, data_file: str, allowed: list[str] | None, silent: bool) -> None:
    from trainmaster.gateway.rules import RuleError, load_table, run_call

    table = load_table(Path(data_file))
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(8)
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


def encode_reply(result: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """A successful rule's reply head and body: the result as compact JSON, its size and digest."""
    body = json.dumps(result, separators=(",", ":")).encode()
    return {"ok": True, "error": "", "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}, body


class RuleReply:
    """An executor's answer: ``ok``/``error`` and, when ok, ``size`` bytes of result JSON to read.

    ``read(n)`` returns the next ``n`` bytes; reading in chunks keeps a large result from being
    held whole by the party agent (the subprocess executor streams it off its socket).
    """

    def __init__(self, head: dict[str, Any], read: Callable[[int], Awaitable[bytes]],
                 close: Callable[[], None] = lambda: None):
        self.ok, self.error = bool(head.get("ok")), str(head.get("error", ""))
        self.size, self.sha256 = int(head.get("size", 0)), str(head.get("sha256", ""))
        self._read, self._close, self._left = read, close, self.size

    async def chunks(self, chunk_bytes: int) -> AsyncIterator[tuple[bytes, bool]]:
        """The result in order, each piece with whether it is the last (an empty result is one piece)."""
        while True:
            piece = await self._read(min(chunk_bytes, self._left)) if self._left else b""
            self._left -= len(piece)
            yield piece, self._left == 0
            if self._left == 0:
                return

    async def read_all(self) -> bytes:
        return b"".join([piece async for piece, _last in self.chunks(max(1, self.size))])

    def close(self) -> None:
        self._close()


class Executor(Protocol):
    """What the party needs from a per-task isolated executor, whatever runs it."""

    address: str

    @property
    def alive(self) -> bool: ...

    async def call(self, call: RuleCall, timeout_s: float) -> RuleReply: ...

    def kill(self) -> None: ...


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--allowed", default="")
    ap.add_argument("--silent", action="store_true", help="fault injection: never report readiness")
    a = ap.parse_args()

    def _exit_when_orphaned() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    _serve(a.socket, a.data, a.allowed.split(",") if a.allowed else None, a.silent)


class ExecutorHandle:
    """The party's side of one executor process."""

    def __init__(self, proc: asyncio.subprocess.Process, sock_path: str, workdir: str):
        self.proc, self.address, self._workdir = proc, sock_path, workdir

    @classmethod
    async def start(cls, data_file: Path, deadline_s: float, start_timeout_s: float, memory_mb: int,
                    allowed: list[str] | None = None, silent: bool = False) -> "ExecutorHandle":
        workdir = tempfile.mkdtemp(prefix="tm-exec-")
        os.chmod(workdir, 0o700)
        sock_path = os.path.join(workdir, "executor.sock")
        cpu = int(deadline_s) + 5

        def _limits() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        args = [sys.executable, "-I", "-B", "-m", "trainmaster.gateway.executor", "--socket", sock_path, "--data", str(data_file)]
        if allowed:
            args += ["--allowed", ",".join(allowed)]
        if silent:
            args.append("--silent")
        proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            env=env, cwd=workdir, start_new_session=True, preexec_fn=_limits,
        )
        handle = cls(proc, sock_path, workdir)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=start_timeout_s)
            if line.strip() != b"READY":
                raise RuntimeError(f"executor exited before reporting (code {await proc.wait()})")
        except (asyncio.TimeoutError, RuntimeError) as exc:
            handle.kill()
            raise TimeoutError(f"executor did not report within {start_timeout_s:.0f}s") from exc
        asyncio.get_running_loop().call_later(deadline_s, handle.kill)
        return handle

    async def call(self, call: RuleCall, timeout_s: float) -> RuleReply:
        """Send the rule call; the reply's body stays on the socket until the caller reads it."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.address, limit=1 << 20), timeout_s)
        try:
            body = call.model_dump_json().encode()
            writer.write(struct.pack(">I", len(body)) + body)
            await writer.drain()
            (size,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), timeout_s))
            if size > MAX_FRAME:
                raise ValueError("executor reply head too large")
            head = json.loads(await asyncio.wait_for(reader.readexactly(size), timeout_s))
        except BaseException:
            writer.close()
            raise

        async def read(n: int) -> bytes:
            return await asyncio.wait_for(reader.readexactly(n), timeout_s)

        return RuleReply(head, read, writer.close)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def kill(self) -> None:
        """Kill the executor's whole process group and remove its private directory."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        try:
            if os.path.exists(self.address):
                os.unlink(self.address)
            os.rmdir(self._workdir)
        except OSError:
            pass


if __name__ == "__main__":
    main()
