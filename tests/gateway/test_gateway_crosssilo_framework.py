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
    run_dir = next((tmp_path / "home" / "runs").glob("*/logs")).parent
    _assert_no_private_key_in_outputs([tmp_path / "out", run_dir / "output"], run_dir / "crosssilo" / "deploy")
    parties = sorted(p.name for p in (run_dir / "crosssilo" / "data").iterdir())
    assert parties == ["p0", "p1", "p2"]  # each party replica wrote only its own data directory
    kept = tmp_path / "out" / "crosssilo"
    assert json.loads((kept / "report.json").read_text())["model"]["within_tolerance"]
    assert (kept / "ca.pem").read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert "identities" in json.loads((kept / "roster.json").read_text())
    from trainmaster.service.dashboard.capability import capability_views  # the dashboard's gateway view

    view = next(v for v in capability_views(tmp_path / "out") if v.kind == "gateway.task")
    assert {row[2] for row in view.table} == {"p0", "p1", "p2"} and {row[4] for row in view.table} == {"result"}


PRIVATE_NAMES = ("ca.key", "tls.key", "sign.key", "enc.key")


def _assert_no_private_key_in_outputs(outputs: list[Path], deployment: Path) -> None:
    """Issue 38 item 3: a job's outputs hold what a user keeps (the report, the CA certificate,
    the roster of public keys), never a private key; the keys stay in the deployment's own folder
    (the run's, not copied with the outputs), each readable by its owner only."""
    import stat

    for out in outputs:
        for path in out.rglob("*"):
            if path.is_file():
                assert path.name not in PRIVATE_NAMES, f"private key {path} in the job's outputs"
                assert b"PRIVATE KEY" not in path.read_bytes(), f"{path} in the job's outputs holds a private key"
    keys = [p for p in deployment.rglob("*") if p.name in PRIVATE_NAMES]
    assert len(keys) == 1 + 3 * (
        1 + 1 + 1 + 3
    )  # the CA's, then tls/sign/enc of gateway, operator, initiator, 3 parties
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys)
    assert stat.S_IMODE(deployment.parent.stat().st_mode) == 0o700
