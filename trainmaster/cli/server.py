"""``trainmaster server``: the controller as a long-running service with a REST API."""

from __future__ import annotations

import os
from pathlib import Path
import socket
from typing import Annotated, Optional

import typer

from trainmaster.cli.jobs import AllowFrameworkOpt, DbOpt, RuntimeOpt, make_backend

# on SIGTERM, seconds open requests get to finish before they are cancelled; live dashboard
# streams end at its start (service/draining.py), a followed log (REST) may still be cut
SHUTDOWN_DRAIN_S = 3


def server(
    db: DbOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, envvar="TRAINMASTER_PORT", help="Port to listen on.")] = 8642,
    backend: Annotated[str, typer.Option(help="Where instances run: local or ray.")] = "local",
    ray_address: Annotated[Optional[str], typer.Option(help="Join this Ray cluster (backend ray).")] = None,
    interval: Annotated[float, typer.Option(min=0.01, help="Seconds between reconcile passes.")] = 1.0,
    grace: Annotated[float, typer.Option(min=0, help="Seconds between SIGTERM and SIGKILL.")] = 5.0,
    max_jobs: Annotated[int, typer.Option(min=1, help="Jobs running at once; the rest wait in their queue.")] = 8,
    cpus: Annotated[Optional[float], typer.Option(help="CPUs the local backend offers.")] = None,
    queue_weight: Annotated[
        Optional[list[str]],
        typer.Option(help="QUEUE=WEIGHT, repeatable: queues share admissions by weight (unlisted queues weigh 1)."),
    ] = None,
    token: Annotated[
        Optional[str],
        typer.Option(
            envvar="TRAINMASTER_TOKEN",
            help="Require this token on the API and the dashboard. Required beyond "
            "loopback: when --host is not a loopback address and no token is given, one is generated and printed.",
        ),
    ] = None,
    allow_path: Annotated[
        Optional[list[Path]],
        typer.Option(
            "--allow-path",
            help="A directory submitted jobs may name by absolute path in workingDir/output.path "
            "(repeatable; default none: relative paths, inside each job's folder, only).",
        ),
    ] = None,
    allow_framework: AllowFrameworkOpt = None,
    runtime: RuntimeOpt = None,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach",
            help="Start the service in the background and return once it listens (its log: "
            "server.log in the Trainmaster home; stop it with the kill command it prints).",
        ),
    ] = False,
) -> None:
    """Run the controller service: dashboard at /, REST API (OpenAPI at /openapi.json), /metrics, reconcile loop.

    Examples:

      trainmaster server                       # http://127.0.0.1:8642, open on loopback

      trainmaster server --host 0.0.0.0 --token "$(openssl rand -hex 16)"

      trainmaster server --detach               # returns once it listens; prints how to stop it
    """
    if detach:
        _detach()
        return
    import secrets
    from dataclasses import replace

    import uvicorn

    from trainmaster.controller import Controller
    from trainmaster.controller.leader import LeaderElector
    from trainmaster.controller.queues import parse_weights
    from trainmaster.errors import UserError
    from trainmaster.frameworks import allow_frameworks
    from trainmaster.service.app import ServiceOptions, create_app
    from trainmaster.service.dashboard import AccessOptions
    from trainmaster.service.dashboard.access import is_loopback
    from trainmaster.service.draining import DrainingServer
    from trainmaster.spec.paths import PathPolicy
    from trainmaster.store.db import ServerLock, default_url, make_engine, session_factory, sqlite_path

    try:
        weights = parse_weights(queue_weight or [])
    except ValueError as exc:
        raise UserError(f"--queue-weight {exc}") from None
    try:
        allow_frameworks(allow_framework or [])
    except ValueError as exc:
        raise UserError(f"--allow-framework {exc}") from None
    from trainmaster.spec.model import RuntimeKind

    options = ServiceOptions(
        paths=PathPolicy(base=None, allowed_roots=tuple(p.resolve() for p in allow_path or [])),
        runtime=None if runtime is None else RuntimeKind(runtime.value),
    )
    url = db or default_url()
    db_file = sqlite_path(url)
    lock = ServerLock(db_file) if db_file else None
    if lock:
        lock.acquire()  # one server per SQLite store
    sessions = session_factory(make_engine(url))
    elector = None if lock else LeaderElector(sessions)  # servers on a shared database elect a leader
    controller = Controller(
        sessions,
        make_backend(backend, cpus, ray_address),
        url,
        interval=interval,
        grace=grace,
        max_jobs=max_jobs,
        queue_weights=weights,
        fence=elector.fence if elector else None,
    )
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(24)
        typer.echo(
            f"{host} is reachable beyond this machine: the API and dashboard need a token.\n"
            f"  token: {token}\n  browser: http://{host}:{port}/login?token={token}\n"
            f"  CLI/scripts: send 'Authorization: Bearer {token}'"
        )
    listener = _bind(host, port)  # before the banner: a port in use is an error, not a lie
    pid_file = _claim_pid_file()  # a detached server's, removed when it exits
    role = "" if elector is None else f", server {elector.identity}: leads when elected, standby otherwise"
    typer.echo(f"trainmaster controller on http://{host}:{port} (store {url}, backend {backend}{role})")
    app = create_app(controller, options=replace(options, access=AccessOptions(token=token)), elector=elector)
    # at shutdown, not only in `finally`: uvicorn re-raises the SIGTERM it caught once it has
    # stopped, and the default action ends the process before any `finally` runs
    app.router.on_shutdown.append(lambda: _release_pid_file(pid_file))
    try:
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_DRAIN_S)
        DrainingServer(config, app.state.draining).run(sockets=[listener])
    finally:
        if lock:
            lock.release()
        _release_pid_file(pid_file)


