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


def test_an_unknown_schema_is_refused_not_upgraded(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        conn.execute("create table jobs (id integer primary key, name text)")
    with pytest.raises(UserError) as info:
        make_engine(f"sqlite:///{db}")
    assert "not a schema any release wrote" in info.value.message and "jobs" in info.value.message


def test_run_owners_are_named_by_pid_and_start_time() -> None:
    """Crash safety of `trainmaster run`: a job's owner names its process by pid and start time,
    so a dead (or recycled) pid reads as an orphaned job, and the service is never called dead."""
    import os

    from trainmaster.store.ownership import SERVICE, orphan_note, owner_alive, run_owner, run_pid

    me = run_owner()
    assert owner_alive(me) is True and run_pid(me) == os.getpid()
    pid, created = me.removeprefix("run-").split("-", 1)
    assert owner_alive(f"run-{pid}-{float(created) - 100:.2f}") is False  # same pid, another process
    assert owner_alive("run-0bad") is False and owner_alive(SERVICE) is None
    assert "trainmaster resume 7" in orphan_note(7, me)
