"""The ``trainmaster`` command: assembles every verb group and turns user errors into exit codes.

Each capability owns one module here exposing ``register(app)``; heavy imports (torch, ray,
cryptography...) happen inside the commands, so ``trainmaster --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup
from typer.models import TyperInfo

import trainmaster
from trainmaster.cli import (
    aggregation,
    cluster,
    contexts,
    convert,
    db,
    flsched,
    gateway,
    info,
    jobs,
    operator,
    partition,
    queues,
    remote,
    runtime,
    server,
    testbed,
)
from trainmaster.cli.examples import add_examples
from trainmaster.errors import BackendError, UserError

# optional packages -> the extra that installs them (pyproject.toml's optional-dependencies)
EXTRA_OF = {
    "torch": "torch",
    "sklearn": "torch",
    "pymetis": "partition",
    "kahip": "partition",
    "onnx": "partition",
    "pyarrow": "gateway",
    "ray": "ray",
    "psycopg": "postgres",
    "kubernetes": "kubernetes",
}


class FullHelpGroup(TyperGroup):
    """Lists each command with its whole first paragraph, wrapped, instead of cutting it at the
    terminal's width with '...'."""

    def format_commands(self, ctx, formatter) -> None:  # type: ignore[no-untyped-def]
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


HELP = """Run distributed and federated ML training jobs: one controller for every framework.

\b
Examples:
  trainmaster job run examples/pytorch-digits.yaml   # run a job here, live view
  trainmaster server                                # controller service + dashboard
  trainmaster job status my-job                     # ask the service about a job

Job verbs also answer at the top level as before (trainmaster run, status, list, logs...).
"""

app = typer.Typer(
    name="trainmaster",
    help=HELP,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    cls=FullHelpGroup,
)
job_app = typer.Typer(
    help="Jobs: validate, convert, run here, or submit to the service and follow.",
    no_args_is_help=True,
    rich_markup_mode=None,
    cls=FullHelpGroup,
)


def _register_all() -> None:
    """Groups the way users think (job verbs under ``job``, the gateway's party and task under
    ``gateway``); the old flat names stay as hidden aliases so no script breaks."""
    for module in (jobs, convert, remote):
        module.register(job_app)
        before = len(app.registered_commands)
        module.register(app)
        for alias in app.registered_commands[before:]:
            alias.hidden = True
    queues.register_job_verbs(job_app)  # job explain
    app.add_typer(job_app, name="job")
    for module in (
        server,
        contexts,
        db,
        runtime,
        info,
        testbed,
        cluster,
        operator,
        aggregation,
        flsched,
        partition,
        gateway,
        queues,
    ):
        module.register(app)
    gateway_group = _typer_of(next(g for g in app.registered_groups if g.name == "gateway"))
    for group in app.registered_groups:
        if group.name in ("party", "task"):
            gateway_group.add_typer(_typer_of(group), name=group.name)
            group.hidden = True
    for group in app.registered_groups:  # plain help: no <bool> placeholders, nothing cut off
        _plain(_typer_of(group))
    add_examples(app)


def _typer_of(group: TyperInfo) -> typer.Typer:
    """The app of a group added with ``add_typer`` (typer types it optional: TyperInfo also
    describes callbacks, which our groups never are)."""
    if group.typer_instance is None:
        raise RuntimeError(f"command group {group.name!r} has no Typer app")
    return group.typer_instance


def _plain(typer_app: typer.Typer) -> None:
    typer_app.rich_markup_mode = None  # type: ignore[assignment]
    typer_app.info.cls = FullHelpGroup
    for group in typer_app.registered_groups:
        _plain(_typer_of(group))


def _version(value: bool) -> None:
    if value:
        print(f"trainmaster {trainmaster.__version__}")
        raise typer.Exit()


@app.command()
def version() -> None:
    """Print Trainmaster's version."""
    _version(True)


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    home: Optional[Path] = typer.Option(
        None,
        "--home",
        envvar="TRAINMASTER_HOME",
        help=(
            "Folder of Trainmaster's state: store, runs, agent (default ~/.trainmaster). A per-project "
            "layout: --home ./.trainmaster"
        ),
    ),
) -> None:
    """Run distributed and federated ML training jobs: one controller for every framework."""
    if home is not None:
        os.environ["TRAINMASTER_HOME"] = str(home.expanduser().resolve())  # every part reads it from here


_register_all()


def main(argv: list[str] | None = None) -> None:
    """Entry point: user mistakes print ``error: ...`` and exit non-zero, without a traceback.

    Usage errors (unknown flags, missing arguments) are handled by click itself (exit 2).
    """
    try:
        app(args=argv)
    except UserError as exc:
        _fail(str(exc), exc.exit_code)
    except BackendError as exc:  # a node agent that refused or is away: said, not a traceback
        _fail(str(exc), 1)
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        _fail(
            f"this command needs the optional package '{exc.name}': pip install 'trainmaster[{extra}]' "
            f"(or 'trainmaster[all]')",
            2,
        )
    except (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        # a path the user gave that the file system refuses: say which and why, no traceback
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}", 2)


def _fail(message: str, exit_code: int) -> None:
    from rich.markup import escape

    from trainmaster.cli.output import console

    console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")
    sys.exit(exit_code)
