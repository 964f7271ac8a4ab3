"""The dashboard's data access: which database, whether it is usable, and cached loaders.

Everything goes through `tuner.db.queries` (the module the CLI uses) on a read-only engine
(tuner.db.engine.open_readonly): the dashboard never creates, migrates or writes a database.
Loaders are wrapped in `st.cache_data` with a TTL so a rerun (every widget click) costs nothing
while a search that is still writing shows up within a minute.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import SQLAlchemyError

from tuner.db import queries
from tuner.db.engine import (DatabaseError, default_url, masked, open_readonly,
                             session_factory, sqlite_path)
from tuner.export import build_lookup, default_lookup_path, read_lookup

TTL_S = 60
LIVE_TTL_S = 5  # the live page refreshes every LIVE_TTL_S seconds and reads that fresh
SUMMARY_COLUMNS = ["gpu_key", "gpu_name", "family", "problem_key", "bucket_key", "batch", "heads", "kv_heads",
                   "seqlen_q", "seqlen_k", "head_dim", "dtype", "causal", "mask", "status", "count", "max_tflops", "last_at"]
SEARCH_HINT = "tuner search --gpu auto"


def resolve_url(argv: list[str] | None = None) -> str:
    """`--db URL` after `streamlit run app.py --` wins, then TUNER_DB, then the per-user default.

    Unknown arguments are ignored: under AppTest sys.argv is pytest's.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--db")
    known, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return known.db or default_url()


@dataclass(frozen=True)
class DbState:
    """Why the database cannot be shown (`problem` set, with `hint` saying what to run), or None."""

    url: str
    problem: str | None = None
    hint: str | None = None


def check_db(url: str) -> DbState:
    """Whether `url` can be shown, and if not what to run: the database is opened read-only
    (tuner.db.engine.open_readonly), which never creates, migrates or writes it."""
    try:
        path = sqlite_path(url)
    except ValueError:
        return DbState(url, f"malformed database URL {masked(url)!r}", "pass e.g. `--db sqlite:////path/to/flashtune.db`")
    if path is not None and not path.exists():
        return DbState(url, f"no database yet at {path}", f"run `{SEARCH_HINT}` to create and fill it")
    try:
        engine(url)
    except DatabaseError as e:
        hint = {
            "foreign": f"run `{SEARCH_HINT}` with `--db` pointing at it, or pass another with `--db URL`",
            "older": f"upgrade it in place with `tuner migrate --db {masked(url)}`, then reload this page",
            "newer": "upgrade flashtune (`pip install -U flashtune`) to browse it",
        }.get(e.kind, "pass a working URL with `--db URL` or TUNER_DB")
        return DbState(url, str(e), hint)
    except (ValueError, SQLAlchemyError) as e:
        return DbState(url, str(e).splitlines()[0], "pass a working URL with `--db URL` or TUNER_DB")
    return DbState(url)


FLEET_GRACE_S = 70  # tuner.fleet.WorkerOptions().lost_after_s: a worker silent this long shows as lost


@st.cache_resource(show_spinner=False)
def engine(url: str) -> Engine:
    """One read-only engine per URL for the server's lifetime (a pool, not a connection per rerun)."""
    return open_readonly(url)


def _session(url: str):
    return session_factory(engine(url))()


@st.cache_data(ttl=TTL_S, show_spinner=False)
def summaries(url: str) -> pd.DataFrame:
    """Counts per (GPU, family, problem, status): SQL-side aggregation, cheap on 100k rows."""
    with _session(url) as s:
        return pd.DataFrame(queries.study_summaries(s), columns=SUMMARY_COLUMNS)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def fleet(url: str) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """The workers and the job queue (`tuner status` as tables): empty where no worker ever ran."""
    from tuner import queue

    with _session(url) as s:
        st_ = queue.status(s, grace_s=FLEET_GRACE_S)
    workers = pd.DataFrame([{"worker": w.id, "host": w.host, "pid": w.pid, "gpu": w.gpu_index, "GPU model": w.gpu_key,
                             "state": w.state, "last beat s": round(w.silent_s), "job": w.job_id,
                             "jobs done": w.jobs_done, "trials": w.trials_done} for w in st_.workers])
    jobs = pd.DataFrame([{"GPU model": k, **v} for k, v in st_.jobs.items()])
    notes = [f"{len(st_.alive)} worker(s) alive, {st_.trials_per_minute():.1f} trials/min"]
    notes += [f"queued jobs for {k} wait: {why}" for k, why in st_.waiting.items()]
    return workers, jobs, notes


