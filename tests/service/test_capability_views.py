"""Capability views: what roles publish with ``trainmaster.publish`` and how the dashboard draws it
(federated schedule, aggregation counters, partition graph, gateway legs), bounded and escaped.

Mechanism: the dashboard's capability views (issue #21): a federated job's per-round schedule and
accuracy, an aggregation job's counters over time, a partition coloured by device with critical
and cut edges, the gateway's tasks and legs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmaster.errors import UserError
from trainmaster.runtime import views as published
from trainmaster.service.dashboard.capability import MAX_RECORDS, capability_views, read_records


def _publish_into(monkeypatch: pytest.MonkeyPatch, output: Path, kind: str, record: dict) -> None:
    """What the controller's channel stores for a ``publish`` (checked, one line appended)."""
    folder = published.views_dir(output)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{kind}.jsonl", "a") as views:
        views.write(published.check_record(kind, record))


def test_publish_checks_its_records_and_is_a_no_op_outside_an_instance(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TM_CHANNEL", raising=False)
    assert published.publish("gateway.task", {"task": "t", "legs": []}) is False
    with pytest.raises(UserError, match="unknown view kind"):
        published.publish("nope", {})
    with pytest.raises(UserError, match="needs legs"):
        published.publish("gateway.task", {"task": "t"})
    with pytest.raises(UserError, match="finite JSON"):
        published.publish("aggregation.counters", {"time": float("nan")})
    with pytest.raises(UserError, match="at most"):
        published.publish("gateway.task", {"task": "t", "legs": ["x" * 300_000]})


def test_federated_schedule_grid_and_accuracy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for r in range(5):
        _publish_into(
            monkeypatch,
            tmp_path,
            "flsched.round",
            {
                "round": r,
                "assignment": {"digits": [0, 1], "wine": [2 + r % 2]},
                "accuracy": {"digits": 0.5 + r / 10, "wine": 0.4 + r / 20},
            },
        )
    (view,) = capability_views(tmp_path)
    assert view.kind == "flsched.round" and 'id="flsched-grid"' in view.svg
    assert view.svg.count('class="cell"') == 15  # 3 devices busy in each of 5 rounds
    assert view.table == [["digits", "0.900", "10"], ["wine", "0.600", "5"]]


def test_aggregation_counters_per_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for t in range(4):
        for node in ("parameter node", "forwarding node 0"):
            _publish_into(
                monkeypatch,
                tmp_path,
                "aggregation.counters",
                {
                    "time": 100.0 + t,
                    "node": node,
                    "verified": 10 * t,
                    "overflow_fallbacks": t,
                    "slots_in_use": 3,
                    "packets_in": 999,
                },
            )
    (view,) = capability_views(tmp_path)
    counters = {row[1] for row in view.table}
    assert counters == {"verified", "overflow_fallbacks", "slots_in_use"}  # the watched ones only
    assert ["parameter node", "verified", "30"] in view.table
    assert view.svg.count("<polyline") == 6  # 3 counters x 2 nodes


def test_partition_graph_colours_devices_and_marks_cut_and_critical_edges(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    nodes = [{"id": n, "device": d, "critical": n in "abd"} for n, d in zip("abcd", (0, 0, 1, 1))]
    edges = [
        {"src": "a", "dst": "b", "critical": True},
        {"src": "a", "dst": "c", "critical": False},
        {"src": "b", "dst": "d", "critical": True},
        {"src": "c", "dst": "d", "critical": False},
    ]
    _publish_into(
        monkeypatch, tmp_path, "partition.plan", {"method": "trainmaster", "devices": 2, "nodes": nodes, "edges": edges}
    )
    (view,) = capability_views(tmp_path)
    assert view.svg.count('class="op"') == 4 and view.svg.count('class="cut"') == 2
    assert "2 of 4 edges cut, 1 of them critical" in view.caption


def test_gateway_legs_and_escaping(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _publish_into(
        monkeypatch,
        tmp_path,
        "gateway.task",
        {
            "task": "<script>x</script>",
            "legs": [
                {"data_id": "m_a", "party": "a", "rule": "summary_stats", "outcome": "result"},
                {"data_id": "m_b", "party": "b", "rule": "summary_stats", "outcome": "party_unavailable"},
            ],
        },
    )
    (view,) = capability_views(tmp_path)
    assert [row[4] for row in view.table] == ["result", "party_unavailable"]
    assert "1 party_unavailable, 1 result" in view.caption
    # table cells are escaped by the template; the SVG of other kinds escapes record text itself
    _publish_into(
        monkeypatch,
        tmp_path,
        "flsched.round",
        {"round": 0, "assignment": {"<b>j</b>": [0]}, "accuracy": {"<b>j</b>": 0.5}},
    )
    svg = next(v for v in capability_views(tmp_path) if v.kind == "flsched.round").svg
    assert "<b>" not in svg and "&lt;b&gt;j&lt;/b&gt;" in svg


def test_reading_is_bounded_and_survives_a_damaged_line(tmp_path: Path) -> None:
    folder = published.views_dir(tmp_path)
    folder.mkdir(parents=True)
    lines = [json.dumps({"task": f"t{i}", "legs": []}) for i in range(3 * MAX_RECORDS)]
    lines.insert(5, '{"task": broken')
    (folder / "gateway.task.jsonl").write_text("\n".join(lines) + "\n")
    records = read_records(tmp_path, "gateway.task")
    assert len(records) == MAX_RECORDS and records[-1]["task"] == f"t{3 * MAX_RECORDS - 1}"
    (folder / "partition.plan.jsonl").write_text('{"nodes": 1}\n')  # a record that cannot be drawn
    assert any("could not be drawn" in v.caption for v in capability_views(tmp_path))


def flood(kind: str, n: int) -> dict:
    """A record of ``kind`` built to draw as much as a record may make a page draw (each under
    the 256 KiB a record may be)."""
    if kind == "flsched.round":
        jobs = {f"job-{j}-{'x' * 40}": list(range(200)) for j in range(60)}
        return {"round": n, "assignment": jobs, "accuracy": {j: 0.5 for j in jobs}}
    if kind == "aggregation.counters":
        return {"time": float(n), "node": f"node-{n % 50}", **{f"slots_in_use_{k}": float(k) for k in range(3000)}}
    if kind == "partition.plan":
        nodes = [{"id": f"op{i}", "device": i % 7, "critical": i % 2 == 0} for i in range(399)]
        edges = [{"src": f"op{i % 399}", "dst": f"op{(i * 7 + 1) % 399}", "critical": True} for i in range(2500)]
        return {"method": f"m{n}", "devices": 7, "nodes": nodes, "edges": edges}
    return {"task": f"t{n}", "legs": [{"data_id": "d" * 100, "party": "p", "outcome": "result"} for _ in range(1500)]}


def test_views_of_10_mb_of_records_are_bounded_in_bytes_and_time(tmp_path: Path) -> None:
    """10 MB of records made to draw as much as possible (every kind): the drawings stay under
    MAX_VIEW_BYTES each and take well under the page's refresh period; a second load of an
    unchanged job draws nothing again. (Before the bounds: 2.5 MB made a 122 MB, 3.6 s SVG.)"""
    import time

    from trainmaster.service.dashboard.capability import MAX_VIEW_BYTES, CapabilityDrawings

    folder = published.views_dir(tmp_path)
    folder.mkdir(parents=True)
    written = 0
    for kind in published.KINDS:
        with open(folder / f"{kind}.jsonl", "w") as views:
            n = 0
            while views.tell() < 2_600_000:
                views.write(published.check_record(kind, flood(kind, n)))
                n += 1
            written += views.tell()
    assert written > 10_000_000
    drawings = CapabilityDrawings()
    started = time.monotonic()
    drawn = drawings.draw(tmp_path)
    took = time.monotonic() - started
    sizes = {v.kind: len(v.svg) + sum(len(c) for row in v.table for c in row) for v in drawn}
    assert len(drawn) == 4 and all(size <= MAX_VIEW_BYTES for size in sizes.values()), sizes
    assert sum(sizes.values()) <= 4 * MAX_VIEW_BYTES and took < 5, (sizes, took)
    assert drawings.draw(tmp_path) is drawn  # unchanged files: the same drawing, not a new one
    with open(folder / "gateway.task.jsonl", "a") as views:
        views.write(published.check_record("gateway.task", {"task": "new", "legs": []}))
    assert drawings.draw(tmp_path) is not drawn


def test_a_job_publishing_10_mb_is_capped_and_its_page_stays_small(tmp_path: Path) -> None:
    """A role publishing 10 MB through trainmaster.publish: the controller stores at most
    MAX_VIEW_BYTES of the kind (publish() then says no, once, on stderr) and the job's views
    answer stays bounded in bytes and time."""
    import sys
    import time

    import httpx

    from api_server import ThreadedServer
    from trainmaster.controller.channel import MAX_VIEW_BYTES
    from trainmaster.service.dashboard.capability import MAX_VIEW_BYTES as MAX_DRAWN

    code = (
        "import json, sys, trainmaster\n"
        "sys.path.insert(0, %r)\n"
        "from test_capability_views import flood\n"
        "stored = [trainmaster.publish('flsched.round', flood('flsched.round', n)) for n in range(200)]\n"
        "print('stored', sum(stored), 'refused', len(stored) - sum(stored), flush=True)\n"
    ) % str(Path(__file__).parent)
    doc = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "flood"},
        "spec": {"roles": [{"name": "main", "command": [sys.executable, "-c", code]}]},
    }
    with ThreadedServer(tmp_path, reconcile=True, interval=0.1) as api:
        job_id = httpx.post(f"{api}/api/v1/jobs", json=doc, timeout=30).json()["id"]
        deadline = time.monotonic() + 120
        while (status := httpx.get(f"{api}/api/v1/jobs/{job_id}", timeout=30).json())["state"] not in (
            "succeeded",
            "failed",
        ):
            assert time.monotonic() < deadline, status["state"]
            time.sleep(0.5)
        assert status["state"] == "succeeded", status["events"][-5:]
        log = Path(status["instances"][0]["logPath"]).read_text()
        assert "publish(): the controller refused" in log and log.count("refused a flsched.round") == 1
        views = Path(status["runDir"]) / "output" / "trainmaster-views" / "flsched.round.jsonl"
        assert MAX_VIEW_BYTES - 300_000 < views.stat().st_size <= MAX_VIEW_BYTES
        started = time.monotonic()
        page = httpx.get(f"{api}/ui/jobs/{job_id}/views", timeout=60)
        assert page.status_code == 200 and len(page.content) <= MAX_DRAWN + 64 * 1024
        assert time.monotonic() - started < 10
        assert 'id="flsched-grid"' in page.text
