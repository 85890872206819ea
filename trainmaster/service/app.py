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

The routes live in :mod:`.routes`, one module per concern, and read the parts built here from
``app.state.service`` (:class:`.state.ServiceState`); the dashboard mounts its own.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from trainmaster.api import LocalTrainmaster
from trainmaster.controller import Controller
from trainmaster.controller.leader import LeaderElector
from trainmaster.service.apidocs import mount_api_docs
from trainmaster.service.dashboard import mount_dashboard
from trainmaster.service.draining import Draining
from trainmaster.service.limits import BodyLimit
from trainmaster.service.protect import RequestGuard
from trainmaster.service.queue_routes import register_queue_routes
from trainmaster.service.reconciler import ControllerLink, Reconciler
from trainmaster.service.routes import health, jobs, logs, metrics
from trainmaster.service.routes.errors import install_error_handlers
from trainmaster.service.state import API, ServiceOptions, ServiceState
from trainmaster.spec.model import Job

__all__ = ["API", "Reconciler", "ServiceOptions", "create_app"]

#: The service's route modules, in the order they are matched.
ROUTES = (health, jobs, logs, metrics)


def create_app(
    controller: Controller,
    reconcile: bool = True,
    options: ServiceOptions | None = None,
    elector: LeaderElector | None = None,
    link: ControllerLink | None = None,
) -> FastAPI:
    """The service: REST API under /api/v1, /metrics, /healthz and the dashboard at /; with an
    ``elector`` (servers sharing a database) it reconciles only while it leads. With a ``link``
    (``trainmaster server``: the controller process, :mod:`.controller_process`) the loop runs
    there, elects there, and ``controller`` here only reads the store and records intents."""
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
    facade = LocalTrainmaster(controller.sessions, controller.db_url)  # every job verb goes through the facade
    draining = Draining()  # the server calls begin() when it stops, so live streams end themselves
    reconciler: ControllerLink = link or Reconciler(controller, elector)
    app.state.draining = draining
    app.state.reconciler = reconciler
    app.state.service = ServiceState(controller, facade, options, reconciler, draining)
    mount_api_docs(app)  # before the dashboard's /static, which would shadow swagger-ui's files
    mount_dashboard(
        app, controller, facade, options.paths, options.access, options.runtime, draining, quota=options.quota
    )
    app.add_middleware(RequestGuard, hosts=options.hosts)  # outermost: every answer gets its headers

    @app.on_event("startup")
    def _start() -> None:
        if elector is not None:
            elector.start()
        if reconcile or link is not None:
            reconciler.start()

    @app.on_event("shutdown")
    def _stop() -> None:
        reconciler.stop()
        if elector is not None or link is not None:
            reconciler.join(timeout=controller.grace + 30)  # the pass in flight ends before the lease goes
        if elector is not None:
            elector.stop()

    install_error_handlers(app)
    for module in ROUTES:
        app.include_router(module.router)
    register_queue_routes(app, controller, facade)  # queues with quota, and "why pending"
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
