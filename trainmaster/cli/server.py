"""``trainmaster server``: the controller as a long-running service with a REST API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trainmaster.cli.jobs import AllowFrameworkOpt, DbOpt, make_backend


def server(
    db: DbOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8642,
    backend: Annotated[str, typer.Option(help="Where instances run: local or ray.")] = "local",
    ray_address: Annotated[Optional[str], typer.Option(help="Join this Ray cluster (backend ray).")] = None,
    interval: Annotated[float, typer.Option(min=0.01, help="Seconds between reconcile passes.")] = 1.0,
    grace: Annotated[float, typer.Option(min=0, help="Seconds between SIGTERM and SIGKILL.")] = 5.0,
    max_jobs: Annotated[int, typer.Option(min=1, help="Jobs running at once; the rest wait in their queue.")] = 8,
    cpus: Annotated[Optional[float], typer.Option(help="CPUs the local backend offers.")] = None,
    queue_weight: Annotated[Optional[list[str]], typer.Option(
        help="QUEUE=WEIGHT, repeatable: queues share admissions by weight (unlisted queues weigh 1).")] = None,
    allow_path: Annotated[Optional[list[Path]], typer.Option(
        "--allow-path", help="A directory submitted jobs may name by absolute path in workingDir/output.path "
                             "(repeatable; default none: relative paths, inside each job's folder, only).")] = None,
    allow_framework: AllowFrameworkOpt = None,
) -> None:
    """Run the controller service: REST API (OpenAPI at /openapi.json), /metrics, reconcile loop."""
    import uvicorn

    from trainmaster.controller import Controller
    from trainmaster.controller.queues import parse_weights
    from trainmaster.errors import UserError
    from trainmaster.frameworks import allow_frameworks
    from trainmaster.service.app import ServiceOptions, create_app
    from trainmaster.spec.paths import PathPolicy
    from trainmaster.store.db import default_url, make_engine, session_factory

    try:
        weights = parse_weights(queue_weight or [])
    except ValueError as exc:
        raise UserError(f"--queue-weight {exc}") from None
    try:
        allow_frameworks(allow_framework or [])
    except ValueError as exc:
        raise UserError(f"--allow-framework {exc}") from None
    options = ServiceOptions(paths=PathPolicy(base=None, allowed_roots=tuple(p.resolve() for p in allow_path or [])))
    url = db or default_url()
    controller = Controller(session_factory(make_engine(url)), make_backend(backend, cpus, ray_address), url,
                            interval=interval, grace=grace, max_jobs=max_jobs, queue_weights=weights)
    typer.echo(f"trainmaster controller on http://{host}:{port} (store {url}, backend {backend})")
    uvicorn.run(create_app(controller, options=options), host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.command()(server)
