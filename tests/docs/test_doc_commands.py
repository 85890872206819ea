"""Every shell command in the README and the user pages in docs/ runs as written from a clone.

Each fenced ``bash`` block is one script: it runs with ``bash -euo pipefail`` in a fresh copy of
the checkout (tracked and new files, no outputs), with a fresh ``HOME`` (so the Trainmaster home is
``~/.trainmaster`` as a new user's is) and the project's virtualenv first on ``PATH``, as a user who
ran ``make run`` and then ``source .venv/bin/activate`` would have it. A block fails the test when
any of its commands fails. Blocks that show syntax rather than a runnable command are written
``console``/``text``; a runnable block that cannot run in a test says why right above it, in a
comment the reader sees in the source (``<!-- doc-test: skip: REASON -->``), and the test
reports that reason. Blocks that need root (network namespaces) skip where the test is not root.

Left behind by a block: its background jobs are killed with its process group, the node agent it
started in its home is stopped, and a testbed it created is taken down, whether it passed or not.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller_harness import stop_agent
from helpers import free_port

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!--\s*doc-test:\s*skip:\s*(?P<reason>.+?)\s*-->\s*$")
RUNNABLE = {"bash", "sh", "shell"}
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class DocBlock:
    """One runnable fenced block of a page, with where it is and why it is skipped, if it is."""

    page: Path
    line: int
    script: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def needs_root(self) -> bool:
        return bool(re.search(r"\btestbed up\b|\bip netns\b|\bcluster up\b", self.script))

    @property
    def needs_kubernetes(self) -> bool:
        return bool(re.search(r"\bcluster up\b", self.script))


def doc_blocks() -> list[DocBlock]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group("lang") not in RUNNABLE:
                continue
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            blocks.append(DocBlock(page, line, match.group("body"), skip.group("reason") if skip else None))
    return blocks


def _fresh_copy(destination: Path) -> Path:
    """The checkout's files as a clone has them: tracked and new (not ignored) files, no outputs."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    (destination / ".venv").symlink_to(Path(sys.prefix))
    return destination


def test_every_page_has_runnable_commands() -> None:
    """The extraction sees the pages' commands (a silent regex change would otherwise pass all)."""
    blocks = doc_blocks()
    assert {b.page.name for b in blocks} >= {"README.md", "controller.md", "testbed.md"}
    assert len(blocks) >= 15


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    "block",
    # a block with a Kubernetes cluster runs last: `make test` builds Kubernetes meanwhile
    [pytest.param(b, id=b.id, marks=[pytest.mark.kubernetes] if b.needs_kubernetes else []) for b in doc_blocks()],
)
def test_doc_block_runs_as_written(block: DocBlock, tmp_path: Path) -> None:
    if block.skip_reason:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    assert not re.search(r"(^|[;&|]\s*)(\S*pip3? install|make)\b", block.script, re.M), (
        f"{block.id} installs into the environment the tests run in; put the install in the text, "
        "or mark the block <!-- doc-test: skip: REASON -->"
    )
    if block.needs_root and os.geteuid() != 0:
        pytest.skip(f"{block.id} creates network namespaces, which needs root")
    if block.needs_kubernetes:
        from cluster_fixtures import cluster_unavailable, wait_for_binaries

        why = cluster_unavailable()
        if why:
            pytest.skip(f"{block.id}: {why}")
        wait_for_binaries()  # skips, saying why, where Kubernetes is not built (make k8s-deps)
    clone = _fresh_copy(tmp_path / "clone")
    home = tmp_path / "home"
    home.mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TRAINMASTER_", "TM_", "PYTEST", "VIRTUAL_ENV"))
    }
    env.update(
        HOME=str(home),
        PATH=f"{Path(sys.prefix) / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
        TRAINMASTER_PORT=str(free_port()),
        PYTHONUNBUFFERED="1",
    )
    log_path = tmp_path / "output.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: background jobs must not hold the test
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", block.script],
            cwd=clone,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        process.wait(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id} did not finish within {BLOCK_TIMEOUT_S} s; its output:\n{_tail(log_path)}")
    finally:
        _clean_up(process, home, env, clone, block)
    assert process.returncode == 0, f"{block.id} failed (exit {process.returncode}); its output:\n{_tail(log_path)}"


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-6000:]


def _clean_up(process: subprocess.Popen[bytes], home: Path, env: dict[str, str], clone: Path, block: DocBlock) -> None:
    """Whatever the block started: its process group, a detached server, the agent, a testbed."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    state = home / ".trainmaster"
    server_pid = state / "server.pid"
    if server_pid.exists():
        try:
            os.kill(int(server_pid.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
    stop_agent(state / "agent")
    if block.needs_kubernetes:
        subprocess.run(
            [str(Path(sys.prefix) / "bin" / "trainmaster"), "cluster", "down"],
            env=env,
            cwd=clone,
            capture_output=True,
            timeout=180,
        )
    if block.needs_root:
        subprocess.run(
            [str(Path(sys.prefix) / "bin" / "trainmaster"), "testbed", "down"],
            env=env,
            cwd=clone,
            capture_output=True,
            timeout=120,
        )
