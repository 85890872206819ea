"""Verbs against a running controller service: submit, list, status, logs, cancel, delete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from trainmaster.errors import UserError

DEFAULT_SERVER = "http://127.0.0.1:8642"
ServerOpt = Annotated[str, typer.Option("--server", envvar="TRAINMASTER_SERVER",
                                        help="URL of the controller service.")]
JobArg = Annotated[str, typer.Argument(help="Job name (most recent of that name) or id.")]


def _request(server: str, method: str, path: str, **kwargs: Any) -> Any:
    import httpx

    try:
        response = httpx.request(method, server.rstrip("/") + path, timeout=30, **kwargs)
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach the controller at {server} ({exc}); start one with "
                        "`trainmaster server` or pass --server URL", exit_code=1) from None
    if response.status_code == 422:
        body = response.json()
        details = body.get("details") or [json.dumps(d) for d in body.get("detail", [])]
        raise UserError(body.get("error", "the controller rejected the request"), details)
    if response.status_code >= 400:
        body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        detail = body.get("detail") or body.get("error") or response.text if isinstance(body, dict) else response.text
        raise UserError(str(detail), exit_code=2 if response.status_code == 413 else 1)
    return response.json()


def submit(file: Annotated[Path, typer.Argument(help="Job file (ours, Kubeflow or Volcano).")],
           server: ServerOpt = DEFAULT_SERVER,
           lenient: Annotated[bool, typer.Option(
               "--lenient", help="Kubeflow/Volcano files: list unknown fields and ignore them instead of "
                                 "refusing the file.")] = False) -> None:
    """Submit a job to the controller service."""
    from trainmaster.spec.load import read_document

    reply = _request(server, "POST", "/api/v1/jobs", json=read_document(file),
                     params={"lenient": "true"} if lenient else None)
    for path in reply.get("ignored", []):
        Console(stderr=True).print(f"[yellow]ignored:[/] {path}", highlight=False)
    print(f"submitted job {reply['name']} (id {reply['id']})")


def list_jobs(server: ServerOpt = DEFAULT_SERVER,
              json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List jobs and their states."""
    jobs = _request(server, "GET", "/api/v1/jobs")
    if json_out:
        print(json.dumps(jobs, indent=2))
        return
    table = Table("id", "name", "state", "reason", "queue", "created")
    for job in jobs:
        table.add_row(str(job["id"]), job["name"], job["state"], job["reason"], job["queue"], job["createdAt"][:19])
    Console().print(table)


def status(job: JobArg, server: ServerOpt = DEFAULT_SERVER,
           json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Show a job: state, roles with per-state counts, instances, recent events."""
    from trainmaster.cli.view import render_status

    data = _request(server, "GET", f"/api/v1/jobs/{job}")
    if json_out:
        print(json.dumps(data, indent=2))
    else:
        console = Console()
        console.print(render_status(data, events=15, width=console.width, height=10_000))  # not live: show all


def logs(job: JobArg, role: Annotated[Optional[str], typer.Option(help="Role (default: the first).")] = None,
         index: Annotated[int, typer.Option(min=0, help="Replica index.")] = 0,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming until it ends.")] = False,
         server: ServerOpt = DEFAULT_SERVER) -> None:
    """Print (or follow) one instance's log."""
    import httpx
    import sys

    params: dict[str, Any] = {"index": index, "follow": follow}
    if role:
        params["role"] = role
    url = server.rstrip("/") + f"/api/v1/jobs/{job}/logs"
    try:
        with httpx.stream("GET", url, params=params, timeout=None) as response:
            if response.status_code >= 400:
                response.read()
                raise UserError(response.json().get("detail", response.text), exit_code=1)
            for chunk in response.iter_bytes():
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach the controller at {server} ({exc})", exit_code=1) from None


def cancel(job: JobArg, server: ServerOpt = DEFAULT_SERVER) -> None:
    """Cancel a job: every instance is stopped."""
    reply = _request(server, "POST", f"/api/v1/jobs/{job}/cancel")
    print(f"job {reply['id']}: " + ("cancellation requested" if reply["cancelRequested"] else "already ended"))


def scale(job: JobArg,
          role: Annotated[str, typer.Argument(help="Role to scale.")],
          replicas: Annotated[int, typer.Argument(min=1, help="Desired number of instances.")],
          server: ServerOpt = DEFAULT_SERVER) -> None:
    """Set a role's desired replicas; the controller creates or deletes instances to match."""
    reply = _request(server, "POST", f"/api/v1/jobs/{job}/scale", json={"role": role, "replicas": replicas})
    print(f"job {reply['id']}: role {reply['role']} scaled to {reply['replicas']} replica(s)")


def delete(job: JobArg, server: ServerOpt = DEFAULT_SERVER) -> None:
    """Delete an ended job and its records (cancel a running one first)."""
    reply = _request(server, "DELETE", f"/api/v1/jobs/{job}")
    print(f"job {reply['id']} deleted")


def register(app: typer.Typer) -> None:
    app.command()(submit)
    app.command("list")(list_jobs)
    app.command()(status)
    app.command()(logs)
    app.command()(cancel)
    app.command()(scale)
    app.command()(delete)
