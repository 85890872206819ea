"""Mechanisms: strict, faithful reading of foreign job files, on the project's own corpus
(tests/compat/corpus: job files written in each upstream kind). ``trainmaster validate`` and
``trainmaster convert`` on every file: the valid ones pass, the others are refused by the paths
named in their ``# expect:`` header (exit 2, no traceback); in every valid file, a field added to
any mapping is refused by its own path, so no field of these kinds is silently dropped."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from trainmaster.errors import UserError
from trainmaster.spec.compat import convert

CORPUS = Path(__file__).parent / "corpus"
FILES = sorted(CORPUS.glob("*.yaml"))
#: Free-form mappings (names chosen by the user or by Kubernetes), where any key is allowed.
FREE_FORM = {"labels", "annotations", "limits", "requests", "nodeSelector"}


def expectation(path: Path) -> tuple[bool, list[str]]:
    """(valid?, refused field paths) from the file's ``# expect:`` header."""
    header = next(line for line in path.read_text().splitlines() if line.startswith("# expect:"))
    verdict = header.removeprefix("# expect:").strip()
    if verdict == "valid":
        return True, []
    assert verdict.startswith("refused:"), header
    return False, [p.strip() for p in verdict.removeprefix("refused:").split(";")]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "1000"}  # one problem per line, unwrapped
    return subprocess.run(
        [sys.executable, "-m", "trainmaster", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_corpus_covers_every_kind() -> None:
    kinds = {yaml.safe_load(p.read_text())["kind"] for p in FILES}
    assert kinds == {"PyTorchJob", "TFJob", "MPIJob", "Job"}


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_validate_and_convert_on_the_corpus(path: Path) -> None:
    valid, refused = expectation(path)
    for verb in ("validate", "convert"):
        out = cli(verb, str(path))
        assert "Traceback" not in out.stderr, out.stderr
        if valid:
            assert out.returncode == 0, out.stderr
        else:
            assert out.returncode == 2, (verb, out.stdout, out.stderr)
            problems = [line.strip() for line in out.stderr.splitlines() if line.strip().startswith("- ")]
            for field in refused:
                assert any(p.startswith(f"- {field}:") for p in problems), (verb, field, out.stderr)
            assert len(problems) == len(refused), (verb, out.stderr)  # every problem, and only those


def mappings(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            if key not in FREE_FORM:
                yield from mappings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from mappings(value, f"{path}[{i}]")


@pytest.mark.parametrize(
    "path", [p for p in FILES if expectation(p)[0]], ids=[p.stem for p in FILES if expectation(p)[0]]
)
def test_an_unknown_field_anywhere_is_refused_by_its_path(path: Path) -> None:
    document = yaml.safe_load(path.read_text())
    count = 0
    for where, _ in mappings(document):
        changed = copy.deepcopy(document)
        target = next(m for w, m in mappings(changed) if w == where)
        target["bogusField"] = 1
        with pytest.raises(UserError) as err:
            convert(changed)
        expected = f"{where}.bogusField: unknown field" if where else "bogusField: unknown field"
        assert any(d.startswith(expected) for d in err.value.details), (where, err.value.details)
        count += 1
    assert count >= 8


def needs(path: Path) -> str | None:
    """Why a valid corpus file cannot run on this machine (None: it can)."""
    import importlib.util
    import shutil

    text = path.read_text()
    if "mpirun" in text and shutil.which("mpirun") is None:
        return "mpirun not found: install Debian's openmpi-bin (make system-deps)"
    if "torchrun" in text and importlib.util.find_spec("torch") is None:
        return "torch is not installed (the torch extra)"
    from trainmaster.spec.load import load_job

    entry_points = [r.name for r in load_job(path).job.spec.roles if r.image and r.command is None]
    if entry_points:
        return (
            f"roles {entry_points} run their image's entry point, and the image is upstream's (no registry "
            "here); tests/containers runs entry-point roles from images built locally"
        )
    return None


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "path", [p for p in FILES if expectation(p)[0]], ids=[p.stem for p in FILES if expectation(p)[0]]
)
def test_every_valid_corpus_file_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every corpus file either runs to success with `trainmaster run` (this test) or is refused
    by name (the test above): nothing is only converted."""
    from controller_harness import run_job_file

    reason = needs(path)
    if reason:
        pytest.skip(reason)
    # `torchrun` is the console script next to this interpreter, as in the training image
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc, status = run_job_file(path, tmp_path, timeout=180)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0 and status.get("state") == "succeeded", proc.stdout[-3000:] + proc.stderr[-3000:]


def _upstream_files() -> list[Path]:
    """Upstream's example job files ($TRAINMASTER_SHARED_DATA or ../shared/data next to the repo)."""
    env = os.environ.get("TRAINMASTER_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"
    return sorted((base / "upstream-job-examples").glob("*/*.yaml"))


@pytest.mark.skipif(
    not _upstream_files(), reason="upstream's example job files (shared data upstream-job-examples) are absent"
)
def test_validate_and_convert_agree_on_every_upstream_example() -> None:
    """One set of rules (issue 38: 6 of upstream's Volcano MPI/Paddle files were refused by
    `validate` for a workingDir or hostPath outside the allowed directories, while `convert`
    printed them): on each of upstream's example files both verbs exit alike and list the same
    problems, and `convert` prints nothing when it refuses."""
    from typer.testing import CliRunner

    from trainmaster.cli.main import app

    runner = CliRunner()
    disagree = []
    for path in _upstream_files():
        runs = {verb: runner.invoke(app, ["job", verb, str(path)]) for verb in ("validate", "convert")}
        problems = {
            verb: sorted(
                line.strip() for line in str(run.exception or "").splitlines() if line.strip().startswith("- ")
            )
            for verb, run in runs.items()
        }
        codes = {verb: run.exit_code for verb, run in runs.items()}
        if codes["validate"] != codes["convert"] or problems["validate"] != problems["convert"]:
            disagree.append((path.name, codes, problems))
        if codes["convert"] != 0:
            assert runs["convert"].stdout == "", (path.name, runs["convert"].stdout[:500])
    assert not disagree, disagree
