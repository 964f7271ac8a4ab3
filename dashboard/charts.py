"""The dashboard's pictures, built from `frames`' tables: Plotly figures with every label read
from a database escaped (plain.plotly), numeric axes in numeric order, TFLOP/s on the y axes."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from tuner.dashboard.frames import ordered
from tuner.dashboard.plain import plotly
from tuner.dashboard.roofline import Ceilings, roof

MARGIN = dict(l=10, r=10, t=50, b=10)
FAILED = "#8c8c8c"


def versus_heatmap(rows: pd.DataFrame, title: str) -> go.Figure:
    """Problems down, peers across, tuned/peer in each cell: blue where ours is faster, red where
    the peer is, white at par (the colour scale is centred on 1.0x and saturates at 2x either way,
    so that one slow peer, SDPA's math at 60x, does not wash out the differences that matter)."""
    rows = rows.sort_values("order")
    problems = list(dict.fromkeys(rows["problem"]))
    peers = list(dict.fromkeys(rows["peer"]))
    ratio = rows.pivot(index="problem", columns="peer", values="ratio").reindex(index=problems, columns=peers)
    ours = rows.pivot(index="problem", columns="peer", values="TFLOP/s").reindex(index=problems, columns=peers)
    theirs = rows.pivot(index="problem", columns="peer", values="peer TFLOP/s").reindex(index=problems, columns=peers)
    family = rows.drop_duplicates("problem").set_index("problem")["family"].reindex(problems)
    text = ratio.map(lambda v: "" if pd.isna(v) else f"{v:.2f}x")
    hover = [[f"{plotly(p)}<br>tuned {plotly(family[p])}: {ours.at[p, c]:.1f} TFLOP/s<br>"
              f"{plotly(c)}: {theirs.at[p, c]:.1f} TFLOP/s" if not pd.isna(ratio.at[p, c]) else ""
              for c in peers] for p in problems]
    span = min(1.0, max(0.05, float(np.nanmax(np.abs(np.log2(ratio.to_numpy(dtype=float)))))))
    fig = go.Figure(go.Heatmap(
        z=np.log2(ratio.to_numpy(dtype=float)), x=[plotly(c) for c in peers], y=[plotly(p) for p in problems],
        text=text.to_numpy(), texttemplate="%{text}", hovertext=hover, hoverinfo="text",
        colorscale="RdBu", zmid=0, zmin=-span, zmax=span,
        colorbar=dict(title="tuned / peer", tickvals=[-span, 0, span],
                      ticktext=[f"{2 ** -span:.2f}x", "1x", f"{2 ** span:.2f}x" + ("+" if span == 1.0 else "")]),
    ))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(side="top", type="category")
    fig.update_layout(title=title, height=max(220, 60 + 26 * len(problems)), margin=dict(l=10, r=10, t=80, b=10))
    return fig


def tflops_by_gpu(top: pd.DataFrame) -> go.Figure:
    """The tuned best of each problem on each GPU, side by side."""
    shown = top.assign(**{c: top[c].map(plotly) for c in ("GPU", "problem", "family")})
    fig = px.bar(shown, x="problem", y="TFLOP/s", color="GPU", barmode="group", hover_data=["family"],
                 title="Tuned best per GPU")
    fig.update_layout(margin=MARGIN, yaxis_title="TFLOP/s", xaxis_title=None)
    return fig


def param_box(ok: pd.DataFrame, param: str, label: str) -> go.Figure:
    """TFLOP/s of the measured points at each value of one parameter, values in numeric order."""
    values = ordered(ok[param])
    shown = ok.assign(**{param: ok[param].map(plotly), "params_key": ok["params_key"].map(plotly)})
    fig = px.box(shown, x=param, y="tflops", points="all", hover_data=["trial", "params_key", "median_ms"],
                 labels={param: plotly(label), "tflops": "TFLOP/s"}, title=plotly(label))
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=[plotly(v) for v in values])
    fig.update_layout(height=320, margin=MARGIN)
    return fig


