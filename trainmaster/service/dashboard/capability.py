"""Capability views on a job's page: what a table cannot show, drawn as SVG on the server.

A capability's roles publish records (:func:`trainmaster.publish`, one JSON line each) into
``<run dir>/output/trainmaster-views/<kind>.jsonl``; this module reads the newest of them, bounded
(never more than :data:`READ_LIMIT` bytes of a file, :data:`MAX_RECORDS` records), and turns each
known kind into a :class:`CapabilityView`: a title, an SVG drawing and a table. Every text that
came from a record is escaped here, because the SVG is inserted as markup.

What a job publishes is its own choice, and the page is refetched every few seconds by every
open tab, so what is drawn is bounded too, whatever the records say: each drawing caps what it
draws (rounds, devices, jobs, counters, nodes, points, operators, edges, table rows, the length
of a text), a drawing larger than :data:`MAX_VIEW_BYTES` is replaced by its caption, and
:class:`CapabilityDrawings` draws a job's views once per change of its files (every other load
gets the same drawing) and at most :data:`DRAWERS` at a time.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Callable

from trainmaster.runtime.views import KINDS, views_dir

READ_LIMIT = 512 * 1024  # bytes read from the end of one view file
MAX_RECORDS = 400
MAX_VIEW_BYTES = 512 * 1024  # one drawing's markup; past it the caption says why there is none
MAX_ROUNDS, MAX_DEVICES, MAX_JOBS = 120, 64, 20  # the federated grid: at most 7,680 cells
MAX_COUNTERS, MAX_NODES, MAX_POINTS = 12, 8, 200  # aggregation charts, lines per chart, points per line
MAX_DRAWN_EDGES = 1_000
MAX_TABLE_ROWS = 500
MAX_TEXT = 80  # characters of one name drawn or tabled
DRAWERS = 2  # drawings made at once, over all jobs and tabs
CACHED_JOBS = 64
PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#475569", "#ea580c")
MAX_DRAWN_NODES = 400  # a partition drawing beyond this would be unreadable; the table stays


@dataclass(frozen=True)
class CapabilityView:
    kind: str
    title: str
    svg: str  # escaped, safe to insert
    caption: str
    table_head: list[str] = field(default_factory=list)
    table: list[list[str]] = field(default_factory=list)


def read_records(output_dir: Path, kind: str) -> list[dict[str, Any]]:
    """The newest records of one kind (a partial first line after a bounded seek is dropped)."""
    path = views_dir(output_dir) / f"{kind}.jsonl"
    if not path.is_file():
        return []
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(max(0, size - READ_LIMIT))
        data = handle.read(READ_LIMIT)
    lines = data.split(b"\n")
    if size > READ_LIMIT:
        lines = lines[1:]
    lines = [line for line in lines if line.strip()]
    records = []
    for line in lines[-MAX_RECORDS:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written, or damaged: the rest still draws
        if isinstance(record, dict):
            records.append(record)
    return records


def capability_views(output_dir: Path) -> list[CapabilityView]:
    drawn = []
    for kind in KINDS:
        records = read_records(output_dir, kind)
        if records:
            try:
                drawn.append(_bounded(RENDERERS[kind](records)))
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
                drawn.append(
                    CapabilityView(
                        kind,
                        kind,
                        "",
                        f"records of {kind} could not be drawn: {escape(type(exc).__name__)} {escape(str(exc))}",
                    )
                )
    return drawn


def _bounded(view: CapabilityView) -> CapabilityView:
    """``view``, or its caption alone where its drawing is over :data:`MAX_VIEW_BYTES`."""
    size = len(view.svg) + sum(len(cell) for row in view.table for cell in row)
    if size <= MAX_VIEW_BYTES:
        return view
    return CapabilityView(
        view.kind,
        view.title,
        "",
        f"{escape(view.caption)}; not drawn: {size // 1024} KiB of markup, more than a page may hold "
        f"({MAX_VIEW_BYTES // 1024} KiB)",
    )


class CapabilityDrawings:
    """Each job's drawings, made once per change of its view files and shared by every load
    (an open tab refetches every few seconds), at most :data:`DRAWERS` being made at a time."""

    def __init__(self) -> None:
        self._cache: OrderedDict[str, tuple[tuple[Any, ...], list[CapabilityView]]] = OrderedDict()
        self._lock = threading.Lock()
        self._drawers = threading.BoundedSemaphore(DRAWERS)
        self._job_locks: dict[str, threading.Lock] = {}

    @staticmethod
    def _signature(output_dir: Path) -> tuple[Any, ...]:
        marks: list[tuple[str, int | None, int | None]] = []
        for kind in KINDS:
            try:
                stat = (views_dir(output_dir) / f"{kind}.jsonl").stat()
                marks.append((kind, stat.st_size, stat.st_mtime_ns))
            except OSError:
                marks.append((kind, None, None))
        return tuple(marks)

    def draw(self, output_dir: Path) -> list[CapabilityView]:
        key = str(output_dir)
        with self._lock:
            job_lock = self._job_locks.setdefault(key, threading.Lock())
        with job_lock:  # several tabs of one job: one drawing, the others wait for it
            signature = self._signature(output_dir)
            with self._lock:
                cached = self._cache.get(key)
                if cached is not None and cached[0] == signature:
                    self._cache.move_to_end(key)
                    return cached[1]
            with self._drawers:
                drawn = capability_views(output_dir)
            with self._lock:
                self._cache[key] = (signature, drawn)
                self._cache.move_to_end(key)
                while len(self._cache) > CACHED_JOBS:
                    old, _ = self._cache.popitem(last=False)
                    self._job_locks.pop(old, None)
            return drawn


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _short(value: Any) -> str:
    """A record's text as drawn: at most :data:`MAX_TEXT` characters."""
    text = str(value)
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def _text(x: float, y: float, text: Any, size: int = 11, anchor: str = "start", color: str = "#334155") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'fill="{color}">{escape(_short(text))}</text>'
    )


