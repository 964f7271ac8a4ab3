"""Screenshots of the dashboard over a results database, for the README: the overview and the
study page of the study with the most measured points, as PNGs, taken in headless Chromium
through tuner.dashboard.browser (the browser test's helper):

    python3 benchmarks/dashboard_screenshots.py sqlite:////path/to/results.db docs/
    # -> docs/dashboard-overview.png, docs/dashboard-study.png

The database is opened read-only (a path is taken as a SQLite file); needs /usr/bin/chromium.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

SIZE = (1500, 2000)  # tall enough for the overview's pictures above the fold


def busiest_study(url: str) -> tuple[str, str, str]:
    """(GPU key, family, problem key) of the tuning study with the most ok measurements."""
    from tuner.db import queries
    from tuner.db.engine import open_readonly, session_factory
    from tuner.peers import PEER_FAMILIES

    with session_factory(open_readonly(url))() as s:
        rows = [r for r in queries.study_summaries(s) if r["status"] == "ok" and r["family"] not in PEER_FAMILIES]
    if not rows:
        raise SystemExit(f"no tuning study with an ok measurement in {url}")
    top = max(rows, key=lambda r: r["count"])
    return top["gpu_key"], top["family"], top["problem_key"]


def main(argv: list[str] | None = None) -> int:
    from tuner.dashboard import browser
    from tuner.dashboard.nav import study_link

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db", help="database URL, or a path to a SQLite file")
    ap.add_argument("outdir", type=Path)
    a = ap.parse_args(argv)
    url = a.db if "://" in a.db else f"sqlite:///{Path(a.db).resolve()}"
    a.outdir.mkdir(parents=True, exist_ok=True)
    pages = {"dashboard-overview.png": ("", "Best config per problem", 1),
             "dashboard-study.png": (study_link(busiest_study(url)), "Every trial", 2)}
    with tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "TUNER_LOOKUP": str(Path(work) / "no-lookup.json")}
        with browser.serve(url, Path(work), env) as base, browser.chromium(SIZE) as tab:
            for name, (path, text, charts) in pages.items():
                dom = tab.load(base + path, lambda d: browser.rendered(d, text, charts))
                if browser.exceptions_shown(dom):
                    print(f"{name}: the page shows an exception", file=sys.stderr)
                    return 1
                tab.screenshot(a.outdir / name)
                print(a.outdir / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
