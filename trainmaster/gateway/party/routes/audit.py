"""The party's audit log for the operator identity (the route is :mod:`trainmaster.gateway.audit.routes`)."""

from __future__ import annotations

from fastapi import Request

from trainmaster.gateway.audit.log import AuditLog
from trainmaster.gateway.audit.routes import audit_router
from trainmaster.gateway.crypto.envelope import PublicIdentity
from trainmaster.gateway.net.service import request_peer
from trainmaster.gateway.party.core import agent_of


def _log(request: Request) -> tuple[AuditLog, PublicIdentity]:
    agent = agent_of(request)
    return agent.audit, agent.ctx.roster[agent.cfg.name]


router = audit_router(_log, request_peer)
