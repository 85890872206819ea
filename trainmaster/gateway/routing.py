"""The task processing mapping table and the seen-message table, in SQLAlchemy.

Mapping table: task id -> data id -> (party, executor address, rule), plus each leg's state and its
one recorded outcome. Rows are never deleted, so past tasks stay queryable (the table "is built from
history as well"). SQLite in WAL mode by default; any SQLAlchemy URL (PostgreSQL) works.

The per-request writes (seen message, leg outcome) and the leg lookup use
SQLAlchemy Core statements on the engine, not ORM sessions: each is still its own committed
transaction (persist before acknowledging), but without the unit-of-work bookkeeping, which
profiling showed was most of the gateway's own time per task.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Float, Integer, String, Text, UniqueConstraint, create_engine, delete, event, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from trainmaster.store.db import check_schema


class Base(DeclarativeBase):
    pass


class LegRow(Base):
    __tablename__ = "legs"
    __table_args__ = (UniqueConstraint("task_id", "data_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[str] = mapped_column(String(64), index=True)
    data_id: Mapped[str] = mapped_column(String(64))
    party: Mapped[str | None] = mapped_column(String(64), nullable=True)
    address: Mapped[str] = mapped_column(String(300), default="")
    call_json: Mapped[str] = mapped_column(Text, default="{}")
    state: Mapped[str] = mapped_column(String(16), default="registered")
    outcome: Mapped[str | None] = mapped_column(String(32), nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")
    result_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    stream_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time)


class SeenMessage(Base):
    __tablename__ = "seen_messages"
    msg_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    sender: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[float] = mapped_column(Float, index=True)


def make_sessionmaker(url: str) -> sessionmaker[Session]:
    """Open (and create) the database; SQLite gets WAL, a busy timeout and NORMAL sync.

    ``synchronous=NORMAL`` in WAL mode: a commit is durable against a process crash (``kill -9``:
    the WAL is in the OS page cache) but the last commits may be lost on power loss or an OS
    crash; that is SQLite's documented trade-off, and it saves an fsync per commit on the hot path.
    """
    engine = create_engine(url, future=True)
    if url.startswith("sqlite"):
        @event.listens_for(engine, "connect")
        def _pragmas(conn: Any, _record: Any) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=5000")
            cur.close()
    Base.metadata.create_all(engine)
    check_schema(engine, url, Base.metadata)
    return sessionmaker(engine, expire_on_commit=False)


class _HotPath:
    """One long-lived connection for the per-request statements: no pool checkout, reset-on-return
    rollback and connection object per call. Each ``tx()`` is still its own committed transaction.
    The owning service's event loop (or the initiator's one thread) is its only user."""

    def __init__(self, engine: Engine):
        self._engine, self._conn = engine, None

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = self._conn = self._engine.connect()
        with conn.begin():
            yield conn


class LegConflict(Exception):
    """A report or result for a leg that belongs to someone else."""


@dataclass(frozen=True)
class Leg:
    task_id: str
    data_id: str
    party: str | None
    address: str
    call: dict[str, Any]
    state: str
    outcome: str | None
    detail: str
    result_json: str | None
    stream_bytes: int | None = None


def _leg(row: LegRow) -> Leg:
    return Leg(row.task_id, row.data_id, row.party, row.address, json.loads(row.call_json), row.state,
               row.outcome, row.detail, row.result_json, row.stream_bytes)


class MappingTable:
    """Repository over the legs table; every write commits before the caller acknowledges."""

    def __init__(self, url: str):
        self._sessions = make_sessionmaker(url)
        self._hot = _HotPath(self._sessions.kw["bind"])

    def register(self, task_id: str, data_id: str, party: str, address: str, call: dict[str, Any],
                 ready: bool = True, reason: str = "") -> Leg:
        """Record an executor report; a leg already owned by another party is refused."""
        with self._sessions.begin() as s:
            row = s.scalar(select(LegRow).where(LegRow.task_id == task_id, LegRow.data_id == data_id))
            if row is not None and row.party != party:
                raise LegConflict(f"leg ({task_id}, {data_id}) belongs to party {row.party!r}")
            if row is not None and row.outcome is not None:
                raise LegConflict(f"leg ({task_id}, {data_id}) already finished with {row.outcome!r}")
            if row is None:
                row = LegRow(task_id=task_id, data_id=data_id, party=party)
                s.add(row)
            row.address, row.call_json, row.updated_at = address, json.dumps(call), time.time()
            if not ready:
                row.outcome, row.detail, row.state = "timeout", reason or "executor did not come up", "done"
            s.flush()
            return _leg(row)

    def legs(self, task_id: str) -> dict[str, Leg]:
        with self._hot.tx() as c:
            rows = c.execute(select(LegRow.__table__).where(LegRow.task_id == task_id)).all()
        return {r.data_id: Leg(r.task_id, r.data_id, r.party, r.address, json.loads(r.call_json), r.state, r.outcome,
                               r.detail, r.result_json, r.stream_bytes) for r in rows}

    def mark_unrouted(self, task_id: str, data_id: str) -> None:
        """A requested data id with no report: it still gets exactly one outcome."""
        try:
            with self._sessions.begin() as s:
                s.add(LegRow(task_id=task_id, data_id=data_id, party=None, state="done",
                             outcome="party_unavailable", detail="no party reported an executor for this data id"))
        except IntegrityError:
            pass

    def record_outcome(self, task_id: str, data_id: str, outcome: str, detail: str = "", result_json: str | None = None,
                       stream_bytes: int | None = None) -> bool:
        """Set the leg's outcome once; returns False if it already had one (never overwritten)."""
        with self._hot.tx() as c:
            res = c.execute(
                update(LegRow).where(LegRow.task_id == task_id, LegRow.data_id == data_id, LegRow.outcome.is_(None))
                .values(outcome=outcome, detail=detail, result_json=result_json, stream_bytes=stream_bytes, state="done",
                        updated_at=time.time())
            )
            return bool(res.rowcount)

    def count(self) -> int:
        with self._sessions() as s:
            return len(s.scalars(select(LegRow.id)).all())


class SeenTable:
    """Replay protection: a message id is accepted once; old ids age out past the skew window."""

    def __init__(self, url: str):
        self._sessions = make_sessionmaker(url)
        self._hot = _HotPath(self._sessions.kw["bind"])
        self._insert = insert(SeenMessage.__table__)
        self._last_prune = 0.0

    def first_sighting(self, msg_id: str, sender: str, expires_at: float, now: float, skew_s: float) -> bool:
        """Record ``msg_id`` (committed) and say whether this was its first sighting."""
        if now - self._last_prune > 30:
            with self._hot.tx() as c:
                c.execute(delete(SeenMessage.__table__).where(SeenMessage.expires_at < now - 2 * skew_s))
            self._last_prune = now
        try:
            with self._hot.tx() as c:
                c.execute(self._insert, {"msg_id": msg_id, "sender": sender, "expires_at": expires_at})
            return True
        except IntegrityError:
            return False

    def count(self) -> int:
        with self._sessions() as s:
            return len(s.scalars(select(SeenMessage.msg_id)).all())
