"""Event ids are never reused (SQLite's AUTOINCREMENT on events; PostgreSQL's sequence never
reuses), and jobs are indexed by queue.

An event's id is the store's resource version: a watch and the controller's reconcile pass
(which reloads only the jobs changed since the last version it saw) read "every event after N".
Without AUTOINCREMENT SQLite would hand the ids of a deleted job's last events to new ones,
which a reader already past them would never see. The queue index serves the job list's
queue filter.

Revision ID: 0008
Revises: 0007
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_queue", "jobs", ["queue"])
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("events", recreate="always", table_kwargs={"sqlite_autoincrement": True}):
        pass
