"""The ``trainmaster`` command: assembles every verb group and turns user errors into exit codes.

Each capability owns one module here exposing ``register(app)``; heavy imports (torch, ray,
cryptography...) happen inside the commands, so ``trainmaster --help`` stays fast.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from trainmaster.errors import UserError

# optional packages -> the extra that installs them (pyproject.toml's optional-dependencies)
EXTRA_OF = {"torch": "torch", "sklearn": "torch", "pymetis": "partition", "kahip": "partition",
            "onnx": "partition", "pyarrow": "gateway", "ray": "ray", "psycopg": "postgres"}

app = typer.Typer(
    name="trainmaster",
    help="Run distributed and federated ML training jobs: one controller for every framework.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    from trainmaster.cli import aggregation, convert, db, flsched, gateway, jobs, partition, remote, server

    for module in (jobs, convert, server, remote, db, aggregation, flsched, partition, gateway):
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
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        _fail(f"this command needs the optional package '{exc.name}': pip install 'trainmaster[{extra}]' "
              f"(or 'trainmaster[all]')", 2)
    except (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        # a path the user gave that the file system refuses: say which and why, no traceback
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}", 2)


def _fail(message: str, exit_code: int) -> None:
    from rich.markup import escape

    Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(message)}")
    sys.exit(exit_code)
