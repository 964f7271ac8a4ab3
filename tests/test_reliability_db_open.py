"""Opening a results database: reading never writes, a writer is told in one line what it cannot
write, drivers that are missing are named with the package to install (never the password), and
the setup lock lives in a per-user folder, says what it waits on, and is removed after use."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuner.db import queries
from tuner.db.engine import SCHEMA_VERSION, DatabaseError, lock_dir, make_engine, open_readonly, session_factory, sqlite_init_lock

FIXTURE = Path(__file__).parent / "fixtures" / "h100_simt.db"


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch) -> Path:
    """platformdirs' user cache dir (where the locks live) inside tmp_path, for this process and
    the subprocesses it starts."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _copy(tmp_path: Path, name: str = "rec.db") -> Path:
    dst = tmp_path / name
    shutil.copy(FIXTURE, dst)
    dst.chmod(0o644)
    return dst


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- reading never writes ----

def test_open_readonly_leaves_the_file_as_it_was(tmp_path):
    db = _copy(tmp_path)
    before = _digest(db)
    engine = open_readonly(f"sqlite:///{db}")
    with session_factory(engine)() as s:
        assert queries.best_rows(s)
        assert queries.list_gpus(s)
    engine.dispose()
    assert _digest(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.db"]  # no -wal, no -shm, no lock
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # never switched to WAL


def test_open_readonly_never_creates_or_migrates(tmp_path):
    with pytest.raises(DatabaseError, match="no database at .*never create"):
        open_readonly(f"sqlite:///{tmp_path / 'typo.db'}")
    assert not (tmp_path / "typo.db").exists()
    old = _copy(tmp_path, "old.db")
    with sqlite3.connect(old) as c:
        c.execute("UPDATE ft_meta SET schema_version = 2")
        c.execute("UPDATE ft_alembic_version SET version_num = '0002'")
    before = _digest(old)
    with pytest.raises(DatabaseError,
                       match=rf"schema version 2, this flashtune reads {SCHEMA_VERSION} .*tuner migrate --db"):
        open_readonly(f"sqlite:///{old}")
    assert _digest(old) == before
    with sqlite3.connect(tmp_path / "foreign.db") as c:
        c.execute("CREATE TABLE notes (x)")
    with pytest.raises(DatabaseError, match="is not a flashtune results database"):
        open_readonly(f"sqlite:///{tmp_path / 'foreign.db'}")


def test_open_readonly_of_a_path_with_uri_characters(tmp_path):
    folder = tmp_path / "we ird [x] #dir"
    folder.mkdir()
    db = _copy(folder)
    with session_factory(open_readonly(f"sqlite:///{db}"))() as s:
        assert queries.list_gpus(s)


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_in_memory_database_is_refused(url):
    for opener in (make_engine, open_readonly):
        with pytest.raises(DatabaseError, match="in-memory database, which keeps nothing"):
            opener(url)


def test_a_writer_is_told_the_file_is_read_only(tmp_path):
    """SQLite's own read-only mode stands in for a file the user cannot write (root writes any
    chmod 444 file): the writer's first write fails, and that is one DatabaseError."""
    db = _copy(tmp_path)
    before = _digest(db)
    with pytest.raises(DatabaseError, match="attempt to write a readonly database"):
        make_engine(f"sqlite:///file:{db}?mode=ro&uri=true")
    assert _digest(db) == before


def test_a_read_only_file_is_refused_for_writing_and_read_for_reading(tmp_path):
    db = _copy(tmp_path)
    db.chmod(0o444)
    immutable = False
    if os.access(db, os.W_OK):  # root: only an immutable file is read-only
        immutable = subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode == 0
        if not immutable:
            pytest.skip("running as root where `chattr +i` is not permitted: no file is read-only here")
    try:
        before = _digest(db)
        with pytest.raises(DatabaseError, match=r"is read-only here and this command stores results in it"):
            make_engine(f"sqlite:///{db}")
        with session_factory(open_readonly(f"sqlite:///{db}"))() as s:
            assert queries.best_rows(s)
        assert _digest(db) == before
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(db)], check=True)


# ---- drivers and passwords ----

