"""``trainmaster runtime``: Kubeflow Trainer runtimes that TrainJobs name, installed in the store.

A ``TrainJob`` names a ``TrainingRuntime`` or ``ClusterTrainingRuntime`` in ``spec.runtimeRef``;
on a cluster the runtime is an object the platform team installed. Here ``runtime add`` keeps it
in the store (read strictly first, as ``run`` reads it), and ``trainmaster run trainjob.yaml``
finds it there when no runtime of that name is given with the job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from trainmaster.cli.jobs import DbOpt, LenientOpt
from trainmaster.cli.output import console
from trainmaster.errors import UserError

app = typer.Typer(
    help="Kubeflow Trainer runtimes (TrainingRuntime, ClusterTrainingRuntime) that TrainJobs name: add, list, show, delete.",
    no_args_is_help=True,
)


def _sessions(db: str | None):  # type: ignore[no-untyped-def]
    from trainmaster.store.db import make_engine, session_factory

    return session_factory(make_engine(db))


@app.command()
def add(
    files: Annotated[list[Path], typer.Argument(help="Runtime YAML/JSON files (several documents each allowed).")],
    db: DbOpt = None,
    lenient: LenientOpt = False,
) -> None:
    """Install runtimes (replacing one of the same kind and name); each is read strictly first.

    Examples:

      trainmaster runtime add torch_distributed.yaml

      trainmaster runtime add runtimes/*.yaml
    """
    from trainmaster.spec.compat.trainer import is_runtime, runtime_doc, runtime_notes
    from trainmaster.spec.load import read_documents
    from trainmaster.store import runtimes

    found = []
    for file in files:
        for doc in read_documents(file):
            if not is_runtime(doc):
                raise UserError(f"{file}: holds a {doc.get('kind')!r}, not a TrainingRuntime or ClusterTrainingRuntime")
            found.append((runtime_doc(doc, str(file.resolve()), lenient), runtime_notes(doc, lenient)))
    err = console(stderr=True, highlight=False)
    with _sessions(db)() as session:
        for runtime, notes in found:
            replaced = runtimes.install(session, runtime)
            typer.echo(f"{runtime.kind}/{runtime.name}: {'replaced' if replaced else 'installed'} ({runtime.source})")
            for line in notes:
                err.print(f"[yellow]note:[/] {line}")
        session.commit()


@app.command("list")
def list_runtimes(
    db: DbOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List installed runtimes: kind, name, ml policy, the file each came from.

    Example:

      trainmaster runtime list
    """
    from trainmaster.store import runtimes

    with _sessions(db)() as session:
        rows = runtimes.installed(session)
    table = [
        {
            "kind": r.kind,
            "name": r.name,
            "mlPolicy": _policy(r.document),
            "source": r.source.removeprefix("installed from "),
        }
        for r in rows
    ]
    if json_out:
        typer.echo(json.dumps(table))
        return
    if not table:
        typer.echo("no runtimes installed (trainmaster runtime add FILE)")
        return
    for row in table:
        typer.echo(f"{row['kind']:<24} {row['name']:<36} {row['mlPolicy']:<8} {row['source']}")


@app.command()
def show(
    name: Annotated[str, typer.Argument(help="The runtime's name.")],
    kind: Annotated[
        Optional[str], typer.Option(help="TrainingRuntime or ClusterTrainingRuntime (when both exist).")
    ] = None,
    db: DbOpt = None,
) -> None:
    """Print an installed runtime as YAML.

    Example:

      trainmaster runtime show torch-distributed
    """
    import yaml

    from trainmaster.store import runtimes

    with _sessions(db)() as session:
        rows = [r for r in runtimes.installed(session) if r.name == name and (kind is None or r.kind == kind)]
    if not rows:
        raise UserError(f"no runtime named {name!r} is installed", ["see `trainmaster runtime list`"])
    if len(rows) > 1:
        raise UserError(f"{len(rows)} runtimes are named {name!r}", ["pick one with --kind"])
    typer.echo(yaml.safe_dump(rows[0].document, sort_keys=False), nl=False)


@app.command()
def delete(
    name: Annotated[str, typer.Argument(help="The runtime's name.")],
    kind: Annotated[
        Optional[str], typer.Option(help="Only this kind (TrainingRuntime or ClusterTrainingRuntime).")
    ] = None,
    db: DbOpt = None,
) -> None:
    """Uninstall a runtime (jobs already running keep what they were built from).

    Example:

      trainmaster runtime delete torch-distributed
    """
    from trainmaster.store import runtimes

    with _sessions(db)() as session:
        count = runtimes.remove(session, name, kind)
        session.commit()
    if not count:
        raise UserError(f"no runtime named {name!r} is installed", ["see `trainmaster runtime list`"])
    typer.echo(f"deleted {count} runtime(s) named {name}")


def _policy(document: dict) -> str:  # type: ignore[type-arg]
    policy = (document.get("spec") or {}).get("mlPolicy") or {}
    return next((k for k in ("torch", "mpi", "jax", "xgboost", "flux") if k in policy), "-")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="runtime")
