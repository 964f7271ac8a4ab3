"""Alembic environment for flashtune's own tables (ft_*).

Run programmatically by tuner.db.engine.migrate(), which hands over an open connection (inside a
BEGIN IMMEDIATE transaction on SQLite) in `config.attributes["connection"]`. Our version table is
`ft_alembic_version`, so it never collides with Optuna's `alembic_version` in the same database.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

VERSION_TABLE = "ft_alembic_version"


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=None, version_table=VERSION_TABLE,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:  # `alembic -x url=sqlite:///...` by hand
    url = context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option("sqlalchemy.url")
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
