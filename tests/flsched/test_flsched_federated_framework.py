"""The `federated` framework under the controller: `trainmaster run` on a shrunken fl-multijob."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from controller_harness import run_job_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(280)
def test_fl_multijob_runs_under_controller(tmp_path: Path) -> None:
    """federated framework: a server role (scheduler + FedAvg over HTTP) and device replicas (real
    processes training their shards) under the controller; the server reports per-job accuracy
    and time to target, writes its report to the job output, and the job succeeds with it."""
    job = yaml.safe_load((ROOT / "examples/fl-multijob.yaml").read_text())
    job["spec"]["roles"][1]["replicas"] = 6
    job["spec"]["frameworkParams"].update({"per_round": 1, "rounds": 3})
    job["spec"]["output"]["path"] = str(tmp_path / "out")
    path = tmp_path / "fl.yaml"
    path.write_text(yaml.safe_dump(job))
    out, status = run_job_file(path, tmp_path, timeout=270)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [i["state"] for i in status["instances"] if i["role"] == "server"] == ["succeeded"]
    log = next((tmp_path / "home" / "runs").glob("*/logs/server-0.log")).read_text()
    for name in ("digits", "wine", "breast-cancer"):
        assert f"job {name}: accuracy" in log
    report = json.loads(next((tmp_path / "out").rglob("flsched-report.json")).read_text())
    assert set(report) == {"digits", "wine", "breast-cancer"}
    assert all(1 <= r["rounds"] <= 3 for r in report.values())
