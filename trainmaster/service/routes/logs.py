"""``GET /api/v1/jobs/{ref}/logs``: an instance's log, its tail, or followed as it grows."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from trainmaster.api import LocalTrainmaster, LogTarget
from trainmaster.errors import UserError
from trainmaster.service.routes.jobs import JobRef
from trainmaster.service.state import API, service_of
from trainmaster.spec.model import MAX_REPLICAS

router = APIRouter()


@router.get(f"{API}/jobs/{{ref}}/logs")
def logs(
    request: Request,
    ref: JobRef,
    role: str | None = Query(None, max_length=63),
    index: int = Query(0, ge=0, le=MAX_REPLICAS),
    follow: bool = False,
    tail: int | None = Query(
        None, ge=1, le=100_000, description=("Only the last N lines (of at most the last MiB); not with follow")
    ),
) -> Response:
    jobs = service_of(request).jobs
    if tail is not None:
        if follow:
            raise UserError("tail and follow: choose one", ["tail: drop it to follow the whole log"])
        return PlainTextResponse(jobs.tail(ref, role, index, lines=tail))
    return StreamingResponse(_stream(jobs, jobs.log_target(ref, role, index), follow), media_type="text/plain")


async def _stream(jobs: LocalTrainmaster, target: LogTarget, follow: bool) -> AsyncIterator[bytes]:
    """The log from its start; with ``follow`` until the instance ends. Async, so a follower
    holds no worker thread while it waits for output."""
    offset, ended = 0, not follow
    while True:
        chunk = jobs.log_chunk(target, offset)
        offset += len(chunk)
        if chunk:
            yield chunk
        elif ended:
            return
        elif jobs.instance_ended(target.instance_id):
            ended = True  # one more pass drains what it wrote before it ended
        else:
            await asyncio.sleep(0.25)
