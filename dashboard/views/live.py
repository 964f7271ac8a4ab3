"""Live: a running search as it goes, refreshed every few seconds: per study its trials, trials
per minute over a recent window, best so far and whether a trial is in flight; and the fleet of
workers and jobs where the database has a job queue's tables."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pandas as pd
import streamlit as st

from tuner.dashboard import charts, data, nav
from tuner.peers import PEER_FAMILIES
from tuner.search import study_name

WINDOWS = (15, 60, 240)  # minutes
ACTIVE = timedelta(minutes=2)  # a study that stored a trial this recently counts as running


def progress(summ: pd.DataFrame, recent: pd.DataFrame, running: dict[str, int], minutes: int,
             now: datetime) -> pd.DataFrame:
    """One row per study: trials stored, measured, in the window and per minute over it, best
    TFLOP/s so far, trials in flight (Optuna RUNNING), the last trial's time; active ones first."""
    tuned = summ[~summ["family"].isin(PEER_FAMILIES)]
    keys = ["gpu_key", "family", "problem_key"]
    per = tuned.groupby(keys).agg(trials=("count", "sum"), last=("last_at", "max"))
    ok = tuned[tuned["status"] == "ok"].groupby(keys).agg(measured=("count", "sum"), best=("max_tflops", "max"))
    per = per.join(ok).fillna({"measured": 0}).reset_index()
    in_window = recent.groupby(keys).size()
    per["in window"] = [int(in_window.get(tuple(k), 0)) for k in per[keys].itertuples(index=False)]
    per["trials / min"] = per["in window"] / minutes
    per["in flight"] = [running.get(study_name(*k), 0) for k in per[keys].itertuples(index=False)]
    last = pd.to_datetime(per["last"], utc=True)
    per["state"] = ["running" if f or (now - t.to_pydatetime()) < ACTIVE else "idle"
                    for f, t in zip(per["in flight"], last)]
    per["study"] = ["|".join(k) for k in per[keys].itertuples(index=False)]
    per["explore"] = [nav.study_link(tuple(k)) for k in per[keys].itertuples(index=False)]
    per = per.rename(columns={"best": "best TFLOP/s", "last": "last trial"})
    cols = ["state", "study", "explore", "trials", "measured", "in window", "trials / min", "best TFLOP/s",
            "in flight", "last trial"]
    return per.sort_values(["state", "last trial"], ascending=[False, False])[cols]


def _fleet(url: str) -> None:
    """`tuner status` as tables: the workers (alive or lost) and the job queue per GPU model."""
    st.subheader("Fleet")
    workers, jobs, notes = data.fleet(url)
    if workers.empty and jobs.empty:
        st.info("No worker has run on this database (`tuner worker` and `tuner submit` make a fleet): "
                "only the studies above.")
        return
    for note in notes:
        st.text(note)
    st.dataframe(jobs, hide_index=True, key="fleet_jobs")
    st.dataframe(workers, hide_index=True, key="fleet_workers")


def render(ctx: nav.Ctx) -> None:
    st.header("Live")
    minutes = st.selectbox("window (minutes)", WINDOWS, key="live_window")

    @st.fragment(run_every=f"{data.LIVE_TTL_S}s")
    def _live() -> None:
        now = datetime.now(timezone.utc)
        recent = data.recent_trials(ctx.url, minutes)
        per = progress(data.live_summaries(ctx.url), recent, data.running_trials(ctx.url), minutes, now)
        c = st.columns(4)
        c[0].metric("studies running", int((per["state"] == "running").sum()))
        c[1].metric(f"trials, last {minutes} min", len(recent))
        c[2].metric("trials / min", f"{len(recent) / minutes:.1f}")
        c[3].metric("trials in flight", int(per["in flight"].sum()))
        if recent.empty:
            st.info(f"No trial stored in the last {minutes} minutes.")
        else:
            at = pd.to_datetime(recent["created_at"], utc=True)
            st.plotly_chart(charts.trials_per_minute(recent.assign(label=recent["study_name"], created_at=at), minutes),
                            key="per_minute")
        st.dataframe(per, hide_index=True, key="live_table", column_config={
            "explore": st.column_config.LinkColumn("explore", display_text="open"),
            "best TFLOP/s": st.column_config.NumberColumn(format="%.2f"),
            "trials / min": st.column_config.NumberColumn(format="%.2f")})
        st.caption(f"Every study in the database (the filters do not apply: a new study shows as soon as it stores "
                   f"a trial); refreshed every {data.LIVE_TTL_S} s, at {now:%H:%M:%S} UTC.")
        _fleet(ctx.url)

    _live()


if __name__ == "__main__":
    render(nav.current())
