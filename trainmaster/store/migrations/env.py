"""Alembic environment: runs on the connection :func:`trainmaster.store.migrate.upgrade` hands it."""

from alembic import context

from trainmaster.store.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
