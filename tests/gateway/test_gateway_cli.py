"""The gateway CLI: provisioning from the command line, user errors without tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainmaster", *args], capture_output=True, text=True, timeout=120)


def test_gateway_init_writes_a_deployment(tmp_path: Path) -> None:
    """`trainmaster gateway init DIR --parties a,b,c` writes CA, roster and one config per identity."""
    out = _cli("gateway", "init", str(tmp_path / "d"), "--parties", "a,b,c", "--port-base", "31000")
    assert out.returncode == 0, out.stderr
    for name in ("gateway", "initiator", "a", "b", "c"):
        assert (tmp_path / "d" / name / "config.yaml").is_file()
    assert (tmp_path / "d" / "roster.json").is_file() and (tmp_path / "d" / "ca" / "ca.pem").is_file()


def test_user_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    """User mistakes (bad party names, missing config or task file) print `error:` and exit 2."""
    for args in (
        ("gateway", "init", str(tmp_path / "x"), "--parties", "a,../b"),
        ("gateway", "serve", "--config", str(tmp_path / "missing.yaml")),
        ("task", "run", "--config", str(tmp_path / "missing.yaml"), str(tmp_path / "t.yaml")),
    ):
        out = _cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "error:" in out.stderr and "Traceback" not in out.stderr


def test_help_lists_the_three_groups() -> None:
    """The party and task groups sit under `trainmaster gateway`, each with help text; the old
    top-level `party`/`task` still work as aliases."""
    out = _cli("gateway", "--help")
    assert all(g in out.stdout for g in ("init", "serve", "party", "task"))
    assert _cli("gateway", "party", "serve", "--help").returncode == 0
    assert _cli("party", "serve", "--help").returncode == 0
