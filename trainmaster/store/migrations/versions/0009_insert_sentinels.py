"""A nullable ``insert_sentinel`` column on ``instances`` and ``registry``: the ORM writes a gang's
new rows of either table in one multi-row INSERT and matches the ids the database returns to
its objects by it (:data:`trainmaster.store.models.INSERT_SENTINEL`). Without it SQLite got one
INSERT per row. Rows written before it keep NULL there: nothing reads it.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("instances", "registry"):
        with op.batch_alter_table(table) as batch:  # an ALTER TABLE ADD COLUMN, also on SQLite
            batch.add_column(sa.Column("insert_sentinel", sa.Integer, nullable=True))
