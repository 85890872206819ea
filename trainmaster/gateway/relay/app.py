"""The gateway service (the source's "load server"): the initiator's one door to every party.

An initiator first creates its task here (id, legs, which party holds each data id); the task is
its own (item 9) and its id is never reused (item 2). Only the party a leg is assigned to may
report that leg's executor or answer it, which the gateway checks from the connection's TLS
identity and the party's signatures (items 1, 6). The leg logic is :mod:`.core`; the HTTP routes
are in :mod:`.routes`, one module per concern; bulk bytes (inputs, stored results) cross the
stream port (:mod:`.streams`).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from functools import partial
from typing import AsyncIterator

from fastapi import FastAPI

from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.net.service import install_common
from trainmaster.gateway.net.streams import StreamServer
from trainmaster.gateway.net.tls import client_ssl_context, server_ssl_context
from trainmaster.gateway.relay.core import Relay
from trainmaster.gateway.relay.partylink import PartyLinks
from trainmaster.gateway.relay.routes import audit, health, results, tasks
from trainmaster.gateway.relay.streams import serve_stream


def build_gateway_app(cfg: ServiceConfig) -> FastAPI:
    relay = Relay.load(cfg)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        relay.parties = PartyLinks(client_ssl_context(cfg), max_idle=cfg.party_concurrency)
        relay.loop = asyncio.get_running_loop()
        streams = StreamServer(
            server_ssl_context(cfg),
            cfg.host,
            cfg.stream_port,
            partial(serve_stream, relay),
            cfg.max_streams,
            cfg.body_timeout_s,
            cfg.header_timeout_s,
        ).start()
        syncing = asyncio.ensure_future(relay.sync_audit())
        try:
            yield
        finally:
            syncing.cancel()
            streams.close()
            await relay.parties.aclose()
            relay.audit.close()

    app = FastAPI(title="trainmaster gateway", lifespan=lifespan)
    app.state.relay = relay
    install_common(app, cfg.max_body_bytes)
    for module in (tasks, results, health, audit):
        app.include_router(module.router)
    return app
