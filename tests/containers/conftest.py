"""Fixtures of the container tests: the podman runtime (skip with its reason where none can run),
images built here from this machine's files (removed at the end, passed or failed), and a node
agent whose containers are all removed when a test ends."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from container_fixtures import AgentUnderTest, container_cgroups, labelled
from controller_harness import stop_agent
from trainmaster.containers import images
from trainmaster.containers.runtime import ContainerRuntime, detect, unavailable

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
