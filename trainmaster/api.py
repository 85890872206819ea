"""The application facade: every job verb over one store, in this process.

What TorchX's ``Runner`` is to TorchX: the CLI's job verbs, the REST API's handlers and the tests
all go through :class:`LocalTrainmaster`, the local implementation of the client protocol
:class:`trainmaster.client.Trainmaster` (a service's is
:class:`trainmaster.client.remote.RemoteTrainmaster`), so a verb behaves the same whether a user
types it with or without a server. It holds no state of its own: the store is the truth, and a verb that changes a
job records an intent (cancel, scale) that whichever controller owns the job acts on at its next
pass, or (``run``, ``resume``) drives an embedded controller itself.

Its results are the protocol's (:mod:`trainmaster.client.results`): status and list answer the
REST API's JSON documents, every other verb a small dataclass.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from sqlalchemy.orm import Session, sessionmaker

from trainmaster.backends.base import BackendOptions, Placement
from trainmaster.backends.ports import PortPool
from trainmaster.backends.registry import make_backend
from trainmaster.containers.policy import CONTAINER_BACKENDS
from trainmaster.contract import LaunchSpec
from trainmaster.controller import Controller
from trainmaster.controller.launching import planned_launches
from trainmaster.client.protocol import wait_for
from trainmaster.client.results import (
    CancelResult,
    Deleted,
    JobNotFound,
    JobRef,
    JobStatus,
    ScaleResult,
    StoreMissing,
    SuspendResult,
    WaitTimedOut,
)
from trainmaster.errors import JobConflict, UserError
from trainmaster.store.repository import NameTaken  # noqa: F401 (re-exported: the facade's conflicts)
from trainmaster.loading import check_runnable, load_document, validate_document
from trainmaster.spec.load import LoadedJob, LoadOptions
from trainmaster.spec.model import Job
from trainmaster.spec.states import INSTANCE_TERMINAL
from trainmaster.store import listing, repository as repo
from trainmaster.store.listing import JobFilter, JobPage, WatchEvent
from trainmaster.store.db import default_url, make_engine, session_factory, sqlite_path
from trainmaster.store.models import InstanceRow, JobRow
from trainmaster.store.ownership import orphan_note, owner_alive, run_owner, run_pid, why_not_resumable

#: How much of a log :meth:`Trainmaster.tail` reads at most, whatever the number of lines asked:
#: a tail must answer at once even for a log of gigabytes.
TAIL_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class LogTarget:
    """One instance's log file."""

    label: str
    instance_id: int
    path: Path


@dataclass(frozen=True)
class RunOptions:
    """How ``run`` and ``resume`` drive their embedded controller (the ``trainmaster run`` flags)."""

    backend: str = "local"
    interval: float = 1.0
    grace: float = 5.0
    cpus: float | None = None
    ray_address: str | None = None


#: What a dry run writes for the job's run folder, which only a submit makes.
RUN_DIR_PLACEHOLDER = "$RUN_DIR"
DRY_RUN_HOST = "127.0.0.1"  # a dry run places every instance here, on ports free now


@dataclass(frozen=True)
class DryRun:
    """What ``run`` would launch, without launching it (TorchX's dry run): the job as it would be
    stored, and the :class:`LaunchSpec` of each instance's first attempt in start order. Paths
    under the job's folder read ``$RUN_DIR``; the host and ports are this machine's now (the
    backend chooses its own when each attempt starts); the controller's own environment is
    added at launch."""

    job: Job
    launches: list[LaunchSpec]


@dataclass(frozen=True)
class RunResult:
    job_id: int
    state: str
    status: JobStatus  # the final status document

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"


@dataclass
class _Submission:
    """One submit waiting for the batch that stores it (:meth:`LocalTrainmaster.submit`)."""

    loaded: LoadedJob
    controller: Controller
    unique_name: bool
    result: int | Exception | None = None


