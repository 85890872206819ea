"""Schema migrations (Alembic), applied whenever a store is opened for writing and by
``trainmaster db upgrade``: a store written by an older Trainmaster is upgraded in place, never
silently misread. Revisions live in ``trainmaster/store/migrations/versions``; a test checks that
the models and the newest revision describe the same schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect, text

from trainmaster.errors import UserError

MIGRATIONS = Path(__file__).parent / "migrations"
ADVISORY_LOCK = 7_304_112_001  # PostgreSQL: servers starting together upgrade one at a time
# Stores made before migrations existed: the newest revision whose tables they already have.
LEGACY = (("0002", {"metrics", "leases"}), ("0001", {"jobs", "roles", "instances", "events", "registry"}))
# (a store reaches 0003 and later only through migrations, so it always carries Alembic's mark)


@dataclass(frozen=True)
class Upgrade:
    before: str | None  # the revision the store was at (None: empty store)
    after: str

    @property
    def changed(self) -> bool:
        return self.before != self.after


def _config(connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


@contextmanager
def _sqlite_turn(engine: Engine) -> Iterator[None]:
    database = engine.url.database if engine.dialect.name == "sqlite" else None
    if not database or database == ":memory:":
        yield
        return
    import fcntl
    import os

    fd = os.open(f"{database}.migrate.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def head() -> str:
    return str(ScriptDirectory(str(MIGRATIONS)).get_current_head())


def current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine) -> Upgrade:
    """Bring the store to the newest revision (creating it when empty). Processes opening one
    store at once take turns: an advisory lock on PostgreSQL, an ``flock`` beside a SQLite file
    (SQLite's deferred transactions would let two of them create the same tables)."""
    with _sqlite_turn(engine), engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text(f"SELECT pg_advisory_xact_lock({ADVISORY_LOCK})"))
        before = current(connection)
        if before is None:
            tables = set(inspect(connection).get_table_names())
            legacy = next((rev for rev, needed in LEGACY if needed <= tables), None)
            if legacy:  # created by create_all before migrations existed: adopt it at that revision
                command.stamp(_config(connection), legacy)
                before = legacy
            elif tables & {name for _, needed in LEGACY for name in needed}:
                raise UserError(
                    f"the store {engine.url.render_as_string(hide_password=True)} has some of Trainmaster's tables ({', '.join(sorted(tables))}) "
                    "but not a schema any release wrote, so it cannot be upgraded safely; move that "
                    "database away or point Trainmaster at a new one"
                )
        if before != head():
            command.upgrade(_config(connection), "head")
        return Upgrade(before, head())
