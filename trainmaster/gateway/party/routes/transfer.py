"""Data transfer requests (the gateway): run the leg's rule once, answer its sealed result."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from trainmaster.gateway.executors.base import ExecutorStartError
from trainmaster.gateway.models import DataTransfer, MessageKind
from trainmaster.gateway.party.core import PartyAgent, agent_of
from trainmaster.gateway.party.records import PartyLeg

router = APIRouter()


@router.post("/v1/transfer")
async def transfer(request: Request) -> Any:
    """Run the leg's rule once (a repeated transfer is answered from its record) and answer its
    result sealed to the gateway: inline, or, for a large one, that it is stored here and fetched
    through the stream port. A leg that cannot run yet (its executor is queued or restarting, its
    input still arriving) answers 503: the gateway asks again."""
    agent = agent_of(request)
    env, requester, req = await agent.open(request, MessageKind.data_transfer, {"gateway"}, DataTransfer)
    key = (req.task_id, req.data_id)
    record = agent.records.get(*key)
    if record is None:
        raise HTTPException(404, f"no leg ({req.task_id}, {req.data_id}) at this party")
    if req.call != record.task.call:
        raise HTTPException(400, "the transfer names another rule call than the leg was created with")
    if record.state != "done":
        record = await _run(agent, record, requester, max(1.0, env.header.expires_at - agent.ctx.clock()))
    agent.audit.append(
        "transfer",
        requester,
        task_id=req.task_id,
        data_id=req.data_id,
        ok=record.ok,
        stored=bool(record.ok and record.size > agent.cfg.stream_chunk_bytes),
    )
    return _answer(agent, req, record)


async def _run(agent: PartyAgent, record: PartyLeg, requester: Any, timeout_s: float) -> PartyLeg:
    key = record.key
    if record.task.input is not None and not record.input_done:
        raise HTTPException(
            503,
            f"leg ({key[0]}, {key[1]}) is waiting for its input ({record.input_bytes} of "
            f"{record.task.input.size} bytes arrived); retry when it is whole",
            headers={"Retry-After": "1"},
        )
    if record.state == "start_failed":
        raise HTTPException(503, f"executor for task {key[0]!r} could not start: {record.error}")
    leg = agent.executors.get(key)
    if leg is None:
        raise HTTPException(
            503, f"leg ({key[0]}, {key[1]}) has no executor yet (the party is starting it); retry later"
        )
    if not leg.started.done():  # queued for a slot or its start retried: wait, within the request's life
        try:
            await asyncio.wait_for(asyncio.shield(leg.started), timeout=timeout_s)
        except TimeoutError as exc:
            if leg.started.done():  # the executor's own start timed out
                raise HTTPException(503, f"executor for task {key[0]!r} did not come up: {exc}") from exc
            raise HTTPException(
                503,
                f"leg ({key[0]}, {key[1]}) is still waiting for its executor (queued for a slot, or its "
                "start being retried); retry later",
            ) from None
        except (OSError, ExecutorStartError) as exc:
            raise HTTPException(503, f"executor for task {key[0]!r} could not start: {exc}") from exc
    run = agent.runs.get(key)
    if run is None:  # the first delivery runs the rule; a repeated one waits for its record
        if not leg.running:
            raise HTTPException(503, f"leg ({key[0]}, {key[1]}) has no live executor; retry later")
        run = agent.runs[key] = asyncio.ensure_future(agent.run_once(record, leg, requester, timeout_s))
    try:
        done = await asyncio.shield(run)
    finally:
        if run.done():
            agent.runs.pop(key, None)
    if not leg.released:  # its rule ran: the executor's slot goes to the next queued leg now
        agent.release(leg)
    return done


def _answer(agent: PartyAgent, req: DataTransfer, record: PartyLeg) -> Any:
    def seal(payload: dict[str, Any]) -> Any:
        return agent.ctx.seal_to(agent.gateway.name, MessageKind.transfer_result, req.task_id, req.data_id, payload)

    if not record.ok:
        return seal({"ok": False, "error": record.error})
    if record.size > agent.cfg.stream_chunk_bytes:
        sha256 = record.sha256
        if agent.cfg.fault_stream == "misattest":  # fault injection: sign a digest of other bytes than those kept
            sha256 = hashlib.sha256(sha256.encode()).hexdigest()
        return seal({"ok": True, "error": "", "stored": True, "attestation": agent.attestation(req, record, sha256)})
    text = agent.files(record.task).result.read_bytes().decode()
    return seal({"ok": True, "result_text": text, "error": "", "attestation": agent.attestation(req, record)})
