"""Jobs indexed by (admitted, state, owner): a reconcile pass reads its admitted jobs every pass
and its waiting ones only when an event named them (the controller keeps its waiting queue
between passes), so that read must not walk every active job of a long queue.

Revision ID: 0010
Revises: 0009
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_admitted_state_owner", "jobs", ["admitted", "state", "owner"])
