"""``trainmaster server``: the controller as a long-running service with a REST API."""

from __future__ import annotations

import gc
import os
from pathlib import Path
import socket
import sys
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from trainmaster.cli.jobs import AllowFrameworkOpt, DbOpt, RuntimeOpt, make_backend

if TYPE_CHECKING:
    from trainmaster.store.db import ServerLock

# on SIGTERM, seconds open requests get to finish before they are cancelled; live dashboard
# streams end at its start (service/draining.py), a followed log (REST) may still be cut
SHUTDOWN_DRAIN_S = 3
#: Seconds a thread of the API's process may hold the interpreter lock while another waits for it
#: (Python's default: 0.005). A read request gives the lock up and takes it back at each store
#: query and at each hop between the event loop and its worker thread, and each time may wait
#: this long behind a thread that parses a submit (the convoy effect: a reader doing 10 SQLite
#: queries beside 2 busy threads, p99 160-210 ms at 5 ms, 60-78 ms at 1 ms on this machine).
#: With the reconcile loop in its own process, this process's threads are request handlers,
#: all of which want short turns.
API_SWITCH_INTERVAL = 0.001


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
    token_file: Annotated[
        Optional[Path],
        typer.Option(
            "--token-file",
            envvar="TRAINMASTER_TOKEN_FILE",
            help="Require the token in this file (mode 600) on the API and the dashboard; or set TRAINMASTER_TOKEN. "
            "Required beyond loopback: when --host is not a loopback address and no token is given, one is "
            "generated into server.token in the Trainmaster home (and kept for the next start).",
        ),
    ] = None,
    token: Annotated[
        Optional[str],
        typer.Option(
            "--token",
            hidden=True,
            help="Refused: a token on the command line is readable by every user in /proc/PID/cmdline.",
        ),
    ] = None,
    allow_host: Annotated[
        Optional[list[str]],
        typer.Option(
            "--allow-host",
            help="A host name this server answers to besides its addresses, localhost and this machine's names "
            "(repeatable; the name users and the load balancer use). Other names are refused (DNS rebinding); "
            "'*' turns the check off, for a proxy that checks Host itself.",
        ),
    ] = None,
    max_job_instances: Annotated[
        int, typer.Option(min=1, help="Instances one job may ask for (its roles' replicas together).")
    ] = 5_000,
    max_instances: Annotated[
        int, typer.Option(min=1, help="Instances the jobs that have not ended may ask for together.")
    ] = 20_000,
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
    controller_process: Annotated[
        bool,
        typer.Option(
            "--controller-process/--no-controller-process",
            help="Reconcile in a process of its own beside the API's (default), so requests and passes do not "
            "share one interpreter lock; --no-controller-process: in a thread of the server's process.",
        ),
    ] = True,
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

      (umask 077; openssl rand -hex 16 > ~/tm.token)
      trainmaster server --host 0.0.0.0 --token-file ~/tm.token --allow-host trainmaster.example.internal

      trainmaster server --detach               # returns once it listens; prints how to stop it
    """
    if token is not None:
        from trainmaster.errors import UserError

        raise UserError(
            "--token on the command line is readable by every user of this machine (/proc/PID/cmdline); "
            "put it in a file readable by you only and pass --token-file FILE, or set TRAINMASTER_TOKEN"
        )
    if detach:
        _detach()
        return
    from dataclasses import replace

    import uvicorn

    from trainmaster.backends.registry import installed_backends
    from trainmaster.controller import Controller
    from trainmaster.controller.leader import LeaderElector, server_identity
    from trainmaster.controller.queues import parse_weights
    from trainmaster.errors import UserError
    from trainmaster.frameworks import allow_frameworks
    from trainmaster.service.app import ServiceOptions, create_app
    from trainmaster.service.controller_process import ControllerConfig, ControllerProcess
    from trainmaster.service.dashboard import AccessOptions
    from trainmaster.service.draining import DrainingServer
    from trainmaster.service.gc_pauses import time_collections
    from trainmaster.service.protect import ServedHosts
    from trainmaster.service.quotas import JobQuota
    from trainmaster.service.secrets import scrub_environment
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
        hosts=ServedHosts.for_listener(host, allow_host or []),
        quota=JobQuota(per_job=max_job_instances, per_server=max_instances),
    )
    url = db or default_url()
    secret = _token(token_file, host, port)
    # neither stays in this process's environment (nor in /proc/PID/environ): nothing it starts,
    # and no other process of the user, reads them there
    scrub_environment(("TRAINMASTER_TOKEN", "TRAINMASTER_DB"))
    db_file = sqlite_path(url)
    lock = ServerLock(db_file) if db_file else None
    if lock:
        _acquire(lock)  # one server per SQLite store
    engine = make_engine(url)
    sessions = session_factory(engine)
    link = elector = None
    if controller_process:  # the loop (and the election) in a child process; here: the API
        if backend not in installed_backends():
            make_backend(backend)  # says which backends there are
        loop = ControllerConfig(
            url, backend, cpus, ray_address, interval, grace, max_jobs, weights, None if lock else server_identity()
        )
        controller = loop.api_controller(sessions)
        held = lock.fileno() if lock else None
        link = ControllerProcess(controller, loop, engine, inherit=() if held is None else (held,))
    else:
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
    listener = _bind(host, port)  # before the banner: a port in use is an error, not a lie
    if link is not None:
        link.start(listener)  # forked while this process is one thread; it exits if we do
        # (after the fork: the controller process keeps the default, its pass is one thread)
        sys.setswitchinterval(API_SWITCH_INTERVAL)
    pid_file = _claim_pid_file()  # a detached server's, removed when it exits
    identity = elector.identity if elector else link.config.identity if link else None
    role = "" if identity is None else f", server {identity}: leads when elected, standby otherwise"
    typer.echo(f"trainmaster controller on {url_of(host, port)} (store {_shown(url)}, backend {backend}{role})")
    app = create_app(
        controller, options=replace(options, access=AccessOptions(token=secret)), elector=elector, link=link
    )
    # at shutdown, not only in `finally`: uvicorn re-raises the SIGTERM it caught once it has
    # stopped, and the default action ends the process before any `finally` runs
    app.router.on_shutdown.append(lambda: _release_pid_file(pid_file))
    # what start-up made (modules, classes, the app's routes and schemas: ~135,000 objects) lives
    # as long as the server: kept out of every later full garbage collection, each of which
    # would scan it again while every request and the reconcile pass wait for the interpreter
    gc.freeze()
    time_collections()  # each collection's pause in /metrics: requests wait while one runs
    try:
        config = uvicorn.Config(app, http="httptools", log_level="warning", timeout_graceful_shutdown=SHUTDOWN_DRAIN_S)
        DrainingServer(config, app.state.draining).run(sockets=[listener])
    finally:
        if lock:
            lock.release()
        _release_pid_file(pid_file)


def _acquire(lock: ServerLock, wait_s: float = 30.0) -> None:
    """Take the store's server lock; while the server that held it is dead, wait for its
    controller process (which shares the lock) to end its pass and exit, as it does on its own
    once its server is gone (a server killed with SIGKILL and started again at once)."""
    import time

    from trainmaster.errors import UserError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            lock.acquire()
            return
        except UserError:
            if time.monotonic() > deadline or _holder_alive(lock):
                raise
            time.sleep(0.2)


def _holder_alive(lock: ServerLock) -> bool:
    try:
        pid = int(lock.path.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


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


def url_of(host: str, port: int) -> str:
    """The service's URL (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _shown(url: str) -> str:
    """A store URL as printed: without its password."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: the engine says so next, not the banner
        return url.split("@")[-1]


def _token(token_file: Path | None, host: str, port: int) -> str | None:
    """The token the service requires: from --token-file, else TRAINMASTER_TOKEN, else (beyond
    loopback) the one in the Trainmaster home's server.token, generated there the first time.
    Never printed: the banner names the file."""
    import secrets

    from trainmaster.service.dashboard.access import is_loopback
    from trainmaster.service.secrets import TOKEN_FILE_NAME, read_token_file, write_secret
    from trainmaster.store.db import home

    if token_file is not None:
        return read_token_file(token_file)
    if os.environ.get("TRAINMASTER_TOKEN"):
        return os.environ["TRAINMASTER_TOKEN"].strip()
    if is_loopback(host):
        return None
    path = home() / TOKEN_FILE_NAME
    if path.exists():
        token = read_token_file(path)
    else:
        token = secrets.token_urlsafe(24)
        write_secret(path, token)
    typer.echo(
        f"{host} is reachable beyond this machine: the API and dashboard need a token, which is in {path} "
        "(readable by you only).\n"
        f"  CLI: trainmaster context add NAME --server {url_of(host, port)} --token-file {path}\n"
        f"  browser: {url_of(host, port)}/login?token=<the token>  (once; it sets a cookie)\n"
        "  scripts: send 'Authorization: Bearer <the token>'"
    )
    return token


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
    from trainmaster.service.secrets import private_folder
    from trainmaster.store.db import home

    state = private_folder(home())
    log_path, pid_path = state / "server.log", state / "server.pid"
    argv = [sys.executable, "-m", "trainmaster", *(a for a in sys.argv[1:] if a != "--detach")]
    with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as log:
        os.chmod(log_path, 0o600)
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
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # connections whose socket says TCP, and with it on, an answer's body waited for the client's
    # delayed ACK of its headers: ~40 ms added to every request on a kept-alive connection
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
