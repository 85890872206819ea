"""The pipeline framework on the testbed backend: a model split over stages on separate hosts,
its values crossing the hosts' capped links (issue 19: the pipeline on separate testbed hosts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

LINK_BITS = 100_000_000  # each host's link: 100 Mbit/s


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pipeline_stages_on_separate_testbed_hosts(make_testbed, tmp_path: Path) -> None:
    """Mechanism: pipeline stages on separate hosts (``real_links``): ``trainmaster run
    --backend testbed`` places the two stages and the driver on three hosts; every stage
    listens on its host's address, the values between stages and the driver cross the capped
    links (the inputs leave the driver's host, each stage host's link carries values both
    ways), both methods' outputs
    equal the unsplit model's, and each run has a latency predicted with the links priced."""
    bed = make_testbed(hosts=3, link_rate=LINK_BITS)
    out = tmp_path / "out"
    job = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "pipeline-hosts"},
        "spec": {
            "framework": "pipeline",
            "frameworkParams": {
                "model": "trainmaster.partition.models:resnet_like",
                "input_shape": [4, 3, 32, 32],
                "methods": ["trainmaster", "metis"],
                "samples": 6,
                "latency_samples": 4,
                "costs": "measured",
                "real_links": True,
                "bandwidth": LINK_BITS / 8,
                "latency": 0.0,
            },
            "roles": [{"name": "stage", "replicas": 2}, {"name": "driver", "replicas": 1}],
            "output": {"path": str(out)},
        },
    }
    path = tmp_path / "pipeline-hosts.yaml"
    path.write_text(yaml.safe_dump(job))
    before = bed.counters()
    done = subprocess.run(
        [sys.executable, "-m", "trainmaster", "run", str(path), "--backend", "testbed", "--interval", "0.2"]
        + ["--json", "--db", f"sqlite:///{tmp_path / 'jobs.db'}"],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=tmp_path,
        env={**os.environ, "TRAINMASTER_TESTBED": bed.options.prefix},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    status = json.loads(done.stdout)
    assert status["state"] == "succeeded", status
    where = {(i["role"], i["index"]): i["address"].rsplit(":", 1)[0] for i in status["instances"]}
    stage_hosts = [where[("stage", 0)], where[("stage", 1)]]
    assert len(set(where.values())) == 3 and set(where.values()) <= {bed.address(h) for h in bed.host_names}
    after = bed.counters()
    by_address = {bed.address(h): h for h in bed.host_names}
    driver = by_address[where[("driver", 0)]]
    # the inputs (4 x 3 x 32 x 32 floats, 49 KB each; dozens: calibration and both methods) left the driver's host
    assert after[driver].up_bytes - before[driver].up_bytes > 1_000_000
    for address in stage_hosts:  # and every stage's link carried values both ways
        host = by_address[address]
        assert after[host].up_bytes - before[host].up_bytes > 10_000, host
        assert after[host].down_bytes - before[host].down_bytes > 10_000, host
    report = json.loads((out / "pipeline.json").read_text())
    assert report["real_links"] is True and not report["emulated_link"]
    assert set(report["runs"]) == {"trainmaster", "metis"}
    for run in report["runs"].values():
        assert run["outputs_equal_unsplit"]
        assert run["predicted_latency"] > 0 and run["latency_seconds"] > 0
