"""Job verbs that look at and change jobs: submit, list, status, logs, wait, cancel, scale, delete.

Where they act: with ``--server URL`` (or ``$TRAINMASTER_SERVER``), ``--context NAME`` or a
current context (:mod:`trainmaster.cli.contexts`: a saved server and its token) on that
controller service over HTTP; otherwise on the local store (``--db`` / ``$TRAINMASTER_DB`` /
``--home``) through the facade (:mod:`trainmaster.api`), so the jobs of ``trainmaster run`` can
be looked at, scaled and cancelled without any server. ``submit`` always needs a server: a job in
the store runs only when a controller reconciles it.

Both are the client protocol :class:`trainmaster.client.Trainmaster`: the verbs below take one
and cannot tell which (:class:`trainmaster.client.remote.RemoteTrainmaster` carries the token of
the context or ``$TRAINMASTER_TOKEN``; :class:`trainmaster.api.LocalTrainmaster` opens the store),
so a verb prints and exits the same with or without a server.
"""

from __future__ import annotations

import json
import os
from enum import Enum
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.table import Table

from trainmaster.cli.contexts import ContextOpt, Remote, resolve
from trainmaster.cli.jobs import DbOpt
from trainmaster.cli.output import console
from trainmaster.client.results import ENDED
from trainmaster.errors import UserError
from trainmaster.store.listing import JobFilter

if TYPE_CHECKING:
    from trainmaster.client import Trainmaster
    from trainmaster.client.remote import RemoteTrainmaster


class WaitFor(str, Enum):
    """What `job wait` waits for."""

    END = "end"
    RUNNING = "running"


def default_server() -> str:
    """The service `trainmaster server` starts here by default: loopback, $TRAINMASTER_PORT or 8642."""
    return f"http://127.0.0.1:{os.environ.get('TRAINMASTER_PORT') or 8642}"


