"""What the gateway and party services share: mutual TLS, the envelope gate, size caps, errors,
and the connection hygiene of the server (timeouts, a connection cap, rate-limited logging)."""

from __future__ import annotations

import asyncio
import logging
import resource
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol

from trainmaster.gateway.crypto.envelope import EnvelopeError, Identity, PublicIdentity, make_header, seal
from trainmaster.gateway.crypto.gate import EnvelopeGate
from trainmaster.gateway.models import Envelope, MessageKind
from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.crypto.provision import load_identity, load_roster
from trainmaster.gateway.crypto.replay import SeenTable
from trainmaster.gateway.crypto.tlsid import PeerIdentity, peer_from_cert


@dataclass
class ServiceContext:
    """One running service's identity, roster, gate and counters."""

    cfg: ServiceConfig
    me: Identity
    roster: dict[str, PublicIdentity]
    gate: EnvelopeGate
    clock: Callable[[], float]
    handled: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, cfg: ServiceConfig, seen_url: str) -> "ServiceContext":
        Path(cfg.state_dir).mkdir(parents=True, exist_ok=True)
        offset = cfg.fault_clock_offset_s

        def clock() -> float:
            return time.time() + offset

        me, roster = load_identity(cfg), load_roster(cfg.roster)
        return cls(cfg, me, roster, EnvelopeGate(me, roster, SeenTable(seen_url), cfg.skew_s, clock), clock)

    def count(self, kind: MessageKind) -> None:
        self.handled[kind.value] = self.handled.get(kind.value, 0) + 1

    def seal_to(
        self,
        recipient: str,
        kind: MessageKind,
        task_id: str,
        data_id: str,
        payload: dict[str, Any],
        ttl_s: float = 120.0,
    ) -> Envelope:
        header = make_header(self.me.name, recipient, kind.value, task_id, data_id, ttl_s, now=self.clock())
        return seal(self.me, self.roster[recipient], header, payload)


def request_peer(request: Request) -> PeerIdentity | None:
    """The verified TLS client identity of the request's connection (set by :class:`PeerAwareH11`)."""
    return request.scope.get("state", {}).get("tls_peer")


async def read_envelope(request: Request, max_body_bytes: int, body_timeout_s: float) -> Envelope:
    """The request body as an :class:`Envelope`, read as it streams in (item 3).

    The cap is checked against the bytes received, not against Content-Length, so a chunked body
    cannot get past it; the whole body must arrive within ``body_timeout_s`` (item 4). Parsing is
    pydantic's (nesting depth bounded), so a deeply nested document is a 422, never a 500.
    """
    buf = bytearray()
    try:
        async with asyncio.timeout(body_timeout_s):
            async for data in request.stream():
                buf += data
                if len(buf) > max_body_bytes:
                    raise EnvelopeError(413, f"request body over the {max_body_bytes}-byte cap")
    except TimeoutError as exc:
        raise EnvelopeError(408, f"request body did not arrive within {body_timeout_s:.0f}s") from exc
    try:
        return Envelope.model_validate_json(bytes(buf))
    except ValidationError as exc:
        raise EnvelopeError(
            422,
            "malformed envelope: "
            + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5]),
        ) from exc


def install_common(app: FastAPI, max_body_bytes: int) -> None:
    """Size cap before parsing, and envelope failures as clear JSON errors (never a traceback)."""

    @app.middleware("http")
    async def _cap(request: Request, call_next: Any) -> Any:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            return JSONResponse({"detail": f"request body over the {max_body_bytes}-byte cap"}, status_code=413)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _malformed(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only locations and messages: never echo the (possibly non-JSON-safe, possibly secret) input.
        errors = [{"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", ""))} for e in exc.errors()[:20]]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(EnvelopeError)
    async def _refused(_request: Request, exc: EnvelopeError) -> JSONResponse:
        return JSONResponse({"detail": exc.reason}, status_code=exc.status)


