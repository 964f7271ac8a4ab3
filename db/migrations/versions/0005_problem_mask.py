"""Schema version 5: ft_problems.mask, and bucket keys that round Nq and Nk apart.

A causal problem now says which diagonal it means: "causal" (top-left, SDPA's is_causal) or
"causal_br" (bottom-right, a KV cache's); "none" otherwise. Existing rows were all top-left (the
only causal flashtune ran), so `causal` rows become "causal". The `causal` column stays, true for
either diagonal, for readers that only ask "masked at all?". Bucket keys of problems with Nq != Nk
are recomputed (tuner.problem.Bucket: each length rounded on its own); square ones do not change.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    from tuner.problem import Problem

    with op.batch_alter_table("ft_problems") as batch:
        batch.add_column(sa.Column("mask", sa.String(16), nullable=False, server_default="none"))
    op.execute(sa.text("UPDATE ft_problems SET mask = 'causal' WHERE causal"))
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, mask, "
                                "max_error FROM ft_problems WHERE seqlen_q != seqlen_k")).all()
    for r in rows:
        key = Problem(r.batch, r.heads, r.seqlen_q, r.seqlen_k, r.head_dim, r.dtype, r.mask, r.kv_heads,
                      r.max_error or 0.0).bucket().key
        conn.execute(sa.text("UPDATE ft_problems SET bucket_key = :k WHERE id = :i"), {"k": key, "i": r.id})
        conn.execute(sa.text("UPDATE ft_best SET bucket_key = :k WHERE problem_id = :i"), {"k": key, "i": r.id})
    op.execute(sa.text("UPDATE ft_meta SET schema_version = 5 WHERE id = 1"))


def downgrade() -> None:
    # an older flashtune reads every causal row as top-left: bottom-right rows would mean another
    # problem there, so they go, with what was measured of them
    op.execute(sa.text("DELETE FROM ft_best WHERE problem_id IN (SELECT id FROM ft_problems WHERE mask = 'causal_br')"))
    op.execute(sa.text("DELETE FROM ft_measurements WHERE problem_id IN "
                       "(SELECT id FROM ft_problems WHERE mask = 'causal_br')"))
    op.execute(sa.text("DELETE FROM ft_problems WHERE mask = 'causal_br'"))
    with op.batch_alter_table("ft_problems") as batch:
        batch.drop_column("mask")
    op.execute(sa.text("UPDATE ft_meta SET schema_version = 4 WHERE id = 1"))