def _thin(values: list[Any], most: int) -> list[Any]:
    """At most ``most`` of ``values``, evenly spaced, the last one kept."""
    if len(values) <= most:
        return values
    step = len(values) / most
    return [values[int(i * step)] for i in range(most - 1)] + [values[-1]]


def _line_chart(
    series: dict[str, list[tuple[float, float]]], width: int = 640, height: int = 220, y_label: str = ""
) -> str:
    """Polylines of several series on shared axes, with a legend."""
    points = [p for values in series.values() for p in values]
    if not points:
        return ""
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(0.0, min(p[1] for p in points)), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    left, right, top, bottom = 48, 150, 10, 28
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return top + plot_h - (y - y0) / (y1 - y0) * plot_h

    parts = [
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#cbd5e1"/>',
        _text(left - 4, top + 10, f"{y1:.3g}", anchor="end"),
        _text(left - 4, top + plot_h, f"{y0:.3g}", anchor="end"),
        _text(left, height - 8, f"{x0:.3g}"),
        _text(left + plot_w, height - 8, f"{x1:.3g}", anchor="end"),
    ]
    if y_label:
        parts.append(_text(left + plot_w / 2, height - 8, y_label, anchor="middle"))
    for i, (name, values) in enumerate(series.items()):
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in _thin(values, MAX_POINTS))
        parts.append(f'<polyline points="{path}" fill="none" stroke="{_color(i)}" stroke-width="2"/>')
        parts.append(_text(width - right + 10, top + 14 + 16 * i, name, color=_color(i)))
    return f'<svg class="capability" width="{width}" height="{height}" role="img">{"".join(parts)}</svg>'


