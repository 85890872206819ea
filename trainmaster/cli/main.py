"""The ``trainmaster`` command: assembles every verb group and turns user errors into exit codes.

Each capability owns one module here exposing ``register(app)``; heavy imports (torch, ray,
cryptography...) happen inside the commands, so ``trainmaster --help`` stays fast.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from trainmaster.errors import UserError

app = typer.Typer(
    name="trainmaster",
    help="Run distributed and federated ML training jobs: one controller for every framework.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    from trainmaster.cli import aggregation, convert, flsched, gateway, jobs, partition, remote, server, testbed

    for module in (jobs, convert, server, remote, aggregation, flsched, partition, gateway, testbed):
        module.register(app)


@app.command()
def version() -> None:
    """Print Trainmaster's version."""
    from trainmaster import __version__

    print(__version__)


@app.callback()
def _root() -> None:
    """Run distributed and federated ML training jobs: one controller for every framework."""


_register_all()


def main(argv: list[str] | None = None) -> None:
    """Entry point: user mistakes print ``error: ...`` and exit non-zero, without a traceback.

    Usage errors (unknown flags, missing arguments) are handled by click itself (exit 2).
    """
    try:
        app(args=argv)
    except UserError as exc:
        _fail(str(exc), exc.exit_code)
    except (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        # a path the user gave that the file system refuses: say which and why, no traceback
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}", 2)


def _fail(message: str, exit_code: int) -> None:
    from rich.markup import escape

    Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(message)}")
    sys.exit(exit_code)