@pytest.mark.parametrize("url,module,package", [
    ("postgresql://bob:hunter2@localhost/db", "psycopg", "psycopg[binary]"),
    ("postgresql+psycopg2://bob:hunter2@localhost/db", "psycopg2", "psycopg2-binary"),
    ("mysql+pymysql://bob:hunter2@localhost/db", "pymysql", "pip install pymysql"),
])
def test_missing_driver_names_the_package_and_hides_the_password(url, module, package, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # missing here, however installed: import raises ImportError
    for opener in (make_engine, open_readonly):
        with pytest.raises(DatabaseError) as info:
            opener(url)
        msg = str(info.value)
        assert package in msg and "bob:***@localhost" in msg and "hunter2" not in msg and "\n" not in msg


@pytest.mark.parametrize("url", ["nosuchdb://bob:hunter2@h/x", "::bob:hunter2@h/x://"])
def test_unusable_url_hides_the_password(url):
    with pytest.raises(ValueError) as info:
        make_engine(url)
    assert "hunter2" not in str(info.value) and "bob" in str(info.value)


# ---- the setup lock ----

def test_lock_lives_in_a_private_per_user_folder_and_is_removed(tmp_path, user_cache):
    tmp_locks = set(Path("/tmp").glob("flashtune-*.lock"))
    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_engine(url).dispose()
    folder = lock_dir()
    assert folder.is_relative_to(user_cache) and (folder.stat().st_mode & 0o777) == 0o700
    assert list(folder.iterdir()) == []  # the lock file went with the lock
    assert set(Path("/tmp").glob("flashtune-*.lock")) == tmp_locks


def _refused_when_another_user_owns(folder: Path) -> None:
    """Hand `folder` to nobody (root only) and check lock_dir() will not use it."""
    if os.getuid() != 0:
        pytest.skip("handing the folder to another user needs root")
    os.chown(folder, 65534, 65534)
    try:
        with pytest.raises(DatabaseError, match="belongs to another user"):
            lock_dir()
    finally:
        os.chown(folder, 0, 0)


def test_lock_folder_open_to_others_is_closed_and_one_of_another_user_refused(user_cache):
    folder = lock_dir()
    folder.chmod(0o777)
    assert lock_dir() == folder and (folder.stat().st_mode & 0o777) == 0o700
    _refused_when_another_user_owns(folder)


def test_a_held_lock_says_what_is_waited_on(tmp_path):
    url = f"sqlite:///{tmp_path / 'held.db'}"
    code = f"from tuner.db.engine import make_engine; make_engine({url!r}).dispose(); print('opened')"
    with sqlite_init_lock(url):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        assert p.poll() is None  # still waiting
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == "opened", err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "waiting for another flashtune process" in lines[0] and "held.db" in lines[0], err


def _hold_many(args: tuple[str, str, int]) -> None:
    url, log, n = args
    for _ in range(n):
        with sqlite_init_lock(url):
            with open(log, "a") as f:
                f.write(f"in {os.getpid()}\n")
                f.flush()
                time.sleep(0.002)
                f.write(f"out {os.getpid()}\n")


def test_lock_excludes_while_its_file_comes_and_goes(tmp_path):
    """Holders remove the lock file on release; a waiter that locked the removed file retries, so
    two processes are never inside at once."""
    url, log = f"sqlite:///{tmp_path / 'x.db'}", str(tmp_path / "log")
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_hold_many, [(url, log, 25)] * 4)
    lines = Path(log).read_text().splitlines()
    assert len(lines) == 200
    for enter, leave in zip(lines[::2], lines[1::2]):
        assert enter.startswith("in ") and leave == "out " + enter[3:], (enter, leave)
    assert list(lock_dir().iterdir()) == []


def test_without_a_usable_cache_dir_the_locks_go_to_a_private_temp_folder(tmp_path, monkeypatch):
    import tempfile

    (tmp_path / "not-a-dir").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))  # no home to write to
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    folder = lock_dir()
    assert folder == tmp_path / "tmp" / f"flashtune-locks-{os.getuid()}"
    assert (folder.stat().st_mode & 0o777) == 0o700
    make_engine(f"sqlite:///{tmp_path / 'a.db'}").dispose()
    assert list(folder.iterdir()) == []
    _refused_when_another_user_owns(folder)  # someone else made the predictable name first: never used


def test_optuna_storage_on_a_read_only_file_is_one_line(tmp_path):
    """Our tables at head but none of Optuna's, in a file opened read-only: Optuna's first write
    (creating its tables) fails, and that is one DatabaseError, not its traceback."""
    from tuner.search import optuna_storage

    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_engine(url).dispose()
    with pytest.raises(DatabaseError, match="cannot open the database .*attempt to write a readonly database"):
        optuna_storage(f"sqlite:///file:{tmp_path / 'a.db'}?mode=ro&uri=true")
