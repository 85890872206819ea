"""``trainmaster db``: the store's schema revision and its upgrade."""

from __future__ import annotations

import typer

from trainmaster.cli.jobs import DbOpt

app = typer.Typer(help="The store (database): schema revision and upgrades.", no_args_is_help=True)


@app.command()
def upgrade(db: DbOpt = None) -> None:
    """Upgrade the store's schema to this release's (also done when any command opens it).

    Examples:

      trainmaster db upgrade

      trainmaster db upgrade --db postgresql+psycopg://tm@db/trainmaster
    """
    from sqlalchemy import create_engine

    from trainmaster.store import migrate
    from trainmaster.store.db import default_url, make_engine

    url = db or default_url()
    make_engine(url, create=False)  # SQLite: makes the folder and the per-connection settings
    result = migrate.upgrade(create_engine(url))
    if result.changed:
        typer.echo(f"{url}: upgraded from {result.before or 'an empty store'} to {result.after}")
    else:
        typer.echo(f"{url}: already at {result.after}")


@app.command()
def current(db: DbOpt = None) -> None:
    """Print the store's schema revision and this release's newest.

    Example:

      trainmaster db current
    """
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError

    from trainmaster.errors import UserError
    from trainmaster.store import migrate
    from trainmaster.store.db import default_url, sqlite_path

    url = db or default_url()
    path = sqlite_path(url)
    if path is not None and not path.exists():  # looking must not create it
        typer.echo(
            f"store: none yet ({path} does not exist; `trainmaster db upgrade` or the first job "
            f"creates it); this release: {migrate.head()}"
        )
        return
    try:
        with create_engine(url).connect() as connection:
            revision = migrate.current(connection)
    except OperationalError as exc:
        raise UserError(f"cannot open the store {url}: {exc.orig}; check --db / TRAINMASTER_DB") from None
    typer.echo(f"store: {revision or 'none (empty or made before migrations)'}; this release: {migrate.head()}")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="db")
