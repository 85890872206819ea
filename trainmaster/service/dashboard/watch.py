"""One watcher per server turns store changes into server-sent events for every open tab."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.store.models import EventRow, InstanceRow, JobRow, MetricRow

log = logging.getLogger(__name__)


def change_mark(session: Session) -> tuple[Any, ...]:
    """A value that changes whenever anything a page shows changes: new events and metric
    points, jobs added or removed, job and instance state moves."""
    return (
        session.scalar(select(func.max(EventRow.id))),
        session.scalar(select(func.max(MetricRow.id))),
        session.scalar(select(func.count(JobRow.id))),
        session.scalar(select(func.max(JobRow.last_transition_at))),
        tuple(
            session.execute(
                select(InstanceRow.state, func.count(InstanceRow.id), func.sum(InstanceRow.attempt)).group_by(
                    InstanceRow.state
                )
            ).all()
        ),
    )


class StoreWatcher:
    """Polls the store's change mark every ``tick`` seconds (one query set for all tabs) while
    at least one tab listens, and wakes each listener's queue when the mark moves."""

    def __init__(self, sessions: sessionmaker[Session], tick: float = 0.5):
        self.sessions = sessions
        self.tick = tick
        self._listeners: dict[asyncio.Queue[int], asyncio.AbstractEventLoop] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.version = 0

    def subscribe(self) -> asyncio.Queue[int]:
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
        with self._lock:
            self._listeners[queue] = asyncio.get_running_loop()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dashboard-watch", daemon=True)
                self._thread.start()
        self._wake.set()
        return queue

    def unsubscribe(self, queue: asyncio.Queue[int]) -> None:
        with self._lock:
            self._listeners.pop(queue, None)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def _run(self) -> None:
        mark: tuple[Any, ...] | None = None
        while not self._stopping.is_set():
            with self._lock:
                listening = bool(self._listeners)
            if not listening:  # sleep until a tab subscribes again
                self._wake.wait()
                self._wake.clear()
                continue
            now: tuple[Any, ...] | None
            try:
                with self.sessions() as session:
                    now = change_mark(session)
            except Exception:  # a busy or restarting database: try again next tick, say so once
                log.exception("dashboard: reading the store's change mark failed")
                now = mark
            if now != mark:
                mark = now
                self.version += 1
                self._notify(self.version)
            self._stopping.wait(self.tick)

    def _notify(self, version: int) -> None:
        with self._lock:
            listeners = list(self._listeners.items())
        for queue, loop in listeners:
            loop.call_soon_threadsafe(_offer, queue, version)


def _offer(queue: asyncio.Queue[int], version: int) -> None:
    """Keep only the newest version in a listener's queue: a slow tab gets one refresh, not many."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(version)
