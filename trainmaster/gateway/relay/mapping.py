"""The task processing mapping table, in SQLAlchemy.

Mapping table: task id -> data id -> (party, executor address, rule), plus each leg's state and its
one recorded outcome. Rows are never deleted, so past tasks stay queryable (the table "is built from
history as well"). SQLite in WAL mode by default; any SQLAlchemy URL (PostgreSQL) works.

The per-request writes (leg outcome) and the leg lookup use SQLAlchemy Core statements on the
engine, not ORM sessions: each is still its own committed transaction (persist before
acknowledging), but without the unit-of-work bookkeeping, which profiling showed was most of the
gateway's own time per task.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Boolean, Float, Integer, String, Text, UniqueConstraint, func, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from trainmaster.gateway.store import HotPath, make_sessionmaker


class Base(DeclarativeBase):
    pass


class TaskRow(Base):
    """A task, kept for good: its id is never reused (item 2) and it belongs to its creator (item 9)."""

    __tablename__ = "tasks"
    task_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64))
    body_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    deadline_at: Mapped[float] = mapped_column(Float)
    run_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    """The creating run's own id (a retry of that run carries it; a later run reusing the id does not)."""


class LegRow(Base):
    """One leg. States, journaled before the gateway acts on them: ``assigned`` (task created),
    ``reported`` (its party's executor is up), ``dispatched`` (a transfer went out; after a crash
    it is sent again and the party answers it from its own once-only record), ``done``."""

    __tablename__ = "legs"
    __table_args__ = (UniqueConstraint("task_id", "data_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[str] = mapped_column(String(64), index=True)
    data_id: Mapped[str] = mapped_column(String(64))
    party: Mapped[str] = mapped_column(String(64), index=True)
    address: Mapped[str] = mapped_column(String(300), default="")
    call_json: Mapped[str] = mapped_column(Text, default="{}")
    state: Mapped[str] = mapped_column(String(16), default="assigned")
    dispatches: Mapped[int] = mapped_column(Integer, default=0)
    outcome: Mapped[str | None] = mapped_column(String(32), nullable=True)
    envelope_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The leg's outcome, sealed to the task's owner and signed by the gateway (item 7)."""
    stream_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Set for a result stored at its party (fetched through the stream port): its size."""
    input_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The leg's declared input (size, SHA-256), if it takes one."""
    input_done: Mapped[bool] = mapped_column(Boolean, default=False)
    """Its party has the input whole and checked (the gateway relayed it and the party said so)."""
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time)


class LegConflict(Exception):
    """A report for a leg that does not exist or belongs to another party."""


class TaskConflict(Exception):
    """A task id used before with another body or by another initiator; ids are never reused."""


class TaskLimit(Exception):
    """Creating the task would give a party more open legs than the gateway allows."""


@dataclass(frozen=True)
class Task:
    task_id: str
    owner: str
    body_sha256: str
    created_at: float
    deadline_at: float
    run_id: str | None = None


@dataclass(frozen=True)
class Leg:
    task_id: str
    data_id: str
    party: str
    address: str
    call: dict[str, Any]
    state: str
    outcome: str | None
    envelope_json: str | None
    stream_bytes: int | None = None
    dispatches: int = 0
    input: dict[str, Any] | None = None
    input_done: bool = False

    @property
    def waits_for_input(self) -> bool:
        return self.input is not None and not self.input_done


def _leg(r: Any) -> Leg:
    return Leg(
        r.task_id,
        r.data_id,
        r.party,
        r.address,
        json.loads(r.call_json),
        r.state,
        r.outcome,
        r.envelope_json,
        r.stream_bytes,
        r.dispatches,
        json.loads(r.input_json) if r.input_json else None,
        bool(r.input_done),
    )


def _task(r: Any) -> Task:
    return Task(r.task_id, r.owner, r.body_sha256, r.created_at, r.deadline_at, r.run_id)


class MappingTable:
    """Repository over the tasks and legs tables; every write commits before the caller acknowledges."""

    def __init__(self, url: str):
        self._sessions = make_sessionmaker(url, Base.metadata)
        self._hot = HotPath(self._sessions.kw["bind"])

    def create_task(
        self,
        task_id: str,
        owner: str,
        legs: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None]],
        body_sha256: str,
        deadline_s: float,
        max_open_legs_per_party: int,
        run_id: str | None = None,
    ) -> tuple[bool, Task]:
        """Create a task and its legs (data id -> (party, rule call, input)); True if new, False
        for an identical retry (with the task as first created: when, and by which run).

        An id seen before with another body or owner raises :class:`TaskConflict`: ids are never
        reused, so a result can never be served for a task other than the one that produced it.
        """
        now = time.time()
        with self._sessions.begin() as s:
            row = s.get(TaskRow, task_id)
            if row is not None:
                if row.owner != owner:
                    raise TaskConflict(
                        f"task id {task_id!r} is already taken by another initiator; task ids are "
                        "never reused: choose a new one (the CLI does when the task file has none)"
                    )
                if row.body_sha256 != body_sha256:
                    raise TaskConflict(
                        f"task id {task_id!r} was created earlier with a different body; task ids "
                        "are never reused: choose a new one, or resend exactly the same task to retry"
                    )
                return False, _task(row)
            parties = sorted({p for p, _call, _input in legs.values()})
            for party in parties:
                open_legs = s.scalar(
                    select(func.count()).select_from(LegRow).where(LegRow.party == party, LegRow.outcome.is_(None))
                )
                open_legs = int(open_legs or 0)
                want = sum(1 for p, _call, _input in legs.values() if p == party)
                if open_legs + want > max_open_legs_per_party:
                    raise TaskLimit(
                        f"party {party!r} already has {open_legs} open leg(s); this task would exceed "
                        f"the gateway's cap of {max_open_legs_per_party}; retry when earlier tasks finish"
                    )
            row = TaskRow(
                task_id=task_id,
                owner=owner,
                body_sha256=body_sha256,
                created_at=now,
                deadline_at=now + deadline_s,
                run_id=run_id,
            )
            s.add(row)
            for data_id, (party, call, leg_input) in legs.items():
                s.add(
                    LegRow(
                        task_id=task_id,
                        data_id=data_id,
                        party=party,
                        call_json=json.dumps(call),
                        input_json=json.dumps(leg_input) if leg_input is not None else None,
                        input_done=False,
                    )
                )
            task = _task(row)
        return True, task

    def task(self, task_id: str) -> Task | None:
        with self._hot.tx() as c:
            r = c.execute(select(TaskRow.__table__).where(TaskRow.task_id == task_id)).first()
        return None if r is None else _task(r)

    def register(self, task_id: str, data_id: str, party: str, address: str, call: dict[str, Any]) -> Leg:
        """Record an executor report. Only the party the task assigned the leg to may report it
        (item 1, item 8: no legs under unknown task ids, no squatting); a finished leg is final."""
        with self._sessions.begin() as s:
            row = s.scalar(select(LegRow).where(LegRow.task_id == task_id, LegRow.data_id == data_id))
            if row is None:
                raise LegConflict(
                    f"no leg ({task_id}, {data_id}) at the gateway: the initiator creates a task "
                    "at the gateway before its parties report"
                )
            if row.party != party:
                raise LegConflict(f"leg ({task_id}, {data_id}) belongs to party {row.party!r}")
            if row.outcome is not None:
                raise LegConflict(f"leg ({task_id}, {data_id}) already finished with {row.outcome!r}")
            if json.loads(row.call_json) != call:
                raise LegConflict(f"leg ({task_id}, {data_id}) was created at the gateway with another rule call")
            row.address, row.updated_at = address, time.time()
            if row.state == "assigned":
                row.state = "reported"
            s.flush()
            return _leg(row)

    def legs(self, task_id: str) -> dict[str, Leg]:
        with self._hot.tx() as c:
            rows = c.execute(select(LegRow.__table__).where(LegRow.task_id == task_id)).all()
        return {r.data_id: _leg(r) for r in rows}

    def mark_dispatched(self, task_id: str, data_id: str) -> None:
        """Journal that a transfer goes out, before it does (a restart then knows it may be in flight)."""
        with self._hot.tx() as c:
            c.execute(
                update(LegRow)
                .where(LegRow.task_id == task_id, LegRow.data_id == data_id, LegRow.outcome.is_(None))
                .values(state="dispatched", dispatches=LegRow.dispatches + 1, updated_at=time.time())
            )

    def mark_input_done(self, task_id: str, data_id: str) -> None:
        """The leg's party has its input whole and checked."""
        with self._hot.tx() as c:
            c.execute(
                update(LegRow)
                .where(LegRow.task_id == task_id, LegRow.data_id == data_id)
                .values(input_done=True, updated_at=time.time())
            )

    def record_outcome(
        self, task_id: str, data_id: str, outcome: str, envelope_json: str | None, stream_bytes: int | None = None
    ) -> bool:
        """Set the leg's outcome once; returns False if it already had one (never overwritten)."""
        with self._hot.tx() as c:
            res = c.execute(
                update(LegRow)
                .where(LegRow.task_id == task_id, LegRow.data_id == data_id, LegRow.outcome.is_(None))
                .values(
                    outcome=outcome,
                    envelope_json=envelope_json,
                    stream_bytes=stream_bytes,
                    state="done",
                    updated_at=time.time(),
                )
            )
            return bool(res.rowcount)

    def count(self) -> int:
        with self._sessions() as s:
            return int(s.scalar(select(func.count()).select_from(LegRow)) or 0)
