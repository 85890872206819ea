"""Repository functions over the store: what the controller, the CLI and the server read and write."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Mapping
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from weakref import WeakKeyDictionary

from sqlalchemy import Table, Text, bindparam, func, inspect as sa_inspect, insert, select, type_coerce, update
from sqlalchemy.orm import InstanceState as RowState, Mapper, Session, defer, make_transient_to_detached, selectinload
from sqlalchemy.orm.attributes import NO_VALUE, set_committed_value

from trainmaster.errors import JobConflict, UserError
from trainmaster.spec.model import Job
from trainmaster.contract import InstanceHandle
from trainmaster.spec.states import INSTANCE_TERMINAL, JOB_TERMINAL, InstanceState, JobState
from trainmaster.store.models import (
    INSERT_SENTINEL,
    EventRow,
    InstanceRow,
    JobRow,
    MetricRow,
    RegistryRow,
    RoleRow,
    utcnow,
)
from trainmaster.store.ownership import orphan_note, owner_alive


def add_event(session: Session, job_id: int, obj: str, reason: str, message: str, type_: str = "Normal") -> EventRow:
    event = EventRow(job_id=job_id, object=obj, reason=reason, message=message, type=type_, time=utcnow())
    session.add(event)
    return event


def load_job(session: Session, job_id: int) -> JobRow:
    jobs = load_jobs(session, [job_id])
    if not jobs:
        raise UserError(f"no job with id {job_id}")
    return jobs[0]


def load_jobs(session: Session, job_ids: list[int]) -> list[JobRow]:
    """Jobs with their roles, instances and registry, in ``job_ids``' order, in four queries
    whatever their number (a reconcile pass over a long queue would otherwise pay per job)."""
    rows = session.scalars(
        select(JobRow)
        .where(JobRow.id.in_(job_ids))
        .options(selectinload(JobRow.roles), selectinload(JobRow.instances), selectinload(JobRow.addresses))
    ).all()
    by_id = {job.id: job for job in rows}
    return [by_id[i] for i in job_ids if i in by_id]


@dataclass
class WaitingJob:
    """A job not yet admitted, as a reconcile pass first sees it: the few columns admission
    reads, not an ORM row. Most of a long queue stays as it is pass after pass; the controller
    loads the row (:func:`load_waiting_jobs`) only for a job whose state it changes."""

    id: int
    queue: str
    state: str
    reason: str
    message: str
    cancel_requested: bool
    rank: tuple[int, Any, int]  # its place in queue order: (-priority, created_at, id)
    admitted: bool = False


@dataclass(frozen=True)
class LiveInstance:
    """An admitted job's instance that has not ended, as a pass first sees it (plain columns)."""

    id: int
    state: str
    handle: InstanceHandle | None


@dataclass
class AdmittedJob:
    """An admitted job as a reconcile pass first sees it: its plain columns and its instances
    that have not ended. The pass loads its rows only when something changed (an observation,
    an event, a state to move on)."""

    id: int
    queue: str
    state: str
    cancel_requested: bool
    instances: list[LiveInstance] = field(default_factory=list)
    admitted: bool = True


class WaitingQueue:
    """An owner's waiting jobs (:class:`WaitingJob`) in queue order, kept by a controller from
    pass to pass: read whole once (:func:`load_active_jobs` without one), then only the jobs
    an event named since (a submit, a cancel, a scale, an admission) are read again, and what
    the controller itself writes to a waiting job's columns it tells the queue (:meth:`note`).
    A pass over 10,000 waiting jobs read them all before, pass after pass."""

    def __init__(self) -> None:
        self.jobs: dict[int, WaitingJob] = {}
        self.queues: Counter[str] = Counter()  # waiting jobs per queue
        self._order: list[WaitingJob] = []
        self._sorted = True

    def put(self, job: WaitingJob) -> None:
        known = self.jobs.get(job.id)
        if known is not None:  # read again: its columns as they are now, in its place
            if known.queue != job.queue:
                self._count(known.queue, -1)
                self._count(job.queue, 1)
            known.queue, known.state, known.reason, known.message = job.queue, job.state, job.reason, job.message
            known.cancel_requested = job.cancel_requested
            if known.rank != job.rank:
                known.rank, self._sorted = job.rank, False
            return
        self.jobs[job.id] = job
        self._count(job.queue, 1)
        if self._order and job.rank < self._order[-1].rank:
            self._sorted = False
        self._order.append(job)  # the usual case: a new job goes last

    def drop(self, job_ids: set[int]) -> None:
        found = [job for job in (self.jobs.pop(i, None) for i in job_ids) if job is not None]
        for job in found:
            self._count(job.queue, -1)
        if found:
            self._order = [j for j in self._order if j.id in self.jobs]

    def _count(self, queue: str, change: int) -> None:
        self.queues[queue] += change
        if not self.queues[queue]:
            del self.queues[queue]

    def note(self, job_id: int, state: str, reason: str, message: str) -> None:
        """What a pass wrote to a waiting job's columns (it is still waiting)."""
        job = self.jobs.get(job_id)
        if job is not None:
            job.state, job.reason, job.message = state, reason, message

    def ordered(self) -> list[WaitingJob]:
        if not self._sorted:
            self._order.sort(key=lambda j: j.rank)
            self._sorted = True
        return self._order


