"""The gateway service (the source's "load server"): the initiator's one door to every party.

An initiator first creates its task here (id, legs, which party holds each data id); the task is
its own (item 9) and its id is never reused (item 2). Only the party a leg is assigned to may
report that leg's executor or answer it, which the gateway checks from the connection's TLS
identity and the party's signatures (items 1, 6). The leg logic is :mod:`.core`; the HTTP routes
are in :mod:`.routes`, one module per concern.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.net.service import install_common
from trainmaster.gateway.net.tls import client_ssl_context
from trainmaster.gateway.relay.core import Relay
from trainmaster.gateway.relay.partylink import PartyLinks
from trainmaster.gateway.relay.routes import health, results, tasks


def build_gateway_app(cfg: ServiceConfig) -> FastAPI:
    relay = Relay.load(cfg)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        relay.parties = PartyLinks(client_ssl_context(cfg), max_idle=cfg.party_concurrency)
        yield
        await relay.parties.aclose()

    app = FastAPI(title="trainmaster gateway", lifespan=lifespan)
    app.state.relay = relay
    install_common(app, cfg.max_body_bytes)
    for module in (tasks, results, health):
        app.include_router(module.router)
    return app
