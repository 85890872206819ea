"""Shared fixtures: an isolated Trainmaster home per test, and a controller over a fresh store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster_fixtures import k8s_cluster, pytest_collection_modifyitems  # noqa: F401 (the session's cluster; it runs last)
from controller_harness import Harness, stop_agent
from trainmaster.controller.channel import close_channels
from postgres_server import PostgresServer  # noqa: F401 (fixture type)


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A Trainmaster home per test; the node agent a test started there is stopped (and its
    instances and cgroups removed) when the test ends, passed or failed."""
    home = tmp_path / "tmhome"
    monkeypatch.setenv("TRAINMASTER_HOME", str(home))
    monkeypatch.delenv("TRAINMASTER_DB", raising=False)
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    # converted Kubeflow/Volcano roles (runtime: auto) run on the host unless a test asks for
    # containers (tests/containers): their upstream images are not here
    monkeypatch.setenv("TRAINMASTER_RUNTIME", "host")
    yield home
    stop_agent(home / "agent")
    close_channels()  # each test's store got an instance channel; its thread would serve until exit


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.backend.close()


@pytest.fixture(scope="session")
def postgres() -> Iterator["PostgresServer"]:
    """A real PostgreSQL server for the whole session (skips where PostgreSQL cannot run)."""
    from postgres_server import PostgresServer, why_unavailable

    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    server = PostgresServer()
    yield server
    server.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store suite runs on SQLite and on a real PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres").url()
