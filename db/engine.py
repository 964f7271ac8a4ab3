"""Engine and session setup for the results database (SQLite by default, shared with Optuna)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from platformdirs import user_data_dir
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from .models import Base, MetaRow

SCHEMA_VERSION = 1
APP_NAME = "flashtune"


class DatabaseError(RuntimeError):
    """The database cannot be created, opened, or was written by a newer flashtune."""


def default_url() -> str:
    """TUNER_DB wins; otherwise one SQLite file per user, beside the other flashtune data."""
    env = os.environ.get("TUNER_DB")
    if env:
        return env
    folder = Path(user_data_dir(APP_NAME))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatabaseError(f"cannot create the data directory {folder}: {e.strerror or e}") from None
    return f"sqlite:///{folder / 'flashtune.db'}"


def _sqlite_file(url: URL) -> Path | None:
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db).expanduser()


def _install_sqlite_pragmas(engine: Engine, mode: dict[str, bool]) -> None:
    """WAL + busy timeout let a search, a bench and the dashboard share one file.

    pysqlite's own transaction handling is switched off so that SAVEPOINTs nest properly, and
    write sessions start with BEGIN IMMEDIATE: a deferred transaction that reads and then writes
    can fail at once with SQLITE_BUSY under WAL, without waiting for busy_timeout.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute("PRAGMA busy_timeout=60000")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if mode["immediate"] else "BEGIN")


def _ensure_meta(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        row = s.scalar(select(MetaRow).where(MetaRow.id == 1))
        if row is None:
            try:
                with s.begin_nested():
                    s.add(MetaRow(id=1, schema_version=SCHEMA_VERSION))
            except IntegrityError:  # another process wrote it first
                row = s.scalar(select(MetaRow).where(MetaRow.id == 1))
        if row is not None and row.schema_version > SCHEMA_VERSION:
            raise DatabaseError(
                f"{engine.url.render_as_string(hide_password=True)}: schema version "
                f"{row.schema_version} was written by a newer flashtune (this one knows {SCHEMA_VERSION})"
            )


def make_engine(url: str | None = None, *, readonly: bool = False) -> Engine:
    """Open (and create if needed) the results database.

    `readonly=True` (the dashboard) starts plain deferred transactions so long-lived readers never
    hold SQLite's write lock; writers keep the default.
    """
    text = url or default_url()
    try:
        parsed = make_url(text)
    except ArgumentError:
        raise ValueError(f"malformed database URL {text!r} (expected e.g. sqlite:////path/to/flashtune.db)") from None

    is_sqlite = parsed.get_backend_name() == "sqlite"
    kwargs: dict[str, Any] = {}
    path: Path | None = None
    if is_sqlite:
        kwargs["connect_args"] = {"timeout": 60}
        path = _sqlite_file(parsed)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseError(
                    f"cannot create the database directory {path.parent}: {e.strerror or e}"
                ) from None
    try:
        engine = create_engine(parsed, **kwargs)
    except (NoSuchModuleError, ArgumentError) as e:
        raise ValueError(f"unusable database URL {text!r}: {e}") from None
    mode = {"immediate": True}  # schema setup always writes, even for a read-only engine
    if is_sqlite:
        _install_sqlite_pragmas(engine, mode)
    try:
        Base.metadata.create_all(engine)
        _ensure_meta(engine)
    except OperationalError as e:
        engine.dispose()
        where = str(path) if path is not None else parsed.render_as_string(hide_password=True)
        raise DatabaseError(f"cannot open the database {where}: {e.orig}") from None
    mode["immediate"] = not readonly
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Rows stay readable after commit: callers hand them on as plain values."""
    return sessionmaker(engine, expire_on_commit=False)
