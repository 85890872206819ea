"""The ``trainmaster`` entry point: help everywhere, user errors as messages and exit codes."""

from helpers import run_cli


def test_help_lists_commands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    assert "version" in out.stdout


def test_unknown_command_is_a_usage_error_without_traceback() -> None:
    out = run_cli("no-such-verb")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr


def test_a_path_the_file_system_refuses_is_an_error_without_traceback(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = run_cli("gateway", "init", str(blocker / "sub"), "--parties", "a")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and str(blocker) in out.stderr


def test_a_job_file_that_is_not_a_mapping_or_not_text_says_so(tmp_path) -> None:
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    binary = tmp_path / "blob.yaml"
    binary.write_bytes(b"\xff\xfe\x00binary")
    for path, words in ((scalar, "found a str"), (binary, "not a text file")):
        out = run_cli("validate", str(path))
        assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr
