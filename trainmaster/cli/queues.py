"""Queues with quota (``trainmaster queue create/list/show/delete``) and ``trainmaster job explain``.

Like the job verbs, each acts on a controller service with ``--server``/``--context`` (or the
current context), otherwise on the local store. The quota's meaning is in
:mod:`trainmaster.controller.quota` and docs/controller.md ("Queues with quota").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Optional, Protocol

import typer
from rich.table import Table

from trainmaster.cli.contexts import ContextOpt, resolve
from trainmaster.cli.jobs import DbOpt
from trainmaster.cli.output import console
from trainmaster.cli.remote import JobArg, JsonOpt, ServerOpt
from trainmaster.errors import UserError

if TYPE_CHECKING:
    from trainmaster.spec.queue import QueueSpec

QueueArg = Annotated[str, typer.Argument(help="Queue name (lowercase letters, digits and '-').")]
LimitOpt = Annotated[
    Optional[list[str]],
    typer.Option(help="RESOURCE=AMOUNT, e.g. cpu=100 or memory=64Gi (repeatable; needs --cohort)."),
]

queue_app = typer.Typer(
    help="Queues with quota: a nominal quota per resource, cohorts that lend and borrow, preemption.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


class Queues(Protocol):
    def save(self, spec: QueueSpec, replace: bool) -> dict[str, Any]: ...
    def list(self) -> list[dict[str, Any]]: ...
    def show(self, name: str) -> dict[str, Any]: ...
    def delete(self, name: str) -> None: ...
    def explain(self, ref: str) -> dict[str, Any]: ...


class HttpQueues:
    """The queue verbs of a controller service."""

    def __init__(self, server: str | None, context: str | None):
        from trainmaster.cli.remote import connect

        remote = resolve(server, context)
        assert remote is not None
        self.http = connect(remote)

    def save(self, spec: QueueSpec, replace: bool) -> dict[str, Any]:
        body = spec.dump()
        if replace:
            return self.http.request("PUT", f"/api/v1/queues/{spec.name}", json=body)  # type: ignore[no-any-return]
        return self.http.request("POST", "/api/v1/queues", json=body)  # type: ignore[no-any-return]

    def list(self) -> list[dict[str, Any]]:
        return self.http.request("GET", "/api/v1/queues")  # type: ignore[no-any-return]

    def show(self, name: str) -> dict[str, Any]:
        return self.http.request("GET", f"/api/v1/queues/{_path(name)}")  # type: ignore[no-any-return]

    def delete(self, name: str) -> None:
        self.http.request("DELETE", f"/api/v1/queues/{_path(name)}")

    def explain(self, ref: str) -> dict[str, Any]:
        return self.http.request("GET", f"/api/v1/jobs/{_path(ref)}/explain")  # type: ignore[no-any-return]


class LocalQueues:
    """The queue verbs on the local store (a server reconciling it applies them in its next pass)."""

    def __init__(self, db: str | None, existing: bool):
        from trainmaster.api import LocalTrainmaster

        self.jobs = LocalTrainmaster.open(db, existing=existing)
        self.sessions = self.jobs.sessions

    def save(self, spec: QueueSpec, replace: bool) -> dict[str, Any]:
        from trainmaster.store import queues as queue_store

        with self.sessions() as session:
            row = queue_store.save_queue(session, spec, replace=replace)
            session.commit()
            return queue_store.queue_document(row)

    def list(self) -> list[dict[str, Any]]:
        from trainmaster.controller.quota_status import queue_views

        with self.sessions() as session:
            return queue_views(session)

    def show(self, name: str) -> dict[str, Any]:
        from trainmaster.controller.quota_status import queue_view

        with self.sessions() as session:
            return queue_view(session, name)

    def delete(self, name: str) -> None:
        from trainmaster.store import queues as queue_store

        with self.sessions() as session:
            queue_store.delete_queue(session, name)
            session.commit()

    def explain(self, ref: str) -> dict[str, Any]:
        from trainmaster.controller.quota_status import explain

        found = self.jobs.find(ref)
        with self.sessions() as session:
            return explain(session, found.id)


def _path(part: str) -> str:
    from urllib.parse import quote

    return quote(part, safe="")


def _queues(server: str | None, db: str | None, context: str | None, existing: bool = True) -> Queues:
    if resolve(server, context) is not None:
        return HttpQueues(server, context)
    return LocalQueues(db, existing)


def _limits(items: list[str] | None, option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        resource, sep, value = item.partition("=")
        if not sep or resource.strip() not in ("cpu", "memory", "gpu") or not value.strip():
            raise UserError(
                f"{option} '{item}': expected RESOURCE=AMOUNT with RESOURCE cpu, memory or gpu, e.g. cpu=100"
            )
        out[resource.strip()] = value.strip()
    return out


def queue_spec(
    name: str,
    cohort: str | None,
    weight: float,
    nominal: dict[str, str | None],
    borrowing: dict[str, str],
    lending: dict[str, str],
) -> QueueSpec:
    """The queue the flags describe, validated as the REST API validates it."""
    from pydantic import ValidationError

    from trainmaster.spec.queue import QueueSpec
    from trainmaster.spec.validate import field_path

    quota: dict[str, dict[str, Any]] = {}
    for resource in ("cpu", "memory", "gpu"):
        if nominal.get(resource) is not None:
            quota[resource] = {"nominal": nominal[resource]}
    for label, given, key in (
        ("--borrowing-limit", borrowing, "borrowingLimit"),
        ("--lending-limit", lending, "lendingLimit"),
    ):
        for resource, value in given.items():
            if resource not in quota:
                raise UserError(f"{label} {resource}={value}: give the queue a --{resource} quota first")
            quota[resource][key] = value
    if not quota:
        raise UserError("a queue needs a quota: give at least one of --cpu, --memory, --gpu")
    try:
        return QueueSpec.model_validate({"name": name, "cohort": cohort, "weight": weight, "quota": quota})
    except ValidationError as exc:
        details = [f"{field_path(tuple(e['loc'])) or 'queue'}: {e['msg']}" for e in exc.errors()]
        raise UserError(f"queue '{name}' is not valid ({len(details)} problem(s))", details) from None


def create(
    name: QueueArg,
    cpu: Annotated[Optional[str], typer.Option(help="Nominal quota of CPU cores, e.g. 20.")] = None,
    memory: Annotated[Optional[str], typer.Option(help="Nominal quota of memory, e.g. 64Gi.")] = None,
    gpu: Annotated[Optional[str], typer.Option(help="Nominal quota of GPUs.")] = None,
    cohort: Annotated[Optional[str], typer.Option(help="Cohort whose queues lend each other unused quota.")] = None,
    borrowing_limit: LimitOpt = None,
    lending_limit: LimitOpt = None,
    weight: Annotated[float, typer.Option(help="Fair-sharing weight for borrowed quota (default 1).")] = 1.0,
    replace: Annotated[bool, typer.Option("--replace", help="Replace the queue if it exists.")] = False,
    server: ServerOpt = None,
    db: DbOpt = None,
    context: ContextOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Create a queue with quota; jobs naming it (spec.scheduling.queue, Volcano's queue, Kueue's
    queue-name label) are admitted within its quota. A resource not given is not limited."""
    spec = queue_spec(
        name,
        cohort,
        weight,
        {"cpu": cpu, "memory": memory, "gpu": gpu},
        _limits(borrowing_limit, "--borrowing-limit"),
        _limits(lending_limit, "--lending-limit"),
    )
    saved = _queues(server, db, context, existing=False).save(spec, replace)
    if json_out:
        print(json.dumps(saved, indent=2))
    else:
        print(f"queue {saved['name']} {'saved' if replace else 'created'}")


