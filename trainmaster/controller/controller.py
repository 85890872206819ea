"""The controller: queue, gang admission, instances per role, restarts, reconcile, status roll-up.

One reconcile pass (:meth:`Controller.step`) walks every active job in queue order and moves
it towards its spec: observe instances, apply restart policies, create missing and delete
surplus instances, start pending ones, roll states up, finish ended jobs. All state lives in
the store, so a controller started over an existing store simply carries on.
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import struct
import shutil
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import Table, Text, bindparam, insert, select, type_coerce, update
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.backends.base import (
    Backend,
    LaunchRequest,
    Observation,
    Placement,
    Resources,
    StartFailure,
)
from trainmaster.controller import metrics, queues, restart, scaling
from trainmaster.controller.quota import Holder, QuotaBook, job_demand
from trainmaster.controller.quota_status import queue_quotas
from trainmaster.controller.backoff import StoreBackoff
from trainmaster.controller.admission import Admission, admit, admit_gang, gang_of
from trainmaster.controller.launching import RoleLaunch, dependency_order, instance_id, launch_spec, role_launch
from trainmaster.errors import BackendError, JobConflict, UserError
from trainmaster.loading import validate_document
from trainmaster.controller.channel import Claims, InstanceChannel, channel_for
from trainmaster.controller.launching import ChannelGrant
from trainmaster.runtime.environment import host_environment
from trainmaster.spec.load import LoadedJob
from trainmaster.spec.model import Job, RestartScope, Role
from trainmaster.spec.paths import in_job_folder
from trainmaster.contract import InstanceHandle, InstancePhase
from trainmaster.spec.states import (
    INSTANCE_TERMINAL,
    JOB_TERMINAL,
    InstanceState,
    JobState,
    check_transition,
    observed_state,
)
from trainmaster.spec.status import RoleSummary, Verdict, job_state, role_state
from trainmaster.store import repository as repo
from trainmaster.store.db import home
from trainmaster.store.models import EventRow, InstanceRow, JobRow, RoleRow, utcnow
from trainmaster.store.ownership import why_not_resumable

log = logging.getLogger(__name__)
I = InstanceState
ROWS_AHEAD = 64  # a waiting job's row is loaded with those of the next waiting jobs (one query)
BACKEND_TRIES = 3  # passes in a row a backend may fail before `run_job` gives up (each pass is idempotent)
LIVE = (I.STARTING.value, I.RUNNING.value, I.UNKNOWN.value, I.TERMINATING.value)
FULL_PASS_EVERY = 30.0  # seconds between passes that look at every job, changed or not
COLLECT_AFTER_ROWS = 20_000  # rows loaded by passes between two garbage collections (:meth:`step`)
EARLY_HINT = 8  # a start of this many instances or more has its log files hinted to the backend as soon as it is due
RUNNING = I.RUNNING.value  # an instance's and a job's stored state alike
PENDING = JobState.PENDING.value
INSTANCE_STATES = [s.value for s in I]  # every state a role's counts name, in order


# The tables written with plain Core statements (a submit batch, a pass's events): an ORM-enabled
# INSERT of a list of dicts still runs the ORM's bulk machinery per row, most of a submit's cost
JOBS: Table = JobRow.__table__  # type: ignore[assignment]
ROLES: Table = RoleRow.__table__  # type: ignore[assignment]
EVENTS: Table = EventRow.__table__  # type: ignore[assignment]
SET_FOLDERS = (
    update(JOBS)
    .where(JOBS.c.id == bindparam("job_id"))
    .values(run_dir=bindparam("run_dir"), output_path=bindparam("output_path"))
)


class NotResumable(JobConflict):
    """A job that cannot be taken over now; the message says why (HTTP 409)."""


class JobInterrupted(UserError):
    """:meth:`Controller.run_job` gave up on a job because its backend kept failing; the job
    records why and stays as it was (its instances may still run), for a resume to carry on."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=1)


