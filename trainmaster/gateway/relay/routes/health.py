"""Liveness for every member; the counters only for the operator identity (item 8)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from trainmaster.gateway.net.service import request_peer
from trainmaster.gateway.relay.core import relay_of

router = APIRouter()


@router.get("/v1/health")
async def health(request: Request) -> dict[str, Any]:
    relay = relay_of(request)
    out: dict[str, Any] = {"name": relay.cfg.name, "role": "gateway", "ok": True}
    peer = request_peer(request)
    if peer is not None and peer.role == "operator":
        out.update(
            legs=relay.table.count(),
            in_flight_legs=relay.inflight["legs"],
            in_flight_tasks=relay.inflight["tasks"],
            in_flight_streams=relay.inflight["streams"],
            handled=dict(relay.ctx.handled),
            rejected=dict(relay.ctx.gate.rejected),
        )
    return out
