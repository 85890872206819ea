"""FastAPI application of the controller service (``trainmaster server``).

The API only reads the store and records intents (submit, scale, cancel, delete); the reconcile
thread does everything else, so a request never waits on instances and a crash of the server
loses nothing that was acknowledged: a job is committed before ``201`` is returned.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import Body, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import OperationalError

from trainmaster.controller import Controller
from trainmaster.controller import metrics
from trainmaster.controller.leader import LeaderElector, LeaseLost
from trainmaster.service.dashboard import AccessOptions, mount_dashboard
from trainmaster.errors import UserError
from trainmaster.spec.load import load_document
from trainmaster.store import repository as repo

API = "/api/v1"
log = logging.getLogger(__name__)


class ScaleRequest(BaseModel):
    """A role's new desired replica count (``POST /api/v1/jobs/{ref}/scale``)."""

    model_config = ConfigDict(extra="forbid")
    role: str = Field(min_length=1)
    replicas: int = Field(ge=1)


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
        while not self.stopping.is_set():
            if self.elector is not None and not self.elector.leading:
                recovered = False  # a standby: the leader reconciles
                self.elector.elected.wait(self.controller.interval)
                continue
            try:
                if not recovered:
                    self.controller.recover()  # re-adopt what the previous leader (or we) started
                    recovered = True
                self.controller.step()
                self.error = None
            except LeaseLost as exc:
                log.warning("reconcile pass rolled back: %s", exc)
                recovered = False
            except Exception as exc:  # keep reconciling; surface the error on /healthz and in the log
                log.exception("reconcile pass failed")
                self.error = f"{type(exc).__name__}: {exc}"
            self.stopping.wait(self.controller.interval)


def create_app(controller: Controller, reconcile: bool = True, access: AccessOptions | None = None,
               elector: LeaderElector | None = None) -> FastAPI:
    """The service: REST API under /api/v1, /metrics, /healthz and the dashboard at /.

    ``access`` guards all of it (a token when the server listens beyond loopback)."""
    app = FastAPI(title="Trainmaster controller", version="1",
                  description="Submit, inspect, stream logs of, cancel and delete training jobs.")
    mount_dashboard(app, controller, access or AccessOptions())
    reconciler = Reconciler(controller, elector)
    sessions = controller.sessions

    @app.on_event("startup")
    def _start() -> None:
        if elector is not None:
            elector.start()
        if reconcile:
            reconciler.start()

    @app.on_event("shutdown")
    def _stop() -> None:
        reconciler.stopping.set()
        if elector is not None:
            reconciler.join(timeout=controller.grace + 30)  # the pass in flight ends before the lease goes
            elector.stop()

    @app.exception_handler(OperationalError)
    def _store_down(_request: Request, exc: OperationalError) -> JSONResponse:
        log.warning("store unreachable: %s", exc.orig or exc)
        return JSONResponse(status_code=503, headers={"Retry-After": "2"},
                            content={"error": "the store (database) is unreachable right now; retry shortly"})

    @app.exception_handler(UserError)
    def _user_error(_request: Request, exc: UserError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"error": exc.message, "details": exc.details})

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        leadership = ({"leading": True, "leader": None} if elector is None else
                      {"leading": elector.leading, "leader": elector.leader, "server": elector.identity})
        return {"ok": reconciler.error is None, "error": reconciler.error, **leadership}

    @app.post(f"{API}/jobs", status_code=201)
    def submit(document: dict[str, Any] = Body(..., description="A job document: ours, Kubeflow or Volcano")) -> dict[str, Any]:
        loaded = load_document(document, source="submitted job")
        job_id = controller.submit(loaded)
        return {"id": job_id, "name": loaded.job.name, "ignored": loaded.ignored}

    @app.get(f"{API}/jobs")
    def list_jobs() -> list[dict[str, Any]]:
        with sessions() as session:
            return repo.job_summaries(session)

    @app.get(f"{API}/jobs/{{ref}}")
    def status(ref: str, events: int = Query(50, ge=0, le=10_000)) -> dict[str, Any]:
        with sessions() as session:
            job = _find(session, ref)
            return repo.job_status(session, repo.load_job(session, job.id), events=events)

    @app.post(f"{API}/jobs/{{ref}}/cancel")
    def cancel(ref: str) -> dict[str, Any]:
        with sessions() as session:
            job = _find(session, ref)
        controller.cancel(job.id)
        return {"id": job.id, "cancelRequested": not repo.is_terminal(job.state)}

    @app.post(f"{API}/jobs/{{ref}}/scale")
    def scale(ref: str, body: ScaleRequest) -> dict[str, Any]:
        with sessions() as session:
            job = _find(session, ref)
        controller.scale(job.id, body.role, body.replicas)
        return {"id": job.id, "role": body.role, "replicas": body.replicas}

    @app.delete(f"{API}/jobs/{{ref}}")
    def delete(ref: str) -> dict[str, Any]:
        with sessions() as session:
            job = _find(session, ref)
            if not repo.is_terminal(job.state):
                raise HTTPException(409, f"job {job.name} (id {job.id}) is {job.state}; cancel it first")
            session.delete(repo.load_job(session, job.id))
            session.commit()
        return {"id": job.id, "deleted": True}

    @app.get(f"{API}/jobs/{{ref}}/logs")
    def logs(ref: str, role: str | None = None, index: int = Query(0, ge=0),
             follow: bool = False) -> StreamingResponse:
        with sessions() as session:
            job = repo.load_job(session, _find(session, ref).id)
            chosen = [i for i in job.instances if (role is None or i.role == role) and i.index == index]
            if not chosen:
                raise HTTPException(404, f"job {job.name} has no instance {role or '<first role>'}-{index}")
            inst = chosen[0]
            if not inst.log_path:
                raise HTTPException(404, f"{inst.label} has not started yet; no log")
            path, instance_id = Path(inst.log_path), inst.id
        return StreamingResponse(_stream(path, instance_id, follow), media_type="text/plain")

    async def _stream(path: Path, instance_id: int, follow: bool) -> AsyncIterator[bytes]:
        offset = 0
        while True:
            if path.exists():
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                    offset += len(chunk)
                if chunk:
                    yield chunk
            if not follow or _instance_ended(instance_id):
                if follow and path.exists() and path.stat().st_size > offset:
                    continue
                return
            await asyncio.sleep(0.25)

    def _instance_ended(instance_id: int) -> bool:
        from trainmaster.spec.states import INSTANCE_TERMINAL
        from trainmaster.store.models import InstanceRow

        with sessions() as session:
            inst = session.get(InstanceRow, instance_id)
            return inst is None or inst.state in {s.value for s in INSTANCE_TERMINAL}

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
        return PlainTextResponse(generate_latest(metrics.REGISTRY).decode(),
                                 media_type="text/plain; version=0.0.4")

    def _find(session: Any, ref: str) -> Any:
        try:
            return repo.find_job(session, ref)
        except UserError as exc:
            raise HTTPException(404, exc.message) from None

    app.state.reconciler = reconciler
    return app
