"""Shared fixtures: an isolated Trainmaster home per test, and a controller over a fresh store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controller_harness import Harness, stop_agent


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A Trainmaster home per test; the node agent a test started there is stopped (and its
    instances and cgroups removed) when the test ends, passed or failed."""
    home = tmp_path / "tmhome"
    monkeypatch.setenv("TRAINMASTER_HOME", str(home))
    monkeypatch.delenv("TRAINMASTER_DB", raising=False)
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    yield home
    stop_agent(home / "agent")


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.backend.close()
