"""The initiator's download of a streamed result: one blocking mutual-TLS socket, read into reused
buffers.

Why not httpx on this one request: a streamed result (hundreds of MB) arrives as the response
body, and httpx's sync stream hands it out through httpcore and h11 64 KB at a time, each step a
fresh bytes object, which the frame splitter then joins again per 1 MiB frame. Here the body is
read off the TLS socket straight into the caller's buffer (``recv_into``), de-chunked on the way,
so a frame lands in one reused buffer with no intermediate copies, like the direct TLS baseline
of ``bench/gateway.py``. The request is the initiator's own (one POST of a JSON envelope, with
``connection: close``), so the client needs only what uvicorn answers: a status line, headers and
a Content-Length or chunked body.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from trainmaster.gateway.net.http1 import https_address, parse_head, post_head

MAX_HEAD_BYTES = 64 << 10
"""A response head or chunk size line longer than this is refused."""
_BUFFER_BYTES = 256 << 10
"""The socket read buffer for heads, size lines and small bodies; large reads bypass it."""


class ResultLinkError(ConnectionError):
    """The gateway could not be reached, or broke off or garbled its answer (a transport failure)."""


@dataclass
class _Socket:
    """A TLS socket with a small read-ahead buffer, every error a :class:`ResultLinkError`."""

    sock: ssl.SSLSocket
    buf: bytearray = field(default_factory=lambda: bytearray(_BUFFER_BYTES))
    start: int = 0
    end: int = 0

    def _recv_into(self, view: memoryview) -> int:
        try:
            n = self.sock.recv_into(view)
        except TimeoutError as exc:
            raise ResultLinkError("gateway sent nothing within the timeout") from exc
        except OSError as exc:  # ssl.SSLError, ConnectionResetError, ...
            raise ResultLinkError(f"{type(exc).__name__}: {exc}") from exc
        if n == 0:
            raise ResultLinkError("gateway closed the connection before the end of its answer")
        return n

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            self.buf[: self.end - self.start] = self.buf[self.start : self.end]
            self.start, self.end = 0, self.end - self.start
        self.end += self._recv_into(memoryview(self.buf)[self.end :])

    def read_until(self, sep: bytes) -> bytes:
        """Bytes up to and including ``sep``; refused past :data:`MAX_HEAD_BYTES`."""
        while True:
            at = self.buf.find(sep, self.start, self.end)
            if at >= 0:
                out = bytes(self.buf[self.start : at + len(sep)])
                self.start = at + len(sep)
                return out
            if self.end - self.start >= MAX_HEAD_BYTES:
                raise ResultLinkError(f"response head or chunk line over {MAX_HEAD_BYTES} bytes")
            self._fill()

    def read_into(self, out: memoryview) -> None:
        """Exactly ``len(out)`` bytes: what is buffered first, the rest straight off the socket."""
        got = min(len(out), self.end - self.start)
        out[:got] = self.buf[self.start : self.start + got]
        self.start += got
        while got < len(out):
            got += self._recv_into(out[got:])


class ResponseBody:
    """One response body, de-chunked, read into the caller's buffers."""

    def __init__(self, conn: _Socket, content_length: int | None):
        self._conn = conn
        self._chunked = content_length is None
        self._left = content_length or 0
        """Bytes left in the current chunk (chunked) or in the body (Content-Length)."""
        self._first = True
        self.ended = content_length == 0

    def _next_chunk(self) -> None:
        if not self._first and self._conn.read_until(b"\r\n") != b"\r\n":
            raise ResultLinkError("body chunk not followed by CRLF")
        self._first = False
        line = self._conn.read_until(b"\r\n")
        try:
            self._left = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise ResultLinkError(f"malformed chunk size line {line[:40]!r}") from exc
        if self._left == 0:
            while self._conn.read_until(b"\r\n") != b"\r\n":
                pass  # trailers: none expected, none used
            self.ended = True

    def read_into(self, out: memoryview) -> int:
        """Fills ``out``; fewer bytes only where the body ends (0 at its end)."""
        got = 0
        while got < len(out) and not self.ended:
            if self._left == 0:
                if not self._chunked:
                    self.ended = True
                    break
                self._next_chunk()
                continue
            n = min(self._left, len(out) - got)
            self._conn.read_into(out[got : got + n])
            got += n
            self._left -= n
            if not self._chunked and self._left == 0:
                self.ended = True
        return got

    def read(self, cap: int) -> bytes:
        """The rest of the body, at most ``cap`` bytes of it (an error text)."""
        buf = bytearray(cap)
        return bytes(buf[: self.read_into(memoryview(buf))])


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: ResponseBody

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")


@contextmanager
def post(
    ssl_context: ssl.SSLContext, endpoint: str, path: str, body: bytes, server_name: str, timeout_s: float
) -> Iterator[Response]:
    """POST a JSON body to ``endpoint`` + ``path`` on a new connection (closed on exit); TLS checks
    the server is ``server_name``. ``timeout_s`` bounds every wait (connect, each read)."""
    try:
        host, port = https_address(endpoint, "gateway")
    except ValueError as exc:
        raise ResultLinkError(str(exc)) from exc
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise ResultLinkError(f"{type(exc).__name__}: {exc}") from exc
    try:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        try:
            tls = ssl_context.wrap_socket(raw, server_hostname=server_name)
        except (OSError, ssl.SSLError) as exc:
            raise ResultLinkError(f"{type(exc).__name__}: {exc}") from exc
        with tls:
            head = post_head(path, host, port, len(body), close=True)
            try:
                tls.sendall(head + body)
            except OSError as exc:
                raise ResultLinkError(f"{type(exc).__name__}: {exc}") from exc
            conn = _Socket(tls)
            yield _parse_head(conn.read_until(b"\r\n\r\n"), conn)
    finally:
        raw.close()


def _parse_head(head: bytes, conn: _Socket) -> Response:
    try:
        parsed = parse_head(head)
    except ValueError as exc:
        raise ResultLinkError(str(exc)) from exc
    return Response(parsed.status, parsed.headers, ResponseBody(conn, parsed.content_length))
