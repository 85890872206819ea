"""The gateway's audit log for the operator identity: its entries and, on request, its check."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request

from trainmaster.gateway.audit.log import page
from trainmaster.gateway.models import ID_PATTERN
from trainmaster.gateway.net.service import request_peer
from trainmaster.gateway.relay.core import relay_of

router = APIRouter()


@router.get("/v1/audit")
def audit(
    request: Request,
    after: int = Query(0, ge=0),
    limit: int = Query(200, ge=1, le=5000),
    task_id: str | None = Query(None, pattern=ID_PATTERN),
    verify: bool = False,
) -> dict[str, Any]:
    relay = relay_of(request)
    peer = request_peer(request)
    if peer is None or peer.role != "operator":
        raise HTTPException(403, "the audit log is for the operator identity")
    relay.audit.sync()
    return page(relay.audit.path, relay.ctx.roster[relay.cfg.name], after, limit, task_id, verify)