ServerOpt = Annotated[
    Optional[str],
    typer.Option(
        "--server",
        envvar="TRAINMASTER_SERVER",
        help="URL of a controller service to ask; without it (and without $TRAINMASTER_SERVER) the verb works on "
        "the local store (--db, $TRAINMASTER_DB or the Trainmaster home).",
    ),
]
JobArg = Annotated[str, typer.Argument(help="Job name (most recent of that name) or id.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _jobs(server: str | None, db: str | None, context: str | None = None) -> Trainmaster:
    """The service named by ``server``/``context`` (or the current context), else the local
    store (which must exist): the same verbs either way."""
    remote = resolve(server, context)
    if remote is not None:
        return connect(remote)
    from trainmaster.api import LocalTrainmaster

    return LocalTrainmaster.open(db, existing=True)


def connect(remote: Remote) -> RemoteTrainmaster:
    """The client of ``remote``'s service, carrying its token."""
    from trainmaster.client.remote import RemoteTrainmaster

    return RemoteTrainmaster(remote.server, remote.token)


def submit(
    file: Annotated[Path, typer.Argument(help="Job file (ours, Kubeflow or Volcano).")],
    server: Annotated[
        Optional[str],
        typer.Option(
            "--server",
            envvar="TRAINMASTER_SERVER",
            show_default=False,
            help="URL of the controller service that queues and runs the job "
            "[default: http://127.0.0.1:$TRAINMASTER_PORT, port 8642 unless set].",
        ),
    ] = None,
    lenient: Annotated[
        bool,
        typer.Option(
            "--lenient",
            help="Kubeflow/Volcano files: list unknown fields and ignore them instead of refusing the file.",
        ),
    ] = False,
    context: ContextOpt = None,
) -> None:
    """Submit a job to the controller service (`trainmaster job run` runs one here, without a server)."""
    from trainmaster.spec.load import read_document

    document = read_document(file)
    from trainmaster.client import ServiceUnreachable

    jobs = connect(resolve(server, context) or resolve(default_server(), None) or Remote(default_server()))
    try:
        reply = jobs.submit(document, lenient)
    except ServiceUnreachable:
        raise UserError(
            f"submit needs a running controller service, and none answers at {jobs.server}; "
            f"start one with `trainmaster server`, pass --server URL or --context NAME, or run the job here "
            f"with `trainmaster job run {file}`"
        ) from None
    for path in reply.ignored:
        console(stderr=True).print(f"[yellow]ignored:[/] {path}", highlight=False)
    print(f"submitted job {reply.name} (id {reply.id})")


def list_jobs(
    state: Annotated[
        Optional[str], typer.Option(help="Only jobs in this state (pending, running, succeeded...).")
    ] = None,
    queue: Annotated[Optional[str], typer.Option(help="Only jobs of this queue.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Only jobs of this name.")] = None,
    label: Annotated[
        Optional[list[str]], typer.Option(help="KEY=VALUE: only jobs with this label (repeatable: all must hold).")
    ] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Show at most this many jobs (default: all).")] = None,
    server: ServerOpt = None,
    db: DbOpt = None,
    context: ContextOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List jobs and their states, oldest first, read page by page.

    Examples: `trainmaster job list --state running`, `trainmaster job list --queue team-a --label owner=ana`."""
    where = JobFilter.parse(state or "", queue or "", name or "", label or [])
    jobs = list_all(_jobs(server, db, context), where, limit)
    if json_out:
        print(json.dumps(jobs, indent=2))
        return
    table = Table("id", "name", "state", "reason", "queue", "created")
    for job in jobs:
        table.add_row(
            str(job["id"]), job["name"], job["state"], job["reason"], job["queue"], (job["createdAt"] or "")[:19]
        )
    console().print(table)


def list_all(source: Trainmaster, where: JobFilter, most: int | None) -> list[dict[str, Any]]:
    """The jobs ``where`` keeps, following the list's pages (at most ``most``)."""
    found: list[dict[str, Any]] = []
    after: str | None = None
    while most is None or len(found) < most:
        page = source.list_jobs(where, min(500, most - len(found)) if most else 500, after)
        found += page.items
        after = page.next
        if after is None:
            break
    return found


def status(
    job: JobArg, server: ServerOpt = None, db: DbOpt = None, context: ContextOpt = None, json_out: JsonOpt = False
) -> None:
    """Show a job: state, roles with per-state counts, instances, recent events."""
    from trainmaster.cli.view import render_status

    data = _jobs(server, db, context).status(job)
    if json_out:
        print(json.dumps(data, indent=2))
    else:
        out = console()  # without a terminal: as wide as the lines are
        out.print(render_status(data, events=15, width=out.width, height=10_000))  # not live: show all


def logs(
    job: JobArg,
    role: Annotated[Optional[str], typer.Option(help="Role (default: the first).")] = None,
    index: Annotated[int, typer.Option(min=0, help="Replica index.")] = 0,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming until it ends.")] = False,
    tail: Annotated[
        Optional[int],
        typer.Option(min=1, max=100_000, help="Print only the last N lines (at most the last MiB of the log)."),
    ] = None,
    server: ServerOpt = None,
    db: DbOpt = None,
    context: ContextOpt = None,
) -> None:
    """Print (or follow) one instance's log."""
    if tail is not None and follow:
        raise UserError("--tail and --follow: choose one (--follow prints the whole log, then what comes)")
    jobs = _jobs(server, db, context)
    if tail is not None:
        sys.stdout.write(jobs.tail(job, role, index, tail))
        return
    for chunk in jobs.read_log(job, role, index, follow=follow):
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()


def wait(
    job: JobArg,
    timeout: Annotated[float, typer.Option(min=0, help="Seconds to wait at most.")] = 3600,
    until: Annotated[
        WaitFor,
        typer.Option(
            "--for",
            help="end: until the job ends. running: until it runs (or already ended), waiting "
            "also for a job that is not there yet, as one being submitted is.",
        ),
    ] = WaitFor.END,
    server: ServerOpt = None,
    db: DbOpt = None,
    context: ContextOpt = None,
) -> None:
    """Wait until a job ends (or, with --for running, runs); exit 0 if it succeeded or runs, 1 if it
    failed, was cancelled or the wait timed out.

    Examples:

      trainmaster job wait pytorch-digits --timeout 600

      trainmaster job run examples/pytorch-digits.yaml &   # then, from the same shell:
      trainmaster job wait pytorch-digits --for running --timeout 120
    """
    import time

    from trainmaster.client import JobNotFound, StoreMissing

    states = ENDED if until is WaitFor.END else ENDED | {"running"}
    deadline = time.monotonic() + timeout
    left = timeout  # the whole of it while the job exists: its timeout message names the user's figure
    while True:
        try:
            reached = _jobs(server, db, context).wait(job, timeout=left, states=states)
            break
        except (JobNotFound, StoreMissing):
            if until is WaitFor.END or time.monotonic() >= deadline:
                raise
            time.sleep(0.25)  # not created yet: its `run` or `submit` is on its way
            left = max(0.0, deadline - time.monotonic())
    print(f"job {reached.name} (id {reached.id}) {reached.state}")
    ok = reached.state == "succeeded" or (until is WaitFor.RUNNING and reached.state == "running")
    raise typer.Exit(0 if ok else 1)


def cancel(job: JobArg, server: ServerOpt = None, db: DbOpt = None, context: ContextOpt = None) -> None:
    """Cancel a job: every instance is stopped."""
    reply = _jobs(server, db, context).cancel(job)
    if reply.cancel_requested:
        print(f"job {reply.id}: cancellation requested; {reply.note}")
    else:
        print(f"job {reply.id}: already ended")


def scale(
    job: JobArg,
    role: Annotated[str, typer.Argument(help="Role to scale.")],
    replicas: Annotated[int, typer.Argument(min=1, help="Desired number of instances.")],
    server: ServerOpt = None,
    db: DbOpt = None,
    context: ContextOpt = None,
) -> None:
    """Set a role's desired replicas; the controller creates or deletes instances to match."""
    reply = _jobs(server, db, context).scale(job, role, replicas)
    print(f"job {reply.id}: role {reply.role} scaled to {reply.replicas} replica(s)")


def suspend(job: JobArg, server: ServerOpt = None, db: DbOpt = None, context: ContextOpt = None) -> None:
    """Hold a job (Kubeflow runPolicy.suspend): its instances are stopped and it waits, unadmitted,
    until `unsuspend`."""
    reply = _jobs(server, db, context).suspend(job, True)
    print(f"job {reply.id}: {'suspended' if reply.changed else 'already suspended'}")


def unsuspend(job: JobArg, server: ServerOpt = None, db: DbOpt = None, context: ContextOpt = None) -> None:
    """Release a suspended job: its controller admits and starts it at its next pass."""
    reply = _jobs(server, db, context).suspend(job, False)
    print(f"job {reply.id}: {'resumed; its controller starts it' if reply.changed else 'was not suspended'}")


def delete(job: JobArg, server: ServerOpt = None, db: DbOpt = None, context: ContextOpt = None) -> None:
    """Delete an ended job and its records (cancel a running one first)."""
    print(f"job {_jobs(server, db, context).delete(job).id} deleted")


def register(app: typer.Typer) -> None:
    app.command()(submit)
    app.command("list")(list_jobs)
    app.command()(status)
    app.command()(logs)
    app.command()(wait)
    app.command()(cancel)
    app.command()(scale)
    app.command()(suspend)
    app.command()(unsuspend)
    app.command()(delete)
