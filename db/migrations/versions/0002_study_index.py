"""Schema version 2: index ft_measurements by (study_name, trial_number).

The dashboard's per-study views and the search's resume read a study's rows; without the index
that is a scan of every measurement. ft_meta.schema_version goes to 2 with it.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_ft_measurements_study", "ft_measurements", ["study_name", "trial_number"])
    op.execute(sa.text("UPDATE ft_meta SET schema_version = 2 WHERE id = 1"))


def downgrade() -> None:
    op.drop_index("ix_ft_measurements_study", "ft_measurements")
    op.execute(sa.text("UPDATE ft_meta SET schema_version = 1 WHERE id = 1"))
