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


def test_status_summaries_say_what_job_status_says_for_the_keys_they_carry(harness) -> None:  # type: ignore[no-untyped-def]
    """Status roll-up as the operator's status writers read it: the column-only summaries of
    many jobs at once agree with the full status document, key for key, and carry the
    instances that restarted (a replica restarted once by its OnFailure policy)."""
    from controller_harness import job, py

    from trainmaster.store import repository as repo

    state, _ = harness.run(job("plain", [{"name": "main", "replicas": 2, "command": py("pass")}]))
    assert state == "succeeded"
    flaky = "import os, sys; m = os.path.join(os.environ['TM_OUTPUT_DIR'], 'm'); first = not os.path.exists(m); open(m, 'a').close(); sys.exit(1 if first else 0)"
    state, _ = harness.run(
        job(
            "restarted",
            [
                {
                    "name": "main",
                    "command": py(flaky),
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 3, "backoffSeconds": 0.05},
                }
            ],
        )
    )
    assert state == "succeeded"
    with harness.sessions() as session:
        ids = [j.id for j in session.query(repo.JobRow).all()]
        summaries = repo.status_summaries(session, ids)
        assert sorted(summaries) == sorted(ids)
        for job_id in ids:
            full = repo.job_status(session, repo.load_job(session, job_id), events=0)
            summary = summaries[job_id]
            for key in ("id", "name", "state", "reason", "message", "startedAt", "runningAt", "completedAt"):
                assert summary[key] == full[key], key
            assert summary["roles"] == [
                {k: r[k] for k in ("name", "replicas", "state", "counts")} for r in full["roles"]
            ]
            restarted = [{"state": i["state"], "restarts": i["restarts"]} for i in full["instances"] if i["restarts"]]
            assert summary["instances"] == restarted
        assert any(summary["instances"] for summary in summaries.values()), "no instance restarted"