class Controller:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        backend: Backend,
        db_url: str,
        *,
        interval: float = 1.0,
        grace: float = 5.0,
        runs_dir: Path | None = None,
        max_jobs: int = 1_000_000,
        owner: str = "service",
        queue_weights: dict[str, float] | None = None,
        unreachable_grace: float = 60.0,
        fence: Callable[[Session], None] | None = None,
        channel: InstanceChannel | None = None,
        reconciles: bool = True,
    ):
        self.sessions = sessions
        # False: this object only reads the store and records intents while the passes run in
        # another process (the API process of `trainmaster server`): it keeps nothing per job
        self.reconciles = reconciles
        self.backend = backend
        self.db_url = db_url
        self.interval = interval
        self.grace = grace
        self.runs_dir = runs_dir or home() / "runs"
        if reconciles:  # the passes make the job folders in it
            spread_job_folders(self.runs_dir)
        self.max_jobs = max_jobs  # jobs admitted at once; the rest wait in their queue
        self.owner = owner  # the jobs this controller reconciles; others sharing the store are left alone
        self.queue_weights = queue_weights or {}  # queue -> share of admissions (unlisted: 1)
        self.unreachable_grace = unreachable_grace  # seconds an instance may be unknown before it is lost
        self._unreachable_since: dict[int, float] = {}  # instance id -> monotonic time it went silent
        self._lock = threading.RLock()  # one reconcile pass at a time (the server has threads)
        self._specs: dict[int, tuple[dict[str, Any] | str, Job]] = {}  # job id -> (stored spec, validated)
        self._spec_texts: dict[int, str] = {}  # this pass's waiting jobs -> their stored spec text
        # with several servers on one store: makes every reconcile commit re-assert the lease
        # (trainmaster.controller.leader), so a deposed leader writes nothing
        self.fence = fence
        self._observed: dict[int, Observation] = {}  # instance row id -> this pass's observation
        self._ended: list[InstanceHandle] = []  # handles whose exits this pass stored (agent may forget)
        self._to_start: list[_Start] = []  # attempts this pass prepared (started together at its end)
        self._unhinted: list[str] = []  # log files of this pass's starts not yet hinted to the backend
        self._events: list[dict[str, Any]] = []  # this pass's events, written with it (_write_events)
        self._work = threading.Event()  # set by submit, cancel, scale: the next pass need not wait
        # ended jobs with runPolicy.ttlSecondsAfterFinished: job id -> epoch seconds it is deleted
        # (None until the first pass reads them from the store). Only the service's controller
        # deletes them: a `trainmaster run` command reads its job's final status after the end.
        self._expiry: dict[int, float] | None = None if owner == "service" else {}
        self._rescan_at = 0.0
        # the instance channel, once an instance starts (given: one its caller keeps across stores)
        self._channel: InstanceChannel | None = channel
        self._book: QuotaBook | None = None  # this pass's queue quotas and usage (None: no queue has quota)
        self._admitted_rows: dict[int, JobRow] = {}  # admitted jobs whose rows this pass loaded (victims)
        self._preemptible: set[int] = set()  # this controller's admitted jobs (the only ones it may evict)
        self._rows: dict[int, JobRow] = {}  # the rows this pass loaded
        self._evicted: list[tuple[JobRow, list[InstanceRow], str]] = []  # stopped after the pass's commit
        self._created: list[InstanceRow] = []  # new instance rows of this pass, stored together before its commit
        self._seen: int | None = None  # the newest event id the last pass saw (None: none yet)
        self._seen_before = 0  # the one the pass before saw
        self._full_pass_at = 0.0  # monotonic time of the next pass that looks at every job
        self._changed: set[int] | None = None  # this pass: jobs with an event since the last (None: all)
        self._announced: set[int] | None = None  # the same, known on a full pass too (None: not known)
        self._handles: dict[int, tuple[Any, Any]] = {}  # instance id -> (stored handle, decoded handle)
        self._last_job_reason: dict[int, str] = {}  # job id -> reason of its newest "job" event
        self._steady: dict[int, bool] = {}  # job id -> its cached spec has neither suspend nor a deadline
        self._open: dict[int, list[repo.LiveInstance]] = {}  # admitted job -> its open instances, as last read
        self._touched: set[int] = set()  # jobs the last pass loaded (their instances are read again)
        self._loaded = 0  # rows the passes loaded since the last garbage collection
        self._demands: dict[int, tuple[Job, dict[str, float]]] = {}  # job id -> (its spec, quota demand)
        self._gangs: dict[int, tuple[Job, tuple[Resources, int]]] = {}  # job id -> (its spec, gang demand and size)
        self._admissions: dict[tuple[Any, ...], Admission] = {}  # this pass's answers (_admit)
        self._live_sum: Resources | None = None  # what live instances held at the last read (_free_capacity)
        self._verdicts: dict[tuple[Any, ...], Verdict | None] = {}  # this pass's quota answers (_quota_verdict)
        self._capacity = Resources(0.0, 0)  # the backend's capacity as this pass found it (_free_capacity)
        self._environ: dict[str, str] | None = None  # what instances take of this process' environment, this pass
        # waiting job -> the context (:meth:`_waiting_context`) under which a pass last found it
        # staying as it is: under the same context it stays so again, and is not looked at
        self._settled: dict[int, tuple[float, ...]] = {}
        self._waiting: repo.WaitingQueue | None = None  # the waiting jobs as the last pass left them

    @property
    def touched(self) -> frozenset[int]:
        """The jobs the last pass loaded: the only ones whose rows (state, roles, instances) it
        may have changed. A caller mirroring job states elsewhere (the operator's status
        subresources) need look at no other job after a pass."""
        return frozenset(self._touched)

    def wake(self) -> None:
        """Ask for the next reconcile pass now (a server waits up to ``interval`` otherwise)."""
        self._work.set()

    def wait_for_work(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`wake`; True when woken."""
        woken = self._work.wait(timeout)
        self._work.clear()
        return woken

    # ---- queue -------------------------------------------------------------------------------
    def submit(self, loaded: LoadedJob, unique_name: bool = False, uid: str | None = None) -> int:
        """Store a validated job in the queue; returns its id. With ``unique_name``,
        :class:`~trainmaster.store.repository.NameTaken` while an active job has its name (checked
        in the inserting transaction, so it holds across servers sharing the store). ``uid``:
        the job's uid when the caller has one already (the operator: its resource's)."""
        result = self.submit_batch([loaded], unique_name, uids=[uid])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def submit_batch(
        self, batch: list[LoadedJob], unique_name: bool = False, uids: list[str | None] | None = None
    ) -> list[int | repo.NameTaken]:
        """Store several validated jobs in one transaction (a server's concurrent submits: one
        write lock and one commit for all, not one each); per job its id, or the
        :class:`~trainmaster.store.repository.NameTaken` that refused it alone (with
        ``unique_name``: an active job, or an earlier one of the batch, has its name). ``uids``: the
        jobs' uids where the caller has them (else new ones)."""
        results: list[int | repo.NameTaken] = []
        with self.sessions() as session:
            live = repo.claim_job_names(session, [b.job.name for b in batch]) if unique_name else {}
            accepted: list[tuple[LoadedJob, dict[str, Any]]] = []  # with the spec as the store keeps it
            for loaded, uid in zip(batch, uids or [None] * len(batch), strict=True):
                job = loaded.job
                if job.name in live:
                    results.append(repo.name_taken(job.name, live[job.name]))
                    continue
                accepted.append((loaded, {"uid": uid or uuid.uuid4().hex, "spec": job.dump()}))
                if unique_name:
                    live[job.name] = 0  # a second of the batch with this name is refused
                results.append(0)  # its id once inserted
            # plain INSERTs (one per table for the whole batch), not ORM objects: a server under
            # hundreds of submits a second spent most of a submit in the unit of work's flushes
            ids: list[int] = []
            rows = [
                {
                    **columns,
                    "name": loaded.job.name,
                    "queue": loaded.job.spec.scheduling.queue,
                    "priority": loaded.job.spec.scheduling.priority,
                    "backend": self.backend.name,
                    "owner": self.owner,
                }
                for loaded, columns in accepted
            ]
            if len(rows) == 1:  # one job (a CLI's, a quiet server's): its id comes back with the INSERT
                ids = [session.execute(insert(JOBS).returning(JOBS.c.id), rows[0]).scalar_one()]
            elif rows:
                session.execute(insert(JOBS), rows)
                # their ids by their uids (unique): one query, where an INSERT .. RETURNING in
                # submit order is one statement per job on SQLite
                by_uid = dict(
                    session.execute(
                        select(JOBS.c.uid, JOBS.c.id).where(JOBS.c.uid.in_([c["uid"] for _, c in accepted]))
                    ).all()
                )
                ids = [by_uid[columns["uid"]] for _, columns in accepted]
            folders, roles, events = [], [], []
            now = utcnow()
            runs_dir = self.runs_dir.resolve()  # once, not a path walk per job (a name has no '/')
            for job_id, (loaded, _) in zip(ids, accepted, strict=True):
                job = loaded.job
                run_dir = str(runs_dir / f"{job_id}-{job.name}")
                output = in_job_folder(run_dir, job.spec.output.path) if job.spec.output else None
                folders.append({"job_id": job_id, "run_dir": run_dir, "output_path": output})
                roles += [
                    {"job_id": job_id, "name": role.name, "position": position, "replicas": role.replicas}
                    for position, role in enumerate(job.spec.roles)
                ]
                events.append(
                    _event_row(job_id, "Submitted", f"job {job.name} queued in '{job.spec.scheduling.queue}'", now)
                )
                events += [_event_row(job_id, "FieldIgnored", path, now, "Warning") for path in loaded.ignored]
            if folders:
                session.execute(SET_FOLDERS, folders)  # one statement for the batch
                session.execute(insert(ROLES), roles)
                session.execute(insert(EVENTS), events)
            session.commit()
        # validated already: this controller's pass that reads this text (JSON as the store keeps
        # it) finds it cached and does not validate it again; any other text is validated as
        # usual. Not where no pass runs: a job leaves the cache when a pass ends it, so a
        # controller that only records intents kept every submitted job's spec for good (the API
        # process of the Kueue replay: 15,000 specs, ~460,000 objects that each full garbage
        # collection walked, up to 360 ms with every request waiting)
        if self.reconciles:
            for job_id, (loaded, columns) in zip(ids, accepted, strict=True):
                self._cache_spec(job_id, json.dumps(columns["spec"]), loaded.job)
        found = iter(ids)
        results = [r if isinstance(r, Exception) else next(found) for r in results]
        if ids:
            self.wake()
        return results

    def cancel(self, job_id: int) -> None:
        """Record the cancellation; the next pass stops the job's instances."""
        with self.sessions() as session:
            if repo.request_cancel(session, repo.load_job(session, job_id)):
                session.commit()
        self.wake()

    def scale(self, job_id: int, role_name: str, replicas: int) -> None:
        """Change a role's desired replicas; the next pass acts on it."""
        with self.sessions() as session:
            repo.set_replicas(session, repo.load_job(session, job_id), role_name, replicas, validate_document)
            session.commit()
        self.wake()

    def take_over(self, job_id: int) -> None:
        """Make a job whose ``trainmaster run`` died this controller's, then carry it on as after a
        restart: live instances re-adopted, ended ones handled by their restart policy.

        Refused (:class:`NotResumable`) while its run still lives, once it has ended, or when it
        ran on another backend than this controller's (its instances would be out of reach)."""
        with self._lock, self.sessions() as session:
            row = repo.load_job(session, job_id)
            what = f"job {row.name} (id {row.id}, {row.state})"
            refusal = why_not_resumable(repo.is_terminal(row.state), row.owner, what)
            if refusal is None and row.backend != self.backend.name:
                refusal = (
                    f"{what} runs on the {row.backend} backend and this controller on {self.backend.name}; "
                    f"resume it with `trainmaster job resume {row.id}` on that backend"
                )
            if refusal:
                raise NotResumable(refusal)
            if not repo.take_over(session, row.id, row.owner, self.owner):
                raise NotResumable(f"{what} was just taken over by someone else")
            repo.add_event(session, row.id, "job", "Resumed", "taken over by the controller service")
            session.commit()
        self.recover(job_ids=[job_id])
        self.wake()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> None:
        """One reconcile pass over every active job: admitted ones, then waiting ones in fair
        queue order (:mod:`trainmaster.controller.queues`).

        A pass costs what changed, not what exists: every active job is first read as plain
        columns (three queries whatever their number), every live instance observed in one
        backend call, and only the jobs that changed are loaded as rows and reconciled: an
        admitted job with an instance whose observation differs from its stored state, one in
        a state the pass moves on, or one with an event since the last pass (a cancel, a scale,
        a suspend, from this process or another sharing the store: :meth:`_changed_jobs`).

        The cycle collector is off during the pass: what a pass makes and drops again (a plain
        record per active job, 10,000 of them over a long queue) would otherwise survive a
        collection in the middle of it into the oldest generation, and every few passes that
        growth set off a full collection of the whole heap (a quarter second at 10,000 queued
        jobs). Freed by reference counting when the pass ends, they never get there; the rows'
        own cycles are collected below, or by the collector's next young collection."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._pass()
        except BaseException:
            # what this controller keeps of the store across passes (the events seen, the jobs
            # they changed, the waiting queue) may be ahead of a pass that was rolled back: the
            # next one reads all
            self._seen, self._waiting = None, None
            raise
        finally:
            if collecting:
                gc.enable()
        if self._loaded >= COLLECT_AFTER_ROWS:
            # The rows a pass loads (a job, its roles, instances, registry) refer to each other:
            # only the cycle collector frees them. Left to run on its own it scans every live
            # object, a pause of a quarter second at 10,000 instances, that lands in whichever
            # pass or API request comes next; here it runs once enough rows were let go, at the
            # end of the pass that made them garbage.
            self._loaded = 0
            gc.collect()

    def _pass(self) -> None:
        with self._lock, self.sessions() as session, metrics.RECONCILE.time():
            if self.fence:
                self.fence(session)
            self._to_start, self._observed, self._events = [], {}, []  # nothing carried over from a failed pass
            self._unhinted = []
            self._evicted, self._created = [], []
            self._environ = None  # read again each pass
            changed = self._changed_jobs(session)
            free = self._free_capacity(session, changed)
            # instances of admitted jobs as the last pass left them, less the jobs it reconciled
            # and those with an event since: their rows may have changed
            known = None if changed is None else self._open
            for job_id in self._touched | (changed or set()):
                self._open.pop(job_id, None)
            active = repo.load_active_jobs(
                session,
                self.owner,
                lambda i: changed is None or i in changed or i not in self._specs,
                self._handles,
                known,
                # the waiting jobs as the passes kept them: only those with an event read again
                None if changed is None else self._waiting,
                changed,
                self._specs,
            )
            self._waiting, self._spec_texts = active.waiting, active.spec_texts
            admitted_jobs = active.admitted
            if known is None:
                self._open = {j.id: j.instances for j in admitted_jobs}
            self._changed = changed
            admitted = len(admitted_jobs)
            self._observe_all(admitted_jobs)
            announced = self._announced
            quiet = set() if announced is None else {j.id for j in admitted_jobs if self._quiet(j, announced)}
            busy = [j.id for j in admitted_jobs if j.id not in quiet]
            # no flush before each query of the pass (a job's lazy loads, its last event): the
            # pass writes once, at its commit, instead of once per job
            if len(active.waiting.queues) <= 1:  # fair_order's answer, without a walk over a long queue
                order: list[repo.AdmittedJob | repo.WaitingJob] = [j for j in admitted_jobs if j.id not in quiet]
                order += active.waiting.ordered()
            else:
                order = queues.fair_order(
                    [j for j in active.jobs if j.id not in quiet],
                    self.queue_weights,
                    Counter(j.queue for j in admitted_jobs if j.id in quiet),
                )
            self._preemptible = {j.id for j in admitted_jobs}
            self._book = self._quota_book(session)
            self._verdicts, self._admissions = {}, {}
            if self._book is not None:
                order = self._book.order(order, self._facts)
            with session.no_autoflush:
                rows = self._rows = {j.id: j for j in repo.load_jobs(session, busy)}
                self._admitted_rows = {j.id: j for j in rows.values() if j.admitted}
                self._touched = set()  # every job whose row this pass loads (it may write it)
                settled = self._settled_waiting(changed)
                context = self._waiting_context(free, admitted)
                # the waiting jobs not yet come to, and of those the settled ones by context
                left = len(self._waiting.jobs) if self._waiting is not None else 0
                tail = Counter(settled.values()) if settled else Counter()
                for position, entry in enumerate(order):
                    if isinstance(entry, repo.WaitingJob):
                        if settled is not None:
                            if left == tail[context]:
                                # every waiting job from here on (the rest of the order: admitted
                                # jobs come first) stays as it is, and so the context: done
                                break
                            left -= 1
                            before = settled.get(entry.id)
                            if before is not None:
                                tail[before] -= 1
                                if before == context:
                                    continue  # left as it is under the same context before
                        if self._stays_as_it_is(entry, free, admitted):
                            if settled is not None:
                                settled[entry.id] = context
                            continue  # most of a long queue, pass after pass: no row loaded
                        if settled is not None:
                            settled.pop(entry.id, None)
                        if entry.id not in rows:  # with the next ones: those a pass changes come in runs
                            ahead = [
                                j.id
                                for j in order[position : position + ROWS_AHEAD]
                                if isinstance(j, repo.WaitingJob) and j.id not in rows
                            ]
                            rows.update(repo.load_waiting_jobs(session, ahead))
                    elif entry.id not in rows:
                        continue  # deleted since the pass read the queue
                    job = rows.get(entry.id)
                    if job is None:
                        if self._waiting is not None:
                            self._waiting.drop({entry.id})
                        continue  # deleted since the pass read the queue
                    self._touched.add(job.id)
                    if not job.admitted and not job.cancel_requested and admitted >= self.max_jobs:
                        self._set_job_state(session, job, _queued(admitted))
                    else:
                        was_admitted = job.admitted
                        free = self._reconcile(session, job, free)
                        admitted += int(job.admitted and not was_admitted)
                    context = self._waiting_context(free, admitted)
            # the whole pass in one transaction: every job's progress and every start intent
            # (state starting, attempt + 1) is committed here, before anything is spawned; what
            # a crash before it loses (observed exits) the agents still hold until `forget`.
            # Meanwhile the backend may make ready what the starts will need (the local agent
            # creates their log files on the core this pass leaves idle): small starts are hinted
            # here, together, a gang's as soon as it was due (:meth:`_start_pending`)
            if self._unhinted:
                self.backend.prepare_start(self._unhinted)
                self._unhinted = []
            created, self._created = self._created, []
            repo.write_changed_columns(session)  # the rows' changes: one UPDATE per table and columns
            repo.insert_instances(session, created)  # every new instance of the pass: one INSERT
            self._write_events(session)
            session.commit()
            self._spec_texts = {}
            self._note_waiting(rows)
            self._stop_evicted(session)  # committed as evicted first: a crash now leaves no doubt
            self._start_all(session)
            repo.write_changed_columns(session)
            self._write_events(session)
            session.commit()
            if self.owner == "service":
                self._delete_expired(session)
            ended, self._ended = self._ended, []
            self.backend.forget(ended)  # stored: the agent's journal may drop them
            self._loaded += len(session.identity_map)
            self._rows, self._admitted_rows = {}, {}  # the pass's rows: garbage once it ends

    def _changed_jobs(self, session: Session) -> set[int] | None:
        """Jobs with an event since the last pass (the store's resource versions: event ids are
        never reused), or None when every job's rows are read afresh: the first pass, and one
        pass every :data:`FULL_PASS_EVERY` seconds (a state or an instance no event announced).
        On PostgreSQL, ids are taken before their transactions commit, so a late commit can
        land below the newest id seen: the window reaches one pass further back there."""
        newest = repo.newest_event_id(session)
        if self._seen is None:  # nothing known of the store's events: job reasons read when needed
            self._seen, self._seen_before = newest, newest
            self._full_pass_at = time.monotonic() + FULL_PASS_EVERY
            self._last_job_reason.clear()
            self._announced = None
            return None
        since = self._seen if session.get_bind().dialect.name == "sqlite" else self._seen_before
        # the newest "job" event of each job in the range (this controller's own included) keeps
        # the reasons in memory exact without a query per job (:meth:`_set_job_state`)
        changed, reasons = repo.changed_jobs(session, since, newest)
        self._last_job_reason.update(reasons)
        self._announced = changed  # a full pass too reconciles them (a suspend: its spec changed)
        if time.monotonic() >= self._full_pass_at:
            self._seen, self._seen_before = newest, newest
            self._full_pass_at = time.monotonic() + FULL_PASS_EVERY
            return None
        self._seen_before, self._seen = self._seen, newest
        return changed

    def _quiet(self, job: repo.AdmittedJob, announced: set[int]) -> bool:
        """Whether a pass would leave an admitted job as it is: running, no event since the last
        pass (``announced``: the jobs with one), its validated spec cached with neither suspend
        nor deadline (:attr:`_steady`), and every instance that has not ended running and
        observed running where it was placed. A full pass too leaves such a job alone: a spec
        it has cached stands, as the spec changes only with an event; the first pass (or one
        after a take-over), which knows no events, leaves none."""
        if job.id in announced or job.cancel_requested or job.state != RUNNING:
            return False
        if not job.instances or not self._steady.get(job.id, False):
            return False
        observed = self._observed
        for inst in job.instances:
            obs = observed.get(inst.id)
            if obs is None or inst.state != RUNNING or obs.phase is not InstancePhase.RUNNING or obs.host:
                return False
            if obs.ports is not None:
                return False
        return True

    def _event(self, job_id: int, obj: str, reason: str, message: str, type_: str = "Normal") -> None:
        """Record an event of this pass. A job's way through the queue takes about ten (Kubernetes
        style: admitted, started, running, succeeded, per job, role and instance), so they are
        written together, one multi-row INSERT per pass (:meth:`_write_events`), in order, in
        the pass's transaction, instead of one ORM object each."""
        self._events.append(
            {"job_id": job_id, "object": obj, "reason": reason, "message": message, "type": type_, "time": utcnow()}
        )
        if obj == "job":
            self._last_job_reason[job_id] = reason

    def _write_events(self, session: Session) -> None:
        if self._events:
            session.execute(insert(EVENTS), self._events)
            self._events = []

    def _note_waiting(self, rows: dict[int, JobRow]) -> None:
        """Tell the waiting queue what the pass wrote to its jobs' columns (committed): a new
        message without an event (free capacity) is read again by no query."""
        waiting = self._waiting
        if waiting is None:
            return
        gone = set()
        for job_id, row in rows.items():
            if job_id in waiting.jobs:
                if row.admitted or repo.is_terminal(row.state):
                    gone.add(job_id)
                else:
                    waiting.note(job_id, row.state, row.reason, row.message)
        waiting.drop(gone)

    def _settled_waiting(self, changed: set[int] | None) -> dict[int, tuple[float, ...]] | None:
        """The waiting jobs this pass may leave alone without a look, by the context they were
        left in (None: none; every waiting job is looked at). A waiting job's outcome in a pass
        depends only on its spec and stored state (changed only with an event, or by a pass
        that looked at it) and on the pass's context (:meth:`_waiting_context`), so a long queue
        behind full capacity costs a dictionary lookup per job, not an admission check. Without
        quotas only: a quota verdict depends on every holder's usage. A full pass (``changed``
        None) looks at every job again."""
        if changed is None or self._book is not None:
            self._settled.clear()
            return None if self._book is not None else self._settled
        for job_id in changed:
            self._settled.pop(job_id, None)
        waiting = self._waiting.jobs if self._waiting is not None else {}
        for job_id in self._settled.keys() - waiting.keys():  # no longer waiting
            del self._settled[job_id]
        return self._settled

    def _waiting_context(self, free: Resources, admitted: int) -> tuple[float, ...]:
        """What a waiting job's outcome in a pass depends on besides the job itself
        (:meth:`_stays_as_it_is`): the free and total capacity, and the admitted count once it
        reached ``max_jobs`` (the ``Queued`` message names it)."""
        capacity = self._capacity
        queued = admitted if admitted >= self.max_jobs else -1
        return (free.cpu, free.memory, free.gpu, capacity.cpu, capacity.memory, capacity.gpu, queued)

    def _stays_as_it_is(self, job: repo.WaitingJob, free: Resources, admitted: int) -> bool:
        """Whether this pass would leave a waiting job exactly as it is (same state, reason and
        message: still waiting for the same thing). Decided from its plain columns by the same
        rules, in the same order, as :meth:`_reconcile` and the ``max_jobs`` check, so skipping
        it changes nothing; anything else (admitted, cancelled, unschedulable, a new reason or
        message) goes the full way with its row."""
        if job.cancel_requested:
            return False
        if admitted >= self.max_jobs:
            verdict = _queued(admitted)
        else:
            text = self._spec_texts.get(job.id)
            if text:
                spec = self._spec_of(job.id, text)
            elif job.id in self._specs:
                spec = self._specs[job.id][1]
            else:
                return False
            quota = self._quota_verdict(job.id, job.queue, spec)
            if spec.spec.run_policy.suspend:
                verdict = SUSPENDED
            elif quota is PREEMPTS:
                return False
            elif quota is not None:
                verdict = quota
            else:
                decision = self._admit(job.id, spec, free)
                if decision.admitted or decision.unschedulable:
                    return False
                # compared as plain strings: this runs for every waiting job of every pass
                return job.state == PENDING and job.reason == "Pending" and job.message == decision.message
        return (job.state, job.reason, job.message) == (verdict.state.value, verdict.reason, verdict.message)

    # ---- quota (trainmaster.controller.quota) -------------------------------------------------------
    def _quota_book(self, session: Session) -> QuotaBook | None:
        """The queues with quota and what the admitted jobs of the store hold in them (all
        owners': a `trainmaster run` job holds quota too, though only this controller's own jobs
        (:attr:`_preemptible`) may be preempted by it); None when no queue has quota (admission
        by capacity alone)."""
        quotas = queue_quotas(session)
        if not quotas:
            return None
        holding = (
            JobRow.admitted.is_(True),
            JobRow.state.not_in([s.value for s in JOB_TERMINAL]),
            JobRow.queue.in_(list(quotas)),
        )
        rows = session.execute(select(JobRow.id, JobRow.name, JobRow.queue, JobRow.priority).where(*holding)).all()
        # a holder's spec is read only when this controller has none cached, or an event since
        # the last pass may have changed it (a scale): not every admitted job's text every pass
        changed, cached = self._changed, self._specs
        unread = [r[0] for r in rows if changed is None or r[0] in changed or r[0] not in cached]
        texts: dict[int, str] = {}
        for chunk in range(0, len(unread), 500):
            texts.update(
                session.execute(
                    select(JobRow.id, type_coerce(JobRow.spec, Text)).where(JobRow.id.in_(unread[chunk : chunk + 500]))
                ).all()
            )
        holders = {}
        for job_id, name, queue, priority in rows:
            text = texts.get(job_id)
            if text is not None:
                spec = self._spec_of(job_id, text)  # cached by its text: parsed once per change
            elif job_id in cached:
                spec = cached[job_id][1]
            else:
                continue  # ended and deleted between the two reads
            holders[job_id] = Holder(
                job_id, name, queue, priority, self._demand(job_id, spec), preemptible=job_id in self._preemptible
            )
        return QuotaBook(quotas, holders)

    def _facts(self, job: JobRow | repo.AdmittedJob | repo.WaitingJob) -> tuple[int, int, dict[str, float]]:
        """A waiting job's id, priority and quota demand, for the fair-sharing order."""
        if isinstance(job, JobRow):
            spec = self._spec(job)
        elif isinstance(job, repo.WaitingJob) and job.id in self._spec_texts:
            spec = self._spec_of(job.id, self._spec_texts[job.id])
        else:  # its spec unchanged since a pass cached it
            spec = self._specs[job.id][1]
        return job.id, spec.spec.scheduling.priority, self._demand(job.id, spec)

    def _admit(self, job_id: int, spec: Job, free: Resources) -> Admission:
        """:func:`admit`, answered once per gang shape and free capacity in a pass (against the
        capacity the pass found, :meth:`_free_capacity`): a long queue of like jobs, most of
        which stay waiting, asks the same question job after job."""
        shape = self._gangs.get(job_id)
        if shape is None or shape[0] is not spec:
            shape = self._gangs[job_id] = (spec, gang_of(spec))
        key = (shape[1], free)
        decision = self._admissions.get(key)
        if decision is None:
            decision = self._admissions[key] = admit_gang(*shape[1], self._capacity, free)
        return decision

    def _demand(self, job_id: int, spec: Job) -> dict[str, float]:
        """The job's quota demand (:func:`job_demand`), worked out once per validated spec."""
        cached = self._demands.get(job_id)
        if cached is None or cached[0] is not spec:
            cached = self._demands[job_id] = (spec, job_demand(spec))
        return cached[1]

    def _quota_verdict(self, job_id: int, queue: str, spec: Job) -> Verdict | None:
        """Whether the queue's quota lets the job in now: None (it fits, or its queue has no
        quota), :data:`PREEMPTS` (it fits once lower-priority jobs of its queue, or borrowers of
        its lent quota, are evicted), or the pending verdict that says what blocks it and by how much."""
        book = self._book
        if book is None or not book.governs(queue):
            return None
        demand = self._demand(job_id, spec)
        # a long queue holds many like jobs: one answer per (queue, priority, demand) until the
        # book's usage changes (an admission, an end, a preemption), not one per job
        key = (queue, spec.spec.scheduling.priority, tuple(demand.values()), book.version)
        if key not in self._verdicts:
            self._verdicts[key] = self._quota_verdict_now(book, queue, spec.spec.scheduling.priority, demand)
        return self._verdicts[key]

    @staticmethod
    def _quota_verdict_now(book: QuotaBook, queue: str, priority: int, demand: dict[str, float]) -> Verdict | None:
        never = book.never_fits(queue, demand)
        if never:
            return Verdict(
                JobState.PENDING,
                "Inadmissible",
                f"queue '{queue}' can never admit it: "
                + "; ".join(s.describe() for s in never)
                + " (raise the queue's quota or borrowing limit, or make the job smaller)",
            )
        short = book.shortfalls(queue, demand)
        if not short:
            return None
        if book.preemption(queue, priority, demand) is not None:
            return PREEMPTS
        return Verdict(
            JobState.PENDING, "WaitingForQuota", f"queue '{queue}': " + "; ".join(s.describe() for s in short)
        )

    def _preempt_for(
        self, session: Session, job: JobRow, spec: Job, free: Resources
    ) -> tuple[Verdict | None, Resources]:
        """Evict the jobs whose quota ``job`` needs (:meth:`QuotaBook.preemption`), each with a
        ``Preempted`` event naming ``job``, when their resources then also let it fit the
        backend; otherwise nobody is evicted and the job waits for capacity."""
        assert self._book is not None
        demand = job_demand(spec)
        plan = self._book.preemption(job.queue, spec.spec.scheduling.priority, demand)
        if plan is None:  # cannot happen within a pass (the verdict just found one); wait, said plainly
            return Verdict(JobState.PENDING, "WaitingForQuota", f"queue '{job.queue}': no preemption found"), free
        missing = [h.id for h in plan.victims if h.id not in self._admitted_rows]
        for row in repo.load_jobs(session, missing):  # quiet jobs: the pass had not loaded them
            self._admitted_rows[row.id] = self._rows[row.id] = row
        victims = [self._admitted_rows[h.id] for h in plan.victims]
        self._touched.update(v.id for v in victims)  # their instances are read afresh next pass
        freed = Resources(
            sum(i.cpu for v in victims for i in v.instances if i.state in LIVE),
            sum(i.memory for v in victims for i in v.instances if i.state in LIVE),
        )
        decision = admit(spec, self.backend.capacity(), free.plus(freed))
        if not decision.admitted:
            why = f"would preempt {len(victims)} job(s) for quota, but then still {decision.message}"
            return Verdict(JobState.PENDING, "Pending", why), free
        for holder, victim in zip(plan.victims, victims):
            free = self._preempt(session, victim, job, holder, free)
        names = ", ".join(f"{v.name} (id {v.id}, queue '{v.queue}')" for v in victims)
        self._event(job.id, "job", "Preempting", f"evicted {names} to fit in queue '{job.queue}'")
        return None, free

    def _preempt(self, session: Session, victim: JobRow, by: JobRow, holder: Holder, free: Resources) -> Resources:
        """Evict one admitted job: its instances stopped, its gang and quota given back, and it
        waits in its queue again (``Preempted``), as a suspended job does, to start afresh."""
        assert self._book is not None
        if victim.queue != by.queue:
            cohort = self._book.queues[by.queue].cohort
            why = (
                f"preempted by job {by.name} (id {by.id}) of queue '{by.queue}', which reclaims the quota "
                f"queue '{victim.queue}' borrowed from it in cohort '{cohort}'"
            )
        else:
            why = (
                f"preempted by job {by.name} (id {by.id}, priority {by.priority}) of higher priority "
                f"than this job's {victim.priority} in queue '{victim.queue}'"
            )
        # marked terminating now and stopped once the pass committed the eviction (_stop_evicted):
        # a controller killed in between finds a waiting job's terminating instances and stops
        # them (recover), instead of an admitted job whose processes died under it
        live = [i for i in victim.instances if i.state in LIVE]
        for inst in live:
            if inst.state != I.TERMINATING.value:
                self._set_instance_state(inst, I.TERMINATING)
            inst.reason, inst.message = "Preempted", why
            free = free.plus(Resources(inst.cpu, inst.memory))
        self._evicted.append((victim, live, why))
        self._to_start = [s for s in self._to_start if s.job.id != victim.id]  # prepared this pass: not started
        repo.clear_registry(victim)
        self.backend.release_gang(victim.id)
        victim.admitted, victim.started_at = False, None
        self._book.release(holder)
        self._admitted_rows.pop(victim.id, None)
        check_transition("job", victim.state, JobState.PENDING.value)
        victim.state, victim.reason, victim.message = JobState.PENDING.value, "Preempted", why
        victim.last_transition_at = utcnow()
        self._event(victim.id, "job", "Preempted", why, "Warning")
        return free

    def _stop_evicted(self, session: Session) -> None:
        """Stop the instances of the jobs this pass preempted, now that their eviction is stored."""
        evicted, self._evicted = self._evicted, []
        for job, instances, why in evicted:
            self._stop_instances(session, job, instances, Resources(), why, "Preempted")

    def _observe_all(self, jobs: list[repo.AdmittedJob]) -> None:
        """Every live instance of the pass observed in one backend call."""
        live = [i for job in jobs for i in job.instances if i.state in LIVE and i.handle]
        self._observed = dict(zip((i.id for i in live), self.backend.observe([i.handle for i in live if i.handle])))

    def run_job(
        self, job_id: int, on_tick: Callable[[], None] | None = None, should_cancel: Callable[[], bool] | None = None
    ) -> str:
        """Reconcile until ``job_id`` ends; returns its final state. Between passes it waits on
        the same wake as the server's loop (a submit, a cancel, an instance's end reported by
        its node agent), at most ``interval`` seconds. A store that is away is waited out with
        backoff (the job's instances keep running meanwhile)."""
        backoff = StoreBackoff(self.interval)
        backend_failures = 0
        self.backend.watch_exits(self.wake)
        while True:
            try:
                if should_cancel and should_cancel():
                    self.cancel(job_id)
                self.step()
                if on_tick:
                    on_tick()
                with self.sessions() as session:
                    state = repo.load_job(session, job_id).state
            except OperationalError as exc:
                time.sleep(backoff.failed(exc))
                continue
            except BackendError as exc:  # the pass was rolled back: try it again, a few times
                backend_failures += 1
                if backend_failures >= BACKEND_TRIES:
                    raise self._interrupted(job_id, exc) from None
                time.sleep(self.interval * backend_failures)
                continue
            backoff.succeeded()
            backend_failures = 0
            if JobState(state) in JOB_TERMINAL:
                return state
            self.wait_for_work(self.interval)

    def _interrupted(self, job_id: int, error: BackendError) -> JobInterrupted:
        """Record on the job why its controller stops driving it (an event, and its reason and
        message until a controller takes it over again); the error to raise."""
        with self.sessions() as session:
            job = repo.load_job(session, job_id)
            what = f"job {job.name} (id {job.id})"
            message = f"{error}; the controller stopped driving the job after {BACKEND_TRIES} failed passes"
            repo.add_event(session, job.id, "job", "BackendFailed", message, "Warning")
            if not repo.is_terminal(job.state):
                job.reason, job.message = "BackendFailed", message
            state = job.state
            session.commit()
        if repo.is_terminal(state):
            return JobInterrupted(f"{what} {state}, but its backend then failed: {error}")
        return JobInterrupted(
            f"{what} left {state}: {error}. Its instances may still run: `trainmaster job resume {job_id}` "
            f"carries it on (after `trainmaster job cancel {job_id}`, resume stops them)"
        )

    def _delete_expired(self, session: Session) -> None:
        """Delete ended jobs whose ``runPolicy.ttlSecondsAfterFinished`` has passed: the record
        (instances, events, metrics) and the run folder, as Kubernetes deletes a finished job and
        its pods. A job is never deleted in the pass that ended it, so whoever waits on it reads
        its final status first."""

        if self._expiry is None or time.monotonic() >= self._rescan_at:
            # every minute: jobs that other controllers (a `trainmaster run`) ended
            self._expiry, self._rescan_at = {}, time.monotonic() + 60.0
            rows = session.execute(
                select(JobRow.id, JobRow.completed_at, JobRow.spec).where(
                    JobRow.state.in_([s.value for s in JOB_TERMINAL]), JobRow.completed_at.is_not(None)
                )
            ).all()
            for job_id, completed_at, stored in rows:
                ttl = ((stored.get("spec") or {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished")
                if isinstance(ttl, int) and completed_at is not None:
                    self._expiry[job_id] = _aware(completed_at).timestamp() + ttl
            return
        now = time.time()
        for job_id in [j for j, due in self._expiry.items() if due <= now]:
            del self._expiry[job_id]
            row = session.get(JobRow, job_id)
            if row is None or JobState(row.state) not in JOB_TERMINAL:
                continue
            run_dir = Path(row.run_dir) if row.run_dir else None
            session.delete(repo.load_job(session, job_id))
            session.commit()
            if run_dir is not None and run_dir.resolve().parent == self.runs_dir.resolve():
                shutil.rmtree(run_dir, ignore_errors=True)

    def _free_capacity(self, session: Session, changed: set[int] | None) -> Resources:
        """The backend's capacity less what the live instances in the store hold. The sum is read
        again only when some job had an event since the last pass (``changed`` not empty, or a
        full pass): an instance becomes live or ends only in a pass that writes an event for it."""
        from sqlalchemy import func

        if changed or changed is None or self._live_sum is None:
            cpu, memory = session.execute(
                select(func.coalesce(func.sum(InstanceRow.cpu), 0.0), func.coalesce(func.sum(InstanceRow.memory), 0))
                .join(JobRow, JobRow.id == InstanceRow.job_id)
                .where(InstanceRow.state.in_(LIVE), JobRow.backend == self.backend.name)
            ).one()
            self._live_sum = Resources(float(cpu), int(memory))
        self._capacity = self.backend.capacity()  # the pass's: asked once, not once per waiting job
        return self._capacity.minus(self._live_sum)

    # ---- one job -----------------------------------------------------------------------------
    def _spec(self, job: JobRow) -> Job:
        """The job's validated spec; validated again only when the stored one changed (scaling),
        because a pass over a long queue would otherwise spend most of its time in validation.
        A waiting job's is compared as stored text (its column is not loaded: no JSON decode)."""
        text = self._spec_texts.get(job.id)
        if text:
            return self._spec_of(job.id, text)
        if self._changed is not None and job.id not in self._changed and job.id in self._specs:
            # cached, and no event since: unchanged (its column stays unread)
            return self._specs[job.id][1]
        return self._spec_of(job.id, job.spec)

    def _spec_of(self, job_id: int, stored: dict[str, Any] | str) -> Job:
        cached = self._specs.get(job_id)
        if cached is None or cached[0] != stored:
            job = Job.model_validate(json.loads(stored) if isinstance(stored, str) else stored)
            return self._cache_spec(job_id, stored, job)
        return cached[1]

    def _cache_spec(self, job_id: int, stored: dict[str, Any] | str, job: Job) -> Job:
        self._specs[job_id] = (stored, job)
        policy = job.spec.run_policy
        self._steady[job_id] = not policy.suspend and policy.active_deadline_seconds is None
        return job

    def _reconcile(self, session: Session, job: JobRow, free: Resources) -> Resources:
        spec = self._spec(job)
        if job.cancel_requested:
            return self._finish(
                session, job, spec, Verdict(JobState.CANCELLED, "Cancelled", "cancelled by the user"), free
            )
        policy = spec.spec.run_policy
        if policy.suspend:
            return self._hold(session, job, free)
        if policy.active_deadline_seconds is not None and job.admitted and job.started_at is not None:
            ran = (utcnow() - _aware(job.started_at)).total_seconds()
            if ran > policy.active_deadline_seconds:
                return self._finish(
                    session,
                    job,
                    spec,
                    Verdict(
                        JobState.FAILED,
                        "DeadlineExceeded",
                        f"the job ran for {ran:.0f}s, longer than its "
                        f"runPolicy.activeDeadlineSeconds ({policy.active_deadline_seconds}s)",
                    ),
                    free,
                )
        if not job.admitted:
            quota = self._quota_verdict(job.id, job.queue, spec)
            if quota is PREEMPTS:
                quota, free = self._preempt_for(session, job, spec, free)
            if quota is not None:
                self._set_job_state(session, job, quota)
                return free
            decision = self._admit(job.id, spec, free)
            if not decision.admitted:
                if decision.unschedulable:
                    return self._finish(
                        session, job, spec, Verdict(JobState.FAILED, "Unschedulable", decision.message), free
                    )
                self._set_job_state(session, job, Verdict(JobState.PENDING, "Pending", decision.message))
                return free
            gang = self.backend.reserve_gang(job.id, _bundles(spec))
            if not gang.reserved:
                self._set_job_state(session, job, Verdict(JobState.PENDING, "GangPending", gang.reason))
                return free
            job.admitted = True
            self._event(job.id, "job", "Admitted", decision.message)
            if self._book is not None and self._book.governs(job.queue):
                self._book.hold(Holder(job.id, job.name, job.queue, job.priority, self._demand(job.id, spec)))
                self._admitted_rows[job.id] = job
        free = self._observe(session, job, spec, free)
        spent = next(
            (i for i in job.instances if i.reason == "BackoffLimitExceeded" and i.state == I.FAILED.value), None
        )
        if spent is not None:
            return self._finish(
                session, job, spec, Verdict(JobState.FAILED, "BackoffLimitExceeded", spent.message or ""), free
            )
        free = self._scale(session, job, spec, free)
        free = self._start_pending(session, job, spec, free)
        verdict = self._roll_up(session, job, spec)
        if verdict.state in JOB_TERMINAL:
            return self._finish(session, job, spec, verdict, free)
        self._set_job_state(session, job, verdict)
        return free

    def _observe(self, session: Session, job: JobRow, spec: Job, free: Resources) -> Resources:
        for inst in job.instances:
            if inst.state not in LIVE or not inst.handle:
                continue
            polled = self._observed.pop(inst.id, None) or self.backend.observe([inst.handle])[0]
            obs = self._unreachable_for_too_long(inst, polled)
            state = observed_state(obs.phase, obs.exit_code)
            if obs.cpu_seconds or obs.peak_rss:
                inst.cpu_seconds, inst.peak_rss = obs.cpu_seconds, max(obs.peak_rss, inst.peak_rss or 0)
                metrics.observe_instance(job.name, inst.role, inst.index, obs.cpu_seconds, obs.peak_rss)
            if (obs.host and obs.host != inst.host) or (obs.ports is not None and obs.ports != inst.ports):
                self._move(inst, obs)
            if state == I.UNKNOWN:
                self._mark_unknown(session, job, inst, obs)
            elif inst.state == I.UNKNOWN.value and state in (I.RUNNING, I.STARTING):
                self._reachable_again(session, job, inst, obs)
            elif state == I.RUNNING and inst.state == I.STARTING.value:
                self._mark_running(session, job, inst)
            elif state == I.STARTING and obs.reason and inst.reason != obs.reason:
                inst.reason, inst.message = obs.reason, obs.message or "in its dependency wait step"
            elif state in (I.SUCCEEDED, I.FAILED):
                if obs.reason == "Unreachable":  # it may still run over there: ask it to stop first
                    self.backend.stop([inst.handle], self.grace)
                free = self._on_exit(session, job, spec.spec.role(inst.role), inst, obs, free)
        return free

    def _move(self, inst: InstanceRow, obs: Observation) -> None:
        """Where the backend placed an instance after its start (Ray's node, and the ports that
        node could give it): the address the registry will publish follows."""
        ports = obs.ports if obs.ports is not None else list(inst.ports or [])
        host = obs.host or inst.host or ""
        if ports != list(inst.ports or []):
            self.backend.release(Placement(inst.host or "", list(inst.ports or [])))
        inst.host, inst.ports, inst.address = host, ports, Placement(host, ports).address

    def _unreachable_for_too_long(self, inst: InstanceRow, obs: Observation) -> Observation:
        """An instance whose host stays silent past ``unreachable_grace`` is taken as lost, so
        its restart policy can act (as Kubernetes evicts pods of a node that stays unreachable)."""
        if obs.phase != InstancePhase.UNREACHABLE:
            self._unreachable_since.pop(inst.id, None)
            return obs
        since = self._unreachable_since.setdefault(inst.id, time.monotonic())
        if time.monotonic() - since < self.unreachable_grace:
            return obs
        del self._unreachable_since[inst.id]
        return Observation(
            InstancePhase.LOST,
            reason="Unreachable",
            message=f"its host did not answer for {self.unreachable_grace:g}s ({obs.message})",
        )

    def _mark_unknown(self, session: Session, job: JobRow, inst: InstanceRow, obs: Observation) -> None:
        if inst.state in (I.UNKNOWN.value, I.TERMINATING.value):
            return
        self._set_instance_state(inst, I.UNKNOWN)
        inst.reason, inst.message = obs.reason or "Unreachable", obs.message
        self._event(
            job.id,
            f"instance/{inst.label}",
            "Unknown",
            f"{inst.label}: {obs.message or 'its host does not answer'}; "
            f"taken as lost after {self.unreachable_grace:g}s",
            "Warning",
        )

    def _reachable_again(self, session: Session, job: JobRow, inst: InstanceRow, obs: Observation) -> None:
        self._event(job.id, f"instance/{inst.label}", "Reachable", f"{inst.label} answers again")
        if obs.phase == InstancePhase.RUNNING:
            self._mark_running(session, job, inst)
        else:
            self._set_instance_state(inst, I.STARTING)
            inst.reason, inst.message = obs.reason or "Started", "in its dependency wait step"

    def _mark_running(self, session: Session, job: JobRow, inst: InstanceRow) -> None:
        first = not _ran_this_attempt(inst)
        self._set_instance_state(inst, I.RUNNING)
        inst.reason, inst.message = "Running", ""
        if first:  # this attempt's first time running (not back from unknown)
            inst.running_at = utcnow()
            if inst.started_at:
                metrics.LAUNCH_LATENCY.observe((inst.running_at - _aware(inst.started_at)).total_seconds())
        repo.register_address(job, inst.role, inst.index, inst.address or "")

    def _on_exit(
        self, session: Session, job: JobRow, role: Role, inst: InstanceRow, obs: Observation, free: Resources
    ) -> Resources:
        code = obs.exit_code if obs.exit_code is not None else -1
        if obs.command_started is not None and not _ran_this_attempt(inst):  # ran between two polls
            inst.running_at = datetime.fromtimestamp(obs.command_started, timezone.utc)
        # A succeeded instance keeps its registry entry, so dependents that start late still
        # see every address of a Running dependency; a failed one is withdrawn until it reruns.
        free = self._release(session, job, inst, free, keep_address=code == 0)
        inst.exit_code, inst.ended_at = code, utcnow()
        if inst.handle:
            self._ended.append(inst.handle)
        self._set_instance_state(inst, observed_state(obs.phase, code))
        why = f" ({obs.reason}: {obs.message})" if obs.reason else ""
        scope = role.restart_policy.scope
        group, done = [inst], inst.restarts
        if scope != RestartScope.INSTANCE:  # a whole role or job restarts: its count is theirs
            group = [
                i
                for i in job.instances
                if i.state != I.STOPPED.value and (scope == RestartScope.JOB or i.role == inst.role)
            ]
            done = max(i.restarts for i in group)
        decision = restart.decide(role.restart_policy, code, done)
        limit = self._spec(job).spec.run_policy.backoff_limit
        spent = sum(i.restarts for i in job.instances) if limit is not None and decision.restart else 0
        over_limit = decision.restart and code != 0 and limit is not None and spent >= limit
        if over_limit:
            decision = restart.RestartDecision(False, exhausted=True)
        obj = f"instance/{inst.label}"
        if decision.restart and scope != RestartScope.INSTANCE:
            return self._restart_group(session, job, inst, group, done + 1, decision.delay, code, why, free)
        if decision.restart:
            metrics.RESTARTS.labels(role=inst.role).inc()
            inst.restarts += 1
            self._set_instance_state(inst, I.PENDING)
            inst.next_start_at = utcnow() + timedelta(seconds=decision.delay)
            inst.reason, inst.message = "BackOff", f"restart {inst.restarts} in {decision.delay:g}s"
            self._event(
                job.id,
                obj,
                "Restarting",
                f"{inst.label} exited with code {code}{why}; restart {inst.restarts} of "
                f"{role.restart_policy.max_restarts} in {decision.delay:g}s "
                f"(restartPolicy {role.restart_policy.policy.value})",
                "Normal" if code == 0 else "Warning",
            )
        elif code == 0:
            inst.reason, inst.message = "Completed", "exited with code 0"
            self._event(job.id, obj, "Succeeded", f"{inst.label} exited with code 0")
        elif over_limit:
            inst.reason = "BackoffLimitExceeded"
            inst.message = (
                f"{inst.label} exited with code {code}{why} after the job's {spent} restart(s): "
                f"runPolicy.backoffLimit is {limit}"
            )
            self._event(job.id, obj, "BackoffLimitExceeded", inst.message, "Warning")
        else:
            reason = obs.reason or ("RestartsExhausted" if decision.exhausted else "Failed")
            if decision.exhausted:
                message = (
                    f"{inst.label} exited with code {code}{why} and has used all "
                    f"{role.restart_policy.max_restarts} restarts"
                )
            else:
                message = (
                    f"{inst.label} exited with code {code}{why}; restartPolicy "
                    f"{role.restart_policy.policy.value} does not restart it"
                )
            inst.reason, inst.message = reason, message
            self._event(job.id, obj, "RestartsExhausted" if decision.exhausted else "Failed", message, "Warning")
        return free

    def _restart_group(
        self,
        session: Session,
        job: JobRow,
        ended: InstanceRow,
        group: list[InstanceRow],
        count: int,
        delay: float,
        code: int,
        why: str,
        free: Resources,
    ) -> Resources:
        """Restart scope Role or Job (Volcano's RestartTask / RestartJob): every instance of the
        group is stopped and becomes pending again after the backoff, restart ``count``."""
        group = [i for i in group if i.state != I.TERMINATING.value]  # already being stopped for good
        live = [i for i in group if i.state in LIVE and i is not ended]
        handles = [i.handle for i in live if i.handle]
        if handles:
            self.backend.stop(handles, self.grace)
            self._ended += handles
        start_at = utcnow() + timedelta(seconds=delay)
        for inst in group:
            if inst.state in LIVE:
                free = self._release(session, job, inst, free)
                inst.ended_at = utcnow()
            if inst.state != I.PENDING.value:
                self._set_instance_state(inst, I.PENDING)
            inst.restarts, inst.next_start_at = count, start_at
            inst.reason, inst.message = "BackOff", f"{ended.label} failed: restart {count} of the group in {delay:g}s"
        what = (
            "job"
            if self._spec(job).spec.role(ended.role).restart_policy.scope == RestartScope.JOB
            else f"role {ended.role}"
        )
        self._event(
            job.id,
            f"instance/{ended.label}",
            "RestartingGroup",
            f"{ended.label} exited with code {code}{why}; restarting every instance of the {what} "
            f"(restart {count}) in {delay:g}s",
            "Warning" if code else "Normal",
        )
        return free

    def _release(
        self,
        session: Session,
        job: JobRow,
        inst: InstanceRow,
        free: Resources,
        keep_address: bool = False,
    ) -> Resources:
        """Give back an ended instance's ports, resources and (unless kept) registry entry."""
        self.backend.release(Placement(inst.host or "", list(inst.ports or [])))
        if not keep_address:
            repo.unregister_address(job, inst.role, inst.index)
        return free.plus(Resources(inst.cpu, inst.memory))

    def _scale(self, session: Session, job: JobRow, spec: Job, free: Resources) -> Resources:
        for role in spec.spec.roles:
            rows = [i for i in job.instances if i.role == role.name]
            members = [scaling.Member(i.id, i.index, i.state, i.started_at) for i in rows if i.state != I.STOPPED.value]
            # a recreated replica is a new instance; a stopped row of that index stays as history
            created = [
                repo.new_instance_row(
                    job_id=job.id,
                    role=role.name,
                    index=index,
                    state=I.PENDING.value,
                    attempt=0,
                    restarts=0,
                    ports=[],
                    cpu=role.resources.cpu,
                    memory=role.resources.memory_bytes,
                    reason="Created",
                    message="",
                )
                for index in scaling.missing_indices(members, role.replicas)
            ]
            if created:  # stored together before the pass commits (:func:`repo.insert_instances`)
                repo.add_new_instances(job, created)
                self._created += created
            victims = {m.key for m in scaling.surplus(members, role.replicas)}
            doomed = [i for i in rows if i.id in victims]
            if doomed:
                free = self._stop_instances(
                    session, job, doomed, free, f"scaled down: role {role.name} wants {role.replicas}"
                )
                for inst in doomed:
                    self._event(
                        job.id,
                        f"instance/{inst.label}",
                        "ScaledDown",
                        f"deleted {inst.label} (role {role.name} wants {role.replicas})",
                    )
        return free

    def _stop_instances(
        self,
        session: Session,
        job: JobRow,
        instances: list[InstanceRow],
        free: Resources,
        why: str,
        reason: str = "Stopped",
    ) -> Resources:
        """Stop ``instances`` (grace, then the whole tree); each one not already ended becomes
        ``stopped`` with ``reason`` (``Stopped``; ``JobSucceeded`` when a succeeded job no longer
        needs it) and ``why`` as its message, so ``status`` never shows the reason of the state it
        left (``Running``)."""
        if not instances:  # a job whose instances all ended: nothing to stop
            return free
        for inst in instances:  # an attempt prepared this pass but not started yet has no handle
            if inst.state in LIVE and inst.state != I.TERMINATING.value:
                self._set_instance_state(inst, I.TERMINATING)
                inst.reason, inst.message = "Stopping", why
        live = [i for i in instances if i.state in LIVE and i.handle]
        if live:
            self.backend.stop([i.handle for i in live if i.handle], self.grace)
        final = dict(zip((i.id for i in live), self.backend.observe([i.handle for i in live if i.handle])))
        for inst in instances:
            if inst.state in LIVE:
                free = self._release(session, job, inst, free)
                inst.ended_at = utcnow()
                obs = final.get(inst.id)
                inst.exit_code = obs.exit_code if obs else None
                if obs and (obs.cpu_seconds or obs.peak_rss):
                    inst.cpu_seconds, inst.peak_rss = obs.cpu_seconds, max(obs.peak_rss, inst.peak_rss or 0)
                if inst.handle:
                    self._ended.append(inst.handle)
            if inst.state not in (I.SUCCEEDED.value, I.FAILED.value):
                self._set_instance_state(inst, I.STOPPED)  # from pending or terminating
                inst.reason, inst.message = reason, why
        return free

    def _start_pending(self, session: Session, job: JobRow, spec: Job, free: Resources) -> Resources:
        """Start due pending instances that fit, dependencies' roles first.

        The intent (state starting, attempt + 1) is committed (with the pass, one transaction)
        before any process is spawned, so a controller that crashes in between finds the
        instance again by its launch file or its agent (:meth:`recover`) instead of starting a
        second copy.
        """
        now = utcnow()
        order = {r.name: n for n, r in enumerate(dependency_order(spec))}
        pending = sorted(
            (i for i in job.instances if i.state == I.PENDING.value), key=lambda i: (order[i.role], i.index)
        )
        due: list[InstanceRow] = []
        for inst in pending:
            if inst.next_start_at and _aware(inst.next_start_at) > now:
                continue
            need = Resources(inst.cpu, inst.memory)
            if not free.fits(need):
                if inst.reason != "Unschedulable":
                    inst.reason, inst.message = "Unschedulable", "waiting for free resources"
                continue
            due.append(inst)
            free = free.minus(need)
        if not due:
            return free
        logs = [_log_path(job.run_dir, inst.label) for inst in due]
        if len(due) >= EARLY_HINT:
            # a gang's log files, hinted before its launch specs are built and its intents
            # committed: the local agent creates them meanwhile, on the core the pass leaves
            # idle (a new inode costs 0.2-0.5 ms on this disk, more than the pass's end leaves)
            self.backend.prepare_start(logs)
        else:
            self._unhinted += logs  # with the pass's other small starts, one hint
        if self.backend.runs_processes or job.output_path:
            _make_output_folder(job.run_dir)
        # what every instance of the pass shares, made once: the part of this process'
        # environment an instance takes (each instance copies it) and the channel's address
        if self._environ is None:
            self._environ = host_environment(dict(os.environ))
        channel = self._instance_channel().url(self.backend.instance_channel)
        shared: dict[str, RoleLaunch] = {}  # what a role's instances share, made once per role
        for inst in due:
            if inst.role not in shared:
                role = spec.spec.role(inst.role)
                shared[role.name] = role_launch(job, spec, role, self._environ, channel, self.backend.runs_containers)
        # the intents (state starting, attempt + 1) are committed with the pass, before
        # :meth:`_start_all` spawns anything
        self._to_start += [
            _Start(job, spec, inst, self._prepare(job, spec, inst, shared[inst.role], channel, log))
            for inst, log in zip(due, logs, strict=True)
        ]
        return free

    def _start_all(self, session: Session) -> None:
        """Start every attempt this pass prepared, over all jobs, in one backend call (one round
        trip to the node agent, one journal write), recording each handle as it comes back."""
        # an attempt whose job ended later in the same pass was stopped before it ran: skip it
        batch = [s for s in self._to_start if s.inst.state == I.STARTING.value and s.inst.handle is None]
        self._to_start = []
        if not batch:
            return
        spawned: list[_Start] = []
        for start, handle in zip(batch, self.backend.start([s.request for s in batch])):
            if isinstance(handle, StartFailure):
                self._on_exit(
                    session,
                    start.job,
                    start.spec.spec.role(start.inst.role),
                    start.inst,
                    Observation(InstancePhase.EXITED, exit_code=127, reason="StartFailed", message=handle.message),
                    self.backend.capacity(),
                )
            else:
                self._spawn(session, start.job, start.inst, start.request, handle)
                # a container runs once podman created it (the agent says when), like a gated one
                in_container = start.request.spec.container is not None
                if not start.request.gated and not in_container:
                    spawned.append(start)
        # running as soon as the backend says so: at once for a local process, later for a
        # Ray actor that is still being placed (one backend call for the whole batch)
        if self.backend.running_at_start:
            observed = [Observation(InstancePhase.RUNNING) for _ in spawned]
        else:
            observed = self.backend.observe([s.inst.handle for s in spawned if s.inst.handle])
        for start, obs in zip(spawned, observed):
            if obs.phase == InstancePhase.RUNNING and start.inst.state == I.STARTING.value:
                self._mark_running(session, start.job, start.inst)
        jobs = {id(s.job): s for s in batch}.values()
        for start in jobs:  # their states as of now (running, or failed by a refused start)
            verdict = self._roll_up(session, start.job, start.spec)
            if verdict.state in JOB_TERMINAL:
                self._finish(session, start.job, start.spec, verdict, self.backend.capacity())
            else:
                self._set_job_state(session, start.job, verdict)

    def _prepare(
        self, job: JobRow, spec: Job, inst: InstanceRow, shared: RoleLaunch, channel: str, log_path: str
    ) -> LaunchRequest:
        """Place an instance and mark it starting (nothing runs yet).

        ``shared``: what its role's instances share (:func:`role_launch`); ``channel``: the
        instance channel's address; ``log_path``: the instance's log file (:func:`_log_path`)."""
        placement = self.backend.place(shared.placement)
        # created by the agent where it writes there (a wait step's spec, a container's files);
        # plain strings: this runs once per instance on the way from a submit to its start
        instance_dir = os.path.join(job.run_dir, "instances", inst.label)
        # a row this pass created is written as a plain dict until its INSERT (no attribute
        # events, a dozen per replica of a gang); a stored row's changes go as usual, and its last
        # attempt's facts are cleared (a new row has none)
        stored = sa_inspect(inst).key is not None
        if stored:
            inst.attempt += 1
        else:
            repo.set_unstored(inst, attempt=inst.attempt + 1)
        launch = launch_spec(
            job,
            spec,
            shared,
            inst,
            placement,
            ChannelGrant(channel, self._instance_channel().service.token(self._claims(job, inst))),
            log_path,
            instance_dir,
        )
        depends = launch.depends
        check_transition("instance", inst.state, I.STARTING.value)
        values = {
            "host": placement.host,
            "ports": placement.ports,
            "address": placement.address,
            "log_path": log_path,
            "started_at": utcnow(),
            "state": I.STARTING.value,
            "reason": "WaitingForDependencies" if depends else "Started",
            "message": f"waiting for {', '.join(d.role for d in depends)}" if depends else "",
        }
        if stored:
            values |= {"handle": None, "pid": None, "exit_code": None, "ended_at": None, "next_start_at": None}
            values |= {"cpu_seconds": 0.0, "peak_rss": 0}
            for key, value in values.items():
                setattr(inst, key, value)
        else:
            repo.set_unstored(inst, **values)
        return LaunchRequest(placement=placement, spec=launch, resources=shared.placement.resources)

    @staticmethod
    def _claims(job: JobRow, inst: InstanceRow) -> Claims:
        """Who this attempt is on the controller's channel (:mod:`.channel`): its token says so."""
        return Claims(job.uid, inst.role, inst.index, inst.attempt)

    def _instance_channel(self) -> InstanceChannel:
        if self._channel is None:
            self._channel = channel_for(self.sessions, self.db_url)
        return self._channel

    def _spawn(
        self, session: Session, job: JobRow, inst: InstanceRow, request: LaunchRequest, handle: InstanceHandle
    ) -> None:
        inst.handle = handle
        inst.pid = handle.pid
        self._event(
            job.id,
            f"instance/{inst.label}",
            "Started",
            f"attempt {inst.attempt} on {request.placement.address}" + (f"; {inst.message}" if request.gated else ""),
        )

    def recover(self, job_ids: list[int] | None = None) -> None:
        """Carry on after a controller restart (or a take-over, for ``job_ids``): re-adopt live
        instances, requeue unstarted ones.

        Instances whose process ended while no controller watched are left to the next pass,
        which reads their exit from their node agent (journaled there until ``forget``) and
        applies their restart policy. The instance channel is served from here on: adopted
        instances may be waiting on it (a wait step, a report) for the controller to be back.
        """
        self._instance_channel().start(self.backend.instance_channel)
        with self._lock, self.sessions() as session:
            # what this controller remembers of the store may be stale (another leader ran it
            # meanwhile; instances re-found here are written): the next pass looks at every job
            self._open.clear()
            self._seen = None
            if self.fence:
                self.fence(session)
            for job_id in repo.active_job_ids(session, self.owner) if job_ids is None else job_ids:
                job = repo.load_job(session, job_id)
                evicted = [i for i in job.instances if not job.admitted and i.state == I.TERMINATING.value]
                if evicted:  # preempted, and the controller stopped before it stopped them
                    self._stop_instances(session, job, evicted, Resources(), "its job was preempted", "Preempted")
                    self._write_events(session)
                for inst in job.instances:
                    if inst.state not in LIVE:
                        continue
                    obj = f"instance/{inst.label}"
                    if inst.handle is None:
                        instance_dir = str(Path(job.run_dir) / "instances" / inst.label)
                        # the agent that started it holds its record, ended or not, until `forget`
                        inst.handle = self.backend.recover(instance_id(job, inst), instance_dir)
                        if inst.handle is None:
                            self._set_instance_state(inst, I.PENDING)
                            inst.attempt -= 1
                            repo.add_event(
                                session,
                                job.id,
                                obj,
                                "NotStarted",
                                "the controller stopped before starting it; it will start now",
                            )
                            continue
                        inst.pid = inst.handle.pid
                    if self.backend.adopt(inst.handle):
                        repo.add_event(
                            session,
                            job.id,
                            obj,
                            "Adopted",
                            f"re-adopted the live process {inst.pid} after a controller restart",
                        )
                session.commit()

    # ---- status ------------------------------------------------------------------------------
    def _roll_up(self, session: Session, job: JobRow, spec: Job) -> Verdict:
        summaries: dict[str, RoleSummary] = {}
        for role_row, role in zip(job.roles, spec.spec.roles):
            states = [I(i.state) for i in job.instances if i.role == role.name and i.state != I.STOPPED.value]
            counts: Counter[InstanceState] = Counter(states)
            verdict = role_state(role.status_policy, counts, role.replicas)
            _count_instances(job, role_row)
            role_row.replicas = role.replicas
            if role_row.state != verdict.state.value:
                role_row.last_transition_at = utcnow()
                self._event(
                    job.id,
                    f"role/{role.name}",
                    verdict.reason,
                    verdict.message,
                    "Warning" if verdict.state == JobState.FAILED else "Normal",
                )
            role_row.state, role_row.reason, role_row.message = verdict.state.value, verdict.reason, verdict.message
            summaries[role.name] = RoleSummary(verdict.state, counts)
        verdict = job_state(spec.spec.status_policy, summaries)
        if verdict.state == JobState.PENDING and job.admitted:
            verdict = Verdict(JobState.STARTING, "Starting", "admitted; starting instances")
        return verdict

    def _set_job_state(self, session: Session, job: JobRow, verdict: Verdict) -> None:
        new = verdict.state.value
        if job.state != new:
            check_transition("job", job.state, new)
            job.last_transition_at = utcnow()
            if verdict.state != JobState.PENDING and job.admitted and job.started_at is None:
                job.started_at = utcnow()
            if verdict.state == JobState.RUNNING and job.running_at is None:
                job.running_at = utcnow()
            self._event(
                job.id,
                "job",
                verdict.reason,
                verdict.message,
                "Warning" if verdict.state in (JobState.FAILED, JobState.CANCELLED) else "Normal",
            )
        elif job.reason != verdict.reason:
            # a new reason is an event; a message that only updates figures (free capacity,
            # counts) is not, or every queued job would log one per pass
            if job.id not in self._last_job_reason:  # not known since the first pass (or a recovery)
                # read for every job of the pass not known, in one query: a job with an event this
                # pass is known (:meth:`_event`), so the store's newest is the last for the others
                unknown = {job.id} | {j for j in self._rows if j not in self._last_job_reason}
                self._last_job_reason.update(repo.last_job_reasons(session, sorted(unknown)))
            if self._last_job_reason[job.id] != verdict.reason:
                self._event(job.id, "job", verdict.reason, verdict.message)
        if (job.state, job.reason, job.message) != (new, verdict.reason, verdict.message):
            # assigned only when changed: an assignment marks the row dirty even with the same
            # value, and a long queue would then be rewritten on every pass
            job.state, job.reason, job.message = new, verdict.reason, verdict.message

    @staticmethod
    def _set_instance_state(inst: InstanceRow, state: InstanceState) -> None:
        check_transition("instance", inst.state, state.value)
        inst.state = state.value

    def _hold(self, session: Session, job: JobRow, free: Resources) -> Resources:
        """A suspended job (``runPolicy.suspend``): not admitted; one that ran has its live
        instances stopped and its gang released, and starts afresh (deadline clock included)
        once resumed, as Kubeflow deletes a suspended job's pods."""
        if job.admitted:
            live = [i for i in job.instances if i.state not in INSTANCE_TERMINAL]
            free = self._stop_instances(session, job, live, free, "the job was suspended")
            repo.clear_registry(job)
            self.backend.release_gang(job.id)
            job.admitted, job.started_at = False, None
            if self._book is not None:
                self._book.release_job(job.id)
        self._set_job_state(session, job, SUSPENDED)
        return free

    def _finish(self, session: Session, job: JobRow, spec: Job, verdict: Verdict, free: Resources) -> Resources:
        """End a job: stop its instances, keep logs, store outputs on success, clean the registry."""
        succeeded = verdict.state == JobState.SUCCEEDED
        stopping = [i for i in job.instances if i.state not in INSTANCE_TERMINAL]
        # a succeeded job's instances still running are no longer needed: stopped, not failed
        # (as Kubeflow shows the replicas of a succeeded job), and said so in words of success
        why = "stopped when the job succeeded: no longer needed" if succeeded else f"the job {verdict.state.value}"
        free = self._stop_instances(
            session,
            job,
            stopping,
            free,
            why if succeeded else f"{why} ({verdict.reason})",
            "JobSucceeded" if succeeded else "Stopped",
        )
        for role_row in job.roles:
            _count_instances(job, role_row)  # the table as it is now: the stopped ones included
            if JobState(role_row.state) not in JOB_TERMINAL:
                stopped = sum(1 for i in stopping if i.role == role_row.name)
                if succeeded:
                    role_row.state, role_row.reason = JobState.SUCCEEDED.value, "JobSucceeded"
                    role_row.message = f"the job succeeded; {stopped} instance(s) still running were stopped"
                else:
                    role_row.state, role_row.reason = JobState.CANCELLED.value, "StoppedAtJobEnd"
                    role_row.message = f"stopped: the job {verdict.state.value}"
                role_row.last_transition_at = utcnow()
        repo.clear_registry(job)
        if job.admitted:
            self.backend.release_gang(job.id)
        if self._book is not None:
            self._book.release_job(job.id)
        if verdict.state == JobState.SUCCEEDED and job.output_path:
            source = Path(job.run_dir) / "output"
            shutil.copytree(source, job.output_path, dirs_exist_ok=True)
            self._event(job.id, "job", "OutputStored", f"outputs copied to {job.output_path}")
        self._set_job_state(session, job, verdict)
        job.completed_at = utcnow()
        ttl = spec.spec.run_policy.ttl_seconds_after_finished
        if ttl is not None and self._expiry is not None:
            self._expiry[job.id] = time.time() + ttl
        self._specs.pop(job.id, None)
        self._steady.pop(job.id, None)
        self._demands.pop(job.id, None)
        self._gangs.pop(job.id, None)
        self._last_job_reason.pop(job.id, None)
        for inst in job.instances:
            self._handles.pop(inst.id, None)
        return free


#: :meth:`Controller._quota_verdict`: the job fits its queue's quota once others are preempted
PREEMPTS = Verdict(JobState.PENDING, "Preempting", "")
SUSPENDED = Verdict(JobState.PENDING, "Suspended", "suspended (runPolicy.suspend); `trainmaster job resume` starts it")


def _event_row(job_id: int, reason: str, message: str, when: datetime, type_: str = "Normal") -> dict[str, Any]:
    return {"job_id": job_id, "object": "job", "reason": reason, "message": message, "type": type_, "time": when}


def _queued(admitted: int) -> Verdict:
    """A waiting job's verdict while the controller runs its ``max_jobs`` already."""
    return Verdict(JobState.PENDING, "Queued", f"{admitted} job(s) running, the most this controller runs at once")


@dataclass
class _Start:
    """One attempt a pass prepared: its intent is committed, its process not yet started."""

    job: JobRow
    spec: Job
    inst: InstanceRow
    request: LaunchRequest


#: ext2/3/4's inode flags (linux/fs.h): ``chattr +T`` marks "the top of directory hierarchies"
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_TOPDIR_FL = 0x00020000


def spread_job_folders(runs_dir: Path) -> None:
    """Make the runs folder (where missing) and mark it as the top of directory hierarchies
    (``chattr +T``), so that ext4 places each job folder in a block group it chooses (its Orlov
    allocator, as for folders at the root), and the job's files and folders beside it, rather
    than every job folder in the runs folder's own group.

    Why: ext4 without a journal (this machine's root) never reuses an inode freed in the last
    minute (five, if its table block is dirty): each new inode first skips past every such one
    in its group, reading each one's table block. In the group of a busy runs folder, where
    earlier jobs' folders were just removed (and in ``/tmp``'s, where everyone's are), the four
    inodes of a job (its folder, ``output/``, ``logs/``, the log) cost 1.0-2.0 ms of CPU, rising
    run after run, against 0.18-0.29 ms under a folder marked so (1,000 jobs, three rounds, on
    the 2-core machine); on the drain of 1,000 ``true`` jobs that is the pass's own CPU climbing
    from 1.6 to 3.2 ms per job. A hint only: where it is refused (tmpfs, another filesystem, a
    folder we do not own) nothing else changes."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(runs_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (flags,) = struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, bytes(4)))
        if not flags & FS_TOPDIR_FL:
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("i", flags | FS_TOPDIR_FL))
    except OSError as exc:  # ENOTTY / EOPNOTSUPP / EPERM: not ext2/3/4, or not ours
        log.debug("runs folder %s not marked as a top folder: %s", runs_dir, exc)
    finally:
        os.close(fd)


def _make_output_folder(run_dir: str) -> None:
    """The job's run folder and its ``output``: on a job's first start neither exists, so they
    are made outright (two ``mkdir`` s; ``Path.mkdir(parents=True)`` tries the child first and
    fails once: a third call, once per job of a queue drained on the pass's own thread)."""
    output = os.path.join(run_dir, "output")
    try:
        os.mkdir(run_dir)
    except FileExistsError:
        pass
    except FileNotFoundError:  # the first job of a fresh runs folder
        Path(output).mkdir(parents=True, exist_ok=True)
        return
    try:
        os.mkdir(output)
    except FileExistsError:
        pass


def _log_path(run_dir: str, label: str) -> str:
    """An instance's log file (appended to across its attempts)."""
    return os.path.join(run_dir, "logs", f"{label}.log")


def _bundles(spec: Job) -> list[Resources]:
    """One resource bundle per instance of the job, for gang reservation."""
    return [
        Resources(r.resources.cpu, r.resources.memory_bytes, r.resources.gpu)
        for r in spec.spec.roles
        for _ in range(r.replicas)
    ]


def _count_instances(job: JobRow, role_row: RoleRow) -> None:
    """The role's instances by state, every state (stopped ones too): the counts a user sees
    beside the instance table always add up to it."""
    states = Counter(i.state for i in job.instances if i.role == role_row.name)
    counts = {s: states[s] for s in INSTANCE_STATES}
    if role_row.counts != counts:  # assigned only when changed (an assignment dirties the row)
        role_row.counts = counts


def _ran_this_attempt(inst: InstanceRow) -> bool:
    """Whether the current attempt was already recorded running (not only an earlier one)."""
    return inst.running_at is not None and (
        inst.started_at is None or _aware(inst.running_at) >= _aware(inst.started_at)
    )


def _aware(moment: datetime) -> datetime:
    """SQLite returns naive datetimes; everything we store is UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