@dataclass
class ActiveJobs:
    """What one reconcile pass works on: ``owner``'s jobs not yet ended, in queue order (the
    admitted ones, then the waiting ones), and the waiting ones' stored specs it read (as
    text)."""

    jobs: list[AdmittedJob | WaitingJob]
    admitted: list[AdmittedJob]
    waiting: WaitingQueue
    spec_texts: dict[int, str]


ACTIVE_STATES = [s.value for s in JobState if s not in JOB_TERMINAL]
OPEN_INSTANCE_STATES = [s.value for s in InstanceState if s not in INSTANCE_TERMINAL]
_JOB_COLUMNS = (
    JobRow.id,
    JobRow.queue,
    JobRow.state,
    JobRow.reason,
    JobRow.message,
    JobRow.cancel_requested,
    JobRow.admitted,
    JobRow.priority,
    JobRow.created_at,
)


def load_active_jobs(
    session: Session,
    owner: str,
    spec_wanted: Callable[[int], bool],
    handles: dict[int, tuple[Any, Any]],
    known: dict[int, list[LiveInstance]] | None = None,
    waiting: WaitingQueue | None = None,
    changed: set[int] | None = None,
    cached_specs: Mapping[int, Any] | None = None,
) -> ActiveJobs:
    """``owner``'s jobs not yet ended, in queue order (:func:`active_job_ids`), in a few queries
    of plain columns whatever their number: the jobs; the open instances of the admitted ones;
    the stored spec (as text: no JSON decode) of the waiting ones ``spec_wanted`` asks for
    (the controller caches the rest). ``handles`` caches decoded handles by instance id (text,
    handle): a pass over thousands of running instances decodes only the new ones. ``known``:
    the open instances of admitted jobs the caller knows unchanged since it read them (none of
    their rows written since); only the other admitted jobs' instances are read, and ``known``
    is updated with them (None: read every admitted job's).

    ``waiting``, with ``changed``: the waiting jobs as the caller kept them (:class:`WaitingQueue`),
    all unchanged but those in ``changed``: only the admitted jobs and the ``changed`` ones are
    read, and ``waiting`` is brought up to date (what changes, not what exists); their specs
    are read for those read again and those not in ``cached_specs``. Without them every active
    job is read, into a new queue."""
    base = select(*_JOB_COLUMNS).where(JobRow.state.in_(ACTIVE_STATES), JobRow.owner == owner)
    order = (JobRow.priority.desc(), JobRow.created_at, JobRow.id)
    incremental = waiting is not None and changed is not None and cached_specs is not None
    reread: set[int] = set()
    cached: Mapping[int, Any] = cached_specs or {}
    if waiting is None or changed is None or not incremental:
        waiting = WaitingQueue()
        rows = list(session.execute(base.order_by(*order)))
    else:
        rows = list(session.execute(base.where(JobRow.admitted.is_(True)).order_by(*order)))
        reread = set(changed)
        ids = sorted(reread)
        for chunk in range(0, len(ids), 500):
            rows += session.execute(base.where(JobRow.id.in_(ids[chunk : chunk + 500])).order_by(*order))
    admitted: dict[int, AdmittedJob] = {}
    found: set[int] = set()  # waiting, of those read
    for job_id, queue, state, reason, message, cancel, is_admitted, priority, created_at in rows:
        if is_admitted:
            if job_id not in admitted:
                admitted[job_id] = AdmittedJob(job_id, queue, state, bool(cancel))
        else:
            found.add(job_id)
            rank = (-(priority or 0), created_at, job_id)
            waiting.put(WaitingJob(job_id, queue, state, reason or "", message or "", bool(cancel), rank))
    if incremental:
        # read again and no longer waiting (admitted, ended, deleted, given to another owner)
        waiting.drop((reread - found) | (admitted.keys() & waiting.jobs.keys()))
    unknown = list(admitted) if known is None else [i for i in admitted if i not in known]
    if unknown:
        query = (
            select(InstanceRow.id, InstanceRow.job_id, InstanceRow.state, type_coerce(InstanceRow.handle, Text))
            .join(JobRow, JobRow.id == InstanceRow.job_id)
            .where(
                JobRow.state.in_(ACTIVE_STATES),
                JobRow.owner == owner,
                JobRow.admitted.is_(True),
                InstanceRow.state.in_(OPEN_INSTANCE_STATES),
            )
            .order_by(InstanceRow.id)
        )
        if known is not None:  # only those: what changed, not what exists
            query = query.where(InstanceRow.job_id.in_(unknown))
        for inst_id, job_id, state, text in session.execute(query):
            if job_id in admitted:
                admitted[job_id].instances.append(LiveInstance(inst_id, state, _handle(handles, inst_id, text)))
    if known is not None:
        for job_id, job in admitted.items():
            if job_id in known:
                job.instances = known[job_id]
        known.clear()
        known.update({job_id: job.instances for job_id, job in admitted.items()})
    if incremental:  # those read again, and any whose spec the caller lacks
        wanted = sorted((found | (waiting.jobs.keys() - cached.keys())) & waiting.jobs.keys())
    else:
        wanted = [i for i in waiting.jobs if spec_wanted(i)]
    spec_texts: dict[int, str] = {}
    for chunk in range(0, len(wanted), 5000):
        texts = select(JobRow.id, type_coerce(JobRow.spec, Text)).where(JobRow.id.in_(wanted[chunk : chunk + 5000]))
        spec_texts.update(session.execute(texts).all())
    admitted_jobs = list(admitted.values())
    return ActiveJobs(admitted_jobs + waiting.ordered(), admitted_jobs, waiting, spec_texts)


