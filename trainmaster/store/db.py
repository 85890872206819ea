"""Opening the store: SQLite file by default (WAL, busy timeout), any SQLAlchemy URL otherwise."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, MetaData, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.store.models import Base


def home() -> Path:
    """Trainmaster's state folder: ``$TRAINMASTER_HOME`` or ``~/.trainmaster``."""
    return Path(os.environ.get("TRAINMASTER_HOME") or Path.home() / ".trainmaster")


def default_url() -> str:
    return os.environ.get("TRAINMASTER_DB") or f"sqlite:///{home() / 'trainmaster.db'}"


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers (instance wait steps) never block the writer
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def make_engine(url: str | None = None, create: bool = True) -> Engine:
    url = url or default_url()
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 10})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(url, pool_pre_ping=True)
    if create:
        Base.metadata.create_all(engine)
        check_schema(engine, url, Base.metadata)
    return engine


def check_schema(engine: Engine, url: str, metadata: MetaData) -> None:
    """Refuse a database written by an older Trainmaster (``create_all`` adds missing tables,
    never missing columns) instead of failing later mid-job."""
    from sqlalchemy import inspect

    from trainmaster.errors import UserError

    inspector = inspect(engine)
    for table in metadata.sorted_tables:
        have = {c["name"] for c in inspector.get_columns(table.name)}
        missing = sorted(c.name for c in table.columns if c.name not in have)
        if missing:
            raise UserError(f"the store {url} was created by an older Trainmaster (table {table.name} "
                            f"lacks {', '.join(missing)}); move that database away or point the service at a new URL")


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
