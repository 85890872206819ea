"""Serving the dashboard on the service's app: its route modules (:mod:`.auth`, :mod:`.pages`,
:mod:`.streams`, :mod:`.actions`), static files, error pages and token guard."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from trainmaster.api import LocalTrainmaster
from trainmaster.controller import Controller
from trainmaster.service.dashboard import actions, auth, pages, streams
from trainmaster.service.dashboard.access import AccessOptions, TokenMiddleware
from trainmaster.service.dashboard.capability import CapabilityDrawings
from trainmaster.service.dashboard.queues import add_queue_page
from trainmaster.service.dashboard.errors import install_error_pages
from trainmaster.service.dashboard.site import Dashboard
from trainmaster.service.dashboard.watch import StoreWatcher
from trainmaster.service.draining import Draining
from trainmaster.service.quotas import JobQuota
from trainmaster.spec.model import RuntimeKind
from trainmaster.spec.paths import PathPolicy

HERE = Path(__file__).parent


def mount_dashboard(
    app: FastAPI,
    controller: Controller,
    jobs: LocalTrainmaster,
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
    templates = Jinja2Templates(directory=str(HERE / "templates"))  # autoescapes .html
    templates.env.globals["csrf_token"] = access.csrf_token()
    install_error_pages(app, templates)
    watcher = StoreWatcher(controller.sessions)
    dashboard = app.state.dashboard = Dashboard(
        controller=controller,
        jobs=jobs,
        paths=paths,
        access=access,
        runtime=runtime,
        draining=draining or Draining(),
        quota=quota or JobQuota(),
        drawings=CapabilityDrawings(),
        templates=templates,
        watcher=watcher,
    )
    app.add_middleware(TokenMiddleware, options=access)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    app.router.on_shutdown.append(watcher.stop)
    for module in (auth, pages, streams, actions):
        app.include_router(module.router)
    queues_page = APIRouter(include_in_schema=False)
    add_queue_page(queues_page, controller.sessions, dashboard.page)  # /queues
    app.include_router(queues_page)