def _handle(cache: dict[int, tuple[Any, Any]], inst_id: int, stored: Any) -> InstanceHandle | None:
    """The stored handle, decoded once per value: SQLite gives the JSON text, PostgreSQL's
    driver a decoded dict (it parses json columns whatever the SQL type asked)."""
    if not stored or stored == "null":
        return None
    cached = cache.get(inst_id)
    if cached is None or cached[0] != stored:
        cached = (stored, InstanceHandle.from_dict(json.loads(stored) if isinstance(stored, str) else stored))
        cache[inst_id] = cached
    return cached[1]  # type: ignore[no-any-return]


def changed_jobs(session: Session, after: int, upto: int) -> tuple[set[int], dict[int, str]]:
    """The jobs with an event after resource version ``after`` up to ``upto`` (an indexed range),
    and, for those with a ``job`` event there, the reason of the newest one (read with the range
    instead of once per job)."""
    changed: set[int] = set()
    reasons: dict[int, str] = {}
    rows = session.execute(
        select(EventRow.job_id, EventRow.object, EventRow.reason)
        .where(EventRow.id > after, EventRow.id <= upto)
        .order_by(EventRow.id)
    )
    for job_id, obj, reason in rows:
        changed.add(job_id)
        if obj == "job":
            reasons[job_id] = reason
    return changed, reasons


def last_job_reasons(session: Session, job_ids: list[int]) -> dict[int, str]:
    """The reason of each job's newest ``job`` event ("" for a job without one), for many jobs
    in one query per 500."""
    found = dict.fromkeys(job_ids, "")
    for chunk in range(0, len(job_ids), 500):
        newest = (
            select(func.max(EventRow.id))
            .where(EventRow.object == "job", EventRow.job_id.in_(job_ids[chunk : chunk + 500]))
            .group_by(EventRow.job_id)
        )
        for job_id, reason in session.execute(select(EventRow.job_id, EventRow.reason).where(EventRow.id.in_(newest))):
            found[job_id] = reason
    return found


def newest_event_id(session: Session) -> int:
    return session.scalar(select(func.max(EventRow.id))) or 0


def load_waiting_jobs(session: Session, job_ids: list[int]) -> dict[int, JobRow]:
    """The rows of jobs a pass found waiting, with their roles, in two queries (their spec
    column deferred: the pass has its text). Instances and registry entries exist only once a job is admitted (the
    controller creates them then), so they are known empty without a query."""
    rows = session.scalars(
        select(JobRow).where(JobRow.id.in_(job_ids)).options(defer(JobRow.spec), selectinload(JobRow.roles))
    ).all()
    for job in rows:
        set_committed_value(job, "instances", [])
        set_committed_value(job, "addresses", [])
    return {job.id: job for job in rows}


def find_job(session: Session, ref: str | int, with_spec: bool = True) -> JobRow:
    """A job by id, uid, or name (the most recent job of that name); without ``with_spec`` its
    spec is read (and parsed) only if something asks for it (a status shows none of it)."""
    text = str(ref)
    query = select(JobRow) if with_spec else select(JobRow).options(defer(JobRow.spec))
    if text.isascii() and text.isdigit():  # "²".isdigit() holds, int("²") fails
        query = query.where(JobRow.id == int(text))
    else:
        query = query.where((JobRow.name == text) | (JobRow.uid == text)).order_by(JobRow.id.desc())
    job = session.scalars(query.limit(1)).first()
    if job is None:
        raise UserError(f"no job '{ref}' (give a job name or id; `trainmaster job list` shows them)")
    return job


