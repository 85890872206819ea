"""The REST job verbs under ``/api/v1/jobs``: submit, list, status, cancel, resume, scale,
suspend, unsuspend and delete. They only read the store and record intents through the facade;
the reconcile thread does the rest, so a request never waits on instances. Jobs enter and grow
only within the operator's quota (:mod:`trainmaster.service.quotas`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Request, Response
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from trainmaster.service.answers import json_answer
from trainmaster.service.joblist import JobListQuery, job_list_query, list_or_watch
from trainmaster.service.quotas import check_job, check_room, check_scale
from trainmaster.service.state import API, service_of
from trainmaster.spec.load import LoadOptions
from trainmaster.spec.model import MAX_REPLICAS
from trainmaster.store import repository as repo
from trainmaster.store.runtimes import session_reader

STATUS_PAGE = 1_000  # instances in one status answer unless asked otherwise
STATUS_PAGE_MAX = 10_000

#: A job reference in a URL: a name (at most 63 characters), a uid (32) or an id.
JobRef = Annotated[str, PathParam(min_length=1, max_length=63, description="Job name, uid or id")]

router = APIRouter()


class ScaleRequest(BaseModel):
    """A role's new desired replica count (``POST /api/v1/jobs/{ref}/scale``)."""

    model_config = ConfigDict(extra="forbid")
    role: str = Field(min_length=1)
    replicas: int = Field(ge=1, le=MAX_REPLICAS)


@router.post(f"{API}/jobs", status_code=201)
def submit(
    request: Request,
    document: dict[str, Any] = Body(..., description="A job document: ours, Kubeflow or Volcano"),
    lenient: bool = Query(
        False, description="Kubeflow/Volcano: ignore (and list) unknown fields instead of refusing the document"
    ),
) -> dict[str, Any]:
    service = service_of(request)
    options = service.options
    loaded = service.jobs.load(
        document,
        service.controller.backend.name,
        LoadOptions(
            paths=options.paths,
            lenient=lenient,
            runtime=options.runtime,
            installed_runtimes=session_reader(service.controller.sessions),  # `trainmaster runtime add`
        ),
    )
    check_job(loaded.job, options.quota)
    with service.controller.sessions() as session:
        check_room(session, sum(r.replicas for r in loaded.job.spec.roles), options.quota)
    job_id = service.jobs.submit(loaded, service.controller).id  # NameTaken: 409, as every JobConflict
    return {"id": job_id, "name": loaded.job.name, "ignored": loaded.ignored}


@router.get(f"{API}/jobs")
def list_jobs(request: Request, query: Annotated[JobListQuery, Depends(job_list_query)]) -> Response:
    """Jobs in pages with filters, or a watch of their changes (:mod:`trainmaster.service.joblist`)."""
    return list_or_watch(service_of(request).jobs, query)


@router.get(f"{API}/jobs/{{ref}}")
def status(
    request: Request,
    ref: JobRef,
    events: int = Query(50, ge=0, le=10_000),
    instances_from: int = Query(
        0, alias="instancesFrom", ge=0, le=MAX_REPLICAS * 100, description="First instance of the page (by order)"
    ),
    instances: int = Query(
        STATUS_PAGE, ge=0, le=STATUS_PAGE_MAX, description="Instances in the page (instanceCount: all of them)"
    ),
) -> Response:
    """A job's status document: its roles, a page of its instances, its latest ``events``."""
    service = service_of(request)
    page = service.jobs.status(ref, events=events, instances=(instances_from, instances))
    return json_answer({**page, "controller": service.leadership()})


@router.post(f"{API}/jobs/{{ref}}/cancel")
def cancel(request: Request, ref: JobRef) -> dict[str, Any]:
    service = service_of(request)
    result = service.jobs.cancel(ref)
    service.controller.wake()
    return {"id": result.id, "cancelRequested": result.cancel_requested}


@router.post(f"{API}/jobs/{{ref}}/resume")
def resume(request: Request, ref: JobRef) -> dict[str, Any]:
    """Take over a job whose `trainmaster run` died: this service carries it on (HTTP 409 when
    its run still lives, it has ended, or it ran on another backend)."""
    service = service_of(request)
    job_id = service.jobs.find(ref).id
    service.reconciler.take_over(job_id)  # where the loop runs; NotResumable: 409, as every JobConflict
    return {"id": job_id, "resumed": True}


@router.post(f"{API}/jobs/{{ref}}/scale")
def scale(request: Request, ref: JobRef, body: ScaleRequest) -> dict[str, Any]:
    service = service_of(request)
    with service.controller.sessions() as session:
        job = repo.load_job(session, service.jobs.find(ref).id)
        check_scale(session, job, body.role, body.replicas, service.options.quota)
    result = service.jobs.scale(ref, body.role, body.replicas)
    service.controller.wake()
    return {"id": result.id, "role": result.role, "replicas": result.replicas}


@router.post(f"{API}/jobs/{{ref}}/suspend")
def suspend(request: Request, ref: JobRef) -> dict[str, Any]:
    result = service_of(request).jobs.suspend(ref, True)
    return {"id": result.id, "suspended": result.suspended, "changed": result.changed}


@router.post(f"{API}/jobs/{{ref}}/unsuspend")
def unsuspend(request: Request, ref: JobRef) -> dict[str, Any]:
    result = service_of(request).jobs.suspend(ref, False)
    return {"id": result.id, "suspended": result.suspended, "changed": result.changed}


@router.delete(f"{API}/jobs/{{ref}}")
def delete(request: Request, ref: JobRef) -> dict[str, Any]:
    return {"id": service_of(request).jobs.delete(ref).id, "deleted": True}
