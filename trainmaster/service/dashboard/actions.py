"""The dashboard's actions: cancel, resume, scale and delete a job, check and submit a pasted
one. Each is a POST that must carry the page's CSRF token (:meth:`.site.Dashboard.guarded`)."""

from __future__ import annotations

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, Response

from trainmaster.store.repository import NameTaken
from trainmaster.controller.controller import NotResumable
from trainmaster.errors import UserError
from trainmaster.service.dashboard.locate import line_of
from trainmaster.service.dashboard.site import JobId, dashboard_of, error_fragment
from trainmaster.service.quotas import check_scale
from trainmaster.store import repository as repo

router = APIRouter(include_in_schema=False)


@router.post("/ui/jobs/{job_id}/cancel")
def cancel(request: Request, job_id: JobId) -> Response:
    dashboard = dashboard_of(request)
    dashboard.guarded(request)
    with dashboard.sessions() as session:
        dashboard.load(session, job_id)
    dashboard.controller.cancel(job_id)
    return Response(status_code=204, headers={"HX-Trigger": "tm-change"})


@router.post("/ui/jobs/{job_id}/resume")
def resume(request: Request, job_id: JobId) -> Response:
    dashboard = dashboard_of(request)
    dashboard.guarded(request)
    with dashboard.sessions() as session:
        dashboard.load(session, job_id)
    try:
        request.app.state.reconciler.take_over(job_id)  # where the reconcile loop runs
    except NotResumable as exc:
        return error_fragment(exc.message, 409)
    return Response(status_code=204, headers={"HX-Trigger": "tm-change"})


@router.post("/ui/jobs/{job_id}/scale")
def scale(
    request: Request,
    job_id: JobId,
    role: str = Form(..., max_length=63),
    replicas: int = Form(..., ge=1, le=10_000),
) -> Response:
    dashboard = dashboard_of(request)
    dashboard.guarded(request)
    try:
        with dashboard.sessions() as session:
            check_scale(session, dashboard.load(session, job_id), role, replicas, dashboard.quota)
        dashboard.controller.scale(job_id, role, replicas)
    except UserError as exc:
        return error_fragment(str(exc), 422)
    return Response(status_code=204, headers={"HX-Trigger": "tm-change"})


@router.post("/ui/jobs/{job_id}/delete")
def delete(request: Request, job_id: JobId) -> Response:
    dashboard = dashboard_of(request)
    dashboard.guarded(request)
    with dashboard.sessions() as session:
        job = dashboard.load(session, job_id)
        if not repo.is_terminal(job.state):
            return error_fragment(f"job {job.name} is {job.state}; cancel it first", 409)
        session.delete(job)
        session.commit()
    return Response(status_code=204, headers={"HX-Redirect": "/"})


@router.post("/ui/validate", response_class=HTMLResponse)
def validate(request: Request, document: str = Form("")) -> HTMLResponse:
    dashboard = dashboard_of(request)
    dashboard.guarded(request)
    loaded, problems = dashboard.check(document)
    return dashboard.page(
        request,
        "_validation.html",
        problems=problems,
        lines=document.splitlines(),
        ok=loaded is not None,
        ignored=loaded.ignored if loaded else [],
    )


@router.post("/ui/submit", response_class=HTMLResponse)
def submit(request: Request, document: str = Form("")) -> Response:
    dashboard = dashboard_of(request)
    dashboard.guarded(request)
    loaded, problems = dashboard.check(document)
    if loaded is None:
        return dashboard.page(
            request, "_validation.html", problems=problems, lines=document.splitlines(), ok=False, ignored=[]
        )
    try:
        job_id = dashboard.jobs.submit(loaded, dashboard.controller).id
    except NameTaken as exc:
        return dashboard.page(
            request,
            "_validation.html",
            problems=[{"path": "metadata.name", "message": str(exc), "line": line_of(document, "metadata.name")}],
            lines=document.splitlines(),
            ok=False,
            ignored=[],
        )
    return Response(status_code=204, headers={"HX-Redirect": f"/jobs/{job_id}"})
