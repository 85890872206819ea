"""``trainmaster.report(...)``: a role tells the controller how its training is going.

Like Ray Train's ``report``: a role calls it once per step or epoch with its metrics; every point
is stored with the job (a metric history per instance), so ``status``, the REST API, ``/metrics``
and the dashboard show the latest values and a progress bar where a total is known.

The instance finds its job from the variables every instance gets (``TM_DB_URL``, ``TM_JOB_ID``,
``TM_ROLE``, ``TM_REPLICA_INDEX``, ``TM_ATTEMPT``). Outside a Trainmaster instance (a script run
by hand) there is nowhere to report to: the call does nothing, so the same script runs both ways.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from trainmaster.errors import UserError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
MAX_VALUES = 32  # metrics per point: a report is a few numbers, not a data dump


@dataclass(frozen=True)
class ReportTarget:
    """Where this instance's points go."""

    db_url: str
    job_id: int
    role: str
    index: int
    attempt: int

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> ReportTarget | None:
        env = os.environ if environ is None else environ
        try:
            return cls(
                env["TM_DB_URL"],
                int(env["TM_JOB_ID"]),
                env["TM_ROLE"],
                int(env["TM_REPLICA_INDEX"]),
                int(env.get("TM_ATTEMPT", "0")),
            )
        except (KeyError, ValueError):
            return None


def check_point(step: int | None, epoch: int | None, total: int | None, values: dict[str, Any]) -> dict[str, float]:
    """The point's metrics as finite floats; a mistake is a :class:`UserError` naming the field."""
    for field, number in (("step", step), ("epoch", epoch), ("total", total)):
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 0):
            raise UserError(f"report(): {field} must be a non-negative integer, got {number!r}")
    if len(values) > MAX_VALUES:
        raise UserError(f"report(): at most {MAX_VALUES} metrics per call, got {len(values)}")
    clean: dict[str, float] = {}
    for name, value in values.items():
        if not _NAME.match(name):
            raise UserError(f"report(): metric name {name!r} must be an identifier of at most 63 characters")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"report(): metric {name} must be a finite number, got {value!r}")
        clean[name] = float(value)
    return clean


@lru_cache(maxsize=2)
def _sessions(db_url: str) -> Any:
    from trainmaster.store.db import make_engine, session_factory

    return session_factory(make_engine(db_url, create=False))


def report(*, step: int | None = None, epoch: int | None = None, total: int | None = None, **metrics: float) -> bool:
    """Record one point (e.g. ``report(epoch=3, total=10, loss=0.41, accuracy=0.87)``).

    ``total`` is the number of steps (or epochs, when only ``epoch`` is given) the role expects,
    for progress bars. Returns whether the point was stored (False outside an instance).
    """
    values = check_point(step, epoch, total, metrics)
    target = ReportTarget.from_environment()
    if target is None:
        return False
    from trainmaster.store.models import MetricRow

    with _sessions(target.db_url)() as session:
        session.add(
            MetricRow(
                job_id=target.job_id,
                role=target.role,
                index=target.index,
                attempt=target.attempt,
                step=step,
                epoch=epoch,
                total=total,
                values=values,
            )
        )
        session.commit()
    return True
