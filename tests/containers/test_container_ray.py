"""Containers on Ray (issue #22): each Ray node's agent (the same NodeAgent) runs a role's
instances in podman containers, and removes them once they ended."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from container_fixtures import container_cgroups
from controller_harness import RAY_NODE_IP, Harness
from trainmaster.containers.runtime import ContainerRuntime

pytest.importorskip("ray", reason="the optional ray extra (trainmaster[ray]) is not installed")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def test_a_container_role_runs_on_ray_nodes(podman: ContainerRuntime, small_image: str, tmp_path: Path) -> None:
    from trainmaster.backends.ray import RayBackend

    before = container_cgroups()
    backend = RayBackend(node_ip=RAY_NODE_IP)
    try:
        harness = Harness(tmp_path, backend=backend)
        state, status = harness.run(
            {
                "apiVersion": "trainmaster/v1",
                "kind": "Job",
                "metadata": {"name": "ray-box"},
                "spec": {
                    "roles": [
                        {
                            "name": "worker",
                            "replicas": 2,
                            "image": small_image,
                            "runtime": "container",
                            "imagePullPolicy": "Never",
                            "args": ["echo worker $RANK in $(pwd) on $TM_HOST"],
                        }
                    ]
                },
            }
        )
        assert state == "succeeded", status["events"]
        for inst in status["instances"]:
            log = Path(inst["logPath"]).read_text()
            assert "image entrypoint ran" not in log and "in /tmp on" in log, log  # the image's WORKDIR
    finally:
        backend.close()
    names = subprocess.run(
        [*podman.base(), "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True, timeout=60
    ).stdout.split()
    assert not [n for n in names if ".worker-" in n]  # removed by each node's agent
    assert container_cgroups() == before  # and their cgroups, though Ray ends its agents without a shutdown
