"""Schema versions through Alembic (db/migrations, version table ft_alembic_version): a new
database is created at head, an older one is brought forward with its rows, a newer one is
refused with one clear message, and Optuna's own `alembic_version` is never touched."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from tuner.db import queries
from tuner.db.engine import (HEAD_REVISION, MIGRATIONS_DIR, SCHEMA_VERSION, VERSION_TABLE, DatabaseError,
                             _alembic_config, make_engine, migrate, session_factory)
from tuner.db.models import Base
from tuner.gpu import H100_SXM
from tuner.problem import Problem
from tuner.records import Measurement

FIXTURE = Path(__file__).parent / "fixtures" / "h100_simt.db"
P = Problem(2, 4, 512, 512, 64, "fp32", True)
PARAMS = dict(Br=64, Bc=64, TM=4, TN=4, stages=1, min_blocks=1)


def _state(path: Path) -> tuple[list[str], int, set[str]]:
    c = sqlite3.connect(path)
    try:
        revs = [r for (r,) in c.execute(f"SELECT version_num FROM {VERSION_TABLE}")]
        version = c.execute("SELECT schema_version FROM ft_meta").fetchone()[0]
        indexes = {n for (n,) in c.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        return revs, version, indexes
    finally:
        c.close()


def _at_revision(path: Path, rev: str, *, pre_alembic: bool = False) -> None:
    """A database as an older flashtune left it: schema of `rev`, one measurement in it."""
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        command.upgrade(_alembic_config(conn), rev)
        if pre_alembic:  # flashtune 0.1 had no version table at all
            conn.exec_driver_sql(f"DROP TABLE {VERSION_TABLE}")
        conn.exec_driver_sql("INSERT INTO ft_gpus (key, name, cc, sm_count, spec_json, first_seen) "
                             "VALUES ('g/sm_90', 'g', '9.0', 132, '{}', '2025-01-01 00:00:00')")
    engine.dispose()


def test_head_is_what_the_code_says_and_models_match(tmp_path):
    script = ScriptDirectory(str(MIGRATIONS_DIR))
    assert script.get_current_head() == HEAD_REVISION
    engine = make_engine(f"sqlite:///{tmp_path / 'new.db'}")
    revs, version, indexes = _state(tmp_path / "new.db")
    assert revs == [HEAD_REVISION] and version == SCHEMA_VERSION == 5
    assert "ix_ft_measurements_study" in indexes
    with engine.connect() as conn:  # the migrations build exactly what the ORM models describe
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []
    assert migrate(engine) == "current"


@pytest.mark.parametrize("pre_alembic", [True, False], ids=["pre-alembic", "at-0001"])
def test_older_database_upgraded_with_its_rows(tmp_path, pre_alembic):
    path = tmp_path / "old.db"
    _at_revision(path, "0001", pre_alembic=pre_alembic)
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT schema_version FROM ft_meta").fetchone()[0] == 1
        assert not c.execute("SELECT 1 FROM sqlite_master WHERE name = 'ix_ft_measurements_study'").fetchall()
    engine = make_engine(f"sqlite:///{path}")
    revs, version, indexes = _state(path)
    assert revs == [HEAD_REVISION] and version == SCHEMA_VERSION and "ix_ft_measurements_study" in indexes
    with session_factory(engine).begin() as s:  # old rows kept, and the DB takes new ones
        assert [g.key for g in queries.list_gpus(s)] == ["g/sm_90"]
        queries.record_measurement(s, H100_SXM, P, "flash_fwd_simt", PARAMS, Measurement("ok", median_ms=1, tflops=1))
    assert migrate(engine) == "current"


def test_schema_3_problems_get_their_mask_and_buckets(tmp_path):
    """0005: causal rows of older schemas were all top-left; their Nq != Nk bucket keys are recomputed
    (Nq and Nk rounded apart), square ones kept, and their measurements and bests stay."""
    path = tmp_path / "v3.db"
    _at_revision(path, "0003")
    old = [(1, 1, 512, 512, 1, "fp32/d64/causal/n512/small"), (2, 2, 100, 3000, 0, "fp32/d64/full/n4096/small")]
    with sqlite3.connect(path) as c:
        for pid, h, nq, nk, causal, bucket in old:
            key = f"B1-H{h}-N{nq if nq == nk else f'{nq}x{nk}'}-D64-fp32-{'causal' if causal else 'full'}"
            c.execute("INSERT INTO ft_problems (id, key, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, "
                      "causal, max_error, bucket_key) VALUES (?, ?, 1, ?, ?, ?, ?, 64, 'fp32', ?, 0, ?)",
                      (pid, key, h, h, nq, nk, causal, bucket))
            c.execute("INSERT INTO ft_configs (id, family, params_json) VALUES (?, 'flash_fwd_simt', ?)", (pid, f'{{"x":{pid}}}'))
            c.execute("INSERT INTO ft_measurements (id, gpu_id, problem_id, config_id, status, tflops, median_ms, "
                      "registers, spill_bytes, stack_bytes, static_smem, dynamic_smem, reps, versions_json, versions_key, "
                      "message, created_at) VALUES (?, 1, ?, ?, 'ok', 1.0, 1.0, 0, 0, 0, 0, 0, 0, '{}', 'v', '', "
                      "'2025-01-01 00:00:00')", (pid, pid, pid))
            c.execute("INSERT INTO ft_best (gpu_id, problem_id, family, config_id, measurement_id, bucket_key, tflops, "
                      "median_ms, updated_at) VALUES (1, ?, 'flash_fwd_simt', ?, ?, ?, 1.0, 1.0, '2025-01-01 00:00:00')",
                      (pid, pid, pid, bucket))
    engine = make_engine(f"sqlite:///{path}")
    assert _state(path)[:2] == ([HEAD_REVISION], SCHEMA_VERSION)
    with session_factory(engine)() as s:
        problems = {p.key: p for p in queries.list_problems(s)}
        bests = {b.problem.key: b.bucket_key for b in queries.best_rows(s)}
    square, cache = problems["B1-H1-N512-D64-fp32-causal"], problems["B1-H2-N100x3000-D64-fp32-full"]
    assert square.mask == "causal" and cache.mask == "none"
    assert bests == {square.key: "fp32/d64/causal/n512/small", cache.key: "fp32/d64/full/n128x4096/small"}
    assert bests[cache.key] == cache.bucket().key
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT COUNT(*) FROM ft_measurements").fetchone()[0] == 2
        assert c.execute("SELECT bucket_key FROM ft_problems WHERE id = 2").fetchone()[0] == "fp32/d64/full/n128x4096/small"


def test_recorded_fixture_upgrades(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "f.db")
    (tmp_path / "f.db").chmod(0o644)
    before = sqlite3.connect(tmp_path / "f.db").execute("SELECT COUNT(*) FROM ft_measurements").fetchone()[0]
    make_engine(f"sqlite:///{tmp_path / 'f.db'}", readonly=True).dispose()
    c = sqlite3.connect(tmp_path / "f.db")
    assert c.execute("SELECT COUNT(*) FROM ft_measurements").fetchone()[0] == before
    assert c.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [(HEAD_REVISION,)]
    assert c.execute("SELECT COUNT(*) FROM alembic_version").fetchone()[0] == 1  # Optuna's, untouched
    c.close()
    assert optuna.get_all_study_names(f"sqlite:///{tmp_path / 'f.db'}")  # Optuna still opens it


def test_newer_schema_version_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'n.db'}"
    make_engine(url).dispose()
    with sqlite3.connect(tmp_path / "n.db") as c:
        c.execute("UPDATE ft_meta SET schema_version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(DatabaseError, match=f"schema version {SCHEMA_VERSION + 1} was written by a newer flashtune"):
        make_engine(url)


def test_unknown_revision_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'u.db'}"
    make_engine(url).dispose()
    with sqlite3.connect(tmp_path / "u.db") as c:
        c.execute(f"UPDATE {VERSION_TABLE} SET version_num = '0099'")
    with pytest.raises(DatabaseError, match="revision '0099' was written by a newer flashtune"):
        make_engine(url)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1")
    out = subprocess.run([sys.executable, "-m", "tuner.cli", "export", "-o", str(tmp_path / "x.json"), "--db", url],
                         env=env, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "newer flashtune" in lines[0] and "Traceback" not in out.stderr
    assert not (tmp_path / "x.json").exists()


def test_optuna_first_then_ours(tmp_path):
    url = f"sqlite:///{tmp_path / 'o.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(storage=url, study_name="s").optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    make_engine(url).dispose()
    assert _state(tmp_path / "o.db")[0] == [HEAD_REVISION]
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 2
    names = set(inspect(create_engine(url)).get_table_names())
    assert {"alembic_version", VERSION_TABLE} <= names


def _open(url: str) -> str:
    engine = make_engine(url)
    with session_factory(engine).begin() as s:
        queries.upsert_gpu(s, H100_SXM)
    engine.dispose()
    return "ok"


def test_many_processes_create_one_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    with mp.get_context("spawn").Pool(4) as pool:
        assert pool.map(_open, [url] * 8) == ["ok"] * 8
    revs, version, _ = _state(tmp_path / "c.db")
    assert revs == [HEAD_REVISION] and version == SCHEMA_VERSION
    c = sqlite3.connect(tmp_path / "c.db")
    assert c.execute("SELECT COUNT(*) FROM ft_meta").fetchone()[0] == 1
    assert c.execute("SELECT COUNT(*) FROM ft_gpus").fetchone()[0] == 1


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_schema_3_gains_the_job_queue_with_its_rows_kept(tmp_path, request, backend):
    """A database of schema 3 (before the fleet) upgrades to the queue's tables in place: on
    SQLite and on a real PostgreSQL server, rows kept, and the queue takes jobs afterwards."""
    from tuner import queue

    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path / 'v3.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:
        command.upgrade(_alembic_config(conn), "0003")
    engine.dispose()
    with create_engine(url).begin() as conn:  # a measurement stored by the older flashtune, in its columns
        # (ids clear of what PostgreSQL's sequences, which explicit ids do not advance, hand out later)
        for sql in ("INSERT INTO ft_gpus (id, key, name, cc, sm_count, spec_json, first_seen) "
                    "VALUES (1000, 'g/sm_90', 'g', '9.0', 132, '{}', '2025-01-01 00:00:00')",
                    "INSERT INTO ft_problems (id, key, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, "
                    "causal, max_error, bucket_key) VALUES (1000, 'B2-H4-N512-D64-fp32-causal', 2, 4, 4, 512, 512, 64, "
                    "'fp32', true, 0, 'fp32/d64/causal/n512/small')",
                    "INSERT INTO ft_configs (id, family, params_json) VALUES (1000, 'flash_fwd_simt', '{\"x\":1}')",
                    "INSERT INTO ft_measurements (id, gpu_id, problem_id, config_id, status, tflops, median_ms, "
                    "registers, spill_bytes, stack_bytes, static_smem, dynamic_smem, reps, versions_json, versions_key, "
                    "message, created_at) VALUES (1000, 1000, 1000, 1000, 'ok', 1.0, 1.0, 0, 0, 0, 0, 0, 0, '{}', 'v', '', "
                    "'2025-01-01 00:00:00')"):
            conn.exec_driver_sql(sql)
    assert not {"ft_jobs", "ft_workers"} & set(inspect(create_engine(url)).get_table_names())
    engine = make_engine(url)
    assert {"ft_jobs", "ft_workers"} <= set(inspect(engine).get_table_names())
    sessions = session_factory(engine)
    with sessions() as s:
        assert len(queries.measurements(s)) == 1
        assert s.scalar(text("SELECT schema_version FROM ft_meta")) == SCHEMA_VERSION
    (job_id,), _ = queue.submit(sessions, [queue.JobSpec(H100_SXM.key, "flash_fwd_simt", P)])
    worker = queue.register(sessions, 0, H100_SXM.key)
    assert queue.claim(sessions, worker, H100_SXM.key).id == job_id
    with engine.connect() as conn:  # the migrations built what the models describe, on this backend too
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []
    engine.dispose()
