"""docs/gateway.md's walk-through runs as written, on the sample data shipped in examples/gateway."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainmaster.gateway.localdeploy import free_port_block

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


def test_docs_walkthrough_runs_as_written(tmp_path: Path) -> None:
    """Docs (issue #15, `docs/gateway.md` rewritten for users): the "Try it on one machine" block,
    run verbatim by bash from the repository root, provisions a CA, a gateway, two parties and two
    initiators, starts the services, runs both sample tasks to verified results and verifies a
    party's audit log."""
    doc = (ROOT / "docs" / "gateway.md").read_text()
    section = doc.split("## Try it on one machine", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    script = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null' EXIT\n" + block
    env = {
        **os.environ,
        "DEMO": str(tmp_path / "demo"),
        "PORT_BASE": str(free_port_block(6)),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
    }
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    decoder, results, i = json.JSONDecoder(), [], 0
    while (start := out.find("{", i)) != -1:
        obj, i = decoder.raw_decode(out, start)
        results.append(obj)
    stats, hist, audit = results
    assert {k: (v["outcome"], v["party"]) for k, v in stats["legs"].items()} == {
        "m_a": ("result", "a"),
        "m_b": ("result", "b"),
    }
    assert stats["legs"]["m_a"]["result"]["columns"]["age"]["count"] == 120
    assert sum(hist["legs"]["m_a"]["result"]["counts"]) + sum(hist["legs"]["m_b"]["result"]["counts"]) == 270
    assert audit["ok"] and audit["signatures"] == "checked" and audit["lines"] >= 6, audit  # party a's log
