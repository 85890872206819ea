"""The dashboard's pages, their htmx fragments, live streams and actions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, AsyncIterator

from typing import Annotated

from fastapi import APIRouter, FastAPI, Form, Header, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from trainmaster.controller import Controller
from trainmaster.controller.controller import NotResumable
from trainmaster.errors import UserError
from trainmaster.service.dashboard import views
from trainmaster.service.dashboard.capability import CapabilityDrawings
from trainmaster.service.dashboard.errors import install_error_pages
from trainmaster.service.dashboard.access import AccessOptions, TokenMiddleware, login
from trainmaster.service.dashboard.locate import line_of, split_error
from trainmaster.service.dashboard.queues import add_queue_page
from trainmaster.service.dashboard.watch import StoreWatcher
from trainmaster.service.draining import Draining
from trainmaster.service.quotas import JobQuota, check_job, check_room, check_scale
from trainmaster.api import NameTaken, Trainmaster
from trainmaster.spec.load import LoadOptions, parse_document
from trainmaster.spec.model import RuntimeKind
from trainmaster.spec.paths import PathPolicy
from trainmaster.store import repository as repo

HERE = Path(__file__).parent
KEEPALIVE = 15.0  # seconds between SSE comments, so proxies keep an idle stream open
LOG_POLL = 0.25  # seconds between looks at a followed log file
MAX_DOCUMENT = 256 * 1024  # a pasted job file; real ones are a few KB
MAX_ID = 2**63 - 1  # the store's integers are 64-bit: a larger one is no job, not an overflow
#: A job id in a dashboard path: within the store's integer range (a larger one is a 422, not a 500).
JobId = Annotated[int, PathParam(ge=1, le=MAX_ID, description="Job id")]


def mount_dashboard(
    app: FastAPI,
    controller: Controller,
    jobs: Trainmaster,
    paths: PathPolicy,
    access: AccessOptions,
    runtime: RuntimeKind | None = None,
    draining: Draining | None = None,
    quota: JobQuota | None = None,
) -> None:
    """Serve the dashboard at ``/`` on ``app`` and guard the whole app with ``access``; jobs
    submitted from the page take the REST API's path (the facade's ``load`` and ``submit``
    under the operator's path policy ``paths`` and ``runtime`` for ``auto`` roles). The live
    streams end when ``draining`` begins (the server stopping); jobs and scaling stay within
    ``quota``."""
    draining = draining or Draining()
    quota = quota or JobQuota()
    drawings = CapabilityDrawings()
    templates = Jinja2Templates(directory=str(HERE / "templates"))  # autoescapes .html
    templates.env.globals["csrf_token"] = access.csrf_token()
    install_error_pages(app, templates)
    watcher = StoreWatcher(controller.sessions)
    sessions = controller.sessions
    router = APIRouter(include_in_schema=False)
    app.add_middleware(TokenMiddleware, options=access)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    app.router.on_shutdown.append(watcher.stop)

    def page(request: Request, template: str, **context: Any) -> HTMLResponse:
        return templates.TemplateResponse(request, template, context)

    def load(session: Any, job_id: int) -> Any:
        try:
            return repo.load_job(session, job_id)
        except UserError:
            raise HTTPException(404, f"no job with id {job_id}") from None

    def guarded(request: Request) -> None:
        if not access.csrf_ok(request):
            raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")

    @router.get("/login")
    def login_page(request: Request, token: str = Query("", max_length=512)) -> Response:
        return login(request, access, token)

    @router.get("/", response_class=HTMLResponse)
    def jobs_page(
        request: Request,
        state: str = Query("", max_length=16),
        name: str = Query("", max_length=63),
        page_no: int = Query(1, alias="page", ge=1, le=MAX_ID // views.PAGE_SIZE),
    ) -> HTMLResponse:
        with sessions() as session:
            listing = views.job_list(session, state, name, page_no)
        return page(request, "jobs.html", listing=listing, state=state, name=name, states=views.STATES)

    @router.get("/ui/jobs/table", response_class=HTMLResponse)
    def jobs_table(
        request: Request,
        state: str = Query("", max_length=16),
        name: str = Query("", max_length=63),
        page_no: int = Query(1, alias="page", ge=1, le=MAX_ID // views.PAGE_SIZE),
    ) -> HTMLResponse:
        with sessions() as session:
            listing = views.job_list(session, state, name, page_no)
        return page(request, "_jobs_table.html", listing=listing, state=state, name=name)

    @router.get("/jobs/{ref}", response_class=HTMLResponse)
    def job_page(request: Request, ref: str = PathParam(min_length=1, max_length=63)) -> HTMLResponse:
        """A job's page by name (the most recent of that name), id or uid, as the CLI takes them."""
        try:
            job_id = jobs.find(ref).id
        except UserError as exc:
            raise HTTPException(404, exc.message) from None
        with sessions() as session:
            job = load(session, job_id)
            return page(
                request,
                "job.html",
                job=views.job_detail(session, job),
                instances=views.instances(session, job),
                spec=views.spec_yaml(job),
            )

    @router.get("/ui/jobs/{job_id}/summary", response_class=HTMLResponse)
    def job_summary(request: Request, job_id: JobId) -> HTMLResponse:
        with sessions() as session:
            job = load(session, job_id)
            return page(
                request,
                "_job_summary.html",
                job=views.job_detail(session, job),
                instances=views.instances(session, job),
            )

    @router.get("/ui/jobs/{job_id}/views", response_class=HTMLResponse)
    def job_views(request: Request, job_id: JobId) -> HTMLResponse:
        """What the job's capability published (federated schedule, aggregation counters,
        partition, gateway legs), drawn; empty for a job that published nothing."""
        with sessions() as session:
            job = load(session, job_id)
            output = Path(job.run_dir) / "output" if job.run_dir else None
        drawn = drawings.draw(output) if output else []
        return page(request, "_capability.html", views=drawn)

    @router.get("/ui/jobs/{job_id}/metrics")
    def job_metrics(job_id: JobId, after: int = Query(0, ge=0, le=MAX_ID)) -> JSONResponse:
        with sessions() as session:
            load(session, job_id)
            return JSONResponse(views.metric_series(session, job_id, after))

    def log_path(job_id: int, label: str) -> str | None:
        with sessions() as session:
            job = load(session, job_id)
            chosen = [i for i in job.instances if i.label == label]
            if not chosen:
                raise HTTPException(404, f"job {job.name} has no instance {label}")
            return chosen[-1].log_path

    @router.get("/ui/jobs/{job_id}/log")
    def job_log(
        job_id: JobId, instance: str = Query(..., max_length=80), offset: int | None = Query(None, ge=0, le=MAX_ID)
    ) -> JSONResponse:
        chunk = views.read_log(log_path(job_id, instance), offset)
        return JSONResponse(
            {"text": chunk.text, "offset": chunk.offset, "size": chunk.size, "truncated": chunk.truncated}
        )

    @router.get("/ui/jobs/{job_id}/log/stream")
    async def job_log_stream(
        request: Request,
        job_id: JobId,
        instance: str = Query(..., max_length=80),
        offset: int = Query(0, ge=0, le=MAX_ID),
        last_event_id: int | None = Header(None, alias="Last-Event-ID", ge=0, le=MAX_ID),
    ) -> StreamingResponse:
        path = log_path(job_id, instance)

        async def follow() -> AsyncIterator[str]:
            # each event's id is the log offset after it: a browser reconnecting (the server
            # restarted) sends the last one back and gets only what it has not shown yet
            position, quiet = (offset if last_event_id is None else last_event_id), 0.0
            while not draining.begun and not await request.is_disconnected():
                chunk = await asyncio.to_thread(views.read_log, path, position)
                if chunk.text:
                    position, quiet = chunk.offset, 0.0
                    yield f"id: {chunk.offset}\ndata: {json.dumps({'text': chunk.text, 'offset': chunk.offset})}\n\n"
                    continue
                quiet += LOG_POLL
                if quiet >= KEEPALIVE:
                    quiet = 0.0
                    yield ": keepalive\n\n"
                await asyncio.sleep(LOG_POLL)

        return StreamingResponse(follow(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    @router.get("/ui/stream")
    async def changes(request: Request) -> StreamingResponse:
        queue = watcher.subscribe()

        async def stream() -> AsyncIterator[str]:
            try:
                while not draining.begun and not await request.is_disconnected():
                    version = await draining.first(queue.get(), KEEPALIVE)
                    if version is None:
                        if not draining.begun:
                            yield ": keepalive\n\n"
                        continue
                    yield f"event: change\ndata: {version}\n\n"
            finally:
                watcher.unsubscribe(queue)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    @router.post("/ui/jobs/{job_id}/cancel")
    def cancel(request: Request, job_id: JobId) -> Response:
        guarded(request)
        with sessions() as session:
            load(session, job_id)
        controller.cancel(job_id)
        return Response(status_code=204, headers={"HX-Trigger": "tm-change"})

    @router.post("/ui/jobs/{job_id}/resume")
    def resume(request: Request, job_id: JobId) -> Response:
        guarded(request)
        with sessions() as session:
            load(session, job_id)
        try:
            controller.take_over(job_id)
        except NotResumable as exc:
            return HTMLResponse(f"<span class='error'>{_escape(exc.message)}</span>", status_code=409)
        return Response(status_code=204, headers={"HX-Trigger": "tm-change"})

    @router.post("/ui/jobs/{job_id}/scale")
    def scale(
        request: Request,
        job_id: JobId,
        role: str = Form(..., max_length=63),
        replicas: int = Form(..., ge=1, le=10_000),
    ) -> Response:
        guarded(request)
        try:
            with sessions() as session:
                check_scale(session, load(session, job_id), role, replicas, quota)
            controller.scale(job_id, role, replicas)
        except UserError as exc:
            return HTMLResponse(f"<span class='error'>{_escape(str(exc))}</span>", status_code=422)
        return Response(status_code=204, headers={"HX-Trigger": "tm-change"})

    @router.post("/ui/jobs/{job_id}/delete")
    def delete(request: Request, job_id: JobId) -> Response:
        guarded(request)
        with sessions() as session:
            job = load(session, job_id)
            if not repo.is_terminal(job.state):
                return HTMLResponse(
                    f"<span class='error'>job {_escape(job.name)} is {job.state}; cancel it first</span>",
                    status_code=409,
                )
            session.delete(job)
            session.commit()
        return Response(status_code=204, headers={"HX-Redirect": "/"})

    @router.get("/submit", response_class=HTMLResponse)
    def submit_page(request: Request) -> HTMLResponse:
        return page(request, "submit.html")

    def check(document: str) -> tuple[Any, list[dict[str, Any]]]:
        """The loaded job, or the problems with the line each one points at."""
        if len(document.encode()) > MAX_DOCUMENT:
            return None, [{"path": "", "line": None, "message": f"the document is over {MAX_DOCUMENT // 1024} KB"}]
        try:
            loaded = jobs.load(
                parse_document(document, "pasted job"),
                controller.backend.name,
                LoadOptions(paths=paths, runtime=runtime),
                source="pasted job",
            )
            check_job(loaded.job, quota, "pasted job")
            with sessions() as session:
                check_room(session, sum(r.replicas for r in loaded.job.spec.roles), quota)
            return loaded, []
        except UserError as exc:
            problems = []
            for detail in exc.details or [exc.message]:
                path, message = split_error(detail)
                problems.append({"path": path, "line": line_of(document, path) if path else None, "message": message})
            return None, problems

    @router.post("/ui/validate", response_class=HTMLResponse)
    def validate(request: Request, document: str = Form("")) -> HTMLResponse:
        guarded(request)
        loaded, problems = check(document)
        return page(
            request,
            "_validation.html",
            problems=problems,
            lines=document.splitlines(),
            ok=loaded is not None,
            ignored=loaded.ignored if loaded else [],
        )

    @router.post("/ui/submit", response_class=HTMLResponse)
    def submit(request: Request, document: str = Form("")) -> Response:
        guarded(request)
        loaded, problems = check(document)
        if loaded is None:
            return page(
                request, "_validation.html", problems=problems, lines=document.splitlines(), ok=False, ignored=[]
            )
        try:
            job_id = jobs.submit(loaded, controller).id
        except NameTaken as exc:
            return page(
                request,
                "_validation.html",
                problems=[{"path": "metadata.name", "message": str(exc), "line": line_of(document, "metadata.name")}],
                lines=document.splitlines(),
                ok=False,
                ignored=[],
            )
        return Response(status_code=204, headers={"HX-Redirect": f"/jobs/{job_id}"})

    add_queue_page(router, sessions, page)  # /queues
    app.include_router(router)


def _escape(text: str) -> str:
    from html import escape

    return escape(text, quote=True)