class LocalTrainmaster:
    """The job verbs over the store at ``url`` (see the module's docstring)."""

    def __init__(self, sessions: sessionmaker[Session], url: str):
        self.sessions = sessions
        self.url = url
        self._submitting = threading.Lock()  # a name check and its insert are one step
        # submits that came while a batch was being stored: the next batch stores them together
        self._waiting: list[_Submission] = []
        self._waiting_lock = threading.Lock()

    @classmethod
    def open(cls, url: str | None = None, existing: bool = False) -> LocalTrainmaster:
        """The facade over ``url`` (default: the SQLite store in Trainmaster's home); with
        ``existing``, a SQLite store that is not there is an error rather than created empty
        (a verb that only looks at jobs should not leave a database behind)."""
        url = url or default_url()
        path = sqlite_path(url)
        if existing and path is not None and not path.exists():
            raise StoreMissing(
                f"no store at {path}: no job has run with this Trainmaster home yet. Run one with "
                "`trainmaster job run FILE`, give the store with --db / TRAINMASTER_DB or the home with "
                "--home / TRAINMASTER_HOME, or ask a server with --server URL"
            )
        return cls(session_factory(make_engine(url)), url)

    # ---- reading -------------------------------------------------------------------------------
    def find(self, ref: str | int) -> JobRef:
        with self.sessions() as session:
            row = self._find(session, ref)
            return JobRef(row.id, row.name, row.state)

    def list_jobs(
        self, where: JobFilter | None = None, limit: int = listing.DEFAULT_LIMIT, after: str | None = None
    ) -> JobPage:
        """One page of the jobs ``where`` keeps, oldest first, after the ``continue`` token
        ``after`` (``GET /api/v1/jobs``; :mod:`trainmaster.store.listing`)."""
        with self.sessions() as session:
            return listing.list_jobs(session, where or JobFilter(), limit, after)

    def changes(
        self, version: int, where: JobFilter | None = None, limit: int = listing.DEFAULT_LIMIT
    ) -> tuple[list[WatchEvent], int]:
        """The jobs changed after resource ``version`` and the version to watch from next
        (``GET /api/v1/jobs?watch=true``)."""
        with self.sessions() as session:
            return listing.changes_since(session, version, where or JobFilter(), limit)

    def status(self, ref: str | int, events: int = 50, instances: tuple[int, int] | None = None) -> JobStatus:
        """A job's status document with its ``events`` latest events (``GET /api/v1/jobs/{ref}``);
        ``instances`` = (first, count) pages its instances (all of them when None)."""
        with self.sessions() as session:
            # its roles and instances are read as the document needs them (two queries; the
            # registry, which a status does not show, is not read)
            row = self._find(session, ref, with_spec=False)
            document = repo.job_status(session, row, events=events, instances=instances)
            return cast(JobStatus, document)

    def wait(self, ref: str | int, timeout: float, states: frozenset[str] | None = None, poll: float = 0.25) -> JobRef:
        """Wait until the job is in one of ``states`` (default: ended); :class:`WaitTimedOut`
        after ``timeout`` seconds. The store is polled: the job may be run by another process."""
        return wait_for(lambda: self.find(ref), timeout, states, poll)

    # ---- logs ----------------------------------------------------------------------------------
    def log_target(self, ref: str | int, role: str | None = None, index: int = 0) -> LogTarget:
        """The log of instance ``role``-``index`` (default role: the first with that index)."""
        with self.sessions() as session:
            job = repo.load_job(session, self._find(session, ref).id)
            roles = [r.name for r in job.roles]
            if role is not None and role not in roles:
                close = difflib.get_close_matches(role, roles, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise JobNotFound(f"job {job.name} has no role '{role}' ({hint}its roles: {', '.join(roles)})")
            chosen = [i for i in job.instances if (role is None or i.role == role) and i.index == index]
            if not chosen:
                indices = sorted({i.index for i in job.instances if role is None or i.role == role})
                have = f"indices {indices[0]}-{indices[-1]}" if indices else "no instance yet"
                raise JobNotFound(f"job {job.name} has no instance {role or '<first role>'}-{index} ({have})")
            inst = chosen[0]
            if not inst.log_path:
                raise JobNotFound(f"{inst.label} has not started yet; no log")
            return LogTarget(inst.label, inst.id, Path(inst.log_path))

    def tail(self, ref: str | int, role: str | None = None, index: int = 0, lines: int = 100) -> str:
        """The last ``lines`` lines of an instance's log, reading at most :data:`TAIL_MAX_BYTES`."""
        target = self.log_target(ref, role, index)
        if not target.path.exists():
            return ""
        with open(target.path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - TAIL_MAX_BYTES))
            text = handle.read().decode(errors="replace")
        kept = text.splitlines(keepends=True)[-lines:] if lines > 0 else []
        return "".join(kept)

    def read_log(
        self,
        ref: str | int,
        role: str | None = None,
        index: int = 0,
        follow: bool = False,
        poll: float = 0.25,
        timeout: float | None = None,
    ) -> Iterator[bytes]:
        """An instance's log in chunks; with ``follow``, new output as it comes until the instance
        ends (then the rest) or ``timeout`` seconds pass (:class:`WaitTimedOut`)."""
        target = self.log_target(ref, role, index)
        deadline = None if timeout is None else time.monotonic() + timeout
        offset, ended = 0, not follow
        while True:
            chunk = self.log_chunk(target, offset)
            offset += len(chunk)
            if chunk:
                yield chunk
                continue
            if ended:
                return
            if self.instance_ended(target.instance_id):
                ended = True  # one more pass drains what it wrote before it ended
                continue
            orphaned = self._orphaned(target.instance_id)
            if orphaned:  # nobody will ever mark the instance ended: following would never stop
                raise UserError(f"stopped following {target.label}: {orphaned}", exit_code=1)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimedOut(f"{target.label} still runs after {timeout:g} s of following its log")
            time.sleep(poll)

    @staticmethod
    def log_chunk(target: LogTarget, offset: int, size: int = 1 << 16) -> bytes:
        """At most ``size`` bytes of ``target``'s log from ``offset`` (nothing before it exists)."""
        if not target.path.exists():
            return b""
        with open(target.path, "rb") as handle:
            handle.seek(offset)
            return handle.read(size)

    def instance_ended(self, instance_id: int) -> bool:
        with self.sessions() as session:
            inst = session.get(InstanceRow, instance_id)
            return inst is None or inst.state in {s.value for s in INSTANCE_TERMINAL}

    def _orphaned(self, instance_id: int) -> str | None:
        """Why the instance's state will not change any more (its job's ``trainmaster run`` is
        gone), or None. A job of the service is never orphaned: the service restarts."""
        with self.sessions() as session:
            inst = session.get(InstanceRow, instance_id)
            job = session.get(JobRow, inst.job_id) if inst is not None else None
            if job is None or repo.is_terminal(job.state) or owner_alive(job.owner) is not False:
                return None
            return orphan_note(job.id, job.owner)

    # ---- intents -------------------------------------------------------------------------------
    def cancel(self, ref: str | int) -> CancelResult:
        """Record the cancellation; the controller owning the job stops every instance."""
        with self.sessions() as session:
            row = self._find(session, ref)
            if not repo.request_cancel(session, row):
                return CancelResult(row.id, False, f"job {row.name} has already ended ({row.state})")
            session.commit()
            if owner_alive(row.owner) is False:
                note = f"its `trainmaster run` is gone: `trainmaster job resume {row.id}` stops its instances now"
            else:
                note = "its controller stops every instance at its next pass"
            return CancelResult(row.id, True, note)

    def scale(self, ref: str | int, role: str, replicas: int) -> ScaleResult:
        """Set a role's desired replicas. The changed job is validated like a submitted one (a
        framework's single-instance roles, ``minAvailable``...), so scaling cannot make it invalid."""
        with self.sessions() as session:
            row = repo.load_job(session, self._find(session, ref).id)
            repo.set_replicas(session, row, role, replicas, validate_document)
            session.commit()
            return ScaleResult(row.id, role, replicas)

    def suspend(self, ref: str | int, suspend: bool = True) -> SuspendResult:
        """Hold a job (``runPolicy.suspend``: its live instances are stopped, it waits unadmitted)
        or release it; the controller owning the job acts at its next pass."""
        with self.sessions() as session:
            row = self._find(session, ref)
            changed = repo.set_suspended(session, row, suspend)
            session.commit()
            return SuspendResult(row.id, suspend, changed)

    def delete(self, ref: str | int) -> Deleted:
        """Delete an ended job and its records; :class:`JobConflict` while it is active."""
        with self.sessions() as session:
            row = self._find(session, ref)
            if not repo.is_terminal(row.state):
                raise JobConflict(f"job {row.name} (id {row.id}) is {row.state}; cancel it first")
            session.delete(repo.load_job(session, row.id))
            session.commit()
            return Deleted(row.id)

    # ---- submitting ----------------------------------------------------------------------------
    @staticmethod
    def load(
        document: dict[str, Any], backend: str, options: LoadOptions | None = None, source: str = "submitted job"
    ) -> LoadedJob:
        """Validate a job document as a controller on ``backend`` will run it; a
        :class:`UserError` lists every problem with its field path (the job's own
        ``spec.scheduling.backend`` must be that backend)."""
        loaded = load_document(document, source=source, options=replace(options or LoadOptions(), backend=backend))
        wanted = loaded.job.spec.scheduling.backend
        if wanted is not None and wanted.value != backend:
            raise UserError(
                f"{source} is not a valid job (1 problem(s))",
                [
                    f"spec.scheduling.backend: this server runs its instances on '{backend}', not "
                    f"'{wanted.value}'; remove the field or submit to a server started with --backend {wanted.value}"
                ],
            )
        return loaded

    def submit(self, loaded: LoadedJob, controller: Controller, unique_name: bool = True) -> JobRef:
        """Queue ``loaded`` for ``controller`` (the server's, or the embedded one of ``run``),
        which owns and reconciles it. With ``unique_name`` (the REST API and the dashboard),
        :class:`NameTaken` while a job of its name is active: the check and the insert are one
        step in this process. The one way a job enters the store: the CLI, the server and the
        tests all come here. Submits that arrive while one is being stored wait and are stored
        together, in one transaction (a server under hundreds of submits a second commits
        once per batch, not once per job); each still gets its own answer."""
        ticket = _Submission(loaded, controller, unique_name)
        with self._waiting_lock:
            self._waiting.append(ticket)
        with self._submitting:  # one batch at a time in this process; the store's lock covers the others
            if ticket.result is None:  # not stored by the batch before: this thread stores the waiting ones
                with self._waiting_lock:
                    waiting, self._waiting = self._waiting, []
                groups: dict[tuple[int, bool], list[_Submission]] = {}
                for t in waiting:
                    groups.setdefault((id(t.controller), t.unique_name), []).append(t)
                for (_, flag), batch in groups.items():
                    try:
                        results: list[int | Exception] = list(
                            batch[0].controller.submit_batch([t.loaded for t in batch], flag)
                        )
                    except Exception as exc:  # the store refused the batch: each of its submits says so
                        results = [exc] * len(batch)
                    for t, result in zip(batch, results):
                        t.result = result
        if isinstance(ticket.result, Exception):
            raise ticket.result
        assert ticket.result is not None
        return JobRef(ticket.result, loaded.job.name, "pending")

    @staticmethod
    def dry_run(loaded: LoadedJob, backend: str) -> DryRun:
        """The :class:`DryRun` of ``loaded`` on ``backend``; nothing
        is stored, started or left behind (frameworks prepare their files in a scratch folder)."""
        ports = PortPool(DRY_RUN_HOST)
        with tempfile.TemporaryDirectory(prefix="trainmaster-dry-run-") as scratch:
            launches = planned_launches(
                loaded.job,
                scratch,
                containers=backend in CONTAINER_BACKENDS,
                place=lambda request: Placement(DRY_RUN_HOST, ports.take(request.ports, request.wanted_ports)),
            )
        # the scratch folder is named in JSON-safe characters only: a plain text replacement
        return DryRun(
            loaded.job,
            [
                LaunchSpec.from_dict(json.loads(json.dumps(spec.to_dict()).replace(scratch, RUN_DIR_PLACEHOLDER)))
                for spec in launches
            ],
        )

    # ---- running here --------------------------------------------------------------------------
    def controller(self, options: RunOptions, owner: str) -> Controller:
        """An embedded controller over this store reconciling ``owner``'s jobs."""
        return Controller(
            self.sessions,
            make_backend(options.backend, BackendOptions(cpus=options.cpus, address=options.ray_address)),
            self.url,
            interval=options.interval,
            grace=options.grace,
            owner=owner,
        )

    def run(
        self,
        loaded: LoadedJob,
        options: RunOptions,
        on_tick: Callable[[int], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
    ) -> RunResult:
        """Queue ``loaded`` for a controller in this process and reconcile it to its end;
        ``on_tick(job_id)`` after every pass, ``should_cancel()`` true cancels it."""
        check_runnable(loaded, options.backend)  # before anything is stored: a clear refusal
        controller = self.controller(options, run_owner())
        job_id = self.submit(loaded, controller, unique_name=False).id
        return self._drive(controller, job_id, on_tick, should_cancel)

    def resume(
        self,
        ref: str | int,
        options: RunOptions,
        on_tick: Callable[[int], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
    ) -> RunResult:
        """Take over a job whose ``trainmaster run`` ended before it and run it to its end: live
        instances are re-adopted, ended ones handled by their restart policy. ``options.backend``
        is ignored: the job keeps the backend it started on."""
        me = run_owner()
        with self.sessions() as session:
            row = self._find(session, ref)
            what = f"job {row.name} (id {row.id}, {row.state})"
            alive = owner_alive(row.owner)
            if not repo.is_terminal(row.state) and repo.is_suspended(row) and alive is not False:
                raise UserError(
                    f"{what} is suspended and its controller runs; release it with `trainmaster job unsuspend {row.id}`"
                )
            refusal = why_not_resumable(repo.is_terminal(row.state), row.owner, what)
            if refusal:
                raise UserError(refusal)
            repo.set_suspended(session, row, False)  # resuming an orphaned suspended job releases it
            if not repo.take_over(session, row.id, row.owner, me):
                raise UserError(f"{what} was just taken over by another command; try again to see by whom")
            repo.add_event(session, row.id, "job", "Resumed", f"taken over by `trainmaster resume` (pid {run_pid(me)})")
            session.commit()
            job_id, backend_name = row.id, row.backend
        controller = self.controller(replace(options, backend=backend_name, cpus=None), me)
        controller.recover()
        return self._drive(controller, job_id, on_tick, should_cancel)

    def _drive(
        self,
        controller: Controller,
        job_id: int,
        on_tick: Callable[[int], None] | None,
        should_cancel: Callable[[], bool] | None,
    ) -> RunResult:
        try:
            state = controller.run_job(
                job_id, on_tick=None if on_tick is None else lambda: on_tick(job_id), should_cancel=should_cancel
            )
        finally:
            controller.backend.close()  # this command's connection to the node agent, not the agent
        return RunResult(job_id, state, self.status(job_id, events=200))

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _find(session: Session, ref: str | int, with_spec: bool = True) -> JobRow:
        text = str(ref)
        if not text.isascii():  # names, uids and ids are ASCII; '²'.isdigit() holds, int('²') fails
            raise JobNotFound(f"no job '{text}' (job names, uids and ids are ASCII)")
        if text.isdigit() and len(text) > 18:
            raise JobNotFound(f"no job with id {text[:20]}... (ids are at most 18 digits)")
        try:
            return repo.find_job(session, text, with_spec)
        except UserError as exc:
            raise JobNotFound(exc.message) from None
