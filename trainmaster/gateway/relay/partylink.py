"""The gateway's link to its parties for data transfer requests: HTTP/1.1 over mutual TLS on
asyncio's own TLS transport, with a few kept-alive connections per party.

A transfer's answer is one sealed envelope (a large result stays at its party and crosses the
stream port instead, :mod:`trainmaster.gateway.net.streams`). The requests are the gateway's own
(one method, one path, a JSON envelope), so the client needs only what uvicorn answers: a status
line, headers, and a Content-Length or chunked body; a kept-alive connection the party closed
while idle is retried once on a new one with a freshly sealed envelope (never a replay).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from trainmaster.gateway.net.http1 import https_address, parse_head, post_head

READ_BYTES = 1 << 20
"""Most bytes asked of the TLS stream per read (asyncio's SSL transport decrypts 256 KB at a time)."""
MAX_HEADER_BYTES = 1 << 20
"""A response head (or chunk size line) longer than this is refused; also the read buffer's size."""
MAX_IDLE_S = 2.0
"""A kept-alive connection idle longer than this is not reused: the party's server closes idle
connections after its idle timeout (15 s by default), and a request must never race that close."""


class PartyLinkError(ConnectionError):
    """The party could not be reached, or broke off or garbled its answer (a transport failure)."""


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0
    reused: bool = False

    def usable(self, now: float) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing() and now - self.idle_since < MAX_IDLE_S

    def close(self) -> None:
        self.writer.close()


@dataclass
class PartyResponse:
    """One response: its status and headers now, its body when read (once, either way)."""

    status: int
    headers: dict[str, str]
    _conn: _Conn
    _left: int | None
    """Body bytes still to come with a Content-Length; None for a chunked body."""
    _done: bool = field(default=False)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    async def blocks(self) -> AsyncIterator[bytes]:
        """The body, de-chunked, as it arrives."""
        reader = self._conn.reader
        try:
            if self._left is not None:
                while self._left:
                    data = await reader.read(min(READ_BYTES, self._left))
                    if not data:
                        raise PartyLinkError(f"party closed the connection with {self._left} body bytes to come")
                    self._left -= len(data)
                    yield data
            else:
                while True:
                    line = await reader.readuntil(b"\r\n")
                    try:
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError as exc:
                        raise PartyLinkError(f"malformed chunk size line {line[:40]!r}") from exc
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":
                            pass  # trailers: none expected, none used
                        break
                    while size:
                        data = await reader.read(min(READ_BYTES, size))
                        if not data:
                            raise PartyLinkError("party closed the connection inside a body chunk")
                        size -= len(data)
                        yield data
                    if await reader.readexactly(2) != b"\r\n":
                        raise PartyLinkError("body chunk not followed by CRLF")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise PartyLinkError(f"party broke off its answer: {type(exc).__name__}") from exc
        self._done = True

    async def read(self, cap: int) -> bytes:
        """The whole body, refused past ``cap`` bytes instead of buffered without bound."""
        from trainmaster.gateway.crypto.envelope import EnvelopeError

        buf = bytearray()
        async for data in self.blocks():
            buf += data
            if len(buf) > cap:
                raise EnvelopeError(413, f"response body over the {cap}-byte cap")
        return bytes(buf)


class PartyLinks:
    """Kept-alive mutual-TLS connections to parties, at most ``max_idle`` idle per party."""

    def __init__(self, ssl_context: ssl.SSLContext, max_idle: int = 16):
        self._ssl, self._max_idle = ssl_context, max_idle
        self._idle: dict[tuple[str, int, str], list[_Conn]] = {}

    async def _connect(self, host: str, port: int, server_name: str) -> _Conn:
        try:
            reader, writer = await asyncio.open_connection(
                host, port, ssl=self._ssl, server_hostname=server_name, limit=MAX_HEADER_BYTES
            )
        except (OSError, ssl.SSLError) as exc:
            raise PartyLinkError(f"{type(exc).__name__}: {exc}") from exc
        return _Conn(reader, writer)

    def _take_idle(self, key: tuple[str, int, str]) -> _Conn | None:
        pool, now = self._idle.get(key, []), time.monotonic()
        while pool:
            conn = pool.pop()
            if conn.usable(now):
                conn.reused = True
                return conn
            conn.close()
        return None

    @asynccontextmanager
    async def post(
        self, endpoint: str, path: str, make_body: Callable[[], bytes], server_name: str
    ) -> AsyncIterator[PartyResponse]:
        """POST a JSON body to ``endpoint`` + ``path``; TLS checks the server is ``server_name``.

        ``make_body`` is called again (a fresh envelope, never a replay) if a kept-alive connection
        turns out closed before any answer came. The connection goes back to the pool only if the
        caller read the whole body."""
        try:
            host, port = https_address(endpoint, "party")
        except ValueError as exc:
            raise PartyLinkError(str(exc)) from exc
        key = (host, port, server_name)
        conn = self._take_idle(key) or await self._connect(host, port, server_name)
        try:
            try:
                head = await self._send(conn, host, port, path, make_body())
            except PartyLinkError:
                if not conn.reused:
                    raise
                conn.close()  # the party closed it while idle: once more on a new connection
                conn = await self._connect(host, port, server_name)
                head = await self._send(conn, host, port, path, make_body())
            resp = _parse_head(head, conn)
            yield resp
        except BaseException:
            conn.close()
            raise
        keep = resp._done and resp.headers.get("connection", "").lower() != "close"
        pool = self._idle.setdefault(key, [])
        if keep and len(pool) < self._max_idle:
            conn.idle_since, conn.reused = time.monotonic(), False
            pool.append(conn)
        else:
            conn.close()

    @staticmethod
    async def _send(conn: _Conn, host: str, port: int, path: str, body: bytes) -> bytes:
        request = post_head(path, host, port, len(body), close=False)
        try:
            conn.writer.write(request + body)
            await conn.writer.drain()
            return await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise PartyLinkError(f"response head over {MAX_HEADER_BYTES} bytes") from exc
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as exc:
            raise PartyLinkError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        for pool in self._idle.values():
            for conn in pool:
                conn.close()
        self._idle.clear()


def _parse_head(head: bytes, conn: _Conn) -> PartyResponse:
    try:
        parsed = parse_head(head)
    except ValueError as exc:
        raise PartyLinkError(str(exc)) from exc
    return PartyResponse(parsed.status, parsed.headers, conn, parsed.content_length)
