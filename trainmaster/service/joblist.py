"""``GET /api/v1/jobs``: a list in pages with filters, or a watch from a resource version
(:mod:`trainmaster.store.listing`), as the Kubernetes API serves ``list`` and ``watch``.

* list: ``?state=&queue=&name=&label=KEY=VALUE&limit=&continue=`` answers
  ``{"kind": "JobList", "items": [...], "metadata": {"resourceVersion", "continue",
  "remainingItemCount"}}``; pass ``metadata.continue`` back for the next page.
* watch: ``?watch=true&resourceVersion=N&timeoutSeconds=T`` (same filters) streams one JSON
  object a line, ``{"type": "ADDED"|"MODIFIED", "object": job, "event": {...}}``, for each
  change after version N, for up to T seconds, and ends with a ``BOOKMARK`` line whose
  ``object.resourceVersion`` is where the next watch starts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Query
from fastapi.responses import Response, StreamingResponse

from trainmaster.api import LocalTrainmaster
from trainmaster.errors import UserError
from trainmaster.service.answers import json_answer
from trainmaster.store.listing import DEFAULT_LIMIT, MAX_LIMIT, JobFilter

WATCH_POLL = 0.2  # seconds between two looks at the store while a watch has nothing to send
MAX_WATCH = 300


@dataclass(frozen=True)
class JobListQuery:
    """The query parameters of ``GET /api/v1/jobs``."""

    where: JobFilter
    limit: int
    after: str | None
    watch: bool
    version: int
    timeout: float


async def job_list_query(  # async: checked on the event loop, not in a worker thread of its own
    state: str = Query("", max_length=16, description="Only jobs in this state"),
    queue: str = Query("", max_length=63, description="Only jobs of this queue"),
    name: str = Query("", max_length=63, description="Only jobs of this name"),
    label: list[str] = Query([], max_length=8, description="KEY=VALUE: only jobs with this label (repeatable)"),
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT, description="Jobs per page"),
    continue_: str = Query("", alias="continue", max_length=18, description="metadata.continue of the last page"),
    watch: bool = Query(False, description="Stream changes after resourceVersion instead of listing"),
    resource_version: str = Query(
        "", alias="resourceVersion", max_length=18, description="Watch from here (a list's metadata.resourceVersion)"
    ),
    timeout_seconds: int = Query(30, alias="timeoutSeconds", ge=0, le=MAX_WATCH, description="How long a watch lasts"),
) -> JobListQuery:
    if any(len(item) > 317 for item in label):
        raise UserError("label: each KEY=VALUE is at most 317 characters")
    version = 0
    if resource_version:
        if not (resource_version.isascii() and resource_version.isdigit()):
            raise UserError(f"resourceVersion '{resource_version}': expected the number a list or a watch gave")
        version = int(resource_version)
    return JobListQuery(
        JobFilter.parse(state, queue, name, label), limit, continue_ or None, watch, version, float(timeout_seconds)
    )


def list_or_watch(jobs: LocalTrainmaster, query: JobListQuery) -> Response:
    if not query.watch:
        return json_answer(jobs.list_jobs(query.where, query.limit, query.after).to_dict())
    return StreamingResponse(_watch(jobs, query), media_type="application/x-ndjson")


async def _watch(jobs: LocalTrainmaster, query: JobListQuery) -> AsyncIterator[bytes]:
    version = query.version
    deadline = time.monotonic() + query.timeout
    while True:
        changes, version = await asyncio.to_thread(jobs.changes, version, query.where, query.limit)
        for change in changes:
            yield (json.dumps(change.to_dict()) + "\n").encode()
        if time.monotonic() >= deadline:
            break
        if not changes:
            await asyncio.sleep(WATCH_POLL)
    yield (json.dumps({"type": "BOOKMARK", "object": {"resourceVersion": str(version)}}) + "\n").encode()
