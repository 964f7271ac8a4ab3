"""The first schema (flashtune 0.1, ft_meta.schema_version 1): gpus, problems, configs, measurements, best.

Written out table by table, not from the ORM models, so it stays what version 1 was whatever the
models become. Databases created before Alembic came in hold exactly this; they are stamped 0001
and upgraded from here.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    ts = sa.DateTime(timezone=True)
    meta = op.create_table(
        "ft_meta",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("created_at", ts, nullable=False),
    )
    op.create_table(
        "ft_gpus",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("key", sa.String(200), nullable=False, unique=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("cc", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.Column("first_seen", ts, nullable=False),
    )
    op.create_table(
        "ft_problems",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("key", sa.String(200), nullable=False, unique=True),
        sa.Column("batch", sa.Integer(), nullable=False),
        sa.Column("heads", sa.Integer(), nullable=False),
        sa.Column("kv_heads", sa.Integer(), nullable=False),
        sa.Column("seqlen_q", sa.Integer(), nullable=False),
        sa.Column("seqlen_k", sa.Integer(), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("causal", sa.Boolean(), nullable=False),
        sa.Column("bucket_key", sa.String(100), nullable=False),
    )
    op.create_index("ix_ft_problems_bucket_key", "ft_problems", ["bucket_key"])
    op.create_table(
        "ft_configs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("family", sa.String(100), nullable=False),
        sa.Column("params_json", sa.Text(), nullable=False),
        sa.UniqueConstraint("family", "params_json", name="uq_ft_configs_family_params"),
    )
    op.create_index("ix_ft_configs_family", "ft_configs", ["family"])
    op.create_table(
        "ft_measurements",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("gpu_id", sa.Integer(), sa.ForeignKey("ft_gpus.id"), nullable=False),
        sa.Column("problem_id", sa.Integer(), sa.ForeignKey("ft_problems.id"), nullable=False),
        sa.Column("config_id", sa.Integer(), sa.ForeignKey("ft_configs.id"), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        *(sa.Column(c, sa.Float()) for c in ("median_ms", "min_ms", "max_ms", "tflops", "max_abs_err", "rel_err",
                                            "lse_err")),
        *(sa.Column(c, sa.Integer(), nullable=False) for c in ("registers", "spill_bytes", "stack_bytes",
                                                              "static_smem", "dynamic_smem")),
        sa.Column("compile_seconds", sa.Float()),
        sa.Column("reps", sa.Integer(), nullable=False),
        sa.Column("versions_json", sa.Text(), nullable=False),
        sa.Column("versions_key", sa.String(64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("study_name", sa.String(300)),
        sa.Column("trial_number", sa.Integer()),
        sa.Column("run_id", sa.String(100)),
        sa.Column("created_at", ts, nullable=False),
    )
    op.create_index("ix_ft_measurements_lookup", "ft_measurements", ["gpu_id", "problem_id", "config_id", "versions_key"])
    op.create_index("ix_ft_measurements_versions_key", "ft_measurements", ["versions_key"])
    op.create_index("ix_ft_measurements_run_id", "ft_measurements", ["run_id"])
    op.create_index("ix_ft_measurements_status", "ft_measurements", ["status"])
    op.create_table(
        "ft_best",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("gpu_id", sa.Integer(), sa.ForeignKey("ft_gpus.id"), nullable=False),
        sa.Column("problem_id", sa.Integer(), sa.ForeignKey("ft_problems.id"), nullable=False),
        sa.Column("family", sa.String(100), nullable=False),
        sa.Column("config_id", sa.Integer(), sa.ForeignKey("ft_configs.id"), nullable=False),
        sa.Column("measurement_id", sa.Integer(), sa.ForeignKey("ft_measurements.id"), nullable=False),
        sa.Column("bucket_key", sa.String(100), nullable=False),
        sa.Column("tflops", sa.Float(), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=False),
        sa.Column("updated_at", ts, nullable=False),
        sa.UniqueConstraint("gpu_id", "problem_id", "family", name="uq_ft_best_gpu_problem_family"),
    )
    op.create_index("ix_ft_best_bucket_key", "ft_best", ["bucket_key"])
    op.bulk_insert(meta, [{"id": 1, "schema_version": 1, "created_at": datetime.now(timezone.utc)}])


def downgrade() -> None:
    for t in ("ft_best", "ft_measurements", "ft_configs", "ft_problems", "ft_gpus", "ft_meta"):
        op.drop_table(t)
