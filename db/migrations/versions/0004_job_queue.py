"""Schema version 4: the job queue (ft_jobs) and the workers that take from it (ft_workers).

`tuner worker` processes on many GPUs and hosts share one database: each claims (GPU model,
family, problem) jobs under a row lock and beats in ft_workers, so a lost worker's job goes back
to the queue. Older databases gain the two empty tables; their rows are untouched.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    ts = sa.DateTime(timezone=True)
    op.create_table(
        "ft_workers",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("gpu_key", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("started_at", ts, nullable=False),
        sa.Column("beat_at", ts, nullable=False),
        sa.Column("jobs_done", sa.Integer(), nullable=False),
        sa.Column("trials_done", sa.Integer(), nullable=False),
    )
    op.create_index("ix_ft_workers_gpu_key", "ft_workers", ["gpu_key"])
    op.create_index("ix_ft_workers_state", "ft_workers", ["state"])
    op.create_table(
        "ft_jobs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("gpu_key", sa.String(200), nullable=False),
        sa.Column("family", sa.String(100), nullable=False),
        sa.Column("problem_key", sa.String(200), nullable=False),
        sa.Column("problem_json", sa.Text(), nullable=False),
        sa.Column("trials", sa.Integer(), nullable=False),
        sa.Column("sampler", sa.String(16), nullable=False),
        sa.Column("seed", sa.Integer()),
        sa.Column("peers", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.Integer(), sa.ForeignKey("ft_workers.id")),
        sa.Column("submitted_at", ts, nullable=False),
        sa.Column("started_at", ts),
        sa.Column("lease_at", ts),
        sa.Column("finished_at", ts),
        sa.Column("trials_done", sa.Integer(), nullable=False),
        sa.Column("best_tflops", sa.Float()),
        sa.Column("message", sa.Text(), nullable=False),
    )
    op.create_index("ix_ft_jobs_claim", "ft_jobs", ["state", "gpu_key", "id"])
    op.execute(sa.text("UPDATE ft_meta SET schema_version = 4 WHERE id = 1"))


def downgrade() -> None:
    op.drop_table("ft_jobs")
    op.drop_table("ft_workers")
    op.execute(sa.text("UPDATE ft_meta SET schema_version = 3 WHERE id = 1"))
