"""The `crosssilo` framework under the controller: `trainmaster run` on the example job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from controller_harness import run_job_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_crosssilo_example_matches_pooled_computation(tmp_path: Path) -> None:
    """crosssilo framework: roles gateway, party x3 (own data dirs) and initiator under the controller;
    statistics through the gateway equal the pooled data's, the FedAvg model is within tolerance,
    and the job succeeds when the initiator does (fewer rounds than the example, to stay quick)."""
    job = yaml.safe_load((ROOT / "examples/crosssilo.yaml").read_text())
    job["spec"]["frameworkParams"]["rounds"] = 2
    job["spec"]["output"]["path"] = str(tmp_path / "out")
    path = tmp_path / "crosssilo.yaml"
    path.write_text(yaml.safe_dump(job))
    out, status = run_job_file(path, tmp_path, timeout=230)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [i["state"] for i in status["instances"] if i["role"] == "initiator"] == ["succeeded"]
    log = next((tmp_path / "home" / "runs").glob("*/logs/initiator-0.log")).read_text()
    assert "crosssilo: results equal the pooled computation" in log
    report = json.loads(log[log.index("{") : log.rindex("}") + 1])
    assert all(s["equal"] for s in report["statistics"].values())
    assert report["model"]["within_tolerance"]
    parties = sorted(p.name for p in (tmp_path / "out" / "crosssilo" / "data").iterdir())
    assert parties == ["p0", "p1", "p2"]  # each party replica wrote only its own data directory
    from trainmaster.service.dashboard.capability import capability_views  # the dashboard's gateway view

    view = next(v for v in capability_views(tmp_path / "out") if v.kind == "gateway.task")
    assert {row[2] for row in view.table} == {"p0", "p1", "p2"} and {row[4] for row in view.table} == {"result"}
