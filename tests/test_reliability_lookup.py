"""Nothing lost: the best-config lookup and the results database through the CLI, as a clumsy user
would drive it. A replay or a search of another database leaves the default lookup alone, reading
commands never create a database, a lookup is replaced only by one that serves at least as much
(or merged into, or with --force), and no file that is not a lookup is ever overwritten. Where
nothing should change, files are compared byte for byte."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from test_reliability_input import one_line

from tuner.db import queries
from tuner.db.engine import make_engine, session_factory
from tuner.db.queries import BestEntry
from tuner.export import build_lookup, read_lookup, write_lookup
from tuner.gpu import A100_SXM, H100_SXM
from tuner.problem import Problem
from tuner.records import Measurement

FIXTURE = Path(__file__).parent / "fixtures" / "h100_simt.db"
SHAPE = "2,4,512,64,causal"
P = Problem(2, 4, 512, 512, 64, "fp32", True)
PARAMS = dict(Br=64, Bc=64, TM=4, TN=4, stages=1, min_blocks=1)


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The CLI with the user's defaults (TUNER_DB, TUNER_LOOKUP) inside tmp_path."""
    full = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1", COLUMNS="200",
                TUNER_DB=f"sqlite:///{tmp_path / 'default.db'}", TUNER_LOOKUP=str(tmp_path / "best.json"),
                XDG_CACHE_HOME=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], env=full, capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def recording(tmp_path) -> Path:
    dst = tmp_path / "recording.db"
    shutil.copy(FIXTURE, dst)
    dst.chmod(0o644)
    return dst


@pytest.fixture
def good_lookup(tmp_path) -> Path:
    """The user's real lookup (the default one): an A100 and an H100 entry no replay measured."""
    other = Problem(8, 12, 1024, 1024, 64, "fp32", True)
    path = tmp_path / "best.json"
    write_lookup(build_lookup([BestEntry(A100_SXM.key, "flash_fwd_simt", other, other.bucket().key, PARAMS, 9.0, 2.0, 1),
                               BestEntry(H100_SXM.key, "flash_fwd_simt", other, other.bucket().key, PARAMS, 20.0, 1.0, 2)]),
                 path)
    return path


def _slots(path: Path) -> set[tuple[str, str, str]]:
    return {(e["gpu_key"], e["bucket"], e["family"]) for e in read_lookup(path)["entries"]}


# ---- search ----

def test_the_readme_replay_leaves_the_default_lookup_alone(tmp_path, recording, good_lookup):
    before = digest(good_lookup)
    out = run(tmp_path, "search", "--replay", str(recording), "--shape", SHAPE, "--db", f"sqlite:///{tmp_path / 'try.db'}",
              "--trials", "5", "--no-peers")
    assert out.returncode == 0, out.stderr
    assert digest(good_lookup) == before
    assert "best-config lookup not changed (a replay)" in out.stdout and "--lookup" in out.stdout


def test_a_search_with_lookup_merges_into_it(tmp_path, recording, good_lookup):
    before = _slots(good_lookup)
    out = run(tmp_path, "search", "--replay", str(recording), "--shape", SHAPE, "--db", f"sqlite:///{tmp_path / 'try.db'}",
              "--trials", "5", "--no-peers", "--lookup", str(good_lookup))
    assert out.returncode == 0, out.stderr
    after = _slots(good_lookup)
    assert before < after and (H100_SXM.key, P.bucket().key, "flash_fwd_simt") in after - before
    assert "1 entries written to" in out.stdout and "3 in all" in out.stdout


def test_which_lookup_a_search_writes(tmp_path, monkeypatch):
    from tuner.cli import _search_lookup

    monkeypatch.setenv("TUNER_DB", f"sqlite:///{tmp_path / 'default.db'}")
    monkeypatch.setenv("TUNER_LOOKUP", str(tmp_path / "best.json"))
    default = f"sqlite:///{tmp_path / 'default.db'}"
    assert _search_lookup(None, None, None, default) == tmp_path / "best.json"
    assert _search_lookup(None, default, None, default) == tmp_path / "best.json"  # --db spelled out
    assert _search_lookup(None, "sqlite:///other.db", None, "sqlite:///other.db") is None
    assert _search_lookup(None, None, "rec.db", default) is None  # a replay
    assert _search_lookup(tmp_path / "mine.json", "sqlite:///other.db", "rec.db", "sqlite:///other.db") == \
        tmp_path / "mine.json"


