"""``GET /v1/audit``: a service's audit log for the operator identity, its entries and, on request,
its check. One route for the gateway and every party; each passes how a request reaches its own
log (the member getter) and its TLS peer (the net layer sits beside this one, not below it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request

from trainmaster.gateway.audit.log import AuditLog, page
from trainmaster.gateway.crypto.envelope import PublicIdentity
from trainmaster.gateway.crypto.tlsid import PeerIdentity
from trainmaster.gateway.models import ID_PATTERN

MemberLog = Callable[[Request], tuple[AuditLog, PublicIdentity]]
"""The serving member's audit log and its own public identity (whose key signed the lines)."""


def audit_router(member_log: MemberLog, peer_of: Callable[[Request], PeerIdentity | None]) -> APIRouter:
    """The audit route of the member ``member_log`` finds from a request."""
    router = APIRouter()

    @router.get("/v1/audit")
    def audit(
        request: Request,
        after: int = Query(0, ge=0),
        limit: int = Query(200, ge=1, le=5000),
        task_id: str | None = Query(None, pattern=ID_PATTERN),
        verify: bool = False,
    ) -> dict[str, Any]:
        peer = peer_of(request)
        if peer is None or peer.role != "operator":
            raise HTTPException(403, "the audit log is for the operator identity")
        log, me = member_log(request)
        log.sync()
        return page(log.path, me, after, limit, task_id, verify)

    return router
