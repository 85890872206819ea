"""The pipeline framework: a traced model split by a partition runs as stage roles under the
controller, passing tensors between processes; outputs equal the unsplit model's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainmaster.frameworks import get_framework


def test_pipeline_framework_validates_params():
    """Mechanism: the pipeline framework's roles and parameters are checked before running."""
    fw = get_framework("pipeline")
    errors = fw.validate({"frameworkParams": {"model": "nocolon", "bogus": 1,
                                              "methods": ["nope"]}},
                         [{"name": "stage", "replicas": 2}, {"name": "driver", "replicas": 2}])
    text = "\n".join(errors)
    assert "model" in text and "bogus" in text and "nope" in text and "exactly 1" in text
    assert fw.validate({}, [{"name": "stage"}, {"name": "driver"}]) == []


@pytest.mark.timeout(280)
def test_pipeline_runs_under_controller(tmp_path: Path):
    """Mechanism: stages as controller roles run a torch.fx split of a real model for our
    partition and METIS's, k = 2; every output equals the unsplit model's."""
    job = {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": "pipe-test"},
           "spec": {"framework": "pipeline",
                    "frameworkParams": {"model": "trainmaster.partition.models:inception",
                                        "input_shape": [1, 3, 16, 16], "samples": 4,
                                        "methods": ["trainmaster", "metis"]},
                    "roles": [{"name": "stage", "replicas": 2}, {"name": "driver"}],
                    "output": {"path": str(tmp_path / "out")}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {**os.environ, "TRAINMASTER_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "trainmaster", "run", str(path), "--interval",
                           "0.2", "--json"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=270)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    assert report["k"] == 2 and set(report["runs"]) == {"trainmaster", "metis"}
    for run in report["runs"].values():
        assert run["outputs_equal_unsplit"] is True
        assert run["seconds_per_sample"] > 0
    from trainmaster.service.dashboard.capability import capability_views  # the dashboard's graph view

    view = next(v for v in capability_views(tmp_path / "out") if v.kind == "partition.plan")
    assert view.svg.count('class="capability partition-graph"') == 2 and "trainmaster: " in view.caption
