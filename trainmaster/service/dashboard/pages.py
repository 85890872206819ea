"""The dashboard's pages and the htmx fragments and JSON they refresh themselves with: the job
list, a job's page (summary, capability views, metric curves, log), the submit page."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse

from trainmaster.errors import UserError
from trainmaster.service.dashboard import views
from trainmaster.service.dashboard.site import MAX_ID, JobId, dashboard_of

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True)
class JobFilter:
    """The job list's query (state, name prefix, page), shared by the page and its refresh."""

    state: str
    name: str
    page_no: int


def job_filter(
    state: str = Query("", max_length=16),
    name: str = Query("", max_length=63),
    page_no: int = Query(1, alias="page", ge=1, le=MAX_ID // views.PAGE_SIZE),
) -> JobFilter:
    return JobFilter(state, name, page_no)


def _jobs(request: Request, query: JobFilter, template: str, **extra: object) -> HTMLResponse:
    dashboard = dashboard_of(request)
    with dashboard.sessions() as session:
        listing = views.job_list(session, query.state, query.name, query.page_no)
    return dashboard.page(request, template, listing=listing, state=query.state, name=query.name, **extra)


@router.get("/", response_class=HTMLResponse)
def jobs_page(request: Request, query: JobFilter = Depends(job_filter)) -> HTMLResponse:
    return _jobs(request, query, "jobs.html", states=views.STATES)


@router.get("/ui/jobs/table", response_class=HTMLResponse)
def jobs_table(request: Request, query: JobFilter = Depends(job_filter)) -> HTMLResponse:
    return _jobs(request, query, "_jobs_table.html")


@router.get("/jobs/{ref}", response_class=HTMLResponse)
def job_page(request: Request, ref: str = PathParam(min_length=1, max_length=63)) -> HTMLResponse:
    """A job's page by name (the most recent of that name), id or uid, as the CLI takes them."""
    dashboard = dashboard_of(request)
    try:
        job_id = dashboard.jobs.find(ref).id
    except UserError as exc:
        raise HTTPException(404, exc.message) from None
    with dashboard.sessions() as session:
        job = dashboard.load(session, job_id)
        return dashboard.page(
            request,
            "job.html",
            job=views.job_detail(session, job),
            instances=views.instances(session, job),
            spec=views.spec_yaml(job),
        )


@router.get("/ui/jobs/{job_id}/summary", response_class=HTMLResponse)
def job_summary(request: Request, job_id: JobId) -> HTMLResponse:
    dashboard = dashboard_of(request)
    with dashboard.sessions() as session:
        job = dashboard.load(session, job_id)
        return dashboard.page(
            request,
            "_job_summary.html",
            job=views.job_detail(session, job),
            instances=views.instances(session, job),
        )


@router.get("/ui/jobs/{job_id}/views", response_class=HTMLResponse)
def job_views(request: Request, job_id: JobId) -> HTMLResponse:
    """What the job's capability published (federated schedule, aggregation counters,
    partition, gateway legs), drawn; empty for a job that published nothing."""
    dashboard = dashboard_of(request)
    with dashboard.sessions() as session:
        job = dashboard.load(session, job_id)
        output = Path(job.run_dir) / "output" if job.run_dir else None
    drawn = dashboard.drawings.draw(output) if output else []
    return dashboard.page(request, "_capability.html", views=drawn)


@router.get("/ui/jobs/{job_id}/metrics")
def job_metrics(request: Request, job_id: JobId, after: int = Query(0, ge=0, le=MAX_ID)) -> JSONResponse:
    dashboard = dashboard_of(request)
    with dashboard.sessions() as session:
        dashboard.load(session, job_id)
        return JSONResponse(views.metric_series(session, job_id, after))


@router.get("/ui/jobs/{job_id}/log")
def job_log(
    request: Request,
    job_id: JobId,
    instance: str = Query(..., max_length=80),
    offset: int | None = Query(None, ge=0, le=MAX_ID),
) -> JSONResponse:
    chunk = views.read_log(dashboard_of(request).log_path(job_id, instance), offset)
    return JSONResponse({"text": chunk.text, "offset": chunk.offset, "size": chunk.size, "truncated": chunk.truncated})


@router.get("/submit", response_class=HTMLResponse)
def submit_page(request: Request) -> HTMLResponse:
    return dashboard_of(request).page(request, "submit.html")
