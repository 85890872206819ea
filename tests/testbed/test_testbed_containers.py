"""Containers on testbed hosts (issue #22): a role in a container on ``h1`` shares h1's network
namespace (its host's agent, which joined that namespace, runs ``podman run --network host``), so
it binds h1's address, on its declared containerPort, and a process on ``h2`` reaches it across
the link, as for processes. Skips with
its reason where podman or network namespaces are unavailable."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller_harness import Harness, job, py
from test_testbed_backend import CLIENT, SERVER
from trainmaster.agent.core import AgentOptions
from trainmaster.backends.testbed import TestbedBackend
from trainmaster.containers import images
from trainmaster.containers.runtime import AGENT_LABEL, ContainerRuntime, detect, unavailable
from trainmaster.testbed.agents import host_agent_dir

pytestmark = pytest.mark.timeout(240)
# the testbed backend's server, saying too whether it ran in a container
IN_CONTAINER_SERVER = SERVER.replace(
    "json.dump({", 'json.dump({"container": os.path.exists("/run/.containerenv"), "port": port, '
)
DECLARED = 24567  # the server's containerPort: free on its host (a fresh namespace), so it is its port
assert IN_CONTAINER_SERVER != SERVER


@pytest.fixture(scope="module")
def python_image() -> Iterator[tuple[ContainerRuntime, str]]:
    why = unavailable()
    if why:
        pytest.skip(why)
    podman = detect()
    tag = f"localhost/tm-testbed-python:{os.getpid()}"
    images.build_python_image(podman, tag)
    yield podman, tag
    images.remove_images(podman, [tag])


def test_a_container_on_a_testbed_host_shares_its_network(
    make_testbed, unique_prefix: str, python_image: tuple[ContainerRuntime, str], tmp_path: Path
) -> None:
    podman, tag = python_image
    bed = make_testbed(hosts=2, link_rate=100_000_000)
    volumes = [
        {"name": f"host{i}", "hostPath": str(m["source"]), "mountPath": str(m["target"]), "readOnly": True}
        for i, m in enumerate(images.python_mounts())
    ]
    server = {
        "name": "server",
        "image": tag,
        "runtime": "container",
        "imagePullPolicy": "Never",
        "command": [images.python_executable(), "-c", IN_CONTAINER_SERVER],
        "volumes": volumes,
        "containerPorts": [DECLARED],
    }
    doc = job("across", [server, {"name": "client", "command": py(CLIENT), "depends_on": [{"role": "server"}]}])
    doc["metadata"]["annotations"] = {"testbed/server": "h1", "testbed/client": "h2"}
    harness = Harness(tmp_path, backend=TestbedBackend(bed))
    keys = [AgentOptions(state_dir=host_agent_dir(unique_prefix, h), node=h).node_key for h in ("h1", "h2")]
    try:
        state, status = harness.run(doc)
    finally:
        harness.backend.close()
        left = _containers(podman, keys)
        if left:
            subprocess.run([*podman.base(), "rm", "-f", "-t", "0", *left], capture_output=True, timeout=120)
    assert state == "succeeded", status
    assert not left, f"containers left behind: {left}"
    output = next((tmp_path / "runs").glob("*/output"))
    got = json.loads((output / "server.json").read_text())
    assert got.pop("container") is True and got.pop("port") == DECLARED, got
    assert got == {"bound": bed.address("h1"), "peer": bed.address("h2"), "got": "hello across the link"}, got
    assert json.loads((output / "client.json").read_text())["reply"] == "HELLO ACROSS THE LINK"


def _containers(podman: ContainerRuntime, keys: list[str]) -> list[str]:
    names: list[str] = []
    for key in keys:
        argv = [*podman.base(), "ps", "-a", "--filter", f"label={AGENT_LABEL}={key}", "--format", "{{.Names}}"]
        names += subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.split()
    return names