@st.cache_data(ttl=TTL_S, show_spinner=False)
def gpus(url: str) -> pd.DataFrame:
    with _session(url) as s:
        rows = queries.list_gpus(s)
    return pd.DataFrame(
        [{"key": g.key, "name": g.name, "cc": g.cc, "SMs": g.sm_count,
          "memory GiB": round(g.spec.get("memory_bytes", 0) / 2**30), "first seen": g.first_seen} for g in rows],
        columns=["key", "name", "cc", "SMs", "memory GiB", "first seen"],
    )


@st.cache_data(ttl=TTL_S, show_spinner=False)
def best(url: str) -> list[queries.BestEntry]:
    with _session(url) as s:
        return queries.best_rows(s)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def peers(url: str, gpu_key: str, problem_key: str) -> dict[str, queries.PeerSummary]:
    with _session(url) as s:
        return queries.peer_rows(s, gpu_key, problem_key)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def measurements(url: str, gpu_key: str, family: str, problem_key: str) -> pd.DataFrame:
    """One study's rows (each param also as p_<name>), one DataFrame away from queries.measurements."""
    with _session(url) as s:
        rows = queries.measurements(s, gpu_key, family, problem_key)
    df = pd.DataFrame(rows)
    if not df.empty:
        df = df.drop(columns=["params"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def lookup(url: str) -> dict[str, Any]:
    """The lookup as `tuner export` would write it now (not the file: that may be older)."""
    return build_lookup(best(url))


def lookup_file() -> tuple[Path, dict[str, Any] | None, str | None]:
    """The exported lookup file the dispatcher reads: (path, document or None, error or None)."""
    path = default_lookup_path()
    if not path.exists():
        return path, None, None
    try:
        return path, read_lookup(path), None
    except ValueError as e:
        return path, None, str(e)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def recent_trials(url: str, minutes: int) -> pd.DataFrame:
    """Search trials stored in the last `minutes` (for the live page: a short TTL)."""
    since = datetime.now(timezone.utc) - timedelta(minutes=minutes)
    with _session(url) as s:
        rows = queries.recent_trials(s, since)
    cols = ["study_name", "gpu_key", "family", "problem_key", "trial_number", "status", "tflops", "created_at"]
    return pd.DataFrame(rows, columns=cols)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def live_summaries(url: str) -> pd.DataFrame:
    """summaries() with the live page's short TTL."""
    with _session(url) as s:
        return pd.DataFrame(queries.study_summaries(s), columns=SUMMARY_COLUMNS)


def _tables(url: str) -> set[str]:
    return set(inspect(engine(url)).get_table_names())


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def running_trials(url: str) -> dict[str, int]:
    """Trials Optuna holds as RUNNING, per study name ({} where the database has no Optuna tables).
    A search killed without a word leaves one until the next search of its study fails it."""
    try:
        if not {"studies", "trials"} <= _tables(url):
            return {}
        with engine(url).connect() as c:
            rows = c.execute(text("SELECT s.study_name, COUNT(*) FROM trials t"
                                  " JOIN studies s ON s.study_id = t.study_id"
                                  " WHERE t.state = 'RUNNING' GROUP BY s.study_name"))
            return {name: n for name, n in rows}
    except (DatabaseError, SQLAlchemyError):
        return {}
