"""Mechanism: the state store (SQLAlchemy, SQLite by default, any URL) refuses a database written
by an older schema with a clear error instead of failing mid-job."""

import sqlite3
from pathlib import Path

import pytest

from trainmaster.errors import UserError
from trainmaster.store.db import make_engine


def test_a_fresh_store_has_every_table(tmp_path: Path) -> None:
    from sqlalchemy import inspect

    engine = make_engine(f"sqlite:///{tmp_path / 'new.db'}")
    assert {"jobs", "roles", "instances", "events", "registry"} <= set(inspect(engine).get_table_names())


def test_an_older_schema_is_refused_with_the_missing_columns(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        conn.execute("create table jobs (id integer primary key, name text)")
    with pytest.raises(UserError) as info:
        make_engine(f"sqlite:///{db}")
    assert "created by an older Trainmaster" in info.value.message and "owner" in info.value.message
