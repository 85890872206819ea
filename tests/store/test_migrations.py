"""Schema migrations (Alembic): a store written by an older Trainmaster is upgraded in place on
SQLite and PostgreSQL, never misread; the models and the newest revision agree."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from trainmaster.store import migrate
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.models import Base, JobRow


def test_models_and_the_newest_revision_describe_the_same_schema(store_url: str) -> None:
    """A model change without its migration fails here (write a revision in store/migrations)."""
    engine = make_engine(store_url)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert diff == [], diff


def _legacy_store(url: str, stamp: bool) -> None:
    """A store as Trainmaster 0.1.0 left it: the 0001 tables with one job, with or without Alembic's mark."""
    engine = create_engine(url)
    with engine.begin() as connection:
        config = migrate._config(connection)
        command.upgrade(config, "0001")
        connection.execute(
            text(
                "INSERT INTO jobs (uid, name, spec, state, reason, message, queue, priority, backend, owner, "
                "cancel_requested, admitted, run_dir, created_at, last_transition_at) VALUES ('u1', 'old-job', "
                "'{}', 'succeeded', '', '', 'default', 0, 'local', 'service', false, true, '', "
                "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
            )
        )
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
