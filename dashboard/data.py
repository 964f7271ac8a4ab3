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
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from tuner.db import queries
from tuner.db.engine import (DatabaseError, default_url, masked, open_readonly,
                             readonly_sqlite_kwargs, session_factory, sqlite_path)
from tuner.export import build_lookup, default_lookup_path, read_lookup

TTL_S = 60
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
        rows = queries.study_summaries(s)
    cols = ["gpu_key", "gpu_name", "family", "problem_key", "bucket_key", "batch", "heads", "kv_heads",
            "seqlen_q", "seqlen_k", "head_dim", "dtype", "causal", "mask", "status", "count", "max_tflops", "last_at"]
    return pd.DataFrame(rows, columns=cols)


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


def optuna_storage_has(url: str, study_name: str) -> bool:
    """True if Optuna's tables hold `study_name`; checked first so load_study never creates tables."""
    from sqlalchemy import inspect, text

    try:
        eng = engine(url)
        if "studies" not in inspect(eng).get_table_names():
            return False
        with eng.connect() as c:
            return c.execute(text("SELECT 1 FROM studies WHERE study_name = :n"), {"n": study_name}).first() is not None
    except (DatabaseError, SQLAlchemyError):
        return False


@st.cache_data(ttl=TTL_S, show_spinner=False)
def optuna_figures(url: str, study_name: str) -> tuple[Any, Any, str | None]:
    """Optuna's optimization history and parameter importances (None where they cannot be drawn)."""
    import optuna
    from optuna.importance import PedAnovaImportanceEvaluator
    from optuna.visualization import plot_optimization_history, plot_param_importances

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = sqlite_path(url)  # read-only: no table creation, no version stamp, no journal-mode change
    storage = optuna.storages.RDBStorage("sqlite://" if path else url, skip_table_creation=True,
                                         skip_compatibility_check=True,
                                         engine_kwargs=readonly_sqlite_kwargs(path) if path else {})
    study = optuna.load_study(study_name=study_name, storage=storage)
    history = plot_optimization_history(study)
    try:  # PED-ANOVA needs no scikit-learn (fANOVA, Optuna's default, does)
        importance = plot_param_importances(study, evaluator=PedAnovaImportanceEvaluator())
        why = None
    except (ValueError, RuntimeError, ImportError) as e:
        importance, why = None, str(e).splitlines()[0] if str(e) else type(e).__name__
    return history, importance, why
