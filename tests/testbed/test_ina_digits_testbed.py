"""``examples/ina-digits.yaml`` on a 4-host testbed next to its gloo anchor
``examples/ina-digits-gloo.yaml``: the same training, the same hosts and links."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = "3"  # the examples train 20 epochs; both variants here run the same, fewer


def _run(example: str, tmp_path: Path, prefix: str) -> tuple[dict, dict]:
    """``trainmaster run EXAMPLE --backend testbed`` with fewer epochs; (status, metrics)."""
    job = yaml.safe_load((ROOT / "examples" / example).read_text())
    for role in job["spec"]["roles"]:
        if "command" in role:
            role["command"] = [sys.executable, *role["command"][1:]]
            role["command"][role["command"].index("--epochs") + 1] = EPOCHS
    out = tmp_path / job["metadata"]["name"]
    job["spec"]["output"]["path"] = str(out)
    path = tmp_path / example
    path.write_text(yaml.safe_dump(job))
    # TRAINMASTER_HOME is the test's (where the testbed's record is): only the prefix is ours
    env = {**os.environ, "TRAINMASTER_TESTBED": prefix}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmaster",
            "run",
            str(path),
            "--backend",
            "testbed",
            "--interval",
            "0.2",
            "--json",
            "--db",
            f"sqlite:///{tmp_path / 'jobs.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout), json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ina_digits_trains_across_four_testbed_hosts_like_gloo(make_testbed, tmp_path: Path) -> None:
    """ina framework on the testbed backend: the forwarding and parameter nodes on the switch
    host (the example's ``testbed/<role>: sw`` pins), the 4 workers one per host, their
    gradients crossing the capped links; the test accuracy matches the gloo anchor's (same
    script, same hosts) within 1 point and both report seconds per epoch."""
    bed = make_testbed(hosts=4, link_rate=1_000_000_000)
    before = bed.counters()
    status, ina = _run("ina-digits.yaml", tmp_path, bed.options.prefix)
    where = {(i["role"], i["index"]): i["address"].rsplit(":", 1)[0] for i in status["instances"]}
    assert where[("ps", 0)] == where[("switch", 0)] == bed.address("sw")
    assert sorted(where[("worker", r)] for r in range(4)) == sorted(bed.address(h) for h in bed.host_names)
    after = bed.counters()
    for host in bed.host_names:  # every worker's gradients went over its own link
        assert after[host].up_bytes - before[host].up_bytes > 1_000_000, host
    _, gloo = _run("ina-digits-gloo.yaml", tmp_path, bed.options.prefix)
    assert ina["allreduce"] == "fabric" and gloo["allreduce"] == "gloo"
    assert ina["world_size"] == gloo["world_size"] == 4
    assert abs(ina["test_accuracy"] - gloo["test_accuracy"]) <= 0.01, (ina, gloo)
    assert ina["seconds_per_epoch"] > 0 and gloo["seconds_per_epoch"] > 0
