"""Fixtures of the container tests: the podman runtime (skip with its reason where none can run),
images built here from this machine's files (removed at the end, passed or failed), and a node
agent whose containers are all removed when a test ends."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller_harness import stop_agent, wait_until  # noqa: F401 (the container tests import it from here)
from trainmaster.agent.client import AgentClient, ensure_agent
from trainmaster.agent.contract import ContainerLaunch, InstancePhase, InstanceStatus, LaunchSpec
from trainmaster.agent.core import AgentOptions
from trainmaster.containers import images
from trainmaster.containers.runtime import AGENT_LABEL, ContainerRuntime, detect, unavailable

REPO = str(Path(__file__).resolve().parents[2])
PROGRAMS = ["sleep", "cat", "env", "pwd", "echo", "tail", "true"]


@pytest.fixture(scope="session")
def podman() -> ContainerRuntime:
    why = unavailable()
    if why:
        pytest.skip(why)
    return detect()


@pytest.fixture(scope="session")
def small_image(podman: ContainerRuntime) -> Iterator[str]:
    """A few MB: sh and some coreutils from this machine; its own ENTRYPOINT and CMD."""
    tag = f"localhost/tm-test-small:{os.getpid()}"
    images.build_program_image(
        podman, tag, PROGRAMS, entrypoint=["/bin/sh", "-c"], cmd=["echo image entrypoint ran in $(pwd)"], workdir="/tmp"
    )
    yield tag
    images.remove_images(podman, [tag])


@pytest.fixture(scope="session")
def python_image(podman: ContainerRuntime) -> Iterator[str]:
    """This machine's Python (and torch), bind-mounted read-only (see images.python_mounts)."""
    tag = f"localhost/tm-test-python:{os.getpid()}"
    images.build_python_image(podman, tag, entrypoint=[images.python_executable()])
    yield tag
    images.remove_images(podman, [tag])


def labelled(podman: ContainerRuntime, key: str, running_only: bool = False) -> list[str]:
    argv = [*podman.base(), "ps", "--filter", f"label={AGENT_LABEL}={key}", "--format", "{{.Names}}"]
    if not running_only:
        argv.insert(len(podman.base()) + 1, "--all")
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.split()


class AgentUnderTest:
    """A node agent daemon of the test's own, and what a test asks of it."""

    def __init__(self, state_dir: Path, tmp_path: Path):
        self.state_dir, self.tmp_path = state_dir, tmp_path
        self.key = AgentOptions(state_dir=state_dir).node_key
        self.start_daemon()

    def start_daemon(self) -> None:
        ensure_agent(self.state_dir, linger=60)
        self.client = AgentClient(self.state_dir, linger=60)

    def spec(
        self, name: str, container: ContainerLaunch, attempt: int = 1, env: dict[str, str] | None = None, **extra: Any
    ) -> LaunchSpec:
        return LaunchSpec(
            instance_id=f"job/{name}/{attempt}",
            job_id=1,
            job_name="job",
            role=name,
            index=0,
            attempt=attempt,
            argv=[],
            env=dict(env or {}),
            cwd=None,
            log_path=str(self.tmp_path / f"{name}.log"),
            instance_dir=str(self.tmp_path / name),
            host="127.0.0.1",
            container=container,
            **extra,
        )

    def run(self, specs: list[LaunchSpec], timeout: float = 90) -> list[InstanceStatus]:
        results = self.client.start(specs)
        assert all(r.handle for r in results), [r.error for r in results]
        return self.exited([s.instance_id for s in specs], timeout)

    def exited(self, ids: list[str], timeout: float = 90) -> list[InstanceStatus]:
        def done() -> list[InstanceStatus] | None:
            statuses = self.client.observe(ids)
            return (
                statuses
                if all(s.phase in (InstancePhase.EXITED, InstancePhase.START_FAILED) for s in statuses)
                else None
            )

        return wait_until(done, timeout, f"{ids} to exit")

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()


@pytest.fixture
def agent(podman: ContainerRuntime, tmp_path: Path) -> Iterator[AgentUnderTest]:
    under_test = AgentUnderTest(tmp_path / "agent", tmp_path)
    try:
        yield under_test
    finally:
        under_test.client.close()
        stop_agent(under_test.state_dir)
        left = labelled(podman, under_test.key)
        if left:
            subprocess.run([*podman.base(), "rm", "--force", "--time", "0", *left], capture_output=True, timeout=120)
        assert not left, f"containers left behind: {left}"
        assert not container_cgroups(under_test.key), container_cgroups(under_test.key)


def container_cgroups(key: str = "") -> list[str]:
    """The container cgroup parents of an agent key (every agent's with ``key`` empty)."""
    return sorted(str(p) for p in Path("/sys/fs/cgroup").glob(f"*/trainmaster-containers/{key or '*'}"))
