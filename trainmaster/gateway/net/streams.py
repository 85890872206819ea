"""The stream port: bulk transfers (a leg's input, a stored result) on blocking mutual-TLS sockets,
one thread per stream, beside the service's HTTP port.

Why a second port: the HTTP port is uvicorn on asyncio, whose TLS transport decrypts through
memory BIOs in Python: measured here, receiving over it cost 1.8-2.3 ms of CPU per MB against
0.5-0.8 ms for a blocking ``ssl`` socket (``docs/design/gateway-relay.md``). Three processes share
the path of a streamed byte (initiator, gateway, party) where a direct TLS stream has two, so the
CPU each MB costs decides the throughput. Here a frame is read straight into a reused buffer
(``recv_into``) and sent with one ``sendall``; nothing else runs in these threads, and all the
service's state stays on its event loop (:func:`on_loop`).

Protocol, per connection: the client sends one frame holding a sealed, signed envelope (an
:class:`~trainmaster.gateway.models.InputPut` or :class:`~trainmaster.gateway.models.ResultFetch`);
the server answers one JSON status frame (``{"status": 200, "ready": <sealed StreamReady>}`` or
``{"status": 4xx/5xx, "detail": ...}``); then chunk frames flow one way
(:mod:`trainmaster.gateway.crypto.chunks`), and an upload ends with one more JSON status frame from
the server once the bytes are committed. Every frame is capped; every wait has a timeout. The
request and status frames travel in TLS records; the chunk frames, sealed per hop already, travel
on the bare connection beside them (:meth:`StreamSocket.recv_chunk_into` says why that keeps every
property TLS gave them): TLS's own AES-GCM pass and its two copies through the memory BIOs cost
more CPU per relayed byte than anything else in the gateway did.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from trainmaster.gateway.crypto.chunks import HEADER, ChunkOpener
from trainmaster.gateway.crypto.envelope import EnvelopeError
from trainmaster.gateway.crypto.tlsid import PeerIdentity, peer_from_cert

MAX_REQUEST_BYTES = 64 << 10
"""A request or status frame (an envelope, a JSON status) is refused past this size."""
SOCKET_BUFFER_BYTES = 4 << 20
RAW_READ_BYTES = 1 << 20
"""The most one ``recv_into`` takes off a stream socket (TLS records, decrypted in memory after)."""
LOOP_TIMEOUT_S = 60.0
"""How long a stream thread waits for the event loop to answer (it is never busy that long)."""
T = TypeVar("T")
log = logging.getLogger("trainmaster.gateway.streams")


class StreamError(ConnectionError):
    """The other end could not be reached, broke off, stalled past the timeout, or sent a frame
    that is not one (a transport failure; what it says is the reason)."""


class Refused(Exception):
    """A stream request a service refuses; ``status`` and the message go back to the requester as
    the stream's status frame."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


class StreamAborted(EnvelopeError):
    """The sender ended its stream early with an abort frame; ``why`` is the reason it gave."""

    def __init__(self, why: str):
        super().__init__(502, why)
        self.why = why


def stream_address(endpoint: str, whose: str) -> tuple[str, int]:
    """Host and port of a roster ``stream_endpoint`` (``host:port``; ``[v6]:port``)."""
    url = urlsplit(f"//{endpoint}")
    if url.hostname is None or url.port is None:
        raise StreamError(f"{whose}'s stream endpoint {endpoint!r} is not host:port")
    return url.hostname, url.port


