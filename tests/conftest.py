"""Shared fixtures: an isolated Trainmaster home per test, and a controller over a fresh store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controller_harness import Harness


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "tmhome"
    monkeypatch.setenv("TRAINMASTER_HOME", str(home))
    monkeypatch.delenv("TRAINMASTER_DB", raising=False)
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    return home


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.backend.close()
