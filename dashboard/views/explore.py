"""Explore a study: its search history, TFLOP/s against each parameter (numeric order), the
importances where they mean something, why points were not measured, and every trial with its
config and compile resources, each one a link (the study and trial ride in the query string)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from tuner.dashboard import charts, data, frames, nav
from tuner.dashboard.importance import importances
from tuner.dashboard.plain import md
from tuner.peers import PEER_FAMILIES

KNOWN_PARAMS = ("Br", "Bc", "TM", "TN", "warps", "stages", "cwg", "split", "min_blocks", "precision")
TRIAL_COLUMNS = ["link", "trial", "outcome", "tflops", "median_ms", "registers", "spill_bytes", "static_smem",
                 "dynamic_smem", "params_key", "created_at"]


def _param_columns(df: pd.DataFrame) -> list[str]:
    present = [c for c in df.columns if c.startswith("p_")]
    known = [f"p_{k}" for k in KNOWN_PARAMS if f"p_{k}" in present]
    return known + sorted(c for c in present if c not in known)


def _pick_study(summ: pd.DataFrame) -> nav.Study | None:
    """The study the URL names, else the one with the most measured points (never an empty one
    while another has any); the pick goes back into the URL."""
    tuned = summ[~summ["family"].isin(PEER_FAMILIES)]
    ok = tuned["count"].where(tuned["status"] == "ok", 0)
    per = tuned.assign(ok=ok).groupby(["gpu_key", "family", "problem_key"])["ok"].sum()
    options: list[nav.Study] = sorted(per.index)  # three values from the database's columns, never re-split
    if not options:
        st.info("No tuning study matches the filters.")
        return None
    asked = nav.study_from_query()
    if asked is not None and asked not in options:
        st.info(f"The study in the link, {md('|'.join(asked))}, is not in this database or not within the filters.")
    default = asked if asked in options else max(options, key=lambda s: (per[s], s))
    study = st.selectbox("study (GPU | family | problem)", options, index=options.index(default), key="study",
                         format_func="|".join)
    nav.put_study_in_query(study)
    return study


def _trial_detail(rows: pd.DataFrame) -> None:
    """The trial the link names (`m`, its measurement id): config, outcome, compile resources."""
    asked = st.query_params.get("m")
    picked = rows[rows["id"].astype(str) == asked] if asked else rows.iloc[:0]
    if picked.empty:
        return
    r = picked.iloc[0]
    st.subheader(f"Trial {int(r['trial'])}")
    c = st.columns(5)
    c[0].metric("status", str(r["status"]))
    c[1].metric("TFLOP/s", "-" if pd.isna(r["tflops"]) else f"{r['tflops']:.2f}")
    c[2].metric("registers", int(r["registers"]))
    c[3].metric("spill bytes", int(r["spill_bytes"]))
    c[4].metric("shared memory", f"{int(r['static_smem']) + int(r['dynamic_smem'])} B")
    st.text(f"config: {r['params_key']}")  # plain text: read from the database
    if r["message"]:
        st.text(f"message: {r['message']}")


def _params_and_importance(ok: pd.DataFrame, params: list[str]) -> None:
    st.subheader("TFLOP/s against each parameter")
    if ok.empty or not params:
        st.info("No measured point to plot yet.")
        return
    cols = st.columns(2)
    for i, p in enumerate(params):
        cols[i % 2].plotly_chart(charts.param_box(ok, p, p.removeprefix("p_")), key=f"param_{p}")
    st.subheader("Parameter importances")
    imp, why = importances(ok, params)
    if imp is None:
        st.info(f"Not drawn: {md(why)}.")
    else:
        st.plotly_chart(charts.importance_bars(imp), key="importance")


def _trials_table(rows: pd.DataFrame, study: nav.Study) -> None:
    st.subheader("Every trial")
    status = st.multiselect("status", sorted(rows["status"].unique()), key="trial_status", placeholder="all")
    shown = rows[rows["status"].isin(status)] if status else rows
    shown = shown.assign(link=[nav.study_link(study, m=i) for i in shown["id"]])
    st.dataframe(shown[TRIAL_COLUMNS], hide_index=True, key="trials_table", column_config={
        "link": st.column_config.LinkColumn("trial", display_text=r"open"),
        "tflops": st.column_config.NumberColumn("TFLOP/s", format="%.2f"),
        "median_ms": st.column_config.NumberColumn("ms", format="%.4f"),
        "params_key": "config"})


def render(ctx: nav.Ctx) -> None:
    st.header("Explore a study")
    study = _pick_study(ctx.summ)
    if study is None:
        return
    rows = frames.trials(data.measurements(ctx.url, *study))
    ok, bad = rows[rows["status"] == "ok"], rows[rows["status"] != "ok"]
    c = st.columns(4)
    c[0].metric("trials", len(rows))
    c[1].metric("ok", len(ok))
    c[2].metric("not measured", len(bad))
    c[3].metric("best TFLOP/s", f"{ok['tflops'].max():.2f}" if not ok.empty else "-")
    _trial_detail(rows)
    st.plotly_chart(charts.history(rows), key="history")
    _params_and_importance(ok, _param_columns(rows))
    if bad.empty:
        st.success("Every point was measured.")
    else:
        st.plotly_chart(charts.not_measured_bars(bad), key="not_measured")
    _trials_table(rows, study)


if __name__ == "__main__":
    render(nav.current())
