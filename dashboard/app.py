"""flashtune's dashboard: what was tuned, on which GPU, why it won, and against what.

Run `tuner dashboard [--db URL]` or `streamlit run dashboard/app.py -- --db URL` (TUNER_DB is the
fallback). It only reads: every query goes through tuner.db.queries on a read-only engine, and a
missing, empty or newer database gets a page saying what to run instead of a traceback.

This entry script checks the database, draws the sidebar's filters and runs the page the URL
names (dashboard/views/, one file a page, listed in dashboard/nav.py).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from tuner.dashboard import data, nav
from tuner.dashboard.plain import md
from tuner.db.engine import masked

FILTERS = (("gpu_key", "GPU"), ("family", "family"), ("dtype", "dtype"), ("head_dim", "head dim"), ("mask", "mask"))


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
    page = nav.navigation()
    filtered = _sidebar_filters(summ)
    st.sidebar.caption(f"database: {md(masked(url))}; refreshed every {data.TTL_S} s")
    if filtered.empty:
        st.header(page.title)
        st.info("Nothing matches the filters.")
        return
    nav.hand_over(nav.Ctx(url, filtered))
    page.run()


if __name__ == "__main__":  # streamlit runs the script as __main__; a multiprocessing child that re-runs
    main()                  # the parent's main module (as __mp_main__) must not draw the page again
