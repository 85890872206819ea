"""Job ids are never reused: SQLite's AUTOINCREMENT on jobs (PostgreSQL's sequence never reuses).

Without it SQLite hands a deleted job's id to the next job, which then shows the old job's logs.

Revision ID: 0003
Revises: 0002
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("jobs", recreate="always", table_kwargs={"sqlite_autoincrement": True}):
        pass
