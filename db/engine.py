"""Engine and session setup for the results database (SQLite by default, shared with Optuna)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from platformdirs import user_cache_dir, user_data_dir
from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.exc import DatabaseError as SQLDatabaseError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import QueuePool


# ft_meta.schema_version of a database at HEAD_REVISION. Alembic (db/migrations, version table
# ft_alembic_version: Optuna keeps its own `alembic_version` in the same file) moves older databases
# forward; a database whose version or revision this flashtune does not know is refused.
SCHEMA_VERSION = 5
HEAD_REVISION = "0005"
VERSION_TABLE = "ft_alembic_version"
MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
APP_NAME = "flashtune"


LOCK_NOTICE_S = 1.5  # a lock held longer than this is named on stderr: the user sees what blocks
# The Python package that provides each DB-API driver SQLAlchemy may ask for.
DRIVER_PACKAGES = {
    "psycopg2": "psycopg2-binary (or use postgresql+psycopg:// with pip install 'psycopg[binary]')",
    "psycopg": "'psycopg[binary]'", "asyncpg": "asyncpg", "pg8000": "pg8000",
    "mysqldb": "mysqlclient (or use mysql+pymysql:// with pip install pymysql)", "pymysql": "pymysql",
    "mysqlconnector": "mysql-connector-python", "oracledb": "oracledb", "pyodbc": "pyodbc",
}


class DatabaseError(RuntimeError):
    """`kind` says what a reader can do about it: "foreign" (no flashtune tables), "older" (tuner
    migrate), "newer" (upgrade flashtune), or "unusable" (anything else)."""

    def __init__(self, message: str, kind: str = "unusable") -> None:
        super().__init__(message)
        self.kind = kind


def masked(url: str) -> str:
    """A database URL as it may be shown: the password hidden (text that does not parse as a URL
    still has any `user:secret@` masked)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return re.sub(r"([^:/@\s]+):[^@\s]*@", r"\1:***@", url)


