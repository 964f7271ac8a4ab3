"""flashtune's dashboard: what was tuned, on which GPU, why it won, and against what.

Run `tuner dashboard [--db URL]` or `streamlit run dashboard/app.py -- --db URL` (TUNER_DB is the
fallback). It only reads: every query goes through tuner.db.queries on a read-only engine, and a
missing, empty or newer database gets a page saying what to run instead of a traceback.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import streamlit as st

from tuner.dashboard import data
from tuner.dashboard.plain import md, plotly
from tuner.dashboard.roofline import ceilings_for, roof
from tuner.db.engine import masked
from tuner.peers import PEER_FAMILIES
from tuner.problem import MASK_KEYS, Problem
from tuner.search import study_name

PAGES = ("Overview", "Explore a study", "Compare", "Lookup")
KNOWN_PARAMS = ("Br", "Bc", "TM", "TN", "warps", "stages", "min_blocks", "precision")
FILTERS = (("gpu_key", "GPU"), ("family", "family"), ("dtype", "dtype"), ("head_dim", "head dim"), ("mask", "causal"))


def _params_text(params: dict) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":")) if params else "{}"


def _stop_with(state: data.DbState) -> None:
    st.title("flashtune")
    st.warning(f"**{md(state.problem)}**")
    if state.hint:
        st.markdown(f"To fix: {md(state.hint)}.")
    st.caption(f"database: {md(masked(state.url))}")
    st.stop()


def _sidebar_filters(summ: pd.DataFrame) -> pd.DataFrame:
    """Multiselects over GPU, family, dtype, head dim and mask; nothing picked means all."""
    st.sidebar.subheader("Filters")
    out = summ
    for col, label in FILTERS:
        options = sorted(summ[col].unique().tolist())
        picked = st.sidebar.multiselect(label, options, key=f"f_{col}", placeholder="all")
        if picked:
            out = out[out[col].isin(picked)]
    return out


def _best_frame(url: str, summ: pd.DataFrame) -> pd.DataFrame:
    """One row per tuned best (GPU, family, problem) left by the filters, with its SDPA peers beside it."""
    keep = set(zip(summ["gpu_key"], summ["family"], summ["problem_key"]))
    rows = []
    for b in data.best(url):
        if b.family in PEER_FAMILIES or (b.gpu_key, b.family, b.problem.key) not in keep:
            continue
        peers = {f: p.tflops for f, p in data.peers(url, b.gpu_key, b.problem.key).items() if p.tflops}
        top = max(peers.values(), default=None)
        row = {"GPU": b.gpu_key, "problem": b.problem.key, "family": b.family, "params": _params_text(b.params),
               "ms": b.median_ms, "TFLOP/s": b.tflops}
        row.update({f"{f.removeprefix('sdpa_')} TFLOP/s": peers.get(f) for f in PEER_FAMILIES if f in peers})
        row["vs best peer"] = b.tflops / top if top else None
        rows.append(row)
    return pd.DataFrame(rows)


def _formatted(best: pd.DataFrame) -> pd.DataFrame:
    """Numbers as text with sensible precision, a missing peer as a dash, and the text read from
    the database escaped: st.table renders its cells as Markdown."""
    out = best.copy()
    for col in out.columns:
        if col in ("GPU", "problem", "family", "params"):
            out[col] = out[col].map(md)
        elif col == "ms":
            out[col] = out[col].map(lambda v: f"{v:.4f}")
        elif col.endswith("TFLOP/s"):
            out[col] = out[col].map(lambda v: "-" if pd.isna(v) else f"{v:.2f}")
        elif col == "vs best peer":
            out[col] = out[col].map(lambda v: "-" if pd.isna(v) else f"{v:.2f}x")
    return out


def page_overview(url: str, summ: pd.DataFrame) -> None:
    st.header("Overview")
    studies = summ[~summ["family"].isin(PEER_FAMILIES)]
    n_studies = len(studies.groupby(["gpu_key", "family", "problem_key"]))
    best = _best_frame(url, summ)
    c = st.columns(4)
    c[0].metric("GPUs", summ["gpu_key"].nunique())
    c[1].metric("studies", n_studies)
    c[2].metric("measurements", int(summ["count"].sum()))
    c[3].metric("tuned configs", len(best))

    st.subheader("Best config per problem")
    if best.empty:
        st.info("No tuned best config matches yet: run `tuner search --gpu auto`.")
    else:
        # A static table: few rows, every value readable at once (and in the page's text).
        st.table(_formatted(best), hide_index=True)
        st.caption("Peers: the latest ok measurement of each torch SDPA backend on the same GPU and problem.")

    st.subheader("Trials by status")
    by_status = summ.pivot_table(index="family", columns="status", values="count", aggfunc="sum", fill_value=0)
    by_status["total"] = by_status.sum(axis=1)
    st.dataframe(by_status.reset_index(), hide_index=True, key="status_table")

    st.subheader("Studies per family and problem")
    per_study = studies.pivot_table(index=["gpu_key", "family", "problem_key"], columns="status", values="count",
                                    aggfunc="sum", fill_value=0)
    if not per_study.empty:
        per_study["trials"] = per_study.sum(axis=1)
        tf = studies.groupby(["gpu_key", "family", "problem_key"])["max_tflops"].max()
        per_study["best TFLOP/s"] = tf
        st.dataframe(per_study.reset_index(), hide_index=True, key="study_table")
    else:
        st.info("No tuning study matches the filters.")

    st.subheader("GPUs seen")
    gpus = data.gpus(url)
    st.dataframe(gpus[gpus["key"].isin(summ["gpu_key"].unique())], hide_index=True, key="gpu_table")


def _param_columns(df: pd.DataFrame) -> list[str]:
    present = [c for c in df.columns if c.startswith("p_")]
    known = [f"p_{k}" for k in KNOWN_PARAMS if f"p_{k}" in present]
    return known + sorted(c for c in present if c not in known)


def page_explore(url: str, summ: pd.DataFrame) -> None:
    st.header("Explore a study")
    studies = (summ[~summ["family"].isin(PEER_FAMILIES)][["gpu_key", "family", "problem_key"]]
               .drop_duplicates().sort_values(["gpu_key", "family", "problem_key"]))
    # (GPU key, family, problem key) stay three values from the database's columns: a name joined
    # with "|" is never split again (a GPU name may hold a "|")
    options = [tuple(row) for row in studies.itertuples(index=False)]
    if not options:
        st.info("No tuning study matches the filters.")
        return
    gpu_key, family, problem_key = st.selectbox("study (GPU | family | problem)", options, key="study",
                                                format_func="|".join)
    name = study_name(gpu_key, family, problem_key)
    df = data.measurements(url, gpu_key, family, problem_key)
    ok = df[df["status"] == "ok"]
    failed = df[df["status"] != "ok"]
    c = st.columns(4)
    c[0].metric("trials", len(df))
    c[1].metric("ok", len(ok))
    c[2].metric("failed", len(failed))
    c[3].metric("best TFLOP/s", f"{ok['tflops'].max():.2f}" if not ok.empty else "-")

    st.subheader("TFLOP/s against each parameter")
    params = _param_columns(df)
    if ok.empty or not params:
        st.info("No ok measurement to plot yet.")
    else:
        cols = st.columns(2)
        for i, p in enumerate(params):
            shown = ok.assign(**{p: ok[p].map(plotly), "params_key": ok["params_key"].map(plotly)})
            fig = px.box(shown, x=p, y="tflops", points="all", hover_data=["params_key", "median_ms"],
                         labels={p: plotly(p.removeprefix("p_")), "tflops": "TFLOP/s"},
                         title=plotly(p.removeprefix("p_")))
            fig.update_xaxes(type="category", categoryorder="category ascending")
            fig.update_layout(height=320, margin=dict(l=10, r=10, t=40, b=10))
            cols[i % 2].plotly_chart(fig, key=f"param_{p}")

    st.subheader("Optuna: optimization history and parameter importances")
    if not data.optuna_storage_has(url, name):
        st.info(f"No Optuna study named {md(name)} in this database (replayed or imported data).")
    else:
        try:
            history, importance, why = data.optuna_figures(url, name)
        except Exception as e:  # an Optuna storage from another Optuna version, say
            st.warning(f"Optuna could not load the study: {md(str(e).splitlines()[0] if str(e) else type(e).__name__)}")
        else:
            c1, c2 = st.columns(2)
            c1.plotly_chart(history, key="optuna_history")
            if importance is not None:
                c2.plotly_chart(importance, key="optuna_importance")
            else:
                c2.info(f"Parameter importances unavailable: {md(why)}")

    st.subheader("Failed trials")
    if failed.empty:
        st.success("No failed trial.")
    else:
        status = st.multiselect("status", sorted(failed["status"].unique()), key="failed_status", placeholder="all")
        shown = failed[failed["status"].isin(status)] if status else failed
        st.dataframe(shown[["trial_number", "status", "message", "params_key", "created_at"]],
                     hide_index=True, key="failed_table")


def _peer_long(url: str, summ: pd.DataFrame) -> pd.DataFrame:
    """Tuned best and each SDPA backend per (GPU, problem) as long rows: one bar each."""
    rows = []
    best = _best_frame(url, summ)
    for r in best.to_dict("records"):
        rows.append({"GPU": r["GPU"], "problem": r["problem"], "kernel": f"tuned {r['family']}",
                     "TFLOP/s": r["TFLOP/s"]})
        for f, p in data.peers(url, r["GPU"], r["problem"]).items():
            if p.tflops:
                rows.append({"GPU": r["GPU"], "problem": r["problem"], "kernel": f, "TFLOP/s": p.tflops})
    return pd.DataFrame(rows, columns=["GPU", "problem", "kernel", "TFLOP/s"])


def page_compare(url: str, summ: pd.DataFrame) -> None:
    st.header("Compare with torch SDPA")
    long = _peer_long(url, summ)
    if long.empty:
        st.info("Nothing tuned matches the filters yet: run `tuner search --gpu auto` (it measures the SDPA peers too).")
        return
    shown = long.assign(**{c: long[c].map(plotly) for c in ("GPU", "problem", "kernel")})
    fig = px.bar(shown, x="problem", y="TFLOP/s", color="kernel", barmode="group", facet_row="GPU"
                 if long["GPU"].nunique() > 1 else None, title="Tuned best vs each SDPA backend")
    st.plotly_chart(fig, key="compare_bars")
    st.dataframe(long.pivot_table(index=["GPU", "problem"], columns="kernel", values="TFLOP/s").reset_index(),
                 hide_index=True, key="compare_table")

    st.subheader("Roofline")
    names = dict(zip(summ["gpu_key"], summ["gpu_name"]))
    gpu_key = st.selectbox("GPU", sorted(long["GPU"].unique()), key="roof_gpu")
    pts = long[long["GPU"] == gpu_key].copy()
    problems = {p.key: p for p in _problems(summ, gpu_key)}
    pts["dtype"] = [problems[k].dtype for k in pts["problem"]]
    pts["FLOP/byte"] = [problems[k].flops() / problems[k].bytes_moved() for k in pts["problem"]]
    shown = pts.assign(**{c: pts[c].map(plotly) for c in ("kernel", "problem")})
    fig = px.scatter(shown, x="FLOP/byte", y="TFLOP/s", color="kernel", symbol="dtype", hover_data=["problem"],
                     log_x=True, log_y=True,
                     title=f"Achieved TFLOP/s vs arithmetic intensity on {plotly(names[gpu_key])}")
    c = ceilings_for(names[gpu_key])
    if c is None:
        st.info(f"Ceilings unknown for {md(names[gpu_key])}: only the measured points are shown.")
    else:
        lo, hi = max(pts["FLOP/byte"].min() / 10, 0.1), pts["FLOP/byte"].max() * 10
        ai = np.geomspace(lo, hi, 200)
        for dtype in sorted(set(pts["dtype"]) | set(c.tflops)):
            y = roof(c, dtype, ai)
            if y is not None:
                fig.add_trace(go.Scatter(x=ai, y=y, mode="lines", line=dict(dash="dash"),
                                         name=f"ceiling {dtype} ({c.tflops[dtype]:g} TFLOP/s, {c.memory_tbps:g} TB/s)"))
        missing = sorted(set(pts["dtype"]) - set(c.tflops))
        st.caption(f"Ceilings: {c.source}." + (f" No measured compute ceiling for {', '.join(missing)}." if missing else ""))
    st.plotly_chart(fig, key="roofline")


def _problems(summ: pd.DataFrame, gpu_key: str) -> list[Problem]:
    rows = summ[summ["gpu_key"] == gpu_key].drop_duplicates("problem_key")
    return [Problem(int(r.batch), int(r.heads), int(r.seqlen_q), int(r.seqlen_k), int(r.head_dim), r.dtype,
                    r.mask, int(r.kv_heads)) for r in rows.itertuples(index=False)]


def _lookup_frame(doc: dict) -> pd.DataFrame:
    cols = ["gpu_key", "dtype", "head_dim", "mask", "bucket", "family", "params", "tflops", "median_ms", "problem"]
    rows = [{**e, "params": _params_text(e["params"]), "problem": Problem.from_dict(e["problem"]).key}
            for e in doc.get("entries", [])]
    return pd.DataFrame(rows, columns=cols)


def page_lookup(url: str, summ: pd.DataFrame) -> None:
    st.header("Best-config lookup")
    st.markdown("What the dispatcher sees: one entry per (GPU, dtype, head dim, mask, shape bucket, family), "
                "fastest first in each group.")
    st.subheader("From this database (as `tuner export` would write it now)")
    doc = data.lookup(url)
    frame = _lookup_frame(doc)
    if frame.empty:
        st.info("The database holds no tuned config yet: run `tuner search --gpu auto`.")
    else:
        st.dataframe(frame, hide_index=True, key="lookup_db_table")
    path, file_doc, error = data.lookup_file()
    st.subheader("The exported file")
    st.caption(f"{md(path)} (TUNER_LOOKUP overrides)")
    if error:
        st.error(f"The lookup file cannot be used: {md(error)}")
    elif file_doc is None:
        st.info(f"No lookup file at {md(path)} yet: run {md(f'tuner export -o {path}')} (a search writes one too).")
    else:  # plain text: generated_at is whatever the file says
        st.text(f"version {file_doc['version']}, generated {file_doc.get('generated_at', '?')}, "
                f"{len(file_doc['entries'])} entries")
        st.dataframe(_lookup_frame(file_doc), hide_index=True, key="lookup_file_table")


def main() -> None:
    st.set_page_config(page_title="flashtune", layout="wide")
    url = data.resolve_url()
    state = data.check_db(url)
    if state.problem:
        _stop_with(state)
    summ = data.summaries(url)
    if summ.empty:
        _stop_with(data.DbState(url, "the database holds no measurements yet",
                                f"run `{data.SEARCH_HINT}` (with `--db {masked(url)}`) to fill it"))
    summ = summ.assign(mask=summ["mask"].map(MASK_KEYS))   # the keys' words: full, causal, causal_br
    st.sidebar.title("flashtune")
    page = st.sidebar.radio("page", PAGES, key="page")
    filtered = _sidebar_filters(summ)
    st.sidebar.caption(f"database: {md(masked(url))}; refreshed every {data.TTL_S} s")
    if filtered.empty:
        st.header(page)
        st.info("Nothing matches the filters.")
        return
    {"Overview": page_overview, "Explore a study": page_explore, "Compare": page_compare,
     "Lookup": page_lookup}[page](url, filtered)


if __name__ == "__main__":  # streamlit runs the script as __main__; a multiprocessing child that re-runs
    main()                  # the parent's main module (as __mp_main__) must not draw the page again
