"""Waiting out a store that is away (a database restarting, a dropped connection, a full disk):
retry with exponential backoff and say so, instead of crashing or spinning."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.exc import OperationalError

log = logging.getLogger(__name__)


@dataclass
class StoreBackoff:
    """Delays after consecutive store failures: ``base`` doubling up to ``cap`` seconds."""

    base: float
    cap: float = 10.0
    failures: int = 0

    def failed(self, error: OperationalError) -> float:
        """Record a failure; the seconds to wait before the next try."""
        self.failures += 1
        delay = min(self.cap, self.base * 2 ** (self.failures - 1))
        log.warning("the store is unreachable (%s); retry %d in %.1f s", error.orig or error, self.failures, delay)
        return delay

    def succeeded(self) -> None:
        if self.failures:
            log.warning("the store answers again after %d failed tries", self.failures)
        self.failures = 0

    @property
    def condition(self) -> str | None:
        """What /healthz shows while the store is away."""
        return (
            f"StoreUnreachable: {self.failures} consecutive failures; retrying with backoff" if self.failures else None
        )
