"""``trainmaster.report(...)``: a role tells the controller how its training is going.

Like Ray Train's ``report``: a role calls it once per step or epoch with its metrics; every point
is stored with the job (a metric history per instance), so ``status``, the REST API, ``/metrics``
and the dashboard show the latest values and a progress bar where a total is known.

The point goes to the controller over the instance's channel (``TM_CHANNEL``, with the
instance's own token: :mod:`trainmaster.runtime.channel`), which checks it again and stores it
for this instance's current attempt only; an instance never writes the store itself. Outside a
Trainmaster instance (a script run by hand) there is nowhere to report to: the call does nothing,
so the same script runs both ways.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

from trainmaster.errors import UserError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
MAX_VALUES = 32  # metrics per point: a report is a few numbers, not a data dump
MAX_COUNT = 2**62  # step, epoch, total: the store's integers are 64-bit
_warned: set[str] = set()


def check_point(step: int | None, epoch: int | None, total: int | None, values: dict[str, Any]) -> dict[str, float]:
    """The point's metrics as finite floats; a mistake is a :class:`UserError` naming the field."""
    for field, number in (("step", step), ("epoch", epoch), ("total", total)):
        if number is not None and (
            isinstance(number, bool) or not isinstance(number, int) or number < 0 or number > MAX_COUNT
        ):
            raise UserError(f"report(): {field} must be a non-negative integer below 2**62, got {number!r}")
    if len(values) > MAX_VALUES:
        raise UserError(f"report(): at most {MAX_VALUES} metrics per call, got {len(values)}")
    clean: dict[str, float] = {}
    for name, value in values.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise UserError(f"report(): metric name {name!r} must be an identifier of at most 63 characters")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"report(): metric {name} must be a finite number, got {value!r}")
        clean[name] = float(value)
    return clean


def warn_once(what: str, message: str) -> None:
    """One line on stderr per kind of trouble: a training loop calling report() a million times
    must not print a million lines."""
    if what not in _warned:
        _warned.add(what)
        print(f"[trainmaster] {message}", file=sys.stderr, flush=True)


def report(*, step: int | None = None, epoch: int | None = None, total: int | None = None, **metrics: float) -> bool:
    """Record one point (e.g. ``report(epoch=3, total=10, loss=0.41, accuracy=0.87)``).

    ``total`` is the number of steps (or epochs, when only ``epoch`` is given) the role expects,
    for progress bars. Returns whether the point was stored: False outside an instance, and
    when the controller refused it (over this attempt's budget of points) or stayed away for
    the channel's timeout; each such trouble is said once on stderr, and training goes on.
    """
    from trainmaster.runtime.channel import Channel, ChannelRefused, ChannelUnavailable

    values = check_point(step, epoch, total, metrics)
    channel = Channel.from_environment()
    if channel is None:
        return False
    try:
        channel.call("POST", "/v1/metrics", {"step": step, "epoch": epoch, "total": total, "values": values})
    except ChannelRefused as exc:
        warn_once(f"report-{exc.status}", f"report(): the controller refused the point: {exc.message}")
        return False
    except ChannelUnavailable as exc:
        warn_once("report-away", f"report(): point not stored: {exc}")
        return False
    return True
