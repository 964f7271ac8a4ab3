"""Schema version 3: ft_problems.max_error, the error budget a problem was tuned under.

fp32 problems may allow tensor-core precisions (tf32, bf16) when the user widens the budget; the
budget is part of what was tuned, like the dtype. Existing rows get 0, the dtype's default.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_problems") as batch:
        batch.add_column(sa.Column("max_error", sa.Float(), nullable=False, server_default="0"))
    op.execute(sa.text("UPDATE ft_meta SET schema_version = 3 WHERE id = 1"))


def downgrade() -> None:
    with op.batch_alter_table("ft_problems") as batch:
        batch.drop_column("max_error")
    op.execute(sa.text("UPDATE ft_meta SET schema_version = 2 WHERE id = 1"))