def _parse(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError:
        raise ValueError(f"malformed database URL {masked(url)!r} (expected e.g. sqlite:////path/to/flashtune.db)") from None


def _create(parsed: URL, **kwargs: Any) -> Engine:
    """create_engine, with a missing dialect or driver said in one line that names what to install."""
    try:
        return create_engine(parsed, **kwargs)
    except NoSuchModuleError:
        raise ValueError(f"unusable database URL {parsed.render_as_string(hide_password=True)!r}: "
                         f"SQLAlchemy knows no database {parsed.drivername!r}") from None
    except ImportError as e:
        driver = parsed.get_driver_name()
        raise DatabaseError(f"the database URL {parsed.render_as_string(hide_password=True)} needs the {driver} driver, "
                            f"which is not installed: pip install {DRIVER_PACKAGES.get(driver, e.name or driver)}") from None


def _in_memory(url: URL) -> bool:
    db = url.database or ""
    return url.get_backend_name() == "sqlite" and (db in ("", ":memory:") or "mode=memory" in db
                                                  or url.query.get("mode") == "memory" or db.startswith("file::memory:"))


def _refuse_in_memory(url: URL) -> None:
    if _in_memory(url):
        raise DatabaseError(f"{url.render_as_string(hide_password=True)} is an in-memory database, which keeps "
                            f"nothing between processes: pass a file, e.g. sqlite:////path/to/flashtune.db")


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


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (None for other backends, memory and `file:` URIs)."""
    parsed = _parse(url)
    return _sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None


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
    of failing with "database is locked" when a deferred read transaction tries to become a writer;
    and our engine's synchronous=NORMAL (under WAL a crash of the process loses nothing; a power
    loss may lose the last commits, never the file), where FULL synced the log on each of the
    several commits an ask or a tell makes. Pooled connections are dropped so that every
    connection from now on gets the settings."""
    if engine.url.get_backend_name() != "sqlite":
        return
    _sqlite_transactions(engine, ("PRAGMA busy_timeout=60000", "PRAGMA synchronous=NORMAL"), lambda: True)
    engine.dispose()


def lock_dir() -> Path:
    """Where our lock files live: a per-user folder only its owner may write (0700), never a shared
    temp dir where another user could create, hold or own the lock first. The user's cache dir;
    where that cannot be made (no writable home), a folder named for the uid in the temp dir,
    refused if someone else made it first."""
    import stat
    import tempfile

    first = Path(user_cache_dir(APP_NAME)) / "locks"
    for folder in (first, Path(tempfile.gettempdir()) / f"flashtune-locks-{os.getuid()}"):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = folder.lstat()
        except OSError as e:
            error = f"cannot use the lock directory {folder}: {e.strerror or e}"
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise DatabaseError(f"the lock directory {folder} belongs to another user (uid {st.st_uid}) "
                                f"or is not a directory; remove it")
        if st.st_mode & 0o077:
            folder.chmod(0o700)
        return folder
    raise DatabaseError(error)


@contextlib.contextmanager
def _file_lock(path: Path, what: str) -> Iterator[None]:
    """An exclusive flock on `path`, removed again when released.

    Removing a lock file is safe because a waiter checks, once it holds the lock, that the file
    it locked is still the one at `path` (the holder before it may have unlinked it), else retries.
    """
    import fcntl

    start, told = time.monotonic(), False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not told and time.monotonic() - start > LOCK_NOTICE_S:
                        print(f"waiting for another flashtune process to finish {what} (lock {path})",
                              file=sys.stderr, flush=True)
                        told = True
                    time.sleep(0.05)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            if current is not None and os.path.samestat(os.fstat(fd), current):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # we locked a file its holder removed: lock the one at `path` now
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # while still holding it: a waiter on this file sees it gone and retries
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def sqlite_init_lock(url: str) -> contextlib.AbstractContextManager[None]:
    """An inter-process lock for one SQLite file's first-time setup: our own (WAL, migrations) and a
    library's that does not serialize it itself (Optuna creates its tables and stamps its version
    check-then-act). One lock file per database in the per-user lock_dir(), keyed by the database
    path and removed when released; a no-op for other backends and on Windows. Not re-entrant:
    make no engine while holding it."""
    try:
        parsed = make_url(url)
        path = _sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None
        import fcntl  # noqa: F401
    except (ArgumentError, ImportError):
        path = None
    if path is None:
        return contextlib.nullcontext()
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return _file_lock(lock_dir() / f"{digest}.lock", f"setting up the database {path}")


PG_INIT_LOCK = 0x666C6173  # pg_advisory_lock key of the first-time setup ("flas")


@contextlib.contextmanager
def _pg_lock(url: str) -> Iterator[None]:
    """A PostgreSQL session advisory lock on a connection of its own: workers starting together on
    several hosts create the tables (ours, Optuna's) one at a time."""
    from sqlalchemy.pool import NullPool

    engine = _create(_parse(url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_lock({PG_INIT_LOCK})")
            conn.commit()
            try:
                yield
            finally:
                conn.exec_driver_sql(f"SELECT pg_advisory_unlock({PG_INIT_LOCK})")
                conn.commit()
    finally:
        engine.dispose()


def init_lock(url: str) -> contextlib.AbstractContextManager[None]:
    """The first-time setup lock of any database: sqlite_init_lock for a SQLite file, an advisory
    lock on PostgreSQL, none elsewhere."""
    try:
        backend = make_url(url).get_backend_name()
    except ArgumentError:
        backend = None
    return _pg_lock(url) if backend == "postgresql" else sqlite_init_lock(url)


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
        newer = _newer_than_this(conn, revs, version)
        if newer:
            raise DatabaseError(f"{where}: {newer}; upgrade flashtune to open it", "newer")
        if revs == [HEAD_REVISION]:
            return "current"
        from alembic import command

        cfg = _alembic_config(conn)
        if not revs and "ft_measurements" in tables:
            command.stamp(cfg, "0001")
        command.upgrade(cfg, "head")
        return "created" if "ft_measurements" not in tables else "upgraded"


def _newer_than_this(conn: Connection, revs: list[str], version: int | None) -> str | None:
    """Why the database was written by a newer flashtune (its version, or a revision this one does
    not know), or None."""
    if version is not None and version > SCHEMA_VERSION:
        return f"schema version {version} was written by a newer flashtune (this one knows {SCHEMA_VERSION})"
    if not revs or revs == [HEAD_REVISION]:
        return None
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    script = ScriptDirectory.from_config(_alembic_config(conn))
    for r in revs:
        try:
            known = script.get_revision(r) is not None
        except CommandError:
            known = False
        if not known:
            return f"schema revision {r!r} was written by a newer flashtune (this one knows up to {HEAD_REVISION})"
    return None


def make_engine(url: str | None = None, *, readonly: bool = False) -> Engine:
    """Open (and create if needed) the results database, for a command that writes to it.

    `readonly=True` starts plain deferred transactions so long-lived readers never hold SQLite's
    write lock; writers keep the default. Commands that only read use open_readonly instead,
    which never creates, migrates or changes a database.
    """
    text = url or default_url()
    parsed = _parse(text)
    _refuse_in_memory(parsed)
    is_sqlite = parsed.get_backend_name() == "sqlite"
    kwargs: dict[str, Any] = {}
    path: Path | None = None
    if is_sqlite:
        kwargs["connect_args"] = {"timeout": 60}
        path = _sqlite_file(parsed)
        if path is not None:
            _check_writable(path)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseError(
                    f"cannot create the database directory {path.parent}: {e.strerror or e}"
                ) from None
    engine = _create(parsed, **kwargs)
    mode = {"immediate": True}  # schema setup always writes, even for a read-only engine
    if is_sqlite:
        _install_sqlite_pragmas(engine, mode)
    try:
        # one process at a time: switching a new file to WAL and migrating it can fail at once with
        # "database is locked" when several searches open the same file together (busy_timeout
        # does not cover the journal-mode change)
        with init_lock(text):
            migrate(engine)
    except SQLDatabaseError as e:  # OperationalError (cannot open, locked), "file is not a database", ...
        engine.dispose()
        where = str(path) if path is not None else parsed.render_as_string(hide_password=True)
        raise DatabaseError(f"cannot open the database {where}: {e.orig}") from None
    mode["immediate"] = not readonly
    return engine


def _check_writable(path: Path) -> None:
    """A writer needs the file and its folder (SQLite's journal and WAL files live beside it)."""
    if path.is_dir():
        raise DatabaseError(f"cannot open the database {path}: it is a directory")
    if not path.exists():
        if path.parent.is_dir() and not os.access(path.parent, os.W_OK):
            raise DatabaseError(f"cannot create the database {path}: its folder is not writable")
        return
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        raise DatabaseError(f"the database {path} is read-only here and this command stores results in it: pass a "
                            f"writable --db (reading commands such as `tuner export` open it read-only)")


def require_existing(url: str) -> None:
    """Refuse a SQLite file that is not there: commands that must not create one say so."""
    _refuse_in_memory(_parse(url))
    path = sqlite_path(url)
    if path is not None and path.is_dir():
        raise DatabaseError(f"cannot open the database {path}: it is a directory")
    if path is not None and not path.is_file():
        raise DatabaseError(f"no database at {path} (reading commands never create one; "
                            f"`tuner search --db sqlite:///{path}` does)")


def readonly_sqlite_kwargs(path: Path) -> dict[str, Any]:
    """create_engine("sqlite://", **these) opens `path` through SQLite's read-only mode (a file
    URI, so any character in the path is fine); Optuna's RDBStorage takes them as engine_kwargs."""
    uri = f"{path.resolve().as_uri()}?mode=ro"
    return {"poolclass": QueuePool,
            "creator": lambda: sqlite3.connect(uri, uri=True, timeout=60, check_same_thread=False)}


def open_readonly(url: str | None = None) -> Engine:
    """A database only to be read (export, the dashboard, a replay recording): never created,
    migrated or written. A SQLite file is opened through SQLite's read-only mode with no pragmas,
    so its journal mode and bytes stay as they were; it must exist and be at this schema version."""
    text = url or default_url()
    require_existing(text)
    parsed = _parse(text)
    path = sqlite_path(text)
    where = str(path) if path is not None else parsed.render_as_string(hide_password=True)
    if path is not None:
        engine = create_engine("sqlite://", **readonly_sqlite_kwargs(path))
    elif parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in ("psycopg", "psycopg2"):
        # the server refuses any write on these connections (a reader's bug cannot change the data)
        engine = _create(parsed, connect_args={"options": "-c default_transaction_read_only=on"})
    else:
        engine = _create(parsed)
    try:
        with engine.connect() as conn:
            tables, revs, version = _schema_state(conn)
            newer = _newer_than_this(conn, revs, version)
    except SQLDatabaseError as e:
        engine.dispose()
        raise DatabaseError(f"cannot open the database {where}: {e.orig}") from None
    problem, kind = None, "unusable"
    if "ft_measurements" not in tables:
        what = "is empty" if not tables else "holds no flashtune tables"
        problem, kind = f"{where} {what}: it is not a flashtune results database", "foreign"
    elif newer:
        problem, kind = f"{where}: {newer}; upgrade flashtune to open it", "newer"
    elif version != SCHEMA_VERSION or revs not in ([HEAD_REVISION], []):
        problem, kind = (f"{where} has schema version {version}, this flashtune reads {SCHEMA_VERSION} (written by an "
                         f"older flashtune): upgrade it in place with "
                         f"`tuner migrate --db {parsed.render_as_string(hide_password=True)}`"), "older"
    if problem:
        engine.dispose()
        raise DatabaseError(problem, kind)
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Rows stay readable after commit: callers hand them on as plain values."""
    return sessionmaker(engine, expire_on_commit=False)
