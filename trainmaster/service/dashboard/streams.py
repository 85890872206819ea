"""The dashboard's server-sent events: an instance's log as it grows, and the store's changes
(one :class:`~.watch.StoreWatcher` for every open tab). Both end when the server drains."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from trainmaster.service.dashboard import views
from trainmaster.service.dashboard.site import KEEPALIVE, LOG_POLL, MAX_ID, JobId, dashboard_of

router = APIRouter(include_in_schema=False)


@router.get("/ui/jobs/{job_id}/log/stream")
async def job_log_stream(
    request: Request,
    job_id: JobId,
    instance: str = Query(..., max_length=80),
    offset: int = Query(0, ge=0, le=MAX_ID),
    last_event_id: int | None = Header(None, alias="Last-Event-ID", ge=0, le=MAX_ID),
) -> StreamingResponse:
    dashboard = dashboard_of(request)
    path = dashboard.log_path(job_id, instance)
    draining = dashboard.draining

    async def follow() -> AsyncIterator[str]:
        # each event's id is the log offset after it: a browser reconnecting (the server
        # restarted) sends the last one back and gets only what it has not shown yet
        position, quiet = (offset if last_event_id is None else last_event_id), 0.0
        while not draining.begun and not await request.is_disconnected():
            chunk = await asyncio.to_thread(views.read_log, path, position)
            if chunk.text:
                position, quiet = chunk.offset, 0.0
                yield f"id: {chunk.offset}\ndata: {json.dumps({'text': chunk.text, 'offset': chunk.offset})}\n\n"
                continue
            quiet += LOG_POLL
            if quiet >= KEEPALIVE:
                quiet = 0.0
                yield ": keepalive\n\n"
            await asyncio.sleep(LOG_POLL)

    return StreamingResponse(follow(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})


@router.get("/ui/stream")
async def changes(request: Request) -> StreamingResponse:
    dashboard = dashboard_of(request)
    watcher, draining = dashboard.watcher, dashboard.draining
    queue = watcher.subscribe()

    async def stream() -> AsyncIterator[str]:
        try:
            while not draining.begun and not await request.is_disconnected():
                version = await draining.first(queue.get(), KEEPALIVE)
                if version is None:
                    if not draining.begun:
                        yield ": keepalive\n\n"
                    continue
                yield f"event: change\ndata: {version}\n\n"
        finally:
            watcher.unsubscribe(queue)

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})