@pytest.mark.parametrize("target", ["the-db", "another-db", "foreign-json"])
def test_a_search_refuses_a_lookup_that_is_not_one_before_any_trial(tmp_path, recording, target):
    db = tmp_path / "results.db"
    shutil.copy(recording, db)
    paths = {"the-db": db, "another-db": recording, "foreign-json": tmp_path / "package.json"}
    (tmp_path / "package.json").write_text('{"name": "web"}')
    before = {p: digest(p) for p in paths.values()}
    out = run(tmp_path, "search", "--replay", str(recording), "--shape", SHAPE, "--db", f"sqlite:///{db}",
              "--trials", "5", "--no-peers", "--lookup", str(paths[target]))
    one_line(out, str(paths[target].name))
    assert out.returncode == 2 and out.stdout == ""
    assert {p: digest(p) for p in paths.values()} == before


# ---- export ----

def _db_with(tmp_path: Path, name: str, gpu=H100_SXM) -> str:
    url = f"sqlite:///{tmp_path / name}"
    with session_factory(make_engine(url)).begin() as s:
        queries.record_measurement(s, gpu, P, "flash_fwd_simt", PARAMS, Measurement("ok", median_ms=1.0, tflops=5.0))
        queries.update_best(s, gpu.key, P.key, "flash_fwd_simt")
    return url


@pytest.mark.parametrize("args,words", [
    (("--db", "sqlite:///{tmp}/reslts.db"), ("no database at", "reslts.db", "never create")),
    (("--db", "sqlite:///{tmp}/results.db", "--gpu-key", "NVIDIA-H100"), ("has no GPU 'NVIDIA-H100'",)),
], ids=["mistyped-db", "mistyped-gpu-key"])
def test_export_mistyped_creates_nothing_and_keeps_the_lookup(tmp_path, good_lookup, args, words):
    _db_with(tmp_path, "results.db")
    before = digest(good_lookup)
    listing = sorted(p.name for p in tmp_path.iterdir())
    out = run(tmp_path, "export", "-o", str(good_lookup), *(a.format(tmp=tmp_path) for a in args))
    one_line(out, *words)
    assert out.returncode == 2 and digest(good_lookup) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no database created


def test_export_of_less_is_refused_then_merged_or_forced(tmp_path, good_lookup):
    url = _db_with(tmp_path, "results.db")
    before = digest(good_lookup)
    out = run(tmp_path, "export", "-o", str(good_lookup), "--db", url)
    one_line(out, "holds 2 entries the new lookup lacks", "--merge", "--force")
    assert digest(good_lookup) == before
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    make_engine(empty).dispose()
    out = run(tmp_path, "export", "-o", str(good_lookup), "--db", empty)  # 0 entries over a good lookup
    one_line(out, "holds 2 entries the new lookup lacks")
    assert digest(good_lookup) == before

    old = _slots(good_lookup)
    out = run(tmp_path, "export", "-o", str(good_lookup), "--db", url, "--merge")
    assert out.returncode == 0 and _slots(good_lookup) == old | {(H100_SXM.key, P.bucket().key, "flash_fwd_simt")}
    out = run(tmp_path, "export", "-o", str(good_lookup), "--db", url, "--force")
    assert out.returncode == 0 and _slots(good_lookup) == {(H100_SXM.key, P.bucket().key, "flash_fwd_simt")}


@pytest.mark.parametrize("flag", [[], ["--force"], ["--merge"]], ids=["plain", "force", "merge"])
def test_export_never_overwrites_the_database(tmp_path, flag):
    url = _db_with(tmp_path, "results.db")
    db = tmp_path / "results.db"
    before = digest(db)
    out = run(tmp_path, "export", "-o", str(db), "--db", url, *flag)
    one_line(out, "results.db is a SQLite database, not a best-config lookup")
    assert digest(db) == before


def test_export_reads_without_writing(tmp_path, recording):
    """A rollback-journal database stays one: export opens it read-only (no WAL switch, no
    migration, no side files), and its bytes do not change."""
    before = digest(recording)
    out = run(tmp_path, "export", "-o", str(tmp_path / "x.json"), "--db", f"sqlite:///{recording}")
    assert out.returncode == 0, out.stderr
    assert read_lookup(tmp_path / "x.json")["entries"]
    assert digest(recording) == before
    assert not list(tmp_path.glob("recording.db-*"))
    with sqlite3.connect(recording) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
