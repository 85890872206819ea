"""Rendering a job's status for a terminal: the live view of ``run`` and the table of ``status``.

The view is laid out for the terminal it is drawn on: it always fits 80x24 (header, one line per
role with per-state counts, restarts and progress, then the newest events), and a taller or
wider terminal gets the instances table and longer messages. Nothing wraps: a line too long for
the width ends in an ellipsis instead of pushing the layout down.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from trainmaster.client import JobStatus

STATE_STYLE = {
    "succeeded": "green",
    "running": "cyan",
    "starting": "yellow",
    "pending": "dim",
    "failed": "bold red",
    "cancelled": "magenta",
    "stopped": "dim",
    "terminating": "yellow",
    "unknown": "red",
}
#: A role's instances by state, one column each: every state an instance can be in, so the counts
#: always add up to the instance table. Terminating and unknown (brief, or a lost node) get a
#: column only while some instance is in them.
COUNTS = (
    ("pending", "pend"),
    ("starting", "start"),
    ("running", "run"),
    ("succeeded", "ok"),
    ("failed", "fail"),
    ("stopped", "stop"),
)
TRANSIENT_COUNTS = (("terminating", "term"), ("unknown", "unkn"))
BAR = 10  # cells of a progress bar


def _state(value: str) -> Text:
    return Text(value, style=STATE_STYLE.get(value, ""))


def elapsed(status: JobStatus, now: datetime | None = None) -> str:
    """Time since the job started (or was created), until it completed."""
    since = status.get("startedAt") or status.get("createdAt")
    if not since:
        return ""
    end = status.get("completedAt")
    stop = datetime.fromisoformat(end) if end else (now or datetime.now(timezone.utc))
    start = datetime.fromisoformat(since)
    if start.tzinfo is None:
        start = start.replace(tzinfo=timezone.utc)
    if stop.tzinfo is None:
        stop = stop.replace(tzinfo=timezone.utc)
    seconds = max(0, int((stop - start).total_seconds()))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def role_progress(status: JobStatus, role: str) -> tuple[float | None, dict[str, float]]:
    """The role's mean progress (0..1) over instances that reported a total, and the latest
    metric values of its first reporting instance."""
    fractions: list[float] = []
    latest: dict[str, float] = {}
    for inst in status["instances"]:
        point = inst.get("metrics")
        if inst["role"] != role or not point:
            continue
        latest = latest or dict(point["values"])
        done = point["step"] if point["step"] is not None else point["epoch"]
        if point["total"] and done is not None:
            fractions.append(min(1.0, done / point["total"]))
    return (sum(fractions) / len(fractions) if fractions else None), latest


def _progress_cell(fraction: float | None, latest: dict[str, float], width: int) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    if fraction is not None:
        filled = round(fraction * BAR)
        text.append("█" * filled, style="cyan")
        text.append("░" * (BAR - filled), style="dim")
        text.append(f" {fraction * 100:3.0f}%")
    values = " ".join(f"{k}={v:.4g}" for k, v in list(latest.items())[:3])
    if values:
        text.append(f" {values}" if fraction is not None else values)
    text.truncate(width, overflow="ellipsis")
    return text


def render_status(status: JobStatus, events: int = 8, width: int = 80, height: int = 24) -> Group:
    """The job's status laid out for a ``width`` x ``height`` terminal."""
    head = Text(no_wrap=True, overflow="ellipsis")
    head.append(f"job {status['name']} (id {status['id']}) ", style="bold")
    head.append_text(_state(status["state"]))
    head.append(f"  {elapsed(status)}  {status['reason']}: {status['message']}")
    parts: list[Any] = [head]
    controller = status.get("controller")  # from a server: who reconciles the store
    if controller and controller.get("leader"):
        parts.append(
            Text(
                f"controller: leader {controller['leader']}"
                + (f" (answered by {controller['server']})" if not controller["leading"] else ""),
                style="dim",
                no_wrap=True,
                overflow="ellipsis",
            )
        )

    restarts: dict[str, int] = {}
    for inst in status["instances"]:
        restarts[inst["role"]] = restarts.get(inst["role"], 0) + inst["restarts"]
    room = max(1, height - 8)  # head, role header, events title, a few events
    shown_roles = status["roles"][:room]
    # fixed-width columns (counts never need more); the progress column gets the rest of the line
    name_width = max([4] + [min(16, len(r["name"])) for r in shown_roles])
    shown_counts = COUNTS + tuple(
        (key, label) for key, label in TRANSIENT_COUNTS if any(r["counts"].get(key) for r in status["roles"])
    )
    columns = [(label, max(len(label), 4)) for _, label in shown_counts] + [("rst", 3)]
    fixed = name_width + 1 + 11 + sum(w + 1 for _, w in columns)
    roles = [
        Text(
            f"{'role':<{name_width}} {'state':<11} " + " ".join(f"{label:>{w}}" for label, w in columns) + " progress",
            style="bold",
            no_wrap=True,
            overflow="ellipsis",
        )
    ]
    for role in shown_roles:
        counts = role["counts"]
        fraction, latest = role_progress(status, role["name"])
        line = Text(no_wrap=True, overflow="ellipsis")
        name = role["name"] if len(role["name"]) <= name_width else role["name"][: name_width - 1] + "…"
        line.append(f"{name:<{name_width}} ")
        line.append_text(_state(f"{role['state']:<11}"[:11]))
        values = [str(counts.get(key, 0)) for key, _ in shown_counts] + [str(restarts.get(role["name"], 0))]
        line.append(" " + " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, columns)) + " ")
        line.append_text(_progress_cell(fraction, latest, max(8, width - fixed - 1)))
        roles.append(line)
    if len(status["roles"]) > len(shown_roles):
        roles.append(Text(f"+{len(status['roles']) - len(shown_roles)} more roles (trainmaster status shows all)"))
    used = len(parts) + len(roles)
    parts += roles

    spare = height - used - 2  # keep two lines for the events title and at least one event
    if spare >= len(status["instances"]) + 6 and status["instances"]:  # a tall terminal: instances too
        instances = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1))
        for name in ("instance", "state", "att", "address", "exit", "reason"):
            instances.add_column(name, no_wrap=True, overflow="ellipsis")
        for inst in status["instances"]:
            instances.add_row(
                f"{inst['role']}-{inst['index']}",
                _state(inst["state"]),
                str(inst["attempt"]),
                inst["address"] or "",
                exit_text(inst),
                inst["reason"],
            )
        parts.append(instances)
        used += len(status["instances"]) + 3
    budget = max(1, min(events if height <= 24 else max(events, height - used - 2), height - used - 1))
    parts.append(Text("events", style="bold"))
    for ev in status["events"][-budget:]:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{ev['time'][11:19]} {ev['object']} ")
        line.append(ev["reason"], style="red" if ev["type"] == "Warning" else "")
        line.append(f" {ev['message']}")
        parts.append(line)
    return Group(*parts)


def exit_text(inst: Mapping[str, Any]) -> str:
    """An instance's exit code; for one the controller stopped, the signal it was stopped with
    (its exit says how it was ended, not how its program did: 143 is SIGTERM's)."""
    code = inst["exitCode"]
    if code is None:
        return ""
    if inst["state"] == "stopped" and code > 128:
        try:
            return signal.Signals(code - 128).name
        except ValueError:
            pass
    return str(code)


def event_line(ev: dict[str, Any]) -> str:
    return f"{ev['time'][11:19]} {ev['object']:<22} {ev['reason']:<20} {ev['message']}"