def federated_schedule(records: list[dict[str, Any]]) -> CapabilityView:
    """Devices x rounds, each cell coloured by the job the device trained in that round, and
    each job's accuracy by round."""
    records = sorted(records, key=lambda r: int(r["round"]))[-MAX_ROUNDS:]
    every_job = {str(j) for r in records for j in r["assignment"]} | {str(j) for r in records for j in r["accuracy"]}
    jobs = sorted(every_job)[:MAX_JOBS]
    index = {job: i for i, job in enumerate(jobs)}
    devices = max([int(d) for r in records for ds in r["assignment"].values() for d in ds] + [0]) + 1
    devices = min(devices, MAX_DEVICES)
    cell, left, top = 6, 40, 14
    width, height = left + cell * len(records) + 150, top + cell * devices + 24
    parts = [_text(left, 10, "rounds →"), _text(4, top + 10, "device")]
    for column, record in enumerate(records):
        drawn: set[int] = set()  # one cell per device and round, whatever the record repeats
        for job, chosen in record["assignment"].items():
            if str(job) not in index:
                continue
            for device in chosen:
                if int(device) < devices and int(device) not in drawn:
                    drawn.add(int(device))
                    parts.append(
                        f'<rect class="cell" data-job="{escape(_short(job))}" x="{left + column * cell}" '
                        f'y="{top + int(device) * cell}" width="{cell - 1}" height="{cell - 1}" '
                        f'fill="{_color(index[str(job)])}"><title>round {int(record["round"])}, device '
                        f"{int(device)}: {escape(_short(job))}</title></rect>"
                    )
    for i, job in enumerate(jobs):
        parts.append(_text(width - 140, top + 12 + 16 * i, job, color=_color(i)))
    grid = (
        f'<svg class="capability" id="flsched-grid" width="{width}" height="{height}" role="img">{"".join(parts)}</svg>'
    )
    accuracy = {
        job: [(float(r["round"]), float(r["accuracy"][job])) for r in records if job in r["accuracy"]] for job in jobs
    }
    last = records[-1]
    table = [
        [
            _short(job),
            f"{last['accuracy'].get(job, float('nan')):.3f}" if job in last["accuracy"] else "",
            str(sum(len(r["assignment"].get(job, [])) for r in records)),
        ]
        for job in jobs
    ]
    shown = "" if len(jobs) == len(every_job) else f" (the first {len(jobs)} of {len(every_job)} drawn)"
    return CapabilityView(
        "flsched.round",
        "Federated schedule",
        grid + _line_chart(accuracy, y_label="accuracy by round"),
        f"{len(records)} rounds, {devices} devices, {len(jobs)} jobs{shown}; a cell is a device "
        f"training a job in a round (blank: idle)",
        ["job", "latest accuracy", "device-rounds"],
        table,
    )


#: The counters an operator watches on an aggregation tier (substrings of the stats' names).
WATCHED_COUNTERS = ("slots_in_use", "retransmit", "resent", "overflow", "collision", "fallback", "verified")


