"""Every command a user can see has --help with at least one example, and the help renders in
an 80-column terminal without a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from trainmaster.cli.main import app


def visible_commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, command) of every visible leaf command (typer ships its own click: duck-typed)."""
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            if not sub.hidden:
                yield from visible_commands(sub, (*path, name))
    else:
        yield path, command


COMMANDS = list(visible_commands(typer.main.get_command(app)))


def test_the_walk_sees_the_command_tree() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"job run", "job submit", "server", "partition", "gateway task run"} <= names


@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=" ".join)
def test_help_has_an_example(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "Example" in result.output, f"`trainmaster {' '.join(path)} --help` shows no example"
