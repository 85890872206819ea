"""Opening the store: SQLite file by default (WAL, busy timeout), any SQLAlchemy URL otherwise."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, MetaData, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.errors import UserError
from trainmaster.store.models import Base


def home() -> Path:
    """Trainmaster's state folder: ``$TRAINMASTER_HOME`` or ``~/.trainmaster``."""
    return Path(os.environ.get("TRAINMASTER_HOME") or Path.home() / ".trainmaster")


def default_url() -> str:
    return os.environ.get("TRAINMASTER_DB") or f"sqlite:///{home() / 'trainmaster.db'}"


def private_file(path: Path) -> None:
    """Make a SQLite store's file readable by its owner only (0600, in a folder created 0700, the
    Trainmaster home narrowed to 0700;
    SQLite gives its -wal and -shm files the database file's mode): the store holds every job's
    spec and environment, and whoever can write it can act as the controller."""
    if path.name == ":memory:" or not path.name:
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if path.parent.resolve() == home().resolve() and path.parent.stat().st_uid == os.getuid():
            path.parent.chmod(0o700)  # the Trainmaster home (made by anything first) is private
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        if path.stat().st_uid == os.getuid():
            path.chmod(0o600)
    except OSError:
        pass  # not ours, or a read-only place: SQLite says what is wrong when it opens it


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
        private_file(Path(url.removeprefix("sqlite:///")).expanduser())
        engine = create_engine(url, connect_args={"timeout": 10})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(url, pool_pre_ping=True)
    if create:
        from trainmaster.store.migrate import upgrade

        upgrade(engine)  # an older store is upgraded in place (Alembic)
        check_schema(engine, url, Base.metadata)
    return engine


def check_schema(engine: Engine, url: str, metadata: MetaData) -> None:
    """Refuse a database written by an older Trainmaster (``create_all`` adds missing tables,
    never missing columns) instead of failing later mid-job."""
    from sqlalchemy import inspect

    inspector = inspect(engine)
    for table in metadata.sorted_tables:
        have = {c["name"] for c in inspector.get_columns(table.name)}
        missing = sorted(c.name for c in table.columns if c.name not in have)
        if missing:
            raise UserError(
                f"the store {url} was created by an older Trainmaster (table {table.name} "
                f"lacks {', '.join(missing)}); move that database away or point the service at a new URL"
            )


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL, None for any other database."""
    return Path(url.removeprefix("sqlite:///")).expanduser() if url.startswith("sqlite:///") else None


class ServerLock:
    """One controller server per SQLite store: an ``flock`` on ``<db>.server.lock`` held for the
    server's life (released by the kernel if it dies, even by kill -9). Servers sharing a
    PostgreSQL store elect a leader instead (:mod:`trainmaster.controller.leader`)."""

    def __init__(self, db_file: Path):
        self.path = db_file.with_name(db_file.name + ".server.lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(
                f"another trainmaster server (pid {holder}) already runs on the store {self.path.parent}: "
                "two controllers on one SQLite store would both start every job; stop it, or give "
                "this one another --db (several servers share a PostgreSQL store safely)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def fileno(self) -> int | None:
        """The locked descriptor: a child process that inherits it holds the lock with this one."""
        return self._fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
