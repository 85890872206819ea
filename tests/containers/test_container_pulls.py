"""Image pulls (issue #22), offline: ``IfNotPresent`` uses a local image without pulling; with a
local registry (Debian's ``docker-registry``; skipped with its reason where it is not installed)
a missing image is pulled, ``Always`` pulls a present one again, and podman's pull progress is in
the instance log; ``Always`` from a registry that refuses connections fails in seconds with reason
``ErrImagePull`` naming the image; a registry that accepts and never answers (podman would retry
for minutes) is bounded by the agent's creation timeout. ``Never`` with a missing image:
``test_never_pull_policy_refuses_a_missing_image``."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from container_fixtures import AgentUnderTest
from helpers import wait_until
from trainmaster.contract import ContainerLaunch
from trainmaster.containers.runtime import ContainerRuntime

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


@pytest.fixture
def local_registry(
    podman: ContainerRuntime, small_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A registry on a free loopback port holding ``small_image`` as ``<registry>/tm-pulled:1``
    (not present locally), marked insecure (plain HTTP) in a registries.conf that the agent's
    podman reads (CONTAINERS_REGISTRIES_CONF, set before the agent starts); stopped after."""
    program = shutil.which("docker-registry") or shutil.which("registry")
    if program is None:
        pytest.skip("no local registry: apt-get install -y docker-registry")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    config = tmp_path / "registry.yml"
    config.write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'registry'}\nhttp:\n  addr: {address}\n"
    )
    conf = tmp_path / "registries.conf"
    conf.write_text(f'[[registry]]\nlocation = "{address}"\ninsecure = true\n')
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(conf))
    server = subprocess.Popen([program, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    image = f"{address}/tm-pulled:1"
    try:
        wait_until(lambda: _listens(address), 30, f"the registry to listen on {address}")
        podman_cli = [*podman.base()]
        for argv in (["tag", small_image, image], ["push", "--tls-verify=false", image], ["rmi", image]):
            done = subprocess.run([*podman_cli, *argv], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (argv, done.stderr)
        yield image
    finally:
        subprocess.run([*podman.base(), "rmi", "--force", "--ignore", image], capture_output=True, timeout=120)
        server.terminate()
        server.wait(timeout=30)


def _listens(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_missing_image_is_pulled_with_progress_in_the_log(local_registry: str, agent: AgentUnderTest) -> None:
    """IfNotPresent pulls the missing image (progress in the log), Always pulls it again. (The
    registry comes first: the agent it starts reads its registries.conf.)"""
    first = agent.spec("pull", ContainerLaunch(local_registry, args=["echo pulled and ran"]))
    (status,) = agent.run([first])
    log = agent.log("pull")
    assert status.exit_code == 0, (status, log)
    assert f"Trying to pull {local_registry}" in log and "Writing manifest" in log and "pulled and ran" in log
    again = agent.spec("again", ContainerLaunch(local_registry, args=["echo again"], pull_policy="Always"))
    (status,) = agent.run([again])
    assert status.exit_code == 0 and f"Trying to pull {local_registry}" in agent.log("again"), agent.log("again")


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
