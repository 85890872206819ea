"""The CLI as a user meets it: verbs grouped the way users think, today's flat verbs still
working as aliases, --version, completion, and help that is never cut off nor shows <bool>."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from trainmaster import __version__
from trainmaster.cli.main import app

runner = CliRunner()


def _leaves(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:  # type: ignore[no-untyped-def]
    if getattr(command, "commands", None):  # a group (typer's own click)
        out = [path]
        for name, sub in command.commands.items():
            out += _leaves(sub, (*path, name))
        return out
    return [path]


ALL = _leaves(typer.main.get_command(app))
assert len(ALL) > 30, ALL


def test_version_flag_and_verb() -> None:
    for args in (["--version"], ["version"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and __version__ in result.output


@pytest.mark.parametrize("path", ALL, ids=lambda p: " ".join(p) or "trainmaster")
def test_every_help_works_without_placeholders(path: tuple[str, ...]) -> None:
    result = runner.invoke(app, [*path, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    commands = result.output.split("Commands:", 1)[1] if "Commands:" in result.output else ""
    assert "..." not in commands  # descriptions wrap, never cut


@pytest.mark.parametrize(
    "alias, grouped",
    [
        (["run"], ["job", "run"]),
        (["status"], ["job", "status"]),
        (["list"], ["job", "list"]),
        (["validate"], ["job", "validate"]),
        (["party"], ["gateway", "party"]),
        (["task"], ["gateway", "task"]),
    ],
)
def test_old_flat_verbs_are_aliases_of_the_groups(alias: list[str], grouped: list[str]) -> None:
    old = runner.invoke(app, [*alias, "--help"], terminal_width=100)
    new = runner.invoke(app, [*grouped, "--help"], terminal_width=100)
    assert old.exit_code == new.exit_code == 0
    assert old.output.split("\n", 2)[2] == new.output.split("\n", 2)[2]  # same help past the usage line


def test_aliases_are_hidden_from_the_top_level_help() -> None:
    listing = runner.invoke(app, ["--help"], terminal_width=100).output.split("Commands:", 1)[1]
    names = {line.split()[0] for line in listing.splitlines() if line.startswith("  ") and line.split()}
    assert {"job", "server", "gateway", "partition", "flsched", "aggregation", "db"} <= names
    assert not names & {"run", "status", "list", "party", "task"}


def test_shell_completion_is_installable() -> None:
    result = runner.invoke(app, ["--help"])
    assert "--install-completion" in result.output and "--show-completion" in result.output


def test_home_option_moves_every_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """--home (or TRAINMASTER_HOME) is where the store, runs and agent live, and info shows them."""
    import json

    monkeypatch.delenv("TRAINMASTER_DB", raising=False)
    result = runner.invoke(app, ["--home", str(tmp_path / "proj"), "info", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    home = str((tmp_path / "proj").resolve())
    assert data["home"] == home and data["store"] == f"sqlite:///{home}/trainmaster.db"
    assert data["runs"].startswith(home) and data["agent"].startswith(home)