def list_queues(
    server: ServerOpt = None, db: DbOpt = None, context: ContextOpt = None, json_out: JsonOpt = False
) -> None:
    """List queues with quota: usage of each resource against its nominal quota, borrowed share,
    admitted and waiting jobs."""
    queues = _queues(server, db, context).list()
    if json_out:
        print(json.dumps(queues, indent=2))
        return
    if not queues:
        print("no queue has quota; jobs are admitted by capacity (create one with `trainmaster queue create`)")
        return
    table = Table("NAME", "COHORT", "WEIGHT", "USAGE (used of nominal)", "SHARE", "ADMITTED", "WAITING")
    for q in queues:
        usage = ", ".join(f"{r} {u['shown']}" for r, u in q["usage"].items())
        share = "-" if q["share"] is None else f"{q['share']:.2f}"
        table.add_row(
            q["name"], q["cohort"] or "-", f"{q['weight']:g}", usage, share, str(q["admitted"]), str(q["waiting"])
        )
    console().print(table)


def show(
    name: QueueArg, server: ServerOpt = None, db: DbOpt = None, context: ContextOpt = None, json_out: JsonOpt = False
) -> None:
    """Show a queue: quota and limits, usage, its admitted jobs and its waiting jobs in order."""
    q = _queues(server, db, context).show(name)
    if json_out:
        print(json.dumps(q, indent=2))
        return
    out = console()
    cohort = (
        f"cohort {q['cohort']} (with {', '.join(q['cohortQueues']) or 'no other queue'})"
        if q["cohort"]
        else "no cohort"
    )
    out.print(
        f"queue {q['name']}: {cohort}, weight {q['weight']:g}, borrowed share {q['share'] if q['share'] is not None else 'inf'}"
    )
    table = Table("RESOURCE", "NOMINAL", "BORROWING LIMIT", "LENDING LIMIT", "USED", "BORROWED")
    for r, u in q["usage"].items():
        table.add_row(
            r,
            f"{u['nominal']:g}",
            "-" if u["borrowingLimit"] is None else f"{u['borrowingLimit']:g}",
            "-" if u["lendingLimit"] is None else f"{u['lendingLimit']:g}",
            f"{u['used']:g}",
            f"{u['borrowed']:g}",
        )
    out.print(table)
    out.print(
        f"admitted: {q['admitted']} job(s)"
        + (": " + ", ".join(j["name"] for j in q["admittedJobs"][:20]) if q["admittedJobs"] else "")
    )
    out.print(f"waiting: {q['waiting']} job(s)")
    if q["waitingJobs"]:
        waiting = Table("POS", "JOB", "PRIORITY", "REASON", "MESSAGE")
        for j in q["waitingJobs"]:
            waiting.add_row(
                str(j["position"]), f"{j['name']} ({j['id']})", str(j["priority"]), j["reason"], j["message"]
            )
        out.print(waiting)


def delete(name: QueueArg, server: ServerOpt = None, db: DbOpt = None, context: ContextOpt = None) -> None:
    """Delete a queue's quota (refused while jobs not ended are in it)."""
    _queues(server, db, context).delete(name)
    print(f"queue {name} deleted")


def explain(
    job: JobArg, server: ServerOpt = None, db: DbOpt = None, context: ContextOpt = None, json_out: JsonOpt = False
) -> None:
    """Say why a job is not running: the quota or capacity that blocks it and by how much, and
    its position among its queue's waiting jobs."""
    why = _queues(server, db, context).explain(job)
    if json_out:
        print(json.dumps(why, indent=2))
        return
    print(f"job {why['name']} (id {why['id']}), queue {why['queue']}, priority {why['priority']}: {why['summary']}")
    for block in why["blocking"]:
        print(f"  blocked by {block['limit']}: {block['message']}")


def register(app: typer.Typer) -> None:
    queue_app.command()(create)
    queue_app.command("list")(list_queues)
    queue_app.command()(show)
    queue_app.command()(delete)
    app.add_typer(queue_app, name="queue")


def register_job_verbs(job_app: typer.Typer) -> None:
    job_app.command()(explain)
