"""The schema of Trainmaster 0.1.0 before migrations existed: jobs, roles, instances, events, registry.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("uid", sa.String(32), nullable=False, unique=True),
        sa.Column("name", sa.String(63), nullable=False, index=True),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("queue", sa.String(63), nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False, index=True),
        sa.Column("cancel_requested", sa.Boolean, nullable=False),
        sa.Column("admitted", sa.Boolean, nullable=False),
        sa.Column("run_dir", sa.Text, nullable=False),
        sa.Column("output_path", sa.Text, nullable=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("started_at", TZ, nullable=True),
        sa.Column("running_at", TZ, nullable=True),
        sa.Column("completed_at", TZ, nullable=True),
        sa.Column("last_transition_at", TZ, nullable=False),
    )
    op.create_table(
        "roles",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("replicas", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("counts", sa.JSON, nullable=False),
        sa.Column("last_transition_at", TZ, nullable=False),
        sa.UniqueConstraint("job_id", "name"),
    )
    op.create_table(
        "instances",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        sa.Column("role", sa.String(63), nullable=False),
        sa.Column("index", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("restarts", sa.Integer, nullable=False),
        sa.Column("handle", sa.JSON, nullable=True),
        sa.Column("pid", sa.Integer, nullable=True),
        sa.Column("host", sa.String(255), nullable=True),
        sa.Column("ports", sa.JSON, nullable=False),
        sa.Column("address", sa.String(255), nullable=True),
        sa.Column("exit_code", sa.Integer, nullable=True),
        sa.Column("log_path", sa.Text, nullable=True),
        sa.Column("cpu", sa.Float, nullable=False),
        sa.Column("memory", sa.Integer, nullable=False),
        sa.Column("next_start_at", TZ, nullable=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("started_at", TZ, nullable=True),
        sa.Column("running_at", TZ, nullable=True),
        sa.Column("ended_at", TZ, nullable=True),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        sa.Column("object", sa.String(128), nullable=False),
        sa.Column("type", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("time", TZ, nullable=False),
    )
    op.create_table(
        "registry",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        sa.Column("role", sa.String(63), nullable=False),
        sa.Column("index", sa.Integer, nullable=False),
        sa.Column("address", sa.String(255), nullable=False),
        sa.Column("registered_at", TZ, nullable=False),
        sa.UniqueConstraint("job_id", "role", "index"),
    )
