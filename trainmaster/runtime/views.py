"""``trainmaster.publish(kind, record)``: a capability's role records what the dashboard draws.

`report` carries numbers over time; some capabilities produce structure a chart of numbers
cannot show: which device trained which federated job in each round, a partitioned graph, a
gateway task's legs. A role publishes such a record over its instance channel; the controller checks it and appends
it as one JSON line to ``<job output>/trainmaster-views/<kind>.jsonl`` on the controller's
machine, so it lands with the job's outputs (a result in its own right) wherever the instance
ran, and the dashboard's job page draws each known kind (see
``trainmaster/service/dashboard/capability.py``). A job may publish at most
:data:`trainmaster.controller.channel.MAX_VIEW_BYTES` of each kind. Outside an instance (no
``TM_CHANNEL``) the call does nothing, so the same code runs by hand.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainmaster.errors import UserError

VIEWS_FOLDER = "trainmaster-views"
MAX_RECORD_BYTES = 256 * 1024  # one record is one round, one plan, one task: never a data dump

#: Each kind and the fields its records carry (checked here, drawn by the dashboard).
KINDS: dict[str, tuple[str, ...]] = {
    "flsched.round": ("round", "assignment", "accuracy"),  # assignment: {job: [device index]}
    "aggregation.counters": ("time",),  # plus counters: slots_in_use, retransmits, fallbacks...
    "partition.plan": ("nodes", "edges", "devices"),  # nodes: {id, device, critical}; edges: {src, dst}
    "gateway.task": ("task", "legs"),  # legs: [{data_id, party, outcome}]
}


def views_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / VIEWS_FOLDER


def check_record(kind: str, record: Any) -> str:
    """The record as the JSON line it is stored as; a mistake (unknown kind, missing field, not
    JSON, too large) is a :class:`UserError`."""
    if kind not in KINDS:
        raise UserError(f"publish(): unknown view kind {kind!r} (known: {', '.join(sorted(KINDS))})")
    if not isinstance(record, dict):
        raise UserError(f"publish(): a {kind} record must be a mapping, got {type(record).__name__}")
    missing = [field for field in KINDS[kind] if field not in record]
    if missing:
        raise UserError(f"publish(): a {kind} record needs {', '.join(missing)}")
    try:
        line = json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"
    except (TypeError, ValueError) as exc:
        raise UserError(f"publish(): a {kind} record must be finite JSON: {exc}") from None
    if len(line) > MAX_RECORD_BYTES:
        raise UserError(f"publish(): a {kind} record is {len(line)} bytes; at most {MAX_RECORD_BYTES}")
    return line


def publish(kind: str, record: dict[str, Any]) -> bool:
    """Append ``record`` to this job's ``kind`` view; returns whether it was stored (False outside
    an instance, when the job's view of that kind is full, or when the controller stayed away
    for the channel's timeout: said once on stderr). A mistake (unknown kind, missing field, not
    JSON) is a :class:`UserError`."""
    from trainmaster.runtime.channel import Channel, ChannelRefused, ChannelUnavailable
    from trainmaster.runtime.report import warn_once

    line = check_record(kind, record)
    channel = Channel.from_environment()
    if channel is None:
        return False
    try:
        channel.call("POST", f"/v1/views/{kind}", json.loads(line))
    except ChannelRefused as exc:
        warn_once(f"publish-{kind}-{exc.status}", f"publish(): the controller refused a {kind} record: {exc.message}")
        return False
    except ChannelUnavailable as exc:
        warn_once("publish-away", f"publish(): record not stored: {exc}")
        return False
    return True


def numbers(prefix: str, values: dict[str, Any]) -> dict[str, float]:
    """The numeric leaves of a nested stats mapping, flattened to ``prefix_key_subkey`` names."""
    flat: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}_{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(numbers(name, value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


class PeriodicPublisher:
    """Publish ``sample()`` every ``every_s`` seconds from a daemon thread while a long-running
    role serves (a node's counters), and once more at the end. A sample that fails (the sampled
    object changed under it) is skipped: the next one is a moment away."""

    def __init__(self, kind: str, sample: Any, every_s: float = 2.0):
        import threading

        self.kind, self.sample, self.every_s = kind, sample, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"publish-{kind}", daemon=True)

    def _publish_once(self) -> None:
        import time

        try:
            publish(self.kind, {"time": time.time(), **self.sample()})
        except (RuntimeError, OSError, ValueError, UserError):
            pass  # a sample taken while the node changed it, or not JSON: the next one is a moment away

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._publish_once()

    def __enter__(self) -> PeriodicPublisher:
        if os.environ.get("TM_CHANNEL"):  # outside an instance there is nowhere to publish
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.every_s + 1)
            self._publish_once()
