"""Compare: the tuned best beside each peer per problem, and a roofline against the card's measured
ceilings for the dtype each kernel ran in."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import streamlit as st

from tuner.dashboard import charts, data, frames, nav
from tuner.dashboard.plain import md, plotly
from tuner.dashboard.roofline import ceilings_for
from tuner.kernel_templates import times_a_length_mix


def _long(url: str, best: pd.DataFrame) -> pd.DataFrame:
    """Tuned best and each peer per (GPU, problem) as long rows: one bar each."""
    rows = []
    for r in best.to_dict("records"):
        rows.append({"GPU": r["GPU"], "problem": r["problem"], "family": r["family"],
                     "kernel": f"tuned {r['family']}", "TFLOP/s": r["TFLOP/s"]})
        if times_a_length_mix(r["family"]):   # timed on a packed mix: the padded problem's peers are no match
            continue
        for f, p in data.peers(url, r["GPU"], r["problem"]).items():
            if p.tflops:
                rows.append({"GPU": r["GPU"], "problem": r["problem"], "family": f, "kernel": f, "TFLOP/s": p.tflops})
    return pd.DataFrame(rows, columns=["GPU", "problem", "family", "kernel", "TFLOP/s"]).drop_duplicates()


def render(ctx: nav.Ctx) -> None:
    st.header("Compare with the peers")
    long = _long(ctx.url, frames.best_frame(ctx.url, ctx.summ))
    if long.empty:
        st.info("Nothing tuned matches the filters yet: run `tuner search --gpu auto` "
                "(it measures the SDPA peers too).")
        return
    shown = long.assign(**{c: long[c].map(plotly) for c in ("GPU", "problem", "kernel")})
    fig = px.bar(shown, x="problem", y="TFLOP/s", color="kernel", barmode="group",
                 facet_row="GPU" if long["GPU"].nunique() > 1 else None, title="Tuned best vs each peer")
    st.plotly_chart(fig, key="compare_bars")
    st.dataframe(long.pivot_table(index=["GPU", "problem"], columns="kernel", values="TFLOP/s").reset_index(),
                 hide_index=True, key="compare_table")

    st.subheader("Roofline")
    names = dict(zip(ctx.summ["gpu_key"], ctx.summ["gpu_name"]))
    gpu_key = st.selectbox("GPU", sorted(long["GPU"].unique()), key="roof_gpu")
    pts = frames.roofline_points(frames.dense(long[long["GPU"] == gpu_key]), frames.problems(ctx.summ, gpu_key))
    c = ceilings_for(names[gpu_key])
    title = f"Achieved TFLOP/s vs arithmetic intensity on {plotly(names[gpu_key])}"
    if c is None:
        st.info(f"Ceilings unknown for {md(names[gpu_key])}: only the measured points are shown.")
    else:
        missing = sorted(set(pts["dtype"]) - set(c.tflops))
        st.caption(f"Ceilings: {c.source}. Each point against the ceiling of the dtype it ran in."
                   + (f" No measured compute ceiling for {', '.join(missing)}." if missing else ""))
    st.plotly_chart(charts.roofline(pts, c, title), key="roofline")


if __name__ == "__main__":
    render(nav.current())
