"""A job orphaned the way an operator orphans one: its `trainmaster run` killed -9 mid-job."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import yaml


def orphan_a_run(
    tmp_path: Path, name: str, seconds: float = 6.0, until: Path | None = None
) -> tuple[Path, dict[str, str]]:
    """Start `trainmaster run` of a 2-replica job writing one mark per process, kill it -9 once
    both instances run and the store says so (the job ``running``: killed between the marks and
    that write, the job would be orphaned while still ``starting``); returns the marks folder and
    the environment (home and store) used.
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
    while (len(list(marks.iterdir())) < 2 or _stored_state(tmp_path / "store.db", name) != "running") and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    run.kill()
    run.wait()
    assert len(list(marks.iterdir())) == 2, "the instances never started"
    assert _stored_state(tmp_path / "store.db", name) == "running", "the job was not stored running within 60 s"
    return marks, env


def _stored_state(db: Path, name: str) -> str | None:
    """The job's state as its store holds it (None before the store or the job exists)."""
    if not db.exists():
        return None
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as store:
        try:
            row = store.execute("SELECT state FROM jobs WHERE name = ?", (name,)).fetchone()
        except sqlite3.OperationalError:  # the tables not made yet
            return None
    return row[0] if row else None
