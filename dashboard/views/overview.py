"""Overview: where flashtune stands on this database, in one picture per GPU (the tuned best
against each peer measured beside it, grid and model shapes), where GPUs' winners differ, and the
counts behind it."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from tuner.dashboard import charts, data, frames, nav
from tuner.dashboard.plain import md
from tuner.peers import PEER_FAMILIES

KINDS = {"grid": "standard grid (docs/benchmarks.md)", "model": "model and other shapes"}


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


def _standing(vs: pd.DataFrame) -> None:
    st.subheader("Tuned best against each peer")
    if vs.empty:
        st.info("No tuned best has a peer measured beside it yet: `tuner bench --gpu auto` measures them.")
        return
    for gpu in sorted(vs["GPU"].unique()):
        rows = vs[vs["GPU"] == gpu]
        wins = rows.groupby("problem")["ratio"].min()
        st.markdown(f"**{md(gpu)}**: at or above every peer on {int((wins >= 1).sum())} of {len(wins)} shapes")
        kinds = [k for k in KINDS if k in set(rows["kind"])]
        for col, kind in zip(st.columns(len(KINDS)), kinds):  # one width for every heatmap
            fig = charts.versus_heatmap(rows[rows["kind"] == kind], KINDS[kind])
            col.plotly_chart(fig, key=f"versus_{gpu}_{kind}")
    st.caption("Each cell: the fastest tuned family's TFLOP/s over the peer's, the latest ok measurement of each on "
               "the same GPU and problem (SDPA runs fp8 problems on bf16 copies). Hover for the figures.")


def _across_gpus(best: pd.DataFrame) -> None:
    wide = frames.winners_across_gpus(best)
    if wide.empty:
        return
    st.subheader("Across GPUs")
    n = int(wide["winners differ"].sum())
    st.markdown(f"{n} of {len(wide)} shapes tuned on more than one GPU have a different winner on each.")
    top = frames.fastest(best)
    st.plotly_chart(charts.tflops_by_gpu(top[top["problem"].isin(wide["problem"])]), key="across_gpus")
    st.dataframe(wide, hide_index=True, key="winners_table")


def _counts(url: str, summ: pd.DataFrame, best: pd.DataFrame) -> None:
    st.subheader("Best config per problem")
    if best.empty:
        st.info("No tuned best config matches yet: run `tuner search --gpu auto`.")
    else:
        st.table(_formatted(best), hide_index=True)  # few rows, every value readable at once
        st.caption("Peers: the latest ok measurement of each peer on the same GPU and problem.")
    studies = summ[~summ["family"].isin(PEER_FAMILIES)]
    with st.expander("Trials by status, studies, GPUs"):
        by_status = summ.pivot_table(index="family", columns="status", values="count", aggfunc="sum", fill_value=0)
        by_status["total"] = by_status.sum(axis=1)
        st.dataframe(by_status.reset_index(), hide_index=True, key="status_table")
        per_study = studies.pivot_table(index=["gpu_key", "family", "problem_key"], columns="status", values="count",
                                        aggfunc="sum", fill_value=0)
        if per_study.empty:
            st.info("No tuning study matches the filters.")
        else:
            per_study["trials"] = per_study.sum(axis=1)
            per_study["best TFLOP/s"] = studies.groupby(["gpu_key", "family", "problem_key"])["max_tflops"].max()
            per_study = per_study.reset_index()
            per_study["explore"] = [nav.study_link(s) for s in zip(per_study["gpu_key"], per_study["family"],
                                                                   per_study["problem_key"])]
            st.dataframe(per_study, hide_index=True, key="study_table", column_config={
                "explore": st.column_config.LinkColumn("explore", display_text="open")})
        gpus = data.gpus(url)
        st.dataframe(gpus[gpus["key"].isin(summ["gpu_key"].unique())], hide_index=True, key="gpu_table")


def render(ctx: nav.Ctx) -> None:
    st.header("Overview")
    summ = ctx.summ
    best = frames.best_frame(ctx.url, summ)
    c = st.columns(4)
    c[0].metric("GPUs", summ["gpu_key"].nunique())
    c[1].metric("studies", len(summ[~summ["family"].isin(PEER_FAMILIES)].groupby(["gpu_key", "family", "problem_key"])))
    c[2].metric("measurements", int(summ["count"].sum()))
    c[3].metric("tuned configs", len(best))
    _standing(frames.versus(best, summ))
    _across_gpus(best)
    _counts(ctx.url, summ, best)


if __name__ == "__main__":
    render(nav.current())
