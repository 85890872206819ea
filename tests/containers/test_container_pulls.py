"""Image pulls (issue #22), tested honestly offline (no registry can run here): ``IfNotPresent``
uses a local image without pulling; ``Always`` from a registry that refuses connections fails in
seconds with reason ``ErrImagePull`` naming the image, and podman's pull progress ("Trying to
pull ...") is in the instance log; a registry that accepts and never answers (podman would retry
for minutes) is bounded by the agent's creation timeout. ``Never`` with a missing image:
``test_never_pull_policy_refuses_a_missing_image``."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from conftest import AgentUnderTest
from trainmaster.agent.contract import ContainerLaunch

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def silent_registry() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a hung registry)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    try:
        yield f"localhost:{server.getsockname()[1]}"
    finally:
        server.close()


def test_if_not_present_uses_the_local_image_without_pulling(agent: AgentUnderTest, small_image: str) -> None:
    """``localhost/...`` has no registry behind it: a pull would fail, so success is no pull."""
    spec = agent.spec("local", ContainerLaunch(small_image, args=["echo used the local image"]))
    (status,) = agent.run([spec])
    assert status.exit_code == 0, (status, agent.log("local"))
    assert "used the local image" in agent.log("local") and "Trying to pull" not in agent.log("local")


def test_always_from_an_unreachable_registry_fails_clearly_in_bounded_time(agent: AgentUnderTest) -> None:
    image = "localhost:1/tm-never-there:1"  # port 1: connection refused at once
    began = time.monotonic()
    (status,) = agent.run([agent.spec("always", ContainerLaunch(image, pull_policy="Always"))], timeout=60)
    assert time.monotonic() - began < 60
    assert status.exit_code != 0 and status.reason == "ErrImagePull", status
    assert image in status.message, status.message
    assert f"Trying to pull {image}" in agent.log("always")  # podman's pull progress, in the instance log


def test_a_pull_that_hangs_is_ended_at_the_creation_timeout(agent: AgentUnderTest, silent_registry: str) -> None:
    image = f"{silent_registry}/tm-hangs:1"
    launch = ContainerLaunch(image, pull_policy="Always", create_timeout=3.0)
    began = time.monotonic()
    assert agent.client.start([agent.spec("hung", launch)])[0].handle
    (status,) = agent.exited(["job/hung/1"], timeout=60)  # observing is what checks the deadline
    assert 3.0 <= time.monotonic() - began < 30
    assert status.reason == "ErrImagePull" and image in status.message and "creation timeout" in status.message, status
    assert f"Trying to pull {image}" in agent.log("hung")
