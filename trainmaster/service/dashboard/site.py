"""What the dashboard's route modules share: the controller and facade, the operator's
choices, the templates, the store watcher, and the helpers every page and action uses (render a
template, load a job or answer 404, check the CSRF token, check a pasted job). One
:class:`Dashboard` per app, on ``app.state.dashboard``."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Annotated, Any

from fastapi import HTTPException, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from trainmaster.api import LocalTrainmaster
from trainmaster.controller import Controller
from trainmaster.errors import UserError
from trainmaster.service.dashboard.access import AccessOptions
from trainmaster.service.dashboard.capability import CapabilityDrawings
from trainmaster.service.dashboard.locate import line_of, split_error
from trainmaster.service.dashboard.watch import StoreWatcher
from trainmaster.service.draining import Draining
from trainmaster.service.quotas import JobQuota, check_job, check_room
from trainmaster.spec.load import LoadedJob, LoadOptions, parse_document
from trainmaster.spec.model import RuntimeKind
from trainmaster.spec.paths import PathPolicy
from trainmaster.store import repository as repo
from trainmaster.store.models import JobRow

KEEPALIVE = 15.0  # seconds between SSE comments, so proxies keep an idle stream open
LOG_POLL = 0.25  # seconds between looks at a followed log file
MAX_DOCUMENT = 256 * 1024  # a pasted job file; real ones are a few KB
MAX_ID = 2**63 - 1  # the store's integers are 64-bit: a larger one is no job, not an overflow
#: A job id in a dashboard path: within the store's integer range (a larger one is a 422, not a 500).
JobId = Annotated[int, PathParam(ge=1, le=MAX_ID, description="Job id")]


@dataclass(frozen=True)
class Dashboard:
    """The dashboard's parts (see the module's docstring)."""

    controller: Controller
    jobs: LocalTrainmaster
    paths: PathPolicy
    access: AccessOptions
    runtime: RuntimeKind | None
    draining: Draining
    quota: JobQuota
    drawings: CapabilityDrawings
    templates: Jinja2Templates
    watcher: StoreWatcher

    @property
    def sessions(self) -> Any:
        return self.controller.sessions

    def page(self, request: Request, template: str, **context: Any) -> HTMLResponse:
        return self.templates.TemplateResponse(request, template, context)

    @staticmethod
    def load(session: Any, job_id: int) -> JobRow:
        try:
            return repo.load_job(session, job_id)
        except UserError:
            raise HTTPException(404, f"no job with id {job_id}") from None

    def guarded(self, request: Request) -> None:
        if not self.access.csrf_ok(request):
            raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")

    def log_path(self, job_id: int, label: str) -> str | None:
        with self.sessions() as session:
            job = self.load(session, job_id)
            chosen = [i for i in job.instances if i.label == label]
            if not chosen:
                raise HTTPException(404, f"job {job.name} has no instance {label}")
            return chosen[-1].log_path

    def check(self, document: str) -> tuple[LoadedJob | None, list[dict[str, Any]]]:
        """The loaded job, or the problems with the line each one points at."""
        if len(document.encode()) > MAX_DOCUMENT:
            return None, [{"path": "", "line": None, "message": f"the document is over {MAX_DOCUMENT // 1024} KB"}]
        try:
            loaded = self.jobs.load(
                parse_document(document, "pasted job"),
                self.controller.backend.name,
                LoadOptions(paths=self.paths, runtime=self.runtime),
                source="pasted job",
            )
            check_job(loaded.job, self.quota, "pasted job")
            with self.sessions() as session:
                check_room(session, sum(r.replicas for r in loaded.job.spec.roles), self.quota)
            return loaded, []
        except UserError as exc:
            problems = []
            for detail in exc.details or [exc.message]:
                path, message = split_error(detail)
                problems.append({"path": path, "line": line_of(document, path) if path else None, "message": message})
            return None, problems


def dashboard_of(request: Request) -> Dashboard:
    """The dashboard of the app answering ``request``."""
    dashboard: Dashboard = request.app.state.dashboard
    return dashboard


def error_fragment(message: str, status_code: int) -> HTMLResponse:
    """An htmx fragment saying what went wrong (escaped)."""
    return HTMLResponse(f"<span class='error'>{escape(message, quote=True)}</span>", status_code=status_code)
