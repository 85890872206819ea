"""The ``trainmaster`` entry point: help everywhere, user errors as messages and exit codes."""

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainmaster", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_commands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    assert "version" in out.stdout


def test_unknown_command_is_a_usage_error_without_traceback() -> None:
    out = run_cli("no-such-verb")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
