"""The party agent's service: ``POST /v1/tasks`` (initiators), ``POST /v1/transfer`` (the
gateway), ``GET /v1/health``, ``GET /v1/audit`` (the operator) on its HTTP port, and its stream
port for the gateway (stored results out, inputs in: :mod:`.streams`). The leg logic is
:mod:`.core`; the routes are in :mod:`.routes`, one module per concern."""

from __future__ import annotations

import asyncio
import importlib.util
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI

from trainmaster.errors import UserError
from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.net.service import install_common
from trainmaster.gateway.net.streams import StreamServer
from trainmaster.gateway.net.tls import mtls_client, server_ssl_context
from trainmaster.gateway.party.core import PartyAgent
from trainmaster.gateway.party.routes import audit, health, tasks, transfer
from trainmaster.gateway.party.streams import serve_stream


def check_isolation(cfg: ServiceConfig) -> None:
    """Refuse to start with an executor kind or isolation this host cannot provide (exit 2)."""
    if cfg.executor == "ray" and importlib.util.find_spec("ray") is None:
        raise UserError(
            f"party {cfg.name!r} is configured with executor: ray, but Ray is not installed",
            details=["install the ray extra (pip install 'trainmaster[ray]') or set executor: subprocess"],
        )
    if cfg.isolation == "sandbox" and (cfg.executor == "subprocess" or not cfg.ray_address):
        # A local Ray's actors start their sandboxes on this host too (remote nodes are checked there).
        from trainmaster.gateway.executors.sandbox.bubblewrap import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise UserError(
                f"party {cfg.name!r}: executor isolation 'sandbox' is not available on this host: {reason}",
                details=[
                    "run the party as root on a host with bubblewrap and cgroup v1 memory/pids "
                    "(apt-get install -y bubblewrap, or make sandbox-deps)",
                    "or opt out: set isolation: process in the party's config (or pass "
                    "--isolation process) to run executors as plain processes, without "
                    "namespaces, seccomp or cgroup limits",
                ],
            )


def build_party_app(cfg: ServiceConfig, data_dir: Path) -> FastAPI:
    check_isolation(cfg)
    agent = PartyAgent(cfg, data_dir)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        agent.http = mtls_client(cfg)
        agent.loop = asyncio.get_running_loop()
        agent.recover()
        streams = StreamServer(
            server_ssl_context(cfg),
            cfg.host,
            cfg.stream_port,
            partial(serve_stream, agent),
            cfg.max_streams,
            cfg.body_timeout_s,
            cfg.header_timeout_s,
        ).start()
        sweeper = agent.spawn(agent.sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            streams.close()
            await agent.shutdown()

    app = FastAPI(title=f"trainmaster party {cfg.name}", lifespan=lifespan)
    app.state.agent = agent
    install_common(app, cfg.max_body_bytes)
    for module in (tasks, transfer, health, audit):
        app.include_router(module.router)
    return app
