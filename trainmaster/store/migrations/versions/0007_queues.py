"""Queues with quota: nominal quota per resource, cohort, borrowing and lending limits, weight.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "queues",
        sa.Column("name", sa.String(63), primary_key=True),
        sa.Column("cohort", sa.String(63), nullable=True),
        sa.Column("weight", sa.Float, nullable=False),
        sa.Column("quota", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_queues_cohort", "queues", ["cohort"])
