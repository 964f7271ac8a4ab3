"""Untrusted text (anything read from a database or a lookup file, paths, error messages) shown
as the plain text it is.

Streamlit renders alerts, captions, st.markdown and st.table cells as Markdown (links, images,
`:red[...]` directives, math), and Plotly renders titles, legends and tick labels as a subset of
HTML (`<a href>`); a crafted GPU name or `generated_at` must show as text, never as markup.
"""

from __future__ import annotations

import html
import re
import string

_PUNCT = re.compile("([" + re.escape(string.punctuation) + "])")


def md(text: object) -> str:
    """`text` as Markdown that renders to exactly that text, on one line: CommonMark lets every
    ASCII punctuation character be backslash-escaped, which leaves no construct to start."""
    return _PUNCT.sub(r"\\\1", " ".join(str(text).split()))


def unmd(text: str) -> str:
    """What md() escaped, back as it was (tests compare shown values with stored ones)."""
    return re.sub(r"\\([" + re.escape(string.punctuation) + "])", r"\1", text)


def plotly(text: object) -> str:
    """`text` for a Plotly title, legend or tick label: its tags and entities shown, not applied."""
    return html.escape(str(text), quote=False)
