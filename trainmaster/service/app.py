"""FastAPI application of the controller service (``trainmaster server``).

The API only reads the store and records intents (submit, scale, cancel, delete); the reconcile
thread does everything else, so a request never waits on instances and a crash of the server
loses nothing that was acknowledged: a job is committed before ``201`` is returned.

No request makes the service answer 5xx: bodies and JSON depth are limited before a route runs
(:mod:`.limits`), every field is bounded and checked by the spec layer (422 with its path), and
unknown references are 404. The handler for unexpected exceptions is the last line of defence
only: it logs the traceback and answers 500 without internals.

Before any of that, :mod:`.protect` refuses hosts the server does not serve (DNS rebinding) and
REST state changes a browser could send from another site (CSRF), and adds the security headers
to every answer; :mod:`.quotas` bounds how many instances a job, and all jobs, may ask for.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import OperationalError

from trainmaster.api import JobConflict, JobNotFound, LogTarget, Trainmaster
from trainmaster.controller import Controller
from trainmaster.controller import metrics
from trainmaster.controller.backoff import StoreBackoff
from trainmaster.controller.leader import LeaderElector, LeaseLost
from trainmaster.service.dashboard import AccessOptions, mount_dashboard
from trainmaster.service.dashboard.errors import error_page
from trainmaster.service.draining import Draining
from trainmaster.service.joblist import JobListQuery, job_list_query, list_or_watch
from trainmaster.errors import UserError
from trainmaster.service.apidocs import mount_api_docs
from trainmaster.service.limits import BodyLimit, RequestLimits
from trainmaster.service.protect import RequestGuard, ServedHosts
from trainmaster.service.quotas import JobQuota, OverQuota, check_job, check_room, check_scale
from trainmaster.spec.load import LoadOptions
from trainmaster.spec.model import MAX_REPLICAS, Job, RuntimeKind
from trainmaster.spec.paths import PathPolicy
from trainmaster.spec.validate import field_path
from trainmaster.store import repository as repo

API = "/api/v1"
STATUS_PAGE = 1_000  # instances in one status answer unless asked otherwise
STATUS_PAGE_MAX = 10_000
log = logging.getLogger("trainmaster.service")

#: A job reference in a URL: a name (at most 63 characters), a uid (32) or an id.
JobRef = Annotated[str, PathParam(min_length=1, max_length=63, description="Job name, uid or id")]


@dataclass(frozen=True)
class ServiceOptions:
    """What the operator decides for every submitted job: where its paths may point (relative
    ones are inside the job's folder) and how large a request may be."""

    paths: PathPolicy = field(default_factory=PathPolicy)
    limits: RequestLimits = field(default_factory=RequestLimits)
    access: AccessOptions = field(default_factory=AccessOptions)  # the token beyond loopback, CSRF
    runtime: RuntimeKind | None = None  # where 'runtime: auto' roles run (--runtime); None: podman's presence
    hosts: ServedHosts = field(default_factory=ServedHosts)  # the Host names it answers (DNS rebinding)
    quota: JobQuota = field(default_factory=JobQuota)  # instances per job and in all (--max-*-instances)


class ScaleRequest(BaseModel):
    """A role's new desired replica count (``POST /api/v1/jobs/{ref}/scale``)."""

    model_config = ConfigDict(extra="forbid")
    role: str = Field(min_length=1)
    replicas: int = Field(ge=1, le=MAX_REPLICAS)


class Reconciler(threading.Thread):
    """Runs :meth:`Controller.step` every interval until stopped; with an ``elector`` (several
    servers on one store) only while this server leads, recovering first each time it takes over."""

    def __init__(self, controller: Controller, elector: LeaderElector | None = None):
        super().__init__(name="reconcile", daemon=True)
        self.controller = controller
        self.elector = elector
        self.stopping = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        recovered = False
        backoff = StoreBackoff(self.controller.interval)
        self.controller.backend.watch_exits(self.controller.wake)  # an instance's end wakes the loop
        while not self.stopping.is_set():
            if self.elector is not None and not self.elector.leading:
                recovered = False  # a standby: the leader reconciles
                self.elector.elected.wait(self.controller.interval)
                continue
            delay = self.controller.interval
            try:
                if not recovered:
                    self.controller.recover()  # re-adopt what the previous leader (or we) started
                    recovered = True
                self.controller.step()
                backoff.succeeded()
                self.error = None
            except LeaseLost as exc:
                log.warning("reconcile pass rolled back: %s", exc)
                recovered = False
            except OperationalError as exc:  # the store is away: back off, say so on /healthz
                delay = backoff.failed(exc)
                self.error = backoff.condition
            except Exception as exc:  # keep reconciling; surface the error on /healthz and in the log
                log.exception("reconcile pass failed")
                self.error = f"{type(exc).__name__}: {exc}"
            self.controller.wait_for_work(delay)  # a submit, cancel or scale wakes it at once

    def stop(self) -> None:
        self.stopping.set()
        self.controller.wake()


def create_app(
    controller: Controller,
    reconcile: bool = True,
    options: ServiceOptions | None = None,
    elector: LeaderElector | None = None,
) -> FastAPI:
    """The service: REST API under /api/v1, /metrics, /healthz and the dashboard at /; with an
    ``elector`` (servers sharing a database) it reconciles only while it leads."""
    options = options or ServiceOptions()
    app = FastAPI(
        title="Trainmaster controller",
        version="1",
        description="Submit, inspect, stream logs of, cancel and delete training jobs. State changes "
        "(POST, DELETE) take 'Content-Type: application/json'; with a token, 'Authorization: Bearer <token>'.",
        docs_url=None,  # served by mount_api_docs, from the package (no CDN)
        redoc_url=None,
    )
    app.add_middleware(BodyLimit, limits=options.limits)
    sessions = controller.sessions
    jobs = Trainmaster(sessions, controller.db_url)  # every job verb goes through the facade
    draining = Draining()  # the server calls begin() when it stops, so live streams end themselves
    app.state.draining = draining
    mount_api_docs(app)  # before the dashboard's /static, which would shadow swagger-ui's files
    mount_dashboard(
        app, controller, jobs, options.paths, options.access, options.runtime, draining, quota=options.quota
    )
    app.add_middleware(RequestGuard, hosts=options.hosts)  # outermost: every answer gets its headers
    reconciler = Reconciler(controller, elector)

    @app.on_event("startup")
    def _start() -> None:
        if elector is not None:
            elector.start()
        if reconcile:
            reconciler.start()

    @app.on_event("shutdown")
    def _stop() -> None:
        reconciler.stop()
        if elector is not None:
            reconciler.join(timeout=controller.grace + 30)  # the pass in flight ends before the lease goes
            elector.stop()

    @app.exception_handler(OperationalError)
    def _store_down(_request: Request, exc: OperationalError) -> JSONResponse:
        log.warning("store unreachable: %s", exc.orig or exc)
        return JSONResponse(
            status_code=503,
            headers={"Retry-After": "2"},
            content={"error": "the store (database) is unreachable right now; retry shortly"},
        )

    @app.exception_handler(JobNotFound)
    def _not_found(_request: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": exc.message})

    @app.exception_handler(JobConflict)
    def _conflict(_request: Request, exc: JobConflict) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": exc.message})

    @app.exception_handler(OverQuota)
    def _over_quota(_request: Request, exc: OverQuota) -> JSONResponse:
        return JSONResponse(
            status_code=429, headers={"Retry-After": "30"}, content={"error": exc.message, "details": exc.details}
        )

    @app.exception_handler(UserError)
    def _user_error(_request: Request, exc: UserError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"error": exc.message, "details": exc.details})

    @app.exception_handler(RequestValidationError)
    def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
        details = [f"{field_path(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}" for e in exc.errors()]
        page = error_page(request, 422, details)  # a browser's page request: the dashboard's error page
        if page is not None:
            return page
        return JSONResponse(
            status_code=422, content={"error": f"invalid request to {request.url.path}", "details": details}
        )

    @app.exception_handler(Exception)
    def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
        page = error_page(request, 500, ["internal error; the server's log has the details"])
        if page is not None:
            return page
        return JSONResponse(
            status_code=500, content={"error": "internal error; the server's log has the details", "details": []}
        )

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": reconciler.error is None, "error": reconciler.error, **leadership()}

    def leadership() -> dict[str, Any]:
        """Who reconciles: this server alone, or the leader among servers sharing the store."""
        if elector is None:
            return {"leading": True, "leader": None}
        return {"leading": elector.leading, "leader": elector.leader, "server": elector.identity}

    @app.post(f"{API}/jobs", status_code=201)
    def submit(
        document: dict[str, Any] = Body(..., description="A job document: ours, Kubeflow or Volcano"),
        lenient: bool = Query(
            False, description="Kubeflow/Volcano: ignore (and list) unknown fields instead of refusing the document"
        ),
    ) -> dict[str, Any]:
        loaded = jobs.load(
            document,
            controller.backend.name,
            LoadOptions(paths=options.paths, lenient=lenient, runtime=options.runtime),
        )
        check_job(loaded.job, options.quota)
        with sessions() as session:
            check_room(session, sum(r.replicas for r in loaded.job.spec.roles), options.quota)
        job_id = jobs.submit(loaded, controller).id  # NameTaken: 409, as every JobConflict
        return {"id": job_id, "name": loaded.job.name, "ignored": loaded.ignored}

    @app.get(f"{API}/jobs")
    def list_jobs(query: Annotated[JobListQuery, Depends(job_list_query)]) -> Response:
        """Jobs in pages with filters, or a watch of their changes (:mod:`.joblist`)."""
        return list_or_watch(jobs, query)

    @app.get(f"{API}/jobs/{{ref}}")
    def status(
        ref: JobRef,
        events: int = Query(50, ge=0, le=10_000),
        instances_from: int = Query(
            0, alias="instancesFrom", ge=0, le=MAX_REPLICAS * 100, description="First instance of the page (by order)"
        ),
        instances: int = Query(
            STATUS_PAGE, ge=0, le=STATUS_PAGE_MAX, description="Instances in the page (instanceCount: all of them)"
        ),
    ) -> dict[str, Any]:
        page = jobs.status(ref, events=events, instances=(instances_from, instances))
        return {**page, "controller": leadership()}

    @app.post(f"{API}/jobs/{{ref}}/cancel")
    def cancel(ref: JobRef) -> dict[str, Any]:
        result = jobs.cancel(ref)
        controller.wake()
        return {"id": result.id, "cancelRequested": result.cancel_requested}

    @app.post(f"{API}/jobs/{{ref}}/resume")
    def resume(ref: JobRef) -> dict[str, Any]:
        """Take over a job whose `trainmaster run` died: this service carries it on (HTTP 409 when
        its run still lives, it has ended, or it ran on another backend)."""
        job_id = jobs.find(ref).id
        if elector is not None and not elector.leading:
            raise JobConflict(f"this server is a standby; ask the leader ({elector.leader}) to resume")
        controller.take_over(job_id)  # NotResumable: 409, as every JobConflict
        return {"id": job_id, "resumed": True}

    @app.post(f"{API}/jobs/{{ref}}/scale")
    def scale(ref: JobRef, body: ScaleRequest) -> dict[str, Any]:
        with sessions() as session:
            check_scale(session, repo.load_job(session, jobs.find(ref).id), body.role, body.replicas, options.quota)
        result = jobs.scale(ref, body.role, body.replicas)
        controller.wake()
        return {"id": result.id, "role": result.role, "replicas": result.replicas}

    @app.post(f"{API}/jobs/{{ref}}/suspend")
    def suspend(ref: JobRef) -> dict[str, Any]:
        result = jobs.suspend(ref, True)
        return {"id": result.id, "suspended": result.suspended, "changed": result.changed}

    @app.post(f"{API}/jobs/{{ref}}/unsuspend")
    def unsuspend(ref: JobRef) -> dict[str, Any]:
        result = jobs.suspend(ref, False)
        return {"id": result.id, "suspended": result.suspended, "changed": result.changed}

    @app.delete(f"{API}/jobs/{{ref}}")
    def delete(ref: JobRef) -> dict[str, Any]:
        return {"id": jobs.delete(ref).id, "deleted": True}

    @app.get(f"{API}/jobs/{{ref}}/logs")
    def logs(
        ref: JobRef,
        role: str | None = Query(None, max_length=63),
        index: int = Query(0, ge=0, le=MAX_REPLICAS),
        follow: bool = False,
        tail: int | None = Query(
            None, ge=1, le=100_000, description=("Only the last N lines (of at most the last MiB); not with follow")
        ),
    ) -> Response:
        if tail is not None:
            if follow:
                raise UserError("tail and follow: choose one", ["tail: drop it to follow the whole log"])
            return PlainTextResponse(jobs.tail(ref, role, index, lines=tail))
        return StreamingResponse(_stream(jobs.log_target(ref, role, index), follow), media_type="text/plain")

    async def _stream(target: LogTarget, follow: bool) -> AsyncIterator[bytes]:
        """The log from its start; with ``follow`` until the instance ends. Async, so a follower
        holds no worker thread while it waits for output."""
        offset, ended = 0, not follow
        while True:
            chunk = jobs.log_chunk(target, offset)
            offset += len(chunk)
            if chunk:
                yield chunk
            elif ended:
                return
            elif jobs.instance_ended(target.instance_id):
                ended = True  # one more pass drains what it wrote before it ended
            else:
                await asyncio.sleep(0.25)

    @app.get("/metrics")
    def prometheus() -> PlainTextResponse:
        with sessions() as session:
            counts = repo.state_counts(session)
            latest = repo.latest_metrics_of_live_jobs(session)
        for state in ("pending", "starting", "running", "succeeded", "failed", "cancelled"):
            metrics.JOBS.labels(state=state).set(counts.get(state, 0))
        metrics.LEADING.set(1 if elector is None or elector.leading else 0)
        metrics.REPORTED.clear()  # only live jobs' points: ended jobs' series go away
        for (job, role, index, name), value in latest.items():
            metrics.REPORTED.labels(job=job, role=role, index=str(index), metric=name).set(value)
        return PlainTextResponse(generate_latest(metrics.REGISTRY).decode(), media_type="text/plain; version=0.0.4")

    app.state.reconciler = reconciler
    app.openapi = lambda: _openapi_with_job_schema(app)  # type: ignore[method-assign]
    return app


def _openapi_with_job_schema(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document with the job model as the submit body's schema (the route takes any
    mapping, since Kubeflow and Volcano documents are accepted too), so that clients and API
    fuzzers see what a job looks like."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    job = Job.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(job.pop("$defs", {}))
    components["Job"] = job
    body = schema["paths"][f"{API}/jobs"]["post"]["requestBody"]["content"]["application/json"]
    body["schema"] = {
        "anyOf": [
            {"$ref": "#/components/schemas/Job"},
            {"type": "object", "description": "A Kubeflow PyTorchJob/TFJob/MPIJob or Volcano Job document"},
        ]
    }
    app.openapi_schema = schema
    return schema
