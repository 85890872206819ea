"""A store that is away (database restarting, connection dropped, disk full) is waited out with
exponential backoff and shown as a condition, never a crash loop (the PostgreSQL restart under a
running server is in tests/store/test_failover.py)."""

from __future__ import annotations

from sqlalchemy.exc import OperationalError

from trainmaster.controller.backoff import StoreBackoff


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    backoff = StoreBackoff(base=0.5, cap=3.0)
    error = OperationalError("SELECT 1", {}, Exception("connection refused"))
    assert [backoff.failed(error) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff.condition is not None and "StoreUnreachable" in backoff.condition
    backoff.succeeded()
    assert backoff.condition is None and backoff.failed(error) == 0.5