class StreamSocket:
    """Frames over one mutual-TLS connection; every error is a :class:`StreamError`.

    TLS runs over memory BIOs (``ssl.SSLContext.wrap_bio``) rather than on the socket: an
    ``ssl.SSLSocket`` reads one TLS record (16 KiB at most) per ``recv_into``, two ``read``
    syscalls per record, and writes one syscall per record, so a 1 MiB chunk cost ~130 syscalls and
    as many trips through the interpreter on each side of a hop. Here the socket is read in blocks of
    up to :data:`RAW_READ_BYTES` and each frame's records go out in one ``sendall``; OpenSSL only
    decrypts and encrypts in memory. Measured on a loopback relay of 1 GiB (receive, send on):
    2.2 -> 1.8 ms of CPU per MB."""

    def __init__(self, raw: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO):
        self.raw, self.tls, self._in, self._out = raw, tls, incoming, outgoing
        self._head = bytearray(HEADER.size)
        self._block = bytearray(RAW_READ_BYTES)

    @classmethod
    def handshake(
        cls, raw: socket.socket, ctx: ssl.SSLContext, server_side: bool, server_hostname: str | None = None
    ) -> "StreamSocket":
        """TLS over ``raw`` (its timeout bounds each wait); raises ``ssl.SSLError`` when the
        handshake is refused (the alert is sent first) and :class:`StreamError` when the
        connection breaks."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(incoming, outgoing, server_side=server_side, server_hostname=server_hostname)
        conn = cls(raw, tls, incoming, outgoing)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                conn._flush()
                conn._fill("connection closed during the TLS handshake")
            except ssl.SSLError:
                try:
                    conn._flush()  # the alert tells the other end why
                except StreamError:
                    pass
                raise
        conn._flush()
        return conn

    def getpeercert(self) -> dict[str, Any] | None:
        return self.tls.getpeercert()

    def settimeout(self, timeout_s: float) -> None:
        self.raw.settimeout(timeout_s)

    def _fill(self, closed: str) -> None:
        """One block of TLS records off the socket into the incoming BIO."""
        try:
            n = self.raw.recv_into(self._block)
        except TimeoutError as exc:
            raise StreamError("the other end sent nothing within the timeout") from exc
        except OSError as exc:  # ConnectionResetError, ...
            raise StreamError(f"{type(exc).__name__}: {exc}") from exc
        if n == 0:
            raise StreamError(closed)
        self._in.write(memoryview(self._block)[:n])

    def _flush(self) -> None:
        """Send what TLS has written to the outgoing BIO, in one ``sendall``."""
        if self._out.pending:
            self._sendall(self._out.read())

    def _sendall(self, data: bytes | memoryview) -> None:
        """Bytes onto the socket, a broken or stalled connection as :class:`StreamError`."""
        try:
            self.raw.sendall(data)
        except TimeoutError as exc:
            raise StreamError("the other end took nothing within the timeout") from exc
        except OSError as exc:
            raise StreamError(f"{type(exc).__name__}: {exc}") from exc

    def _recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n: int = self.tls.read(len(view) - got, view[got:])  # type: ignore[assignment]  # with a buffer: a count
            except ssl.SSLWantReadError:
                self._fill("the other end closed the connection mid-frame" if got else "connection closed")
                continue
            except ssl.SSLZeroReturnError:
                n = 0
            except ssl.SSLError as exc:
                raise StreamError(f"{type(exc).__name__}: {exc}") from exc
            if n == 0:
                raise StreamError("the other end closed the connection mid-frame" if got else "connection closed")
            got += n
        self._flush()  # TLS may owe the other end an answer (a key update)

    def recv_frame_into(self, buf: bytearray) -> memoryview:
        """The next frame's body, read into ``buf`` (refused if it does not fit)."""
        return self._frame_into(buf, self._recv_exact)

    def _frame_into(self, buf: bytearray, read_exact: Callable[[memoryview], None]) -> memoryview:
        """One frame (length header, then body into ``buf``) read with ``read_exact``: through
        TLS (:meth:`_recv_exact`) or off the bare socket (:meth:`_raw_exact`)."""
        read_exact(memoryview(self._head))
        (size,) = HEADER.unpack(self._head)
        if size > len(buf):
            raise StreamError(f"frame of {size} bytes is over this stream's {len(buf)}-byte frames")
        view = memoryview(buf)[:size]
        read_exact(view)
        return view

    def recv_frame(self, cap: int = MAX_REQUEST_BYTES) -> bytes:
        return bytes(self.recv_frame_into(bytearray(cap)))

    def recv_json(self) -> dict[str, Any]:
        try:
            value = json.loads(self.recv_frame())
        except ValueError as exc:
            raise StreamError("status frame is not JSON") from exc
        if not isinstance(value, dict) or not isinstance(value.get("status"), int):
            raise StreamError("status frame without a status")
        return value

    def send(self, data: bytes | memoryview) -> None:
        """Bytes already framed (a request or status frame): TLS records into memory, one ``sendall``."""
        view = memoryview(data)
        try:
            while view:
                view = view[self.tls.write(view) :]
        except ssl.SSLError as exc:
            raise StreamError(f"{type(exc).__name__}: {exc}") from exc
        self._flush()

    def send_chunk(self, data: bytes | memoryview) -> None:
        """A whole sealed chunk frame (:mod:`~trainmaster.gateway.crypto.chunks`) straight onto the
        socket, outside the TLS records: the chunk AEAD already gives its bytes what a record would
        (see :meth:`recv_chunk_into`), so a second encryption pass over them is saved."""
        self._sendall(data)

    def _raw_exact(self, view: memoryview) -> None:
        got = 0
        if self._in.pending:  # read off the socket with the last TLS record; TLS left them: ours
            head = self._in.read(len(view))
            view[: len(head)] = head
            got = len(head)
        while got < len(view):
            try:
                n = self.raw.recv_into(view[got:])
            except TimeoutError as exc:
                raise StreamError("the other end sent nothing within the timeout") from exc
            except OSError as exc:
                raise StreamError(f"{type(exc).__name__}: {exc}") from exc
            if n == 0:
                raise StreamError("the other end closed the connection mid-frame" if got else "connection closed")
            got += n

    def recv_chunk_into(self, buf: bytearray) -> memoryview:
        """The next sealed chunk frame's body, read straight off the socket into ``buf`` (refused if
        it does not fit; one ``recv_into`` per piece the kernel holds, no copy through TLS).

        Why a chunk frame may travel outside the TLS records: its body is AES-256-GCM under a key
        that only this hop's two ends hold (it came inside a signed envelope sealed to its receiver,
        over this connection's mutual TLS), with a counter nonce and the stream id, index and flags
        as associated data: confidentiality, integrity, order, truncation and splicing are checked
        per chunk by :class:`~trainmaster.gateway.crypto.chunks.ChunkOpener`, as a TLS record
        would check them, and an abort frame is sealed the same way. What a frame leaves in the
        clear, its 4-byte length, is what TLS records show too. Everything else on the connection
        (the request, the ready answer, the final status) stays inside TLS: TLS never reads ahead
        of the record it needs, so bytes after a record stay in the incoming BIO for this method."""
        return self._frame_into(buf, self._raw_exact)

    def send_frame(self, body: bytes) -> None:
        self.send(HEADER.pack(len(body)) + body)

    def send_json(self, value: dict[str, Any]) -> None:
        self.send_frame(json.dumps(value, separators=(",", ":")).encode())

    def close(self) -> None:
        try:
            self.raw.close()
        except OSError:
            pass


