"""Fixture for aggregation tests: a tier in threads, stopped after the test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aggregation_tier import ThreadTier, start_tier


@pytest.fixture
def tier_factory() -> Iterator[Any]:
    made: list[ThreadTier] = []

    def make(**kwargs: Any) -> ThreadTier:
        tier = start_tier(**kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.stop()
