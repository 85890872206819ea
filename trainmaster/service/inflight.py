"""How many job submits the API process works on at once, apart from its reads, as the
Kubernetes API server keeps mutating requests to a share of their own
(``--max-mutating-requests-inflight`` beside ``--max-requests-inflight``).

A submit is pure Python work (the document loaded, validated, stored: a few ms of interpreter
time each), and this process has one interpreter lock: 16 submits at once in 16 worker threads do
no more work than 4, but every thread that wants the lock waits its turn behind all of them. A
list or a status gives the lock up at each row it reads from SQLite (the driver releases it
around each step) and waits that turn again each time, so with every submit in its own thread
a page of 100 jobs waited behind the submits ~100 times. Submits beyond the share wait for a
slot as coroutines, on no thread and not for the lock; reads keep the default pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
from anyio import to_thread
from fastapi import FastAPI

T = TypeVar("T")

#: Submits worked on at once; more wait for a slot (the 2-core machine's interpreter does one at a time).
MUTATING_INFLIGHT = 4


async def run_mutation(app: FastAPI, work: Callable[[], T]) -> T:
    """``work()`` in a worker thread, at most :data:`MUTATING_INFLIGHT` at once per app."""
    limiter = getattr(app.state, "mutating_limiter", None)
    if limiter is None:  # made on the app's event loop, at its first submit
        limiter = app.state.mutating_limiter = anyio.CapacityLimiter(MUTATING_INFLIGHT)
    return await to_thread.run_sync(work, limiter=limiter)
