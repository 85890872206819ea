"""YAML alias bombs at every entry point that reads YAML: the CLI's job verbs (validate, run,
submit, convert), the gateway's task and config files, and the loader they all share
(``trainmaster.spec.boundedyaml``). The dashboard's /ui/validate and /ui/submit are in
test_attack_surface.py; the REST API takes JSON only.

Mechanism: validation ("every field is checked before anything starts"), which must itself be
bounded: a document is refused by what it expands to, not only by its size on disk."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainmaster.errors import UserError
from trainmaster.spec import boundedyaml

pytestmark = pytest.mark.timeout(120)


def alias_bomb(levels: int, width: int = 10) -> str:
    """A few hundred bytes of nested anchors in spec.frameworkParams that expand to width**levels values."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    params = "\n".join("    " + line for line in lines)
    return (
        "apiVersion: trainmaster/v1\nkind: Job\nmetadata:\n  name: bomb\nspec:\n  frameworkParams:\n"
        f"{params}\n  roles:\n  - name: w\n    command: ['true']\n"
    )


def test_the_loader_refuses_expansions_and_cycles_and_keeps_honest_anchors() -> None:
    started = time.monotonic()
    with pytest.raises(UserError, match="aliases"):
        boundedyaml.load_all(alias_bomb(9), "bomb.yaml")  # 10**9 values from ~600 bytes
    with pytest.raises(UserError, match="aliases"):
        boundedyaml.load_all(alias_bomb(5, width=40), "wide.yaml")  # 40**5 = 10**8
    assert time.monotonic() - started < 2
    long_text = "a: &a " + "x" * 100_000 + "\nb: [" + ", ".join(["*a"] * 50) + "]\n"  # 5 MB of text once expanded
    with pytest.raises(UserError, match="MiB"):
        boundedyaml.load_all(long_text, "long.yaml")
    with pytest.raises(UserError, match="never ends"):
        boundedyaml.load_all("a: &a [1, *a]\n", "cycle.yaml")
    with pytest.raises(UserError, match="never ends"):
        boundedyaml.load_all("a: &a {b: {c: *a}}\n", "cycle.yaml")
    honest = boundedyaml.load_one("base: &b {x: 1, y: [1, 2]}\none: *b\ntwo: {<<: *b, y: 3}\n", "ok.yaml")
    assert honest == {"base": {"x": 1, "y": [1, 2]}, "one": {"x": 1, "y": [1, 2]}, "two": {"x": 1, "y": 3}}
    shared = "s: &s [" + ", ".join(str(i) for i in range(1000)) + "]\n" + "".join(f"k{i}: *s\n" for i in range(90))
    assert len(boundedyaml.load_one(shared, "shared.yaml")) == 91  # 91,000 values: under the bound


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmaster", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "TRAINMASTER_SERVER": "http://127.0.0.1:9"},  # submit must refuse before any call
    )


@pytest.mark.parametrize(
    "verb",
    [("job", "validate"), ("job", "run"), ("job", "submit"), ("job", "convert")],
    ids=lambda v: " ".join(v),
)
def test_every_cli_verb_that_reads_a_job_file_refuses_a_bomb(tmp_path: Path, verb: tuple[str, ...]) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb(9))
    started = time.monotonic()
    done = cli(*verb, str(bomb), cwd=tmp_path)
    assert time.monotonic() - started < 30
    assert done.returncode == 2, done.stdout + done.stderr
    assert "aliases" in done.stderr and "Traceback" not in done.stderr


def test_gateway_task_and_config_files_refuse_a_bomb(tmp_path: Path) -> None:
    from trainmaster.gateway.initiator.taskfile import load_task
    from trainmaster.gateway.config import load_config

    lines = ["l0: &l0 [" + ", ".join(["x"] * 10) + "]"]
    lines += [f"l{n}: &l{n} [" + ", ".join([f"*l{n - 1}"] * 10) + "]" for n in range(1, 9)]
    bomb = tmp_path / "task.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    for load in (load_task, load_config):
        started = time.monotonic()
        with pytest.raises(UserError) as refused:
            load(bomb)
        assert time.monotonic() - started < 5
        assert "aliases" in str(refused.value)
