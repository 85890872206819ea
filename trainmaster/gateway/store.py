"""The gateway's databases: SQLAlchemy engines with the settings every table of the gateway
package shares (SQLite in WAL mode with NORMAL sync by default; any SQLAlchemy URL works), and
the long-lived connection the per-request statements use."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, MetaData, create_engine, event
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from trainmaster.store.db import check_schema


def make_sessionmaker(url: str, metadata: MetaData) -> sessionmaker[Session]:
    """Open (and create) the database; SQLite gets WAL, a busy timeout and NORMAL sync.

    ``synchronous=NORMAL`` in WAL mode: a commit is durable against a process crash (``kill -9``:
    the WAL is in the OS page cache) but the last commits may be lost on power loss or an OS
    crash; that is SQLite's documented trade-off, and it saves an fsync per commit on the hot path.
    """
    if url in ("sqlite://", "sqlite:///:memory:"):
        # One in-memory database for every thread (the default pool gives each thread its own, empty one).
        engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
    else:
        engine = create_engine(url, future=True)
    if url.startswith("sqlite"):

        @event.listens_for(engine, "connect")
        def _pragmas(conn: Any, _record: Any) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=5000")
            cur.close()

    metadata.create_all(engine)
    check_schema(engine, url, metadata)
    return sessionmaker(engine, expire_on_commit=False)


class HotPath:
    """One long-lived connection for the per-request statements: no pool checkout, reset-on-return
    rollback and connection object per call. Each ``tx()`` is still its own committed transaction.
    The owning service's event loop (or the initiator's one thread) is its only user."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        with self._lock:  # a library user may call from several threads; one statement at a time
            conn = self._conn
            if conn is None or conn.closed or conn.invalidated:
                conn = self._conn = self._engine.connect()
            with conn.begin():
                yield conn