def aggregation_counters(records: list[dict[str, Any]]) -> CapabilityView:
    """Each node's watched counters over time: slots in use, retransmits, overflow and collision
    fallbacks, sums verified. One chart per counter, one line per node."""
    records = sorted(records, key=lambda r: float(r["time"]))
    start = float(records[0]["time"])
    names = sorted(
        {
            k
            for r in records
            for k, v in r.items()
            if any(w in k for w in WATCHED_COUNTERS) and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    )[:MAX_COUNTERS]
    nodes = sorted({str(r.get("node", "")) for r in records})[:MAX_NODES]
    charts = "".join(
        f'<div class="counter" data-counter="{escape(_short(name))}"><strong>{escape(_short(name))}</strong>'
        + _line_chart(
            {
                node: [
                    (float(r["time"]) - start, float(r[name]))
                    for r in records
                    if str(r.get("node", "")) == node and name in r
                ]
                for node in nodes
            },
            width=460,
            height=140,
            y_label="seconds",
        )
        + "</div>"
        for name in names
    )
    latest = {node: next(r for r in reversed(records) if str(r.get("node", "")) == node) for node in nodes}
    table = [
        [_short(node), _short(name), f"{float(latest[node][name]):.6g}"]
        for node in nodes
        for name in names
        if name in latest[node]
    ]
    return CapabilityView(
        "aggregation.counters",
        "Aggregation counters",
        charts,
        f"{len(records)} samples from {len(nodes)} node(s) over {float(records[-1]['time']) - start:.1f} s",
        ["node", "counter", "latest"],
        table,
    )


def partition_plan(records: list[dict[str, Any]]) -> CapabilityView:
    """The newest plan of each method (ours and a baseline side by side, as the pipeline runs
    both): operators in topological layers, coloured by device; critical edges thick, edges cut
    between devices dashed."""
    newest = {str(r.get("method", "")): r for r in records}
    drawn = [_draw_plan(plan) for plan in list(newest.values())[-3:]]
    return CapabilityView(
        "partition.plan",
        "Partition",
        "".join(svg for svg, _, _ in drawn),
        " · ".join(caption for _, caption, _ in drawn),
        ["method", "device", "operators"],
        [row for _, _, rows in drawn for row in rows],
    )


def _draw_plan(plan: dict[str, Any]) -> tuple[str, str, list[list[str]]]:
    nodes = plan["nodes"]
    position = {str(n["id"]): i for i, n in enumerate(nodes)}
    edges = [
        (position[str(e["src"])], position[str(e["dst"])], bool(e.get("critical")))
        for e in plan["edges"]
        if str(e["src"]) in position and str(e["dst"]) in position
    ]
    edges = edges[:MAX_DRAWN_EDGES]
    device_of = [int(n["device"]) for n in nodes]
    loads: dict[int, int] = defaultdict(int)
    for d in device_of:
        loads[d] += 1
    cut = sum(1 for s, d, _ in edges if device_of[s] != device_of[d])
    critical_cut = sum(1 for s, d, c in edges if c and device_of[s] != device_of[d])
    method = _short(plan.get("method", ""))
    table = [[method, str(d), str(loads[d])] for d in sorted(loads)]
    caption = (
        f"{method}: {len(nodes)} operators on {int(plan['devices'])} devices; "
        f"{cut} of {len(edges)} edges cut, {critical_cut} of them critical"
    )
    if len(nodes) > MAX_DRAWN_NODES:
        return "", caption + f"; too many operators to draw (over {MAX_DRAWN_NODES})", table
    layer = [0] * len(nodes)
    for _ in range(len(nodes)):  # longest path from a source; records list nodes in any order
        changed = False
        for s, d, _c in edges:
            if layer[d] < layer[s] + 1:
                layer[d], changed = layer[s] + 1, True
        if not changed:
            break
    rows: dict[int, int] = defaultdict(int)
    xy = []
    for i in range(len(nodes)):
        xy.append((20 + layer[i] * 28, 20 + rows[layer[i]] * 22))
        rows[layer[i]] += 1
    width = 40 + (max(layer) + 1) * 28 + 120
    height = 40 + max(rows.values()) * 22
    parts = []
    for s, d, critical in edges:
        (x0, y0), (x1, y1) = xy[s], xy[d]
        style = 'stroke="#dc2626" stroke-width="3"' if critical else 'stroke="#94a3b8" stroke-width="1"'
        dash = ' stroke-dasharray="4 3" class="cut"' if device_of[s] != device_of[d] else ""
        parts.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y1}" {style}{dash}/>')
    for i, node in enumerate(nodes):
        x, y = xy[i]
        parts.append(
            f'<circle class="op" cx="{x}" cy="{y}" r="7" fill="{_color(device_of[i])}" '
            f'stroke="{"#111827" if node.get("critical") else "white"}" stroke-width="2">'
            f"<title>{escape(_short(node['id']))}: device {device_of[i]}</title></circle>"
        )
    for d in sorted(loads):
        parts.append(_text(width - 110, 16 + 16 * d, f"device {d}", color=_color(d)))
    svg = (
        f'<svg class="capability partition-graph" data-method="{escape(method)}" width="{width}" '
        f'height="{height}" role="img">{"".join(parts)}</svg>'
    )
    return svg, caption + "; thick red: critical edges, dashed: cut", table


def gateway_tasks(records: list[dict[str, Any]]) -> CapabilityView:
    """Each task's legs (data id, party, outcome), newest task first."""
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        latest[str(record["task"])] = record
    table = [
        [
            _short(task),
            _short(leg.get("data_id", "")),
            _short(leg.get("party", "")),
            _short(leg.get("rule", "")),
            _short(leg.get("outcome", "")),
        ]
        for task, record in reversed(list(latest.items()))
        for leg in record["legs"][:MAX_TABLE_ROWS]
    ][: MAX_TABLE_ROWS * 4]
    outcomes: dict[str, int] = defaultdict(int)
    for row in table:
        outcomes[row[4]] += 1
    summary = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
    return CapabilityView(
        "gateway.task",
        "Gateway tasks and legs",
        "",
        f"{len(latest)} tasks; legs: {summary}",
        ["task", "data id", "party", "rule", "outcome"],
        table[:MAX_TABLE_ROWS],
    )


RENDERERS: dict[str, Callable[[list[dict[str, Any]]], CapabilityView]] = {
    "flsched.round": federated_schedule,
    "aggregation.counters": aggregation_counters,
    "partition.plan": partition_plan,
    "gateway.task": gateway_tasks,
}
