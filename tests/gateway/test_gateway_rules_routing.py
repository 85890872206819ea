"""Processing-rule registry, data id resolution and the mapping table (no network)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from trainmaster.gateway.crypto.envelope import EnvelopeError
from trainmaster.gateway.models import RuleCall
from trainmaster.gateway.party.data import resolve_data_file
from trainmaster.gateway.relay.mapping import LegConflict, MappingTable, TaskConflict, TaskLimit
from trainmaster.gateway.rules.registry import REGISTRY, RuleError, load_table, run_call

TABLE = {"x": np.array([1.0, 2.0, 3.0, 4.0]), "y": np.array([0.0, 0.0, 1.0, 1.0])}


def test_registry_has_the_required_rules() -> None:
    """Rule registry: row count, summary stats, histogram, local training, scoring."""
    assert {"row_count", "summary_stats", "histogram", "train", "score"} <= set(REGISTRY)


def test_unregistered_rule_and_inline_code_are_refused() -> None:
    """No code ever runs: unknown rule names, extra parameters and disallowed rules are refused."""
    with pytest.raises(RuleError, match="not registered"):
        run_call(TABLE, RuleCall(rule="exec", params={"source": "print(1)"}))
    with pytest.raises(RuleError, match="invalid parameters"):
        run_call(TABLE, RuleCall(rule="summary_stats", params={"code": "__import__('os')"}))
    with pytest.raises(RuleError, match="not registered"):
        run_call(TABLE, RuleCall(rule="train", params={}), allowed=["row_count"])


def test_rules_compute_what_they_say() -> None:
    """Rule results: sums/counts that pool exactly, histogram counts, a model that learns."""
    s = run_call(TABLE, RuleCall(rule="summary_stats", params={"columns": ["x"]}))["columns"]["x"]
    assert (s["count"], s["sum"], s["sumsq"], s["min"], s["max"]) == (4, 10.0, 30.0, 1.0, 4.0)
    h = run_call(TABLE, RuleCall(rule="histogram", params={"column": "x", "edges": [0, 2.5, 5]}))
    assert h["counts"] == [2, 2]
    for model in ("logreg", "mlp"):
        m = run_call(
            TABLE,
            RuleCall(
                rule="train",
                params={
                    "features": ["x"],
                    "label": "y",
                    "model": model,
                    "epochs": 300,
                    "lr": 0.5,
                    "standardize": {"mean": [2.5], "std": [1.2]},
                },
            ),
        )
        sc = run_call(
            TABLE,
            RuleCall(
                rule="score",
                params={
                    "features": ["x"],
                    "label": "y",
                    "weights": m["weights"],
                    "standardize": {"mean": [2.5], "std": [1.2]},
                },
            ),
        )
        assert sc["correct"] == 4 and sc["rows"] == 4
    with pytest.raises(RuleError, match="unknown column"):
        run_call(TABLE, RuleCall(rule="summary_stats", params={"columns": ["nope"]}))


def test_data_id_path_traversal_is_refused(tmp_path: Path) -> None:
    """Data ids name files inside the party's data directory only; traversal and symlink escapes fail."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "m1.csv").write_text("x\n1\n")
    (tmp_path / "secret.csv").write_text("x\n42\n")
    os.symlink(tmp_path / "secret.csv", tmp_path / "data" / "link.csv")
    assert resolve_data_file(tmp_path / "data", "m1").name == "m1.csv"
    assert load_table(resolve_data_file(tmp_path / "data", "m1"))["x"].tolist() == [1.0]
    for bad in ("../secret", "link", "/etc/passwd", "m1/../../secret"):
        with pytest.raises(EnvelopeError):
            resolve_data_file(tmp_path / "data", bad)


