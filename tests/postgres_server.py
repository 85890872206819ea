"""A real PostgreSQL server for tests: ``initdb`` + ``pg_ctl`` into a temporary folder on a free
loopback port, run as the ``postgres`` user (PostgreSQL refuses to run as root). Debian's
``postgresql`` package provides the binaries; without them the tests that need one skip."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from helpers import free_port


def binaries() -> Path | None:
    """The folder of initdb/pg_ctl: PATH first, else Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


def why_unavailable() -> str | None:
    if binaries() is None:
        return "PostgreSQL is not installed (Debian: apt-get install postgresql; `make test` installs it)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a 'postgres' user to run the server as"
    return None


class PostgresServer:
    """One throw-away cluster; ``url()`` gives a SQLAlchemy URL of a fresh database in it."""

    def __init__(self) -> None:
        self.bin = binaries()
        assert self.bin is not None
        self.dir = Path(tempfile.mkdtemp(prefix="tm-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self._databases = 0
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"
        )
        self.start()

    def _run(self, *argv: str) -> None:
        subprocess.run(
            [*self._as_user, *argv],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=self.dir,
            timeout=120,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.dir / "server.log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )
        self._wait_ready()

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self) -> None:
        """A database restart under running clients (every connection is dropped)."""
        self.stop("immediate")
        self.start()

    def _wait_ready(self, timeout: float = 30) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self._dsn("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"PostgreSQL on port {self.port} did not accept connections in {timeout}s")
                time.sleep(0.1)

    def _dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def url(self) -> str:
        """A SQLAlchemy URL of a new, empty database."""
        import psycopg

        self._databases += 1
        name = f"tm{self._databases}"
        with psycopg.connect(self._dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        try:
            self.stop("immediate")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
