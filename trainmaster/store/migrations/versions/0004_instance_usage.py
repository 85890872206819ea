"""CPU seconds and peak memory of each instance's process tree, as its node agent reports them.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.add_column(sa.Column("cpu_seconds", sa.Float, nullable=False, server_default="0"))
        batch.add_column(sa.Column("peak_rss", sa.Integer, nullable=False, server_default="0"))
