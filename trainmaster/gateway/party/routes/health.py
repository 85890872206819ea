"""Liveness for every member; the counters only for the operator identity (item 8)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from trainmaster.gateway.net.service import request_peer
from trainmaster.gateway.party.core import agent_of

router = APIRouter()


@router.get("/v1/health")
async def health(request: Request) -> dict[str, Any]:
    agent = agent_of(request)
    out: dict[str, Any] = {"name": agent.cfg.name, "role": "party", "ok": True}
    peer = request_peer(request)
    if peer is not None and peer.role == "operator":
        out.update(
            executors=sum(leg.running for leg in agent.executors.values()),
            queued_legs=sum(leg.handle is None for leg in agent.executors.values()),
            handled=dict(agent.ctx.handled),
            rejected=dict(agent.ctx.gate.rejected),
            **agent.counters,
        )
    return out
