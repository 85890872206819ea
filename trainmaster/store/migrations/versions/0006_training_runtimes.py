"""Installed Kubeflow Trainer runtimes (``trainmaster runtime add``), named by TrainJobs.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "training_runtimes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("name", sa.String(253), nullable=False, index=True),
        sa.Column("document", sa.JSON, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("installed_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("kind", "name"),
    )


def downgrade() -> None:
    op.drop_table("training_runtimes")
