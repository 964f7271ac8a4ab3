"""Engine and session setup for the results database (SQLite by default, shared with Optuna)."""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

from platformdirs import user_data_dir
from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.exc import DatabaseError as SQLDatabaseError
from sqlalchemy.orm import Session, sessionmaker


# ft_meta.schema_version of a database at HEAD_REVISION. Alembic (db/migrations, version table
# ft_alembic_version: Optuna keeps its own `alembic_version` in the same file) moves older databases
# forward; a database whose version or revision this flashtune does not know is refused.
SCHEMA_VERSION = 3
HEAD_REVISION = "0003"
VERSION_TABLE = "ft_alembic_version"
MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
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


def _sqlite_transactions(engine: Engine, pragmas: tuple[str, ...], immediate: Callable[[], bool]) -> None:
    """pysqlite's own transaction handling is switched off so that SAVEPOINTs nest properly, and
    write sessions start with BEGIN IMMEDIATE: a deferred transaction that reads and then writes
    can fail at once with SQLITE_BUSY under WAL, without waiting for busy_timeout."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            for pragma in pragmas:
                cur.execute(pragma)
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate() else "BEGIN")


def _install_sqlite_pragmas(engine: Engine, mode: dict[str, bool]) -> None:
    """WAL + busy timeout let a search, a bench and the dashboard share one file."""
    pragmas = ("PRAGMA busy_timeout=60000", "PRAGMA journal_mode=WAL", "PRAGMA foreign_keys=ON",
               "PRAGMA synchronous=NORMAL")
    _sqlite_transactions(engine, pragmas, lambda: mode["immediate"])


def serialize_sqlite_writers(engine: Engine) -> None:
    """For an engine we did not make (Optuna's RDBStorage on the same file): busy timeout, and every
    transaction starts with BEGIN IMMEDIATE, so concurrent searches queue for the write lock instead
    of failing with "database is locked" when a deferred read transaction tries to become a writer.
    Pooled connections are dropped so that every connection from now on gets the settings."""
    if engine.url.get_backend_name() != "sqlite":
        return
    _sqlite_transactions(engine, ("PRAGMA busy_timeout=60000",), lambda: True)
    engine.dispose()


def sqlite_init_lock(url: str):
    """An inter-process lock for one SQLite file's first-time setup: our own (WAL, migrations) and a
    library's that does not serialize it itself (Optuna creates its tables and stamps its version
    check-then-act). A file lock in the temp dir, keyed by the database path; a no-op for other
    backends and on Windows. Not re-entrant: make no engine while holding it."""
    import contextlib
    import hashlib
    import tempfile

    try:
        parsed = make_url(url)
        path = _sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None
        import fcntl
    except (ArgumentError, ImportError):
        path = None
    if path is None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _locked():
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        lock = Path(tempfile.gettempdir()) / f"flashtune-{digest}.lock"
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    return _locked()


def _alembic_config(conn: Connection):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = conn
    return cfg


def _schema_state(conn: Connection) -> tuple[set[str], list[str], int | None]:
    tables = set(inspect(conn).get_table_names())
    revs = [r for (r,) in conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}")] if VERSION_TABLE in tables else []
    version = conn.exec_driver_sql("SELECT schema_version FROM ft_meta WHERE id = 1").scalar() if "ft_meta" in tables else None
    return tables, revs, version


def migrate(engine: Engine) -> str:
    """Bring the database to HEAD_REVISION; returns what was done ("current", "created", "upgraded").

    One transaction (BEGIN IMMEDIATE on SQLite), so processes opening one file at once take turns
    and each sees the schema the previous one left. A database created before Alembic came in (ft
    tables, no ft_alembic_version) is stamped 0001, the schema it has, then upgraded.
    """
    where = engine.url.render_as_string(hide_password=True)
    with engine.begin() as conn:
        tables, revs, version = _schema_state(conn)
        if version is not None and version > SCHEMA_VERSION:
            raise DatabaseError(f"{where}: schema version {version} was written by a newer flashtune "
                                f"(this one knows {SCHEMA_VERSION}); upgrade flashtune to open it")
        if revs == [HEAD_REVISION]:
            return "current"
        from alembic import command
        from alembic.script import ScriptDirectory
        from alembic.util import CommandError

        cfg = _alembic_config(conn)
        script = ScriptDirectory.from_config(cfg)
        for r in revs:
            try:
                known = script.get_revision(r) is not None
            except CommandError:
                known = False
            if not known:
                raise DatabaseError(f"{where}: schema revision {r!r} was written by a newer flashtune "
                                    f"(this one knows up to {HEAD_REVISION}); upgrade flashtune to open it")
        if not revs and "ft_measurements" in tables:
            command.stamp(cfg, "0001")
        command.upgrade(cfg, "head")
        return "created" if "ft_measurements" not in tables else "upgraded"


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
        # one process at a time: switching a new file to WAL and migrating it can fail at once with
        # "database is locked" when several searches open the same file together (busy_timeout
        # does not cover the journal-mode change)
        with sqlite_init_lock(text):
            migrate(engine)
    except SQLDatabaseError as e:  # OperationalError (cannot open, locked), "file is not a database", ...
        engine.dispose()
        where = str(path) if path is not None else parsed.render_as_string(hide_password=True)
        raise DatabaseError(f"cannot open the database {where}: {e.orig}") from None
    mode["immediate"] = not readonly
    return engine


def open_recorded(url: str) -> Engine:
    """A database that must not change (a replay fixture, someone else's results): a SQLite file
    is opened through SQLite's read-only mode, with no pragmas and no migrations, and must already
    be at this schema version. Other backends go through make_engine."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(f"malformed database URL {url!r}") from None
    path = _sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None
    if path is None:
        return make_engine(url, readonly=True)
    if not path.is_file():
        raise DatabaseError(f"no database at {path}")
    engine = create_engine(f"sqlite:///file:{path.resolve()}?mode=ro&uri=true")
    try:
        with engine.connect() as conn:
            tables, _, version = _schema_state(conn)
    except SQLDatabaseError as e:
        engine.dispose()
        raise DatabaseError(f"cannot open the database {path}: {e.orig}") from None
    if "ft_measurements" not in tables:
        engine.dispose()
        raise DatabaseError(f"{path} is not a flashtune results database")
    if version != SCHEMA_VERSION:
        engine.dispose()
        raise DatabaseError(f"{path} has schema version {version}, this flashtune reads {SCHEMA_VERSION}: "
                            f"open a copy once with `tuner export --db sqlite:///COPY -o best.json` to upgrade it")
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Rows stay readable after commit: callers hand them on as plain values."""
    return sessionmaker(engine, expire_on_commit=False)
