"""A party's legs on disk: what survives a ``kill -9`` of the party.

One row per leg, written before the party acknowledges anything about it: the creation request
(the idempotency check), the initiator that signed it, the deadline, and the leg's state,
``created`` (its rule has not run) -> ``running`` (a run was handed to the executor) -> ``done``
(the run's record: ok or the reason, the result's size and SHA-256); or ``created`` ->
``start_failed`` (its executor did not come up: the reason waits in ``error`` until the gateway
has taken the party's failure report, then the row goes). An input arriving through
the gateway records how much of it is durable (``input_bytes``, a group commit every
``stream_commit_bytes``) and when it is whole and checked (``input_done``). The bytes themselves
live in the leg's folder (``result``, ``commit``, ``input``; see ``executors.base.LegFiles``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import Boolean, Float, Integer, String, Table, Text, delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from trainmaster.gateway.models import TaskCreate
from trainmaster.gateway.store import HotPath, make_sessionmaker


class Base(DeclarativeBase):
    pass


class PartyLegRow(Base):
    __tablename__ = "party_legs"
    task_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    data_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    request_json: Mapped[str] = mapped_column(Text)
    requester: Mapped[str] = mapped_column(String(64))
    deadline_at: Mapped[float] = mapped_column(Float, index=True)
    state: Mapped[str] = mapped_column(String(16), default="created")
    ok: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    error: Mapped[str] = mapped_column(Text, default="")
    size: Mapped[int] = mapped_column(Integer, default=0)
    sha256: Mapped[str] = mapped_column(String(64), default="")
    input_bytes: Mapped[int] = mapped_column(Integer, default=0)
    input_done: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


@dataclass(frozen=True)
class PartyLeg:
    """A leg's row as the party last committed it."""

    task: TaskCreate
    requester: str
    deadline_at: float
    state: str
    ok: bool | None
    error: str
    size: int
    sha256: str
    input_bytes: int
    input_done: bool

    @property
    def key(self) -> tuple[str, str]:
        return self.task.task_id, self.task.data_id


class LegExists(Exception):
    """A creation request for a leg that exists with another request (task ids are never reused)."""


def _leg(r: PartyLegRow) -> PartyLeg:
    return PartyLeg(
        TaskCreate.model_validate_json(r.request_json),
        r.requester,
        r.deadline_at,
        r.state,
        r.ok,
        r.error,
        r.size,
        r.sha256,
        r.input_bytes,
        r.input_done,
    )


class PartyRecords:
    """The party's legs table; every write commits before the caller acknowledges."""

    def __init__(self, url: str):
        self._sessions = make_sessionmaker(url, Base.metadata)
        self._hot = HotPath(self._sessions.kw["bind"])
        self._table: Table = PartyLegRow.__table__  # type: ignore[assignment]  # a mapped class's table

    def create(self, task: TaskCreate, requester: str, deadline_at: float) -> tuple[bool, PartyLeg]:
        """Record a new leg (True) or find the same request's leg (False); another request for an
        existing leg raises :class:`LegExists`."""
        now = time.time()
        body = task.model_dump_json()
        try:
            with self._hot.tx() as c:
                c.execute(
                    insert(self._table),
                    {
                        "task_id": task.task_id,
                        "data_id": task.data_id,
                        "request_json": body,
                        "requester": requester,
                        "deadline_at": deadline_at,
                        "state": "created",
                        "error": "",
                        "size": 0,
                        "sha256": "",
                        "input_bytes": 0,
                        "input_done": False,
                        "created_at": now,
                        "updated_at": now,
                    },
                )
        except IntegrityError:
            leg = self.get(task.task_id, task.data_id)
            if leg is None or leg.task != task:
                raise LegExists(
                    f"leg ({task.task_id}, {task.data_id}) was created with another request; "
                    "task ids are never reused: choose a new task id"
                ) from None
            return False, leg
        leg = self.get(task.task_id, task.data_id)
        assert leg is not None
        return True, leg

    def get(self, task_id: str, data_id: str) -> PartyLeg | None:
        with self._hot.tx() as c:
            r = c.execute(
                select(self._table).where(PartyLegRow.task_id == task_id, PartyLegRow.data_id == data_id)
            ).first()
        return None if r is None else _leg(r)  # type: ignore[arg-type]  # a Row has the row's fields

    def _set(self, task_id: str, data_id: str, **values: object) -> None:
        with self._hot.tx() as c:
            c.execute(
                update(self._table)
                .where(PartyLegRow.task_id == task_id, PartyLegRow.data_id == data_id)
                .values(updated_at=time.time(), **values)
            )

    def start_run(self, task_id: str, data_id: str) -> None:
        """Journal that a run goes to the executor, before it does."""
        self._set(task_id, data_id, state="running")

    def finish_run(
        self, task_id: str, data_id: str, ok: bool, error: str = "", size: int = 0, sha256: str = ""
    ) -> None:
        """The run's one record (a refusal before the rule ran is recorded the same way)."""
        self._set(task_id, data_id, state="done", ok=ok, error=error[:2000], size=size, sha256=sha256)

    def fail_start(self, task_id: str, data_id: str, error: str) -> None:
        """The leg's executor did not come up: its failure report to the gateway is pending (a
        restarted party resends it from here)."""
        self._set(task_id, data_id, state="start_failed", error=error[:2000])

    def reset(self, task_id: str, data_id: str) -> None:
        """A run that never committed (the party died under it): the rule has not run yet."""
        self._set(task_id, data_id, state="created")

    def input_progress(self, task_id: str, data_id: str, committed: int, done: bool = False) -> None:
        self._set(task_id, data_id, input_bytes=committed, input_done=done)

    def unfinished(self) -> list[PartyLeg]:
        """Legs whose rule has not run to a record, before their deadline (what a restart resumes)."""
        with self._hot.tx() as c:
            rows = c.execute(
                select(self._table).where(PartyLegRow.state != "done", PartyLegRow.deadline_at > time.time())
            ).all()
        return [_leg(r) for r in rows]  # type: ignore[arg-type]

    def older_than(self, deadline_at: float) -> list[tuple[str, str]]:
        with self._hot.tx() as c:
            rows = c.execute(
                select(PartyLegRow.task_id, PartyLegRow.data_id).where(PartyLegRow.deadline_at < deadline_at)
            ).all()
        return [(r.task_id, r.data_id) for r in rows]

    def delete(self, task_id: str, data_id: str) -> None:
        with self._hot.tx() as c:
            c.execute(delete(self._table).where(PartyLegRow.task_id == task_id, PartyLegRow.data_id == data_id))
