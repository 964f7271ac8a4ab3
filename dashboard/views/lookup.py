"""Lookup: what the dispatcher reads, as the database would export it now beside the file on disk,
and whether that file is stale."""

from __future__ import annotations

import streamlit as st

from tuner.dashboard import data, frames, nav
from tuner.dashboard.plain import md
from tuner.export import stale_slots

WIDTHS = {"TFLOP/s": st.column_config.NumberColumn("TFLOP/s", format="%.1f"),
          "ms": st.column_config.NumberColumn("ms", format="%.4f")}


def _staleness(file_doc: dict, db_doc: dict, path: str) -> None:
    stale = stale_slots(file_doc, db_doc)
    n_missing, n_changed = len(stale["missing"]), len(stale["changed"])
    if not n_missing and not n_changed:
        st.success("The file serves every slot this database fills, with the same configs.")
        return
    st.warning(f"The file is stale: {n_missing} slots this database fills are missing from it and {n_changed} hold "
               f"another config than the database's best. Run {md(f'tuner export -o {path} --merge')} to bring it up "
               "to date (a search of the default database does so too).")
    rows = frames.lookup_frame({"entries": stale["missing"] + stale["changed"]})
    rows.insert(0, "in the file", ["missing"] * n_missing + ["another config"] * n_changed)
    st.dataframe(rows, hide_index=True, key="stale_table", column_config=WIDTHS)


def render(ctx: nav.Ctx) -> None:
    st.header("Best-config lookup")
    st.markdown("What the dispatcher sees: one entry per (GPU, dtype, head dim, mask, shape bucket, family), "
                "fastest first in each group.")
    st.subheader("From this database (as `tuner export` would write it now)")
    doc = data.lookup(ctx.url)
    frame = frames.lookup_frame(doc)
    if frame.empty:
        st.info("The database holds no tuned config yet: run `tuner search --gpu auto`.")
    else:
        st.dataframe(frame, hide_index=True, key="lookup_db_table", column_config=WIDTHS)
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
        _staleness(file_doc, doc, str(path))
        st.dataframe(frames.lookup_frame(file_doc), hide_index=True, key="lookup_file_table", column_config=WIDTHS)


if __name__ == "__main__":
    render(nav.current())
