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

    from trainmaster.store import migrate
    from trainmaster.store.db import default_url

    url = db or default_url()
    with create_engine(url).connect() as connection:
        typer.echo(f"store: {migrate.current(connection) or 'none (empty or made before migrations)'}; "
                   f"this release: {migrate.head()}")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="db")
