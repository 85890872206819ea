"""Job verbs that need no server: ``validate``, ``run`` (an embedded controller) and ``resume``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from trainmaster.errors import UserError

FileArg = Annotated[Path, typer.Argument(help="Job file: trainmaster/v1 Job, Kubeflow or Volcano YAML/JSON.")]
DbOpt = Annotated[Optional[str], typer.Option("--db", envvar="TRAINMASTER_DB",
                                              help="SQLAlchemy URL of the store (default: SQLite in ~/.trainmaster).")]
LenientOpt = Annotated[bool, typer.Option(
    "--lenient", help="Kubeflow/Volcano files: list unknown fields and ignore them instead of refusing the file.")]
AllowPathOpt = Annotated[Optional[list[Path]], typer.Option(
    "--allow-path", help="A directory that workingDir/output.path may name by absolute path (repeatable; "
                         "the current directory always is).")]
AllowFrameworkOpt = Annotated[Optional[list[str]], typer.Option(
    "--allow-framework", help="ID=TARGET or TARGET: load a framework that is not installed from a module "
                              "'pkg.mod:Class' or a file 'path/fw.py' (repeatable).")]


def load_options(lenient: bool, allow_path: list[Path] | None, allow_framework: list[str] | None):  # type: ignore[no-untyped-def]
    """The options of a job verb run by the user on this machine (``run``, ``validate``)."""
    from trainmaster.frameworks import allow_frameworks
    from trainmaster.spec.load import LoadOptions
    from trainmaster.spec.paths import PathPolicy

    if allow_framework:
        try:
            allow_frameworks(allow_framework)
        except ValueError as exc:
            raise UserError(f"--allow-framework {exc}") from None
    return LoadOptions(paths=PathPolicy.for_command_line(allow_path), lenient=lenient)


def validate(file: FileArg, lenient: LenientOpt = False, allow_path: AllowPathOpt = None,
             allow_framework: AllowFrameworkOpt = None) -> None:
    """Check a job file and list every problem with its field path (exit 2 if any)."""
    from trainmaster.spec import load_job

    loaded = load_job(file, load_options(lenient, allow_path, allow_framework))
    job = loaded.job
    for path in loaded.ignored:
        Console(stderr=True).print(f"[yellow]ignored:[/] {path}", highlight=False)
    print(f"{file}: valid ({job.spec.framework} job '{job.name}', {len(job.spec.roles)} role(s), "
          f"{job.spec.total_replicas} instance(s))")


def make_backend(name: str, cpus: float | None = None, ray_address: str | None = None):  # type: ignore[no-untyped-def]
    """The backend named ``name``."""
    from trainmaster.backends.base import Capacity
    from trainmaster.backends.local import LocalBackend

    if name == "ray":
        from trainmaster.backends import ray_backend_or_error

        return ray_backend_or_error(ray_address)
    if name == "local":
        if cpus is None:
            return LocalBackend()
        default = LocalBackend().capacity()
        return LocalBackend(Capacity(cpu=cpus, memory=default.memory, gpu=default.gpu))
    if name == "testbed":
        from trainmaster.backends.testbed import TestbedBackend
        from trainmaster.testbed import Testbed

        # the testbed of 'trainmaster testbed up' (--prefix tm, or $TRAINMASTER_TESTBED)
        return TestbedBackend(Testbed.load(os.environ.get("TRAINMASTER_TESTBED") or "tm"))
    raise UserError(f"--backend: unknown backend '{name}' (available: local, ray, testbed)")


def run(
    file: FileArg,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the validated, defaulted job and exit.")] = False,
    db: DbOpt = None,
    backend: Annotated[Optional[str], typer.Option(
        help="Where instances run: local (subprocesses), ray, or testbed (the hosts of 'trainmaster testbed up'); "
             "default: the job's spec.scheduling.backend, else local.")] = None,
    interval: Annotated[float, typer.Option(min=0.01, help="Seconds between reconcile passes.")] = 1.0,
    grace: Annotated[float, typer.Option(min=0, help="Seconds between SIGTERM and SIGKILL when stopping.")] = 5.0,
    cpus: Annotated[Optional[float], typer.Option(help="CPUs the local backend offers (default: this machine's).")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="Join this Ray cluster (backend ray; default: start one).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final status as JSON.")] = False,
    lenient: LenientOpt = False,
    allow_path: AllowPathOpt = None,
    allow_framework: AllowFrameworkOpt = None,
) -> None:
    """Run a job to its end with a live view; exit 0 if it succeeded, 1 if it failed or was cancelled."""
    from trainmaster.spec import load_job
    from trainmaster.spec.load import dump_yaml

    loaded = load_job(file, load_options(lenient, allow_path, allow_framework))
    wanted = loaded.job.spec.scheduling.backend
    if backend is not None and wanted is not None and wanted.value != backend:
        raise UserError(f"--backend {backend} conflicts with the job's spec.scheduling.backend: "
                        f"{wanted.value}; drop one of them")
    backend = backend or (wanted.value if wanted is not None else "local")
    err = Console(stderr=True, highlight=False)
    for path in loaded.ignored:
        err.print(f"[yellow]ignored:[/] {path}")
    if dry_run:
        print(dump_yaml(loaded.job), end="")
        return
    state = _run(loaded, db, backend, interval, grace, cpus, ray_address, json_out)
    raise typer.Exit(0 if state == "succeeded" else 1)


def _run(loaded, db: str | None, backend_name: str, interval: float, grace: float,  # type: ignore[no-untyped-def]
         cpus: float | None, ray_address: str | None, json_out: bool) -> str:
    from trainmaster.controller import Controller
    from trainmaster.store.db import default_url, make_engine, session_factory
    from trainmaster.store.ownership import run_owner

    url = db or default_url()
    sessions = session_factory(make_engine(url))
    controller = Controller(sessions, make_backend(backend_name, cpus, ray_address), url, interval=interval, grace=grace,
                            owner=run_owner())
    return _follow(controller, controller.submit(loaded), json_out)


def _follow(controller, job_id: int, json_out: bool) -> str:  # type: ignore[no-untyped-def]
    """Reconcile ``job_id`` to its end in this process, showing its status; SIGINT, SIGTERM and
    SIGHUP (a closed terminal) cancel it, so no instance outlives the command."""
    from rich.console import Group
    from rich.live import Live

    from trainmaster.cli.view import event_line, render_status
    from trainmaster.store import repository as repo

    sessions = controller.sessions
    console = Console(highlight=False)
    stop = {"requested": False}

    def request_stop(signum: int, _frame: object) -> None:
        stop["requested"] = True

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, request_stop)

    def status() -> dict:  # type: ignore[type-arg]
        with sessions() as session:
            return repo.job_status(session, repo.load_job(session, job_id), events=200)

    shown = {"events": 0}

    def print_new_events() -> None:
        events = status()["events"]
        for ev in events[shown["events"]:]:
            print(event_line(ev), flush=True)
        shown["events"] = len(events)

    if console.is_terminal and not json_out:
        def view() -> Group:
            return render_status(status(), width=console.size.width, height=console.size.height)

        with Live(view(), console=console, refresh_per_second=4, vertical_overflow="crop") as live:
            state = controller.run_job(job_id, on_tick=lambda: live.update(view()),
                                       should_cancel=lambda: stop["requested"])
    else:
        state = controller.run_job(job_id, on_tick=None if json_out else print_new_events,
                                   should_cancel=lambda: stop["requested"])
    final = status()
    if json_out:
        print(json.dumps(final, indent=2))
    else:
        if not console.is_terminal:
            print_new_events()
        _print_result(console, final)
    return state


def resume(
    job: Annotated[str, typer.Argument(help="Job name (most recent of that name) or id.")],
    db: DbOpt = None,
    interval: Annotated[float, typer.Option(min=0.01, help="Seconds between reconcile passes.")] = 1.0,
    grace: Annotated[float, typer.Option(min=0, help="Seconds between SIGTERM and SIGKILL when stopping.")] = 5.0,
    ray_address: Annotated[Optional[str], typer.Option(help="The Ray cluster the job ran on (backend ray).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final status as JSON.")] = False,
) -> None:
    """Take over a job whose `trainmaster run` ended before it (kill -9, out of memory) and run it
    to its end: live instances are re-adopted, ended ones handled by their restart policy."""
    from trainmaster.controller import Controller
    from trainmaster.store import repository as repo
    from trainmaster.store.db import default_url, make_engine, session_factory
    from trainmaster.store.ownership import owner_alive, run_owner, run_pid

    url = db or default_url()
    sessions = session_factory(make_engine(url))
    me = run_owner()
    with sessions() as session:
        row = repo.find_job(session, job)
        what = f"job {row.name} (id {row.id})"
        if repo.is_terminal(row.state):
            raise UserError(f"{what} has already ended ({row.state}); nothing to resume")
        alive = owner_alive(row.owner)
        if alive is None:
            raise UserError(f"{what} belongs to the controller service; it carries on when `trainmaster server` "
                            "runs (use `trainmaster status` / `cancel`)")
        if alive:
            raise UserError(f"{what} is still run by `trainmaster run` (pid {run_pid(row.owner)}); stop that "
                            "command (Ctrl-C cancels the job) or let it finish")
        if not repo.take_over(session, row.id, row.owner, me):
            raise UserError(f"{what} was just taken over by another command; try again to see by whom")
        repo.add_event(session, row.id, "job", "Resumed", f"taken over by `trainmaster resume` (pid {run_pid(me)})")
        session.commit()
        job_id, backend_name = row.id, row.backend
    controller = Controller(sessions, make_backend(backend_name, None, ray_address), url, interval=interval,
                            grace=grace, owner=me)
    controller.recover()
    state = _follow(controller, job_id, json_out)
    raise typer.Exit(0 if state == "succeeded" else 1)


def _print_result(console: Console, final: dict) -> None:  # type: ignore[type-arg]
    console.print(f"job {final['name']} (id {final['id']}) {final['state']}: {final['message']}")
    metrics = Path(final["runDir"]) / "output" / "metrics.json"
    if metrics.is_file():
        console.print(f"result: {metrics.read_text().strip()}")
    for inst in final["instances"]:
        if inst["state"] == "failed" and inst.get("message"):
            # the node's own words for a start that failed ("program 'x' not found"), or the exit
            console.print(f"{inst['role']}-{inst['index']} {inst.get('reason') or 'failed'}: {inst['message']}",
                          markup=False)
        if inst["state"] == "failed" and inst["logPath"] and Path(inst["logPath"]).is_file():
            tail = Path(inst["logPath"]).read_text(errors="replace").splitlines()[-5:]
            console.print(f"last lines of {inst['role']}-{inst['index']} ({inst['logPath']}):")
            for line in tail:
                console.print(f"  {line}", markup=False)
    console.print(f"logs: {final['runDir']}/logs")


def register(app: typer.Typer) -> None:
    """Add the job verbs to the top-level app."""
    app.command()(validate)
    app.command()(run)
    app.command()(resume)