def take_over(session: Session, job_id: int, old_owner: str, new_owner: str) -> bool:
    """Move a job to ``new_owner`` only if ``old_owner`` still holds it (one winner)."""
    from sqlalchemy import update

    result = session.execute(
        update(JobRow).where(JobRow.id == job_id, JobRow.owner == old_owner).values(owner=new_owner)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def active_job_ids(session: Session, owner: str) -> list[int]:
    """``owner``'s jobs not yet ended, highest priority first, then oldest first (the queue order)."""
    rows = session.execute(
        select(JobRow.id)
        .where(JobRow.state.in_(ACTIVE_STATES), JobRow.owner == owner)
        .order_by(JobRow.priority.desc(), JobRow.created_at, JobRow.id)
    ).all()
    return [r[0] for r in rows]


def shown_reason(job: JobRow) -> tuple[str, str]:
    """The job's reason and message, unless the ``trainmaster run`` reconciling it has died:
    then its stored state is stale, and the user is told so and how to take it over."""
    return shown_reason_of(job.id, job.state, job.reason, job.message, job.owner)


def shown_reason_of(job_id: int, state: str, reason: str, message: str, owner: str) -> tuple[str, str]:
    """:func:`shown_reason` from the job's plain columns (a list reads no rows as objects)."""
    if not is_terminal(state) and owner_alive(owner) is False:
        if reason == "BackendFailed":  # why it stopped first, then how to take it over
            return reason, f"{message}; {orphan_note(job_id, owner)}"
        return "ControllerGone", orphan_note(job_id, owner)
    return reason, message


def state_counts(session: Session) -> dict[str, int]:
    from sqlalchemy import func

    return dict(session.execute(select(JobRow.state, func.count(JobRow.id)).group_by(JobRow.state)).all())


def new_instance_row(**values: Any) -> InstanceRow:
    """An instance row not yet stored, its attributes written straight into its ``__dict__``:
    no attribute events (a dozen per row made the usual way, about 3 ms for a 64-replica gang on
    the way from its submit to its start), as :func:`insert_instances` stores the row from that
    dict anyway. Set further attributes before the insert with :func:`set_unstored`."""
    row = InstanceRow()
    row.__dict__.update(values)
    return row


def set_unstored(row: InstanceRow, **values: Any) -> None:
    """Set attributes of a row made by :func:`new_instance_row` and not stored yet, without
    attribute events; a stored row (or one :func:`insert_instances` stored) changes the usual way,
    so that :func:`write_changed_columns` sees its changes."""
    if sa_inspect(row).key is not None:
        raise ValueError(f"instance row {row.__dict__.get('id')} is stored: set its attributes, not its dict")
    row.__dict__.update(values)


def add_new_instances(job: JobRow, rows: list[InstanceRow]) -> None:
    """Put new, not yet stored instance rows in ``job.instances`` without the collection's
    events: they stay out of the session's unit of work (its flush of a 64-replica gang's start
    intents took 6-7 ms of CPU here, mostly per-object bookkeeping) until
    :func:`insert_instances` writes them all at once."""
    set_committed_value(job, "instances", [*job.instances, *rows])


def insert_instances(session: Session, rows: list[InstanceRow]) -> None:
    """Store rows made with :func:`add_new_instances` in one multi-row INSERT whose RETURNING
    ids are matched to the rows by the insert sentinel (SQLite promises no order of returned
    rows), then attach the rows to ``session`` as stored: later changes in the pass are updates,
    as for any loaded row."""
    if not rows:
        return
    table: Table = InstanceRow.__table__  # type: ignore[assignment]
    columns = [c for c in table.columns if not c.primary_key and c.name != INSERT_SENTINEL]
    defaults = {c.key: c.default for c in columns if c.default is not None}
    values = []
    for row in rows:
        # a transient row's attributes are its __dict__, written straight there (no attribute
        # events): make_transient_to_detached below takes all of it as the stored state
        state = row.__dict__
        for column in columns:
            if column.key not in state:  # never set: the column's default, on the object too
                default = defaults.get(column.key)
                state[column.key] = None if default is None else _default(default)
        values.append({c.key: state[c.key] for c in columns})
    returning = insert(table).returning(table.c.id, sort_by_parameter_order=True)
    # on the session's connection: a session.execute would flush the pass's rows first, which its
    # commit does anyway
    for row, row_id in zip(rows, session.connection().execute(returning, values).scalars().all(), strict=True):
        row.__dict__["id"] = row_id
        make_transient_to_detached(row)
        session.add(row)


#: The rows a reconcile pass changes column by column, pass after pass: an instance's state and
#: attempt, a role's counts, a job's state and reason (:func:`write_changed_columns`).
PASS_ROWS: tuple[type[Any], ...] = (InstanceRow, RoleRow, JobRow)


def _column_keys(cls: type[Any]) -> dict[str, str]:
    """Attribute key -> column key of a mapped class's plain columns."""
    mapper: Mapper[Any] = sa_inspect(cls)
    return {attr.key: attr.columns[0].key for attr in mapper.column_attrs}


_COLUMNS: dict[type[Any], dict[str, str]] = {cls: _column_keys(cls) for cls in PASS_ROWS}
_UPDATES: dict[tuple[str, tuple[str, ...]], Any] = {}  # (table, columns) -> its UPDATE by id


def _update_of(table: Table, columns: tuple[str, ...]) -> Any:
    """``UPDATE table SET c = :v_c, ... WHERE id = :v_id``, made once per table and set of columns
    (the ``v_`` names: a bind parameter may not take a column's own name in a SET clause)."""
    key = (table.name, columns)
    statement = _UPDATES.get(key)
    if statement is None:
        statement = _UPDATES[key] = (
            update(table).where(table.c.id == bindparam("v_id")).values({c: bindparam(f"v_{c}") for c in columns})
        )
    return statement


def write_changed_columns(session: Session) -> int:
    """Write what a pass changed in the columns of loaded instance, role and job rows
    (:data:`PASS_ROWS`) as plain UPDATEs, one executemany per table and set of changed columns,
    in the session's transaction, and mark those columns stored; returns the rows written.

    The ORM's flush writes the same UPDATEs, but its unit of work sorts and processes every
    dirty object (attribute histories, the relationships' dependency steps, then their
    bookkeeping), most of a pass's CPU beside the loading once hundreds of rows change in it
    (a queue draining at hundreds of jobs a second changes each job's, role's and instance's row
    about three times). Changes this leaves to the flush: rows added or deleted, and the
    collections (a job's registry rows), which keep their history. A row's
    :attr:`InstanceState.committed_state` holds the stored value of each attribute assigned
    since (:func:`_differs` says whether it really changed, as the ORM's history does). A row with nothing else pending
    is then marked stored whole (:func:`_mark_stored`), so it leaves the session's dirty list:
    marking only its columns stored (``set_committed_value``) left every written row on that
    list, and the commit's flush still registered and walked each one (a fifth of a drain's
    pass) to find nothing to write. A row with a collection change keeps that for the flush,
    its written columns marked stored."""
    groups: dict[tuple[Any, tuple[str, ...]], list[dict[str, Any]]] = {}
    written: list[tuple[RowState[Any], list[str]]] = []
    for obj in session.dirty:
        columns = _COLUMNS.get(type(obj))
        if columns is None:
            continue
        state = sa_inspect(obj)
        if state.key is None or state.deleted or state.was_deleted:
            continue
        pending = state.committed_state  # attribute -> its stored value, for those assigned since
        values = state.dict
        touched = [k for k in pending if k in columns]
        changed = {k: values[k] for k in touched if _differs(pending[k], values.get(k, NO_VALUE))}
        if changed:
            names = tuple(sorted(columns[k] for k in changed))
            params = {"v_id": state.dict["id"], **{f"v_{columns[k]}": v for k, v in changed.items()}}
            groups.setdefault((state.mapper.local_table, names), []).append(params)
        written.append((state, touched))
    connection = session.connection()  # not session.execute: that would flush first
    for (table, names), rows in groups.items():
        connection.execute(_update_of(table, names), rows)
    for state, touched in written:
        if len(touched) == len(state.committed_state):  # nothing but its columns was pending
            _mark_stored(session, state)
        else:
            obj = state.obj()
            for key in touched:
                if key in state.dict:
                    set_committed_value(obj, key, state.dict[key])
    return sum(len(p) for p in groups.values())


def _differs(stored: Any, current: Any) -> bool:
    """Whether a column assigned since its row was stored holds another value now: what the
    attribute's history says (``History.from_scalar_attribute``: a stored value not loaded counts
    as changed, an equal one as unchanged), without making a history object per column."""
    return current is not NO_VALUE and (stored is NO_VALUE or current != stored)


def _mark_stored(session: Session, state: RowState[Any]) -> None:
    """Record a row whose every change was just written as stored and unchanged, and take it
    off ``session``'s list of dirty rows: what the flush itself does with each row it wrote
    (SQLAlchemy's ``InstanceState._commit_all``, also what the public
    ``make_transient_to_detached`` calls; no public call does it for a persistent row).
    ``test_a_pass_leaves_the_flush_no_row_it_wrote_itself`` fails if a SQLAlchemy release
    changes what it does."""
    state._commit_all(state.dict, session.identity_map)


def _default(default: Any) -> Any:
    """A column's Python-side default (a scalar, or a callable SQLAlchemy wrapped to take a context)."""
    return default.arg(None) if default.is_callable else default.arg


#: Registry rows a pass took out of their job's collection, by job: still stored until the pass
#: writes (an orphan is deleted at the flush), so an address registered again for the same role
#: and index in the same pass (a restart) takes its row back instead of inserting a second one
#: (the unique (job, role, index) would refuse it before the delete), with no flush in between.
_withdrawn: WeakKeyDictionary[JobRow, dict[tuple[str, int], RegistryRow]] = WeakKeyDictionary()


def register_address(job: JobRow, role: str, index: int, address: str) -> None:
    """Record where an instance listens (the job's registry rows are loaded with the job)."""
    for row in job.addresses:
        if row.role == role and row.index == index:
            row.address, row.registered_at = address, utcnow()
            return
    withdrawn = _withdrawn.get(job, {}).pop((role, index), None)
    taken = withdrawn is not None and (sa_inspect(withdrawn).persistent or sa_inspect(withdrawn).pending)
    entry = withdrawn if taken and withdrawn is not None else RegistryRow(role=role, index=index)  # else: flushed away
    entry.address, entry.registered_at = address, utcnow()
    job.addresses.append(entry)


def unregister_address(job: JobRow, role: str, index: int) -> None:
    """Forget where an instance listened. Only its own rows are removed from the collection:
    reassigning the whole list fires a remove and an append event per row, so stopping a gang
    of n cost n^2 events (a 64-replica job's stop took 0.14 s of the pass here). The delete is
    written with the pass; a re-registration before then reuses the row (:data:`_withdrawn`)."""
    doomed = [r for r in job.addresses if r.role == role and r.index == index]
    for row in doomed:
        job.addresses.remove(row)
        _withdrawn.setdefault(job, {})[(role, index)] = row


def clear_registry(job: JobRow) -> None:
    withdrawn = _withdrawn.setdefault(job, {})
    for row in job.addresses:
        withdrawn[(row.role, row.index)] = row
    job.addresses.clear()


def registry(session: Session, job_id: int) -> dict[str, list[str]]:
    rows = session.scalars(
        select(RegistryRow).where(RegistryRow.job_id == job_id).order_by(RegistryRow.role, RegistryRow.index)
    ).all()
    out: dict[str, list[str]] = {}
    for row in rows:
        out.setdefault(row.role, []).append(row.address)
    return out


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def job_status(
    session: Session, job: JobRow, events: int = 20, instances: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Everything a user asks about a job, as plain data (the CLI table and the REST API use it);
    ``instances`` = (first, count) keeps one page of the instance list (``instanceCount`` says
    how many there are)."""
    first, count = instances or (0, len(job.instances))
    shown = job.instances[first : first + count]
    recent = session.execute(  # plain columns: a status is asked often, its events need no objects
        select(EventRow.time, EventRow.object, EventRow.type, EventRow.reason, EventRow.message)
        .where(EventRow.job_id == job.id)
        .order_by(EventRow.id.desc())
        .limit(events)
    ).all()
    reason, message = shown_reason(job)
    reported = latest_points(session, job.id)
    return {
        "id": job.id,
        "uid": job.uid,
        "name": job.name,
        "state": job.state,
        "reason": reason,
        "message": message,
        "queue": job.queue,
        "priority": job.priority,
        "backend": job.backend,
        "runDir": job.run_dir,
        "outputPath": job.output_path,
        "createdAt": _iso(job.created_at),
        "startedAt": _iso(job.started_at),
        "runningAt": _iso(job.running_at),
        "completedAt": _iso(job.completed_at),
        "lastTransitionAt": _iso(job.last_transition_at),
        "conditions": conditions(job, reason, message),
        "roles": [
            {
                "name": r.name,
                "replicas": r.replicas,
                "state": r.state,
                "reason": r.reason,
                "message": r.message,
                "counts": r.counts,
                "lastTransitionAt": _iso(r.last_transition_at),
            }
            for r in job.roles
        ],
        "instances": [
            {
                "role": i.role,
                "index": i.index,
                "state": i.state,
                "reason": i.reason,
                "message": i.message,
                "attempt": i.attempt,
                "restarts": i.restarts,
                "pid": i.pid,
                "address": i.address,
                "exitCode": i.exit_code,
                "logPath": i.log_path,
                "cpuSeconds": i.cpu_seconds,
                "peakRss": i.peak_rss,
                "startedAt": _iso(i.started_at),
                "endedAt": _iso(i.ended_at),
                "metrics": _point(reported.get((i.role, i.index))),
            }
            for i in shown
        ],
        "instanceCount": len(job.instances),
        "instancesFrom": first,
        "events": [
            {"time": _iso(e.time), "object": e.object, "type": e.type, "reason": e.reason, "message": e.message}
            for e in reversed(recent)
        ],
    }


def status_summaries(session: Session, job_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Job id -> what the operator's status writers (``trainmaster.operator.status``,
    ``.trainjob``) read of a job's status (:func:`job_status`'s keys, only those), in
    three queries of plain columns for every job at once. A pass touches a starting gang's job
    several times a second; loading it as ORM rows (its roles, every instance, its registry)
    for each status check cost the operator more CPU than the reconcile passes themselves.
    Instances come only where they have restarted (the Restarting condition, Volcano's
    ``retryCount``), as the writers need no others."""
    docs: dict[int, dict[str, Any]] = {}
    for row in session.execute(
        select(
            JobRow.id,
            JobRow.name,
            JobRow.state,
            JobRow.reason,
            JobRow.message,
            JobRow.owner,
            JobRow.started_at,
            JobRow.running_at,
            JobRow.completed_at,
        ).where(JobRow.id.in_(job_ids))
    ):
        reason, message = shown_reason_of(row.id, row.state, row.reason, row.message, row.owner)
        docs[row.id] = {
            "id": row.id,
            "name": row.name,
            "state": row.state,
            "reason": reason,
            "message": message,
            "startedAt": _iso(row.started_at),
            "runningAt": _iso(row.running_at),
            "completedAt": _iso(row.completed_at),
            "roles": [],
            "instances": [],
        }
    for role in session.execute(
        select(RoleRow.job_id, RoleRow.name, RoleRow.replicas, RoleRow.state, RoleRow.counts)
        .where(RoleRow.job_id.in_(job_ids))
        .order_by(RoleRow.job_id, RoleRow.position)
    ):
        if role.job_id in docs:
            docs[role.job_id]["roles"].append(
                {"name": role.name, "replicas": role.replicas, "state": role.state, "counts": role.counts or {}}
            )
    for inst in session.execute(
        select(InstanceRow.job_id, InstanceRow.state, InstanceRow.restarts)
        .where(InstanceRow.job_id.in_(job_ids), InstanceRow.restarts > 0)
        .order_by(InstanceRow.id)
    ):
        if inst.job_id in docs:
            docs[inst.job_id]["instances"].append({"state": inst.state, "restarts": inst.restarts})
    return docs


def conditions(job: JobRow, reason: str, message: str) -> list[dict[str, Any]]:
    """Kubeflow-style conditions: one per phase the job has reached (Created, Admitted, Running,
    then Succeeded/Failed/Cancelled), ``status`` "True" while it holds, with reason, message and
    the time it last changed; ``Admitted`` is "False" with the reason while the job waits."""
    state = JobState(job.state)
    ended = state in JOB_TERMINAL

    def condition(type_: str, holds: bool, since: datetime | None, why: str, what: str) -> dict[str, Any]:
        return {"type": type_, "status": str(holds), "reason": why, "message": what, "lastTransitionTime": _iso(since)}

    found = [condition("Created", True, job.created_at, "Submitted", f"job {job.name} queued in '{job.queue}'")]
    if job.admitted:
        found.append(condition("Admitted", True, job.started_at, "Admitted", "its gang fits; instances start"))
    elif not ended:
        found.append(condition("Admitted", False, job.last_transition_at, reason, message))
    if job.running_at is not None:
        if state == JobState.RUNNING:
            found.append(condition("Running", True, job.last_transition_at, reason, message))
        elif ended:
            found.append(condition("Running", False, job.completed_at, "JobEnded", f"the job {state.value}"))
        else:  # running before, not now (an instance restarting)
            found.append(condition("Running", False, job.last_transition_at, reason, message))
    if ended:
        found.append(condition(state.value.capitalize(), True, job.completed_at, reason, message))
    return found


def is_terminal(state: str) -> bool:
    return JobState(state) in JOB_TERMINAL


def latest_metrics_of_live_jobs(session: Session) -> dict[tuple[str, str, int, str], float]:
    """(job name, role, index, metric) -> the newest value reported by instances of jobs not yet ended."""
    from sqlalchemy import func

    live = select(JobRow.id).where(JobRow.state.not_in([s.value for s in JOB_TERMINAL]))
    newest = (
        select(func.max(MetricRow.id))
        .where(MetricRow.job_id.in_(live))
        .group_by(MetricRow.job_id, MetricRow.role, MetricRow.index)
    )
    rows = session.execute(
        select(JobRow.name, MetricRow).join(JobRow, JobRow.id == MetricRow.job_id).where(MetricRow.id.in_(newest))
    ).all()
    return {(name, m.role, m.index, metric): value for name, m in rows for metric, value in m.values.items()}


def latest_points(session: Session, job_id: int) -> dict[tuple[str, int], Any]:
    """(role, index) -> the newest point each instance of the job reported."""
    from sqlalchemy import func

    newest = select(func.max(MetricRow.id)).where(MetricRow.job_id == job_id).group_by(MetricRow.role, MetricRow.index)
    rows = session.scalars(select(MetricRow).where(MetricRow.id.in_(newest))).all()
    return {(r.role, r.index): r for r in rows}


def _point(row: Any) -> dict[str, Any] | None:
    if row is None:
        return None
    return {"step": row.step, "epoch": row.epoch, "total": row.total, "values": row.values, "time": _iso(row.time)}


def request_cancel(session: Session, job: JobRow) -> bool:
    """Record a cancellation intent (the owning controller stops the instances); False if the
    job has already ended."""
    if is_terminal(job.state):
        return False
    job.cancel_requested = True
    add_event(session, job.id, "job", "CancelRequested", "cancellation requested")
    return True


def set_replicas(
    session: Session, job: JobRow, role: str, replicas: int, validate: Callable[[dict[str, Any], str], Job]
) -> None:
    """Change a role's desired replicas. The changed job is checked by ``validate`` like a
    submitted one (the load chain's :func:`trainmaster.loading.validate_document`: a framework's
    single-instance roles, ``minAvailable``...), so scaling cannot make it invalid."""
    if is_terminal(job.state):
        raise UserError(f"job {job.name} (id {job.id}) has ended ({job.state}); only an active job scales")
    doc = copy.deepcopy(job.spec)
    roles = {r["name"]: r for r in doc["spec"]["roles"]}
    if role not in roles:
        raise UserError(f"job {job.name} (id {job.id}) has no role '{role}' (its roles: {', '.join(roles)})")
    roles[role]["replicas"] = replicas
    job.spec = validate(doc, f"job {job.name} with {role} at {replicas} replicas").dump()
    next(r for r in job.roles if r.name == role).replicas = replicas
    add_event(session, job.id, f"role/{role}", "Scaled", f"desired replicas set to {replicas}")


def set_suspended(session: Session, job: JobRow, suspend: bool) -> bool:
    """Set the job's ``runPolicy.suspend`` (its controller holds or starts it at the next pass);
    False when it already had that value. The spec stays the stored source of truth, so no
    schema change: the controller reads the flag from it as it reads a scaled role's replicas."""
    if is_terminal(job.state):
        raise UserError(
            f"job {job.name} (id {job.id}) has ended ({job.state}); only an active job is "
            f"{'suspended' if suspend else 'resumed'}"
        )
    current = bool(((job.spec.get("spec") or {}).get("runPolicy") or {}).get("suspend", False))
    if current == suspend:
        return False
    doc = copy.deepcopy(job.spec)
    doc["spec"].setdefault("runPolicy", {})["suspend"] = suspend
    job.spec = doc
    add_event(
        session,
        job.id,
        "job",
        "SuspendRequested" if suspend else "ResumeRequested",
        "runPolicy.suspend set" if suspend else "runPolicy.suspend cleared",
    )
    return True


def is_suspended(job: JobRow) -> bool:
    return bool(((job.spec.get("spec") or {}).get("runPolicy") or {}).get("suspend", False))


class NameTaken(JobConflict):
    """A job of that name is still active, and the submitter wants names unique (HTTP 409)."""


def claim_job_names(session: Session, names: list[str]) -> dict[str, int]:
    """:func:`claim_job_name` for a batch inserted in one transaction: the lock is taken once
    (SQLite) or per name in sorted order (PostgreSQL: two batches never wait on each other in a
    cycle), and the active jobs holding any of ``names`` are read in one query: name -> id."""
    import zlib

    from sqlalchemy import text

    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        session.connection().exec_driver_sql("BEGIN IMMEDIATE")
    elif dialect == "postgresql":
        for name in sorted(set(names)):
            session.execute(
                text("SELECT pg_advisory_xact_lock(:space, :key)"),
                {"space": 0x746D, "key": zlib.crc32(name.encode()) - 2**31},
            )
    return dict(
        session.execute(
            select(JobRow.name, JobRow.id).where(
                JobRow.name.in_(sorted(set(names))), JobRow.state.not_in([s.value for s in JOB_TERMINAL])
            )
        ).all()
    )


def name_taken(name: str, live: int) -> NameTaken:
    return NameTaken(
        f"a job named {name} is still active (id {live}); names are unique among active "
        "jobs: choose another name, or cancel that job first"
    )


def claim_job_name(session: Session, name: str) -> None:
    """Make ``name`` this transaction's to insert, or raise :class:`NameTaken` while an active
    job has it. Called first in the transaction that inserts the job, so the check and the insert
    are one step for every server on the store: SQLite takes its write lock before the check
    (``BEGIN IMMEDIATE``: other writers wait), PostgreSQL a transaction-scoped advisory lock on
    the name (other submissions of that name wait; the rest of the store does not)."""
    import zlib

    from sqlalchemy import text

    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        session.connection().exec_driver_sql("BEGIN IMMEDIATE")
    elif dialect == "postgresql":
        session.execute(
            text("SELECT pg_advisory_xact_lock(:space, :key)"),
            {"space": 0x746D, "key": zlib.crc32(name.encode()) - 2**31},
        )
    live = session.scalars(
        select(JobRow.id).where(JobRow.name == name, JobRow.state.not_in([s.value for s in JOB_TERMINAL])).limit(1)
    ).first()
    if live is not None:
        raise NameTaken(
            f"a job named {name} is still active (id {live}); names are unique among active "
            "jobs: choose another name, or cancel that job first"
        )
