"""A job orphaned the way an operator orphans one: its `trainmaster run` killed -9 mid-job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml


def orphan_a_run(
    tmp_path: Path, name: str, seconds: float = 6.0, until: Path | None = None
) -> tuple[Path, dict[str, str]]:
    """Start `trainmaster run` of a 2-replica job writing one mark per process, kill it -9 once
    both instances run; returns the marks folder and the environment (home and store) used.
    Each instance runs ``seconds``, or with ``until`` until that file exists (at most 300 s): a
    test that must find them alive, however slowly its machine starts a server, creates it."""
    marks = tmp_path / f"marks-{name}"
    marks.mkdir()
    code = f"import os, time; open('{marks}/%s-%d' % (os.environ['TM_REPLICA_INDEX'], os.getpid()), 'w')\n"
    if until is None:
        code += f"time.sleep({seconds})"
    else:
        code += f"end = time.monotonic() + 300\nwhile not os.path.exists({str(until)!r}) and time.monotonic() < end: time.sleep(0.1)"
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "trainmaster/v1",
                "kind": "Job",
                "metadata": {"name": name},
                "spec": {"roles": [{"name": "w", "replicas": 2, "command": [sys.executable, "-c", code]}]},
            }
        )
    )
    env = {
        **os.environ,
        "TRAINMASTER_HOME": str(tmp_path / "home"),
        "TRAINMASTER_DB": f"sqlite:///{tmp_path / 'store.db'}",
    }
    run = subprocess.Popen(
        [sys.executable, "-m", "trainmaster", "run", str(path), "--interval", "0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 60
    while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    run.kill()
    run.wait()
    assert len(list(marks.iterdir())) == 2, "the instances never started"
    return marks, env
