"""Schema migrations (Alembic): a store written by an older Trainmaster is upgraded in place on
SQLite and PostgreSQL, never misread; the models and the newest revision agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, create_engine, inspect, text

from trainmaster.store import migrate
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.models import Base, JobRow


def test_models_and_the_newest_revision_describe_the_same_schema(store_url: str) -> None:
    """A model change without its migration fails here (write a revision in store/migrations)."""
    engine = make_engine(store_url)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert diff == [], diff


def _insert_old_job(connection: Connection) -> int:
    """One succeeded job, 'old-job', in the columns every revision since 0001 has; its id."""
    connection.execute(
        text(
            "INSERT INTO jobs (uid, name, spec, state, reason, message, queue, priority, backend, owner, "
            "cancel_requested, admitted, run_dir, created_at, last_transition_at) VALUES ('u1', 'old-job', "
            "'{}', 'succeeded', '', '', 'default', 0, 'local', 'service', false, true, '', "
            "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
        )
    )
    return int(connection.execute(text("SELECT id FROM jobs WHERE uid = 'u1'")).scalar_one())


def _legacy_store(url: str, stamp: bool) -> None:
    """A store as Trainmaster 0.1.0 left it: the 0001 tables with one job, with or without Alembic's mark."""
    engine = create_engine(url)
    with engine.begin() as connection:
        config = migrate._config(connection)
        command.upgrade(config, "0001")
        _insert_old_job(connection)
        if not stamp:
            connection.execute(text("DROP TABLE alembic_version"))
    engine.dispose()


@pytest.mark.parametrize("stamped", [True, False], ids=["alembic-0001", "before-migrations"])
def test_an_older_store_is_upgraded_and_keeps_its_jobs(store_url: str, stamped: bool) -> None:
    _legacy_store(store_url, stamped)
    engine = make_engine(store_url)  # what every command does when it opens the store
    with engine.connect() as connection:
        assert migrate.current(connection) == migrate.head()
    assert {"metrics", "leases"} <= set(inspect(engine).get_table_names())
    with session_factory(engine)() as session:
        assert [job.name for job in session.query(JobRow)] == ["old-job"]


def test_upgrading_twice_changes_nothing(store_url: str) -> None:
    engine = make_engine(store_url)
    again = migrate.upgrade(engine)
    assert not again.changed and again.after == migrate.head()


def test_a_store_of_the_previous_revision_keeps_its_instances_and_starts_gangs(store_url: str, tmp_path: Path) -> None:
    """Revision 0009 adds the insert sentinel column to ``instances`` and ``registry`` (one
    multi-row INSERT per gang on SQLite). A store at 0008 with a running job's rows opens, its
    rows read as before (no sentinel value), and a new gang's rows go in with ids of their own."""
    from controller_harness import Harness, job
    from trainmaster.backends.hollow import RUN_SECONDS, HollowBackend, HollowCluster
    from trainmaster.store import repository as repo

    engine = create_engine(store_url)
    with engine.begin() as connection:
        command.upgrade(migrate._config(connection), "0008")
        old = _insert_old_job(connection)
        for index in range(2):
            connection.execute(
                text(
                    'INSERT INTO instances (job_id, role, "index", state, reason, message, attempt, restarts, '
                    "ports, cpu, memory, cpu_seconds, peak_rss, created_at) VALUES (:job, 'w', :index, "
                    "'succeeded', '', '', 1, 0, '[]', 1.0, 0, 0, 0, CURRENT_TIMESTAMP)"
                ),
                {"job": old, "index": index},
            )
            connection.execute(
                text(
                    'INSERT INTO registry (job_id, role, "index", address, registered_at) '
                    "VALUES (:job, 'w', :index, :address, CURRENT_TIMESTAMP)"
                ),
                {"job": old, "index": index, "address": f"127.0.0.1:{9000 + index}"},
            )
    engine.dispose()
    backend = HollowBackend(HollowCluster.parse("2x8"), state_dir=tmp_path / "hollow")
    h = Harness(tmp_path, backend=backend, url=store_url)
    try:
        with h.sessions.kw["bind"].connect() as connection:
            assert migrate.current(connection) == migrate.head()
        with h.sessions() as session:
            kept = repo.load_job(session, old)
            assert [(i.label, i.state) for i in kept.instances] == [("w-0", "succeeded"), ("w-1", "succeeded")]
            added = text("SELECT insert_sentinel FROM instances WHERE job_id = :job")
            assert session.scalars(added, {"job": old}).all() == [None, None]
            assert repo.registry(session, old) == {"w": ["127.0.0.1:9000", "127.0.0.1:9001"]}
        gang = job("new-gang", [{"name": "w", "replicas": 4, "command": ["true"], "resources": {"cpu": 1}}])
        gang["metadata"]["annotations"] = {RUN_SECONDS: "3600"}
        new = h.submit(gang)
        for _ in range(3):
            h.controller.step()
        with h.sessions() as session:
            started = repo.load_job(session, new)
            assert len({i.id for i in started.instances} | {i.id for i in kept.instances}) == 6
            assert len(repo.registry(session, new)["w"]) == 4
    finally:
        h.backend.close()