def test_mapping_table_records_one_outcome_and_keeps_history(tmp_path: Path) -> None:
    """Mapping table: task -> data id -> party/address/rule, exactly one outcome per leg, history kept,
    only the assigned party may report a leg (items 1, 8: no legs under unknown task ids), task ids
    never reused (item 2), open legs per party bounded, SQLite in WAL mode."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    t = MappingTable(url)
    rc = {"rule": "row_count", "params": {}}
    legs = {"m1": ("a", rc, None), "m9": ("b", rc, None)}
    created, first = t.create_task("t1", "alice", legs, "d" * 64, 60, max_open_legs_per_party=2, run_id="r1")
    assert created is True
    again, task = t.create_task("t1", "alice", legs, "d" * 64, 60, max_open_legs_per_party=2, run_id="r2")
    assert again is False and task.created_at == first.created_at and task.run_id == "r1"  # when, and by which run
    with pytest.raises(TaskConflict, match="different body"):
        t.create_task("t1", "alice", {"m1": ("a", rc, None)}, "e" * 64, 60, max_open_legs_per_party=2)
    with pytest.raises(TaskConflict, match="another initiator"):
        t.create_task("t1", "bob", legs, "d" * 64, 60, max_open_legs_per_party=2)
    with pytest.raises(TaskLimit, match="open leg"):
        t.create_task(
            "t2", "alice", {"x1": ("a", rc, None), "x2": ("a", rc, None)}, "f" * 64, 60, max_open_legs_per_party=2
        )
    with pytest.raises(LegConflict, match="another rule call"):
        t.register("t1", "m1", "a", "unix:/x", {"rule": "summary_stats", "params": {}})
    t.register("t1", "m1", "a", "unix:/x", {"rule": "row_count", "params": {}})
    with pytest.raises(LegConflict, match="belongs to party 'a'"):
        t.register("t1", "m1", "b", "unix:/y", {"rule": "row_count", "params": {}})
    with pytest.raises(LegConflict, match="no leg"):
        t.register("t-future", "m1", "a", "unix:/y", {"rule": "row_count", "params": {}})
    assert t.legs("t1")["m1"].outcome is None
    t.mark_dispatched("t1", "m1")
    assert t.legs("t1")["m1"].state == "dispatched" and t.legs("t1")["m1"].dispatches == 1
    assert t.record_outcome("t1", "m1", "result", envelope_json="{}") is True
    assert t.record_outcome("t1", "m1", "timeout", envelope_json="{}") is False
    assert t.legs("t1")["m1"].outcome == "result"
    t.record_outcome("t1", "m9", "party_unavailable", envelope_json="{}")
    again = MappingTable(url)  # a restarted gateway sees the same history
    assert {k: v.outcome for k, v in again.legs("t1").items()} == {"m1": "result", "m9": "party_unavailable"}
    assert again.task("t1").owner == "alice"
    with create_engine(url).connect() as c:
        assert c.execute(text("PRAGMA journal_mode")).scalar() == "wal"


def test_parquet_data_file_gives_the_same_results_as_csv(tmp_path: Path) -> None:
    """Party data files (spec: data held at the party) may be CSV or Parquet: the same table loads
    from either and rules compute the same results; a data id with both files is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "m1.csv").write_text("x,y\n" + "".join(f"{x},{y}\n" for x, y in zip(TABLE["x"], TABLE["y"])))
    pq.write_table(pa.table({"x": TABLE["x"], "y": TABLE["y"].astype(np.int64)}), tmp_path / "data" / "m2.parquet")
    path = resolve_data_file(tmp_path / "data", "m2")
    assert path.suffix == ".parquet"
    from_parquet, from_csv = load_table(path), load_table(resolve_data_file(tmp_path / "data", "m1"))
    assert {k: v.tolist() for k, v in from_parquet.items()} == {k: v.tolist() for k, v in from_csv.items()}
    call = RuleCall(rule="summary_stats", params={"columns": ["x", "y"]})
    assert run_call(from_parquet, call) == run_call(from_csv, call)
    pq.write_table(pa.table({"x": ["a", "b"]}), tmp_path / "data" / "m3.parquet")
    with pytest.raises(RuleError, match="not numeric"):
        load_table(tmp_path / "data" / "m3.parquet")
    (tmp_path / "data" / "m2.csv").write_text("x\n1\n")
    with pytest.raises(EnvelopeError, match="both a CSV and a Parquet"):
        resolve_data_file(tmp_path / "data", "m2")


def test_an_older_mapping_table_is_refused_with_the_missing_columns(tmp_path) -> None:
    """Mapping table persistence: a database from an older release (its legs table lacks a
    column) is refused with a clear error, not a failure mid-task."""
    import sqlite3

    from trainmaster.errors import UserError
    from trainmaster.gateway.relay.mapping import MappingTable

    db = tmp_path / "old-mapping.db"
    with sqlite3.connect(db) as conn:
        conn.execute("create table legs (id integer primary key, task_id text)")
    with pytest.raises(UserError) as info:
        MappingTable(f"sqlite:///{db}")
    assert "legs" in info.value.message and "stream_bytes" in info.value.message