class PeerAwareH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol plus two things it lacks.

    * The verified client certificate's identity goes into every request's scope state
      (``tls_peer``), so handlers check who is on the other end of the channel (item 6).
    * A header timeout (item 4): a connection that does not finish a request's headers within
      ``header_timeout_s`` of opening (or of its previous response) is closed, so a slow or stalled
      client cannot hold a connection slot; uvicorn's own keep-alive timer covers only idle time.
    """

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        peer = peer_from_cert(ssl_object.getpeercert()) if ssl_object is not None else None
        self.app_state = {**self.app_state, "tls_peer": peer}
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        cycle = self.cycle

        def expire() -> None:
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

        self.loop.call_later(self.header_timeout_s, expire)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()


class RateLimitedLog(logging.Filter):
    """Lets at most ``per_window`` records with the same message template through per window, then
    one line saying how many were dropped (item 4: running out of file descriptors made the accept
    loop log the same error thousands of times a second)."""

    def __init__(self, per_window: int = 5, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.per_window, self.window_s, self.clock = per_window, window_s, clock
        self._windows: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        key = f"{record.name}:{record.msg}"
        start, count = self._windows.get(key, (now, 0))
        if now - start >= self.window_s:
            if count > self.per_window:
                record.msg = f"{record.msg} [{count - self.per_window} similar message(s) suppressed in the last {now - start:.0f}s]"
            start, count = now, 0
        self._windows[key] = (start, count + 1)
        if len(self._windows) > 1024:  # bounded: forget the oldest windows
            for old in sorted(self._windows, key=lambda k: self._windows[k][0])[:512]:
                del self._windows[old]
        return count < self.per_window


def install_rate_limited_logging(per_window: int = 5, window_s: float = 10.0) -> RateLimitedLog:
    flt = RateLimitedLog(per_window, window_s)
    for name in ("asyncio", "uvicorn.error", "uvicorn", "trainmaster"):
        logging.getLogger(name).addFilter(flt)
    return flt


FDS_PER_CONNECTION = 2
"""File descriptors one client connection may cost a service at once (its socket, plus the
upstream socket or spool file it is being served from)."""
FDS_SPARE = 256
"""Descriptors kept for everything else: databases, logs, executors' sockets and pipes."""


def ensure_fd_limit(max_connections: int, log: logging.Logger | None = None) -> int:
    """Raise the soft open-files limit so ``max_connections`` can really be served: at the common
    default soft limit of 1024, 1,000 concurrent tasks would run out of descriptors well below the
    connection cap (and accept() fail in a loop). Capped at the hard limit, with one warning saying
    what is missing. Returns the soft limit."""
    needed = max_connections * FDS_PER_CONNECTION + FDS_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        if soft < needed:
            (log or logging.getLogger("trainmaster.gateway")).warning(
                "open-files limit %d (hard limit %s) is below the %d that max_connections=%d needs; connections past "
                "it will be refused: raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower max_connections",
                soft,
                hard,
                needed,
                max_connections,
            )
    return soft


def serve(app: FastAPI, cfg: ServiceConfig) -> None:
    """Run on one port with TLS that requires a client certificate from our CA, with header, body
    and idle timeouts, a cap on connections and rate-limited logging (item 4)."""
    import uvicorn

    protocol = type("PeerAwareH11Configured", (PeerAwareH11,), {"header_timeout_s": cfg.header_timeout_s})
    install_rate_limited_logging()
    ensure_fd_limit(cfg.max_connections)
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        ssl_keyfile=cfg.key,
        ssl_certfile=cfg.cert,
        ssl_ca_certs=cfg.ca,
        ssl_cert_reqs=ssl.CERT_REQUIRED,
        log_level="warning",
        http=protocol,
        timeout_keep_alive=int(max(1, cfg.idle_timeout_s)),
        limit_concurrency=cfg.max_connections,
        h11_max_incomplete_event_size=cfg.max_header_bytes,
        access_log=False,
        timeout_graceful_shutdown=2,
    )
