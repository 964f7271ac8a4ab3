"""The dashboard's pages, each with its own URL, and what a link carries: the study in the query
string as its three parts (never one name split again: a GPU key may hold "|"), and the
context the entry script hands the page it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import pandas as pd
import streamlit as st
from streamlit.navigation.page import StreamlitPage

VIEWS = Path(__file__).with_name("views")


@dataclass(frozen=True)
class PageSpec:
    url_path: str
    title: str
    script: str  # under views/


# The first is the default page: st.navigation serves it at the app's root ("/"), not at its url_path.
PAGES = (
    PageSpec("overview", "Overview", "overview.py"),
    PageSpec("explore", "Explore a study", "explore.py"),
    PageSpec("compare", "Compare", "compare.py"),
    PageSpec("live", "Live", "live.py"),
    PageSpec("lookup", "Lookup", "lookup.py"),
)
STUDY_KEYS = ("gpu", "family", "problem")  # query-string names of a study's three parts
_CTX = "ft_ctx"

Study = tuple[str, str, str]  # (GPU key, family, problem key)


@dataclass(frozen=True)
class Ctx:
    """What every page reads: the database and its study summaries left by the sidebar's filters."""

    url: str
    summ: pd.DataFrame


def navigation() -> StreamlitPage:
    """The page this URL asks for (st.navigation also draws the page list in the sidebar)."""
    pages = [st.Page(str(VIEWS / p.script), title=p.title, url_path=p.url_path, default=i == 0)
             for i, p in enumerate(PAGES)]
    return st.navigation(pages)


def hand_over(ctx: Ctx) -> None:
    st.session_state[_CTX] = ctx


def current() -> Ctx:
    return st.session_state[_CTX]


def study_link(study: Study, **extra: object) -> str:
    """The Explore page's URL (relative to the app's root) for one study, and e.g. one trial."""
    return "explore?" + urlencode({**dict(zip(STUDY_KEYS, study)), **extra})


def study_from_query() -> Study | None:
    parts = tuple(st.query_params.get(k) for k in STUDY_KEYS)
    return parts if all(parts) else None  # type: ignore[return-value]


def put_study_in_query(study: Study) -> None:
    """The study picked goes into the URL, so the address bar is a link to what is shown."""
    for k, v in zip(STUDY_KEYS, study):
        if st.query_params.get(k) != v:
            st.query_params[k] = v
