"""SQLAlchemy 2 models of everything the controller knows: jobs, roles, instances, events, registry."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, orm_insert_sentinel, relationship
from sqlalchemy.types import TypeDecorator

from trainmaster.contract import InstanceHandle


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class HandleColumn(TypeDecorator[InstanceHandle]):
    """An attempt's :class:`InstanceHandle`, kept as JSON: the one place a handle becomes JSON
    in the store and a typed handle again (rows written before handles were typed included)."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: InstanceHandle | None, dialect: Dialect) -> dict[str, Any] | None:
        return None if value is None else value.to_dict()

    def process_result_value(self, value: Any, dialect: Dialect) -> InstanceHandle | None:
        return None if value is None else InstanceHandle.from_dict(value)


#: The column that lets the ORM write many new rows of a table whose ids the database chooses in
#: one INSERT. To give each new object its id it must match the ids the INSERT returns to its
#: rows; PostgreSQL assigns them in the order of the VALUES, SQLite promises no order, so on
#: SQLite the ORM sent one INSERT per row: 64 into ``instances`` and 64 into ``registry`` for a
#: 64-replica start. With this nullable column the ORM numbers the rows of each multi-row INSERT
#: here and matches the returned ids by it (SQLAlchemy's "insert sentinel"); nothing else reads it.
INSERT_SENTINEL = "insert_sentinel"


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class JobRow(Base):
    __tablename__ = "jobs"
    # ids are never reused: a deleted job's id must not name (and show the logs of) a new one;
    # a reconcile pass reads its admitted jobs by the index (not every active job: revision 0010)
    __table_args__ = (
        Index("ix_jobs_admitted_state_owner", "admitted", "state", "owner"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uid: Mapped[str] = mapped_column(String(32), unique=True)
    name: Mapped[str] = mapped_column(String(63), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # the defaulted trainmaster/v1 Job
    state: Mapped[str] = mapped_column(String(16), index=True, default="pending")
    reason: Mapped[str] = mapped_column(String(64), default="")
    message: Mapped[str] = mapped_column(Text, default="")
    queue: Mapped[str] = mapped_column(String(63), default="default", index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    backend: Mapped[str] = mapped_column(String(16), default="local")
    # which controller reconciles it: "service", or "run-<uid>" for the one embedded in `trainmaster run`
    owner: Mapped[str] = mapped_column(String(64), default="service", index=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    admitted: Mapped[bool] = mapped_column(Boolean, default=False)
    run_dir: Mapped[str] = mapped_column(Text, default="")
    output_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    running_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_transition_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    roles: Mapped[list[RoleRow]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="RoleRow.position"
    )
    instances: Mapped[list[InstanceRow]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="InstanceRow.id"
    )
    events: Mapped[list[EventRow]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="EventRow.id"
    )
    addresses: Mapped[list[RegistryRow]] = relationship(cascade="all, delete-orphan")  # the registry


class RoleRow(Base):
    __tablename__ = "roles"
    __table_args__ = (UniqueConstraint("job_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    position: Mapped[int] = mapped_column(Integer, default=0)
    replicas: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    reason: Mapped[str] = mapped_column(String(64), default="")
    message: Mapped[str] = mapped_column(Text, default="")
    counts: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    last_transition_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    job: Mapped[JobRow] = relationship(back_populates="roles")


class InstanceRow(Base):
    """One run slot of a role: ``(job, role, index)``; ``attempt`` counts its starts.

    A restart reuses the row (attempt + 1), so one replica index never has two live copies.
    """

    __tablename__ = "instances"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(63))
    index: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    reason: Mapped[str] = mapped_column(String(64), default="")
    message: Mapped[str] = mapped_column(Text, default="")
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    handle: Mapped[InstanceHandle | None] = mapped_column(HandleColumn, nullable=True)  # names the attempt
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    ports: Mapped[list[Any]] = mapped_column(JSON, default=list)
    address: Mapped[str | None] = mapped_column(String(255), nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    log_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    cpu: Mapped[float] = mapped_column(Float, default=0.0)
    memory: Mapped[int] = mapped_column(Integer, default=0)
    cpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)  # the current attempt's tree, from its node agent
    peak_rss: Mapped[int] = mapped_column(Integer, default=0)  # bytes, the highest the agent reported
    next_start_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    running_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # a gang's rows go in as one multi-row INSERT (see :data:`INSERT_SENTINEL`)
    insert_sentinel: Mapped[int | None] = orm_insert_sentinel(INSERT_SENTINEL)

    job: Mapped[JobRow] = relationship(back_populates="instances")

    @property
    def label(self) -> str:
        return f"{self.role}-{self.index}"


class EventRow(Base):
    """One change of a job; its id is the store's resource version (never reused: a watch and the
    controller read every event after the last id they saw)."""

    __tablename__ = "events"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    object: Mapped[str] = mapped_column(String(128))  # "job", "role/master", "instance/worker-1"
    type: Mapped[str] = mapped_column(String(16), default="Normal")  # Normal | Warning
    reason: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text, default="")
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    job: Mapped[JobRow] = relationship(back_populates="events")


class RegistryRow(Base):
    """The address registry (the source's cache server): where each running instance listens."""

    __tablename__ = "registry"
    __table_args__ = (UniqueConstraint("job_id", "role", "index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(63))
    index: Mapped[int] = mapped_column(Integer)
    address: Mapped[str] = mapped_column(String(255))
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    insert_sentinel: Mapped[int | None] = orm_insert_sentinel(INSERT_SENTINEL)  # see :data:`INSERT_SENTINEL`


class MetricRow(Base):
    """One point an instance reported with :func:`trainmaster.report` (a metric history per
    instance, stored with its job, like Ray Train's reported metrics)."""

    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(63))
    index: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    total: Mapped[int | None] = mapped_column(Integer, nullable=True)  # steps or epochs expected, for progress
    values: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # name -> finite float
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class LeaseRow(Base):
    """Who leads the controller service on a shared store (a Kubernetes ``Lease``).

    ``token`` grows by one at every change of holder: the fencing token. Every write of the
    leader's reconcile pass re-checks it in its own transaction (:mod:`trainmaster.controller.leader`),
    so a paused leader whose lease was taken over cannot commit anything afterwards.
    """

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    token: Mapped[int] = mapped_column(Integer, default=1)
    expires_at: Mapped[float] = mapped_column(Float)  # epoch seconds, on the holder's clock
    acquired_at: Mapped[float] = mapped_column(Float)


class KeyRow(Base):
    """A secret the controllers sharing this store share, by name: ``channel`` signs the tokens
    instances use on the instance channel (:mod:`trainmaster.controller.channel`), so a token
    minted by one server (or a `trainmaster run`) is honoured by the server that takes over."""

    __tablename__ = "keys"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))  # hex
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TrainingRuntimeRow(Base):
    """A Kubeflow Trainer runtime (``TrainingRuntime`` / ``ClusterTrainingRuntime``) installed
    with ``trainmaster runtime add``: the document as given, which TrainJobs name by kind and name
    (:mod:`trainmaster.spec.compat.trainer`); read strictly when added and again when used."""

    __tablename__ = "training_runtimes"
    __table_args__ = (UniqueConstraint("kind", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(253), index=True)
    document: Mapped[dict[str, Any]] = mapped_column(JSON)
    source: Mapped[str] = mapped_column(Text, default="")  # the file it was added from
    installed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class QueueRow(Base):
    """A queue with quota (Kueue's ClusterQueue): what it owns of each resource, the cohort it
    lends to and borrows from, and its fair-sharing weight (:mod:`trainmaster.controller.quota`).

    ``quota`` maps a resource (``cpu``, ``memory`` in bytes, ``gpu``) to ``{"nominal": n,
    "borrowingLimit": n | null, "lendingLimit": n | null}``. A job's queue without a row here
    has no quota: it is admitted by capacity and weight alone, as before quotas existed."""

    __tablename__ = "queues"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    cohort: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    quota: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
