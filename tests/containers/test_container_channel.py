"""A role in a container reaches its controller through the instance channel as a process does:
its wait step, its reports and its published records (issue 39, item 7: the channel on every
backend; the container gets the channel's folder mounted, never the store).

Mechanism: the wait step of a dependent role and the metrics roles report, for containers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from container_fixtures import REPO
from controller_harness import run_job_file
from trainmaster.containers import images
from trainmaster.containers.runtime import ContainerRuntime

pytestmark = pytest.mark.timeout(300)

CODE = (
    "import os, trainmaster\n"
    "assert 'TM_DB_URL' not in os.environ and 'TRAINMASTER_DB' not in os.environ\n"
    "assert trainmaster.report(step=1, total=1, loss=0.25)\n"
    "assert trainmaster.publish('gateway.task', {'task': 't', 'legs': []})\n"
    "print('in a container:', os.path.exists('/run/.containerenv'), flush=True)\n"
)


def test_a_container_role_waits_reports_and_publishes_through_the_channel(
    podman: ContainerRuntime, python_image: str, tmp_path: Path
) -> None:
    mounts = images.python_mounts([REPO])
    volumes = [
        {"name": f"host{i}", "hostPath": str(m["source"]), "mountPath": str(m["target"]), "readOnly": True}
        for i, m in enumerate(mounts)
    ]
    role = {"image": python_image, "imagePullPolicy": "Never", "runtime": "container", "volumes": volumes}
    job = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "boxed"},
        "spec": {
            "roles": [
                {"name": "first", "command": ["python", "-c", CODE], **role},
                {
                    "name": "second",
                    "command": ["python", "-c", CODE],
                    "dependsOn": [{"role": "first", "condition": "Succeeded"}],
                    **role,
                },
            ]
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    allow = [arg for m in mounts for arg in ("--allow-path", str(m["source"]))]
    proc, status = run_job_file(path, tmp_path, *allow, "--runtime", "container", timeout=240)
    assert proc.returncode == 0 and status["state"] == "succeeded", proc.stderr[-3000:]
    for inst in status["instances"]:
        assert inst["metrics"]["values"] == {"loss": 0.25}, inst
    views = Path(status["runDir"]) / "output" / "trainmaster-views" / "gateway.task.jsonl"
    assert len(views.read_text().splitlines()) == 2
    logs = "".join(p.read_text() for p in (Path(status["runDir"]) / "logs").glob("*.log"))
    assert logs.count("in a container: True") == 2
