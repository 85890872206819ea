"""The client side of mutual TLS: our CA only, our own certificate, and the server identity we expect."""

from __future__ import annotations

import ssl
from typing import Any

import httpx

from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.crypto.tlsid import dns_name


def client_ssl_context(cfg: ServiceConfig) -> ssl.SSLContext:
    """Trust only our CA and present our own certificate: every hop is mutual TLS."""
    ctx = ssl.create_default_context(cafile=cfg.ca)
    ctx.load_cert_chain(cfg.cert, cfg.key)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def server_ssl_context(cfg: ServiceConfig) -> ssl.SSLContext:
    """A serving context that requires a client certificate from our CA (the stream port's; the
    HTTP port's is uvicorn's, set up the same way in ``service.serve``)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cfg.cert, cfg.key)
    ctx.load_verify_locations(cfg.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def expect(name: str, role: str) -> dict[str, Any]:
    """httpx request extensions that make TLS check the server is identity ``name`` in ``role``.

    The expected identity's certificate name goes out as the TLS server name, so the handshake
    fails unless the server's certificate (from our CA) was issued to exactly that identity.
    """
    return {"sni_hostname": dns_name(name, role)}


def mtls_client(cfg: ServiceConfig, timeout_s: float = 30.0, max_connections: int = 256) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        verify=client_ssl_context(cfg),
        timeout=timeout_s,
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
    )
