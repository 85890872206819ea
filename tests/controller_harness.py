"""Test helpers for the controller: a controller over a fresh store, job builders, process checks.

A plain module (not conftest) so tests import it by a unique name: several conftest.py files
live in this tree and ``from conftest import`` would pick whichever loaded first.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from trainmaster.backends.local import LocalBackend
from trainmaster.controller import Controller
from trainmaster.spec import load_document
from trainmaster.store import repository as repo
from trainmaster.store.db import make_engine, session_factory

PY = sys.executable


class Harness:
    """A controller over a fresh SQLite store with a fast reconcile interval."""

    def __init__(self, tmp_path: Path, backend: Any = None):
        self.url = f"sqlite:///{tmp_path / 'store.db'}"
        self.sessions = session_factory(make_engine(self.url))
        self.backend = backend or LocalBackend()
        self.controller = Controller(self.sessions, self.backend, self.url, interval=0.1, grace=2.0,
                                     runs_dir=tmp_path / "runs")

    def submit(self, doc: dict[str, Any] | str) -> int:
        raw = yaml.safe_load(doc) if isinstance(doc, str) else doc
        return self.controller.submit(load_document(raw))

    def run(self, doc: dict[str, Any] | str) -> tuple[str, dict[str, Any]]:
        job_id = self.submit(doc)
        state = self.controller.run_job(job_id)
        return state, self.status(job_id)

    def status(self, job_id: int) -> dict[str, Any]:
        with self.sessions() as session:
            return repo.job_status(session, repo.load_job(session, job_id), events=500)


def job(name: str, roles: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"roles": roles, **spec}}


def py(code: str) -> list[str]:
    return [PY, "-c", code]


def events(status: dict[str, Any], reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in status["events"] if reason is None or e["reason"] == reason]


def pids_alive(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive

