"""Shared fixtures: an isolated Trainmaster home and store per test, and a controller over them."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainmaster.backends.local import LocalBackend
from trainmaster.controller import Controller
from trainmaster.spec import load_document
from trainmaster.store import repository as repo
from trainmaster.store.db import make_engine, session_factory

PY = sys.executable


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "tmhome"
    monkeypatch.setenv("TRAINMASTER_HOME", str(home))
    monkeypatch.delenv("TRAINMASTER_DB", raising=False)
    return home


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


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.backend.close()


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


os.environ.setdefault("PYTHONUNBUFFERED", "1")