def history(rows: pd.DataFrame) -> go.Figure:
    """Each trial's TFLOP/s and the best so far; the points not measured (invalid, failed) in a
    lane of their own below, by status, with the reason on hover: never drawn as 0 TFLOP/s."""
    ok = rows[rows["status"] == "ok"]
    bad = rows[rows["status"] != "ok"]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.78, 0.22], vertical_spacing=0.04)
    fig.add_trace(go.Scatter(x=ok["trial"], y=ok["tflops"], mode="markers", name="measured",
                             hovertext=ok["params_key"].map(plotly), marker=dict(size=6)), row=1, col=1)
    best = ok["tflops"].cummax()
    fig.add_trace(go.Scatter(x=ok["trial"], y=best, mode="lines", line=dict(shape="hv"), name="best so far"),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=bad["trial"], y=bad["status"], mode="markers", name="not measured",
                             hovertext=bad["outcome"].map(plotly), marker=dict(symbol="x", color=FAILED, size=7)),
                  row=2, col=1)
    fig.update_yaxes(title_text="TFLOP/s", row=1, col=1)
    fig.update_yaxes(title_text="not measured", type="category", row=2, col=1)
    fig.update_xaxes(title_text="trial", row=2, col=1)
    fig.update_layout(title="Search history", height=420, margin=MARGIN, legend=dict(orientation="h", y=-0.2))
    return fig


def importance_bars(importance: dict[str, float]) -> go.Figure:
    names = list(importance)[::-1]  # largest on top
    fig = go.Figure(go.Bar(x=[importance[n] for n in names], y=[plotly(n) for n in names], orientation="h"))
    fig.update_layout(title="Parameter importances (measured points only)", height=320, margin=MARGIN,
                      xaxis_title="importance (PED-ANOVA)")
    return fig


def not_measured_bars(bad: pd.DataFrame) -> go.Figure:
    """How many points were not measured, by status and reason."""
    counts = bad.groupby(["status", "outcome"]).size().reset_index(name="points")
    counts = counts.assign(outcome=counts["outcome"].map(plotly), status=counts["status"].map(plotly))
    fig = px.bar(counts, x="points", y="outcome", color="status", orientation="h", title="Why points were not measured")
    fig.update_layout(height=max(200, 80 + 28 * len(counts)), margin=MARGIN, yaxis_title=None)
    return fig


def log_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Powers of ten covering [lo, hi], labelled as plain numbers (0.1, 1, 10, 100, 1000)."""
    vals = [10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]
    return vals, [f"{v:g}" for v in vals]


def roofline(pts: pd.DataFrame, ceilings: Ceilings | None, title: str) -> go.Figure:
    """Achieved TFLOP/s against arithmetic intensity, log-log, with the ceiling of each dtype the
    points ran in (none drawn for a dtype no point ran in)."""
    shown = pts.assign(**{c: pts[c].map(plotly) for c in ("kernel", "problem")})
    fig = px.scatter(shown, x="FLOP/byte", y="TFLOP/s", color="kernel", symbol="dtype", hover_data=["problem"],
                     log_x=True, log_y=True, title=title)
    lo, hi = max(pts["FLOP/byte"].min() / 10, 0.1), pts["FLOP/byte"].max() * 10
    ys = list(pts["TFLOP/s"])
    if ceilings is not None:
        ai = np.geomspace(lo, hi, 200)
        for dtype in sorted(set(pts["dtype"]) & set(ceilings.tflops)):
            y = roof(ceilings, dtype, ai)
            assert y is not None
            ys.append(float(y.max()))
            fig.add_trace(go.Scatter(x=ai, y=y, mode="lines", line=dict(dash="dash"), name=(
                f"ceiling {dtype} ({ceilings.tflops[dtype]:g} TFLOP/s, {ceilings.memory_tbps:g} TB/s)")))
    xt, xl = log_ticks(lo, hi)
    yt, yl = log_ticks(min(ys) / 2, max(ys) * 2)
    fig.update_xaxes(tickvals=xt, ticktext=xl, title="arithmetic intensity (FLOP/byte)")
    fig.update_yaxes(tickvals=yt, ticktext=yl, title="TFLOP/s")
    fig.update_layout(margin=MARGIN)
    return fig


def trials_per_minute(recent: pd.DataFrame, minutes: int) -> go.Figure:
    """Trials stored per minute over the window, stacked by study."""
    per = (recent.assign(minute=recent["created_at"].dt.floor("min"), study=recent["label"].map(plotly))
           .groupby(["minute", "study"]).size().reset_index(name="trials"))
    fig = px.bar(per, x="minute", y="trials", color="study", title=f"Trials per minute, last {minutes} min")
    fig.update_layout(margin=MARGIN, height=320, xaxis_title=None, yaxis_title="trials / min",
                      legend=dict(orientation="h", y=-0.25))
    return fig
