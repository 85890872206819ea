"""The server's stop, as the live streams see it.

The dashboard's server-sent event streams (a tab's change stream, the log it follows) never end
on their own. When the server stops, uvicorn first lets open requests finish, within a short drain, and
cancels what is left (logging an error); only then does the app's shutdown run. So the streams
must learn of the stop from the server itself, at the start of the drain: the server calls
``Draining.begin`` and every stream ends at its next look, like a finished response. The
browser's EventSource reconnects by itself, to this server's successor. (A log followed through
the REST API is not ended so: its client would take a clean end for the end of the log; it is
cut at the end of the drain and the client reports the server unreachable.)
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvicorn

T = TypeVar("T")


class Draining:
    """Set once when the server begins to stop; streams check ``begun`` between events and wait
    for their next event through ``first`` so a quiet stream ends at once too.

    Waiters are plain futures of whichever event loop awaits (test clients run one loop each),
    woken thread-safely, so one instance serves any loop."""

    def __init__(self) -> None:
        self._begun = False
        self._lock = threading.Lock()
        self._waiters: set[asyncio.Future[None]] = set()

    @property
    def begun(self) -> bool:
        return self._begun

    def begin(self) -> None:
        """The server stops accepting requests: wake every stream waiting for its next event."""
        with self._lock:
            self._begun = True
            waiters = list(self._waiters)
        for waiter in waiters:
            waiter.get_loop().call_soon_threadsafe(_wake, waiter)

    async def first(self, next_event: Coroutine[Any, Any, T], timeout: float) -> T | None:
        """The result of ``next_event``, or None when ``timeout`` seconds pass or the server begins
        to stop first (check ``begun`` to tell which); ``next_event`` is cancelled then."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._begun:
                next_event.close()
                return None
            self._waiters.add(waiter)
        work = asyncio.ensure_future(next_event)
        either: set[asyncio.Future[Any]] = {work, waiter}
        try:
            done, _ = await asyncio.wait(either, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            return work.result() if work in done else None
        finally:
            with self._lock:
                self._waiters.discard(waiter)
            work.cancel()
            waiter.cancel()


class DrainingServer(uvicorn.Server):
    """uvicorn's server that tells the app's live streams it stops before its graceful drain
    begins, so the drain finds no stream left to cancel."""

    def __init__(self, config: uvicorn.Config, draining: Draining) -> None:
        super().__init__(config)
        self.draining = draining

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.draining.begin()
        await super().shutdown(sockets)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