#: Set by ``--detach`` for the server it starts: the file in which that server keeps its pid.
PID_FILE_VARIABLE = "TRAINMASTER_SERVER_PID_FILE"


def _claim_pid_file() -> Path | None:
    """Write this server's pid where ``--detach`` asked (before the banner it waits for)."""
    name = os.environ.pop(PID_FILE_VARIABLE, None)
    if not name:
        return None
    path = Path(name)
    path.write_text(f"{os.getpid()}\n")
    return path


def _release_pid_file(path: Path | None) -> None:
    """Remove the pid file as the server exits, if it still names this process: a file left
    behind would send a later `kill "$(cat server.pid)"` to whatever reuses the pid."""
    try:
        if path is not None and path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except OSError:
        pass


def _detach(timeout_s: float = 60.0) -> None:
    """Run this same command without --detach as a background service, and return once it listens.

    Ready means the child printed its banner, which it does only after binding the port (so a
    client started next connects, queued by the kernel until uvicorn accepts). A child that exits
    first (port in use, store locked) makes this fail with its own message.
    """
    import subprocess
    import sys
    import time

    from trainmaster.errors import UserError
    from trainmaster.store.db import home

    state = home()
    state.mkdir(parents=True, exist_ok=True)
    log_path, pid_path = state / "server.log", state / "server.pid"
    argv = [sys.executable, "-m", "trainmaster", *(a for a in sys.argv[1:] if a != "--detach")]
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", PID_FILE_VARIABLE: str(pid_path)},
        )
    deadline = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text(errors="replace")
        banner = next((line for line in text.splitlines() if line.startswith("trainmaster controller on ")), None)
        if banner:  # the server wrote its pid file before its banner, and removes it when it exits
            typer.echo(f"{banner}\n  pid {child.pid} (in {pid_path}), log {log_path}\n  stop it: kill {child.pid}")
            return
        if child.poll() is not None:
            raise UserError(f"the server exited (code {child.returncode}) before listening:\n{text.strip()}")
        if time.monotonic() > deadline:
            child.kill()
            raise UserError(
                f"the server did not listen within {timeout_s:.0f} s (stopped it); its log "
                f"{log_path}:\n{text.strip()[-2000:]}"
            )
        try:
            child.wait(timeout=0.1)  # wakes at once if it exits; else look at the log again
        except subprocess.TimeoutExpired:
            pass


def _bind(host: str, port: int) -> socket.socket:
    from trainmaster.errors import UserError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} "
            "(another server there? choose another --port or --host)"
        ) from None
    sock.listen(2048)
    return sock


def register(app: typer.Typer) -> None:
    app.command()(server)
