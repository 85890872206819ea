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
