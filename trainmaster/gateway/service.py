"""What the gateway and party services share: mutual TLS, the envelope gate, size caps, errors."""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from trainmaster.gateway.crypto import EnvelopeError, Identity, PublicIdentity, make_header, seal
from trainmaster.gateway.gate import EnvelopeGate
from trainmaster.gateway.models import Envelope, MessageKind
from trainmaster.gateway.provision import ServiceConfig, load_identity, load_roster
from trainmaster.gateway.routing import SeenTable


def client_ssl_context(cfg: ServiceConfig) -> ssl.SSLContext:
    """Trust only our CA and present our own certificate: every hop is mutual TLS."""
    ctx = ssl.create_default_context(cafile=cfg.ca)
    ctx.load_cert_chain(cfg.cert, cfg.key)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def mtls_client(cfg: ServiceConfig, timeout_s: float = 30.0, max_connections: int = 256) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=client_ssl_context(cfg), timeout=timeout_s,
                             limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64))


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

    def seal_to(self, recipient: str, kind: MessageKind, task_id: str, data_id: str, payload: dict[str, Any],
                ttl_s: float = 120.0) -> Envelope:
        header = make_header(self.me.name, recipient, kind.value, task_id, data_id, ttl_s, now=self.clock())
        return seal(self.me, self.roster[recipient], header, payload)


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


def serve(app: FastAPI, cfg: ServiceConfig) -> None:
    """Run on one port with TLS that requires a client certificate from our CA."""
    import uvicorn

    uvicorn.run(app, host=cfg.host, port=cfg.port, ssl_keyfile=cfg.key, ssl_certfile=cfg.cert,
                ssl_ca_certs=cfg.ca, ssl_cert_reqs=ssl.CERT_REQUIRED, log_level="warning",
                timeout_keep_alive=30, access_log=False, timeout_graceful_shutdown=2)