class ChunkReader:
    """The receiving end of one hop's stream, the same for every receiver (the gateway relaying
    either way, a party taking an input, an initiator fetching a result): each chunk frame read off
    the socket into one reused buffer and opened, in order, into the caller's buffer."""

    def __init__(self, conn: StreamSocket, opener: ChunkOpener):
        self.conn, self.opener = conn, opener
        self._body = bytearray(opener.max_frame)

    def next_into(self, out: Any) -> tuple[memoryview, bool]:
        """The next chunk's plaintext (a view of ``out``) and whether it was the last. Raises
        :class:`StreamError` when the connection breaks, :class:`StreamAborted` when the sender
        ended the stream with a reason, and :class:`EnvelopeError` for a chunk that is tampered,
        out of order or past the announced length."""
        frame = self.conn.recv_chunk_into(self._body)
        if (why := self.opener.aborted(frame)) is not None:
            raise StreamAborted(why)
        return self.opener.open_into(frame, out)


def _tune(sock: socket.socket) -> None:
    """Large buffers for the bulk chunks, and Nagle's algorithm off: every frame already goes out
    in one ``sendall``, so holding a small one (a request, a status) back until the peer's
    delayed ACK of the last only adds up to 40 ms to a round trip."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)


def connect(ssl_context: ssl.SSLContext, endpoint: str, server_name: str, timeout_s: float, whose: str) -> StreamSocket:
    """A mutual-TLS stream connection to ``endpoint``; TLS checks the server is ``server_name``."""
    host, port = stream_address(endpoint, whose)
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise StreamError(f"{whose} unreachable at {endpoint}: {type(exc).__name__}: {exc}") from exc
    try:
        _tune(raw)
        return StreamSocket.handshake(raw, ssl_context, server_side=False, server_hostname=server_name)
    except (OSError, ssl.SSLError) as exc:
        raw.close()
        raise StreamError(f"{whose} at {endpoint}: TLS handshake failed: {type(exc).__name__}: {exc}") from exc


Handler = Callable[[StreamSocket, "PeerIdentity | None"], None]


class StreamServer:
    """Accepts mutual-TLS stream connections on one port; each runs ``handler`` in its own thread
    (at most ``max_streams`` at once: past it a connection gets a 503 status and is closed)."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext,
        host: str,
        port: int,
        handler: Handler,
        max_streams: int,
        timeout_s: float,
        handshake_timeout_s: float,
    ):
        self._ctx, self._handler, self._timeout, self._handshake = ssl_context, handler, timeout_s, handshake_timeout_s
        self._slots = threading.BoundedSemaphore(max_streams)
        self._max = max_streams
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=128)
        self._listener.settimeout(0.5)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"stream-port-{port}", daemon=True)
        self.active = 0

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> "StreamServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                raw, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                log.warning("stream port: accept failed: %s", exc)
                continue
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        busy = not self._slots.acquire(blocking=False)
        conn: StreamSocket | None = None
        try:
            raw.settimeout(self._handshake)
            _tune(raw)
            conn = StreamSocket.handshake(raw, self._ctx, server_side=True)
            if busy:
                conn.send_json({"status": 503, "detail": f"all {self._max} stream slots are busy; retry later"})
                return
            self.active += 1
            try:
                conn.settimeout(self._timeout)
                self._handler(conn, peer_from_cert(conn.getpeercert()))
            finally:
                self.active -= 1
        except StreamError as exc:
            log.info("stream port: connection ended: %s", exc)
        except (OSError, ssl.SSLError) as exc:
            log.info("stream port: handshake failed: %s", exc)
        finally:
            if not busy:
                self._slots.release()
            if conn is not None:
                conn.close()
            else:
                raw.close()


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args)`` on the service's event loop and return its result: stream threads touch
    the service's state (tables, executors, the gate, the audit log) only through here, so that
    state keeps one owner. ``fn`` may be a coroutine function; it gets ``args`` and ``kwargs``."""

    async def call() -> T:
        out = fn(*args, **kwargs)
        if asyncio.iscoroutine(out):
            awaited: T = await out
            return awaited
        return out  # type: ignore[no-any-return]

    future = asyncio.run_coroutine_threadsafe(call(), loop)
    try:
        return future.result(timeout=LOOP_TIMEOUT_S)
    except TimeoutError:
        future.cancel()
        raise
