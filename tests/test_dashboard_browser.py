"""The dashboard in a real headless Chromium: `tuner dashboard`'s server command on a loopback
port over a fixture database of two GPUs, every page loaded by its own URL (the study of the
Explore page in the query string), each page's screenshot kept as a test artifact.

Screenshots land in test-artifacts/screenshots/ (ignored by git), or in $DASHBOARD_SCREENSHOTS
(e.g. .out/screenshots).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dashboard_dbs import GRID, fleet_db
from tuner.dashboard import browser
from tuner.dashboard.nav import PAGES, study_link
from tuner.gpu import H100_SXM

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("DASHBOARD_SCREENSHOTS") or ROOT / "test-artifacts" / "screenshots")
STUDY = (H100_SXM.key, "flash_fwd_sm90", GRID[0].key)
# URL (relative to the server's root), text the finished page shows, Plotly charts it draws
EXPECT = {
    "overview": ("", "at or above every peer on", 4),  # the app's root; 3 heatmaps (GPU x kind), the GPUs' bars
    "explore": (study_link(STUDY), "Every trial", 6),       # history, 3 params, importances, not measured
    "compare": ("compare", "Ceilings: docs/benchmarks.md", 2),
    "live": ("live", "No worker has run on this database", 1),
    "lookup": ("lookup", "The file is stale", 0),
}

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not browser.CHROMIUM.exists(),
                       reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"),
]


def _stale_lookup(url: str, path: Path) -> None:
    """A lookup file from the H100's bests alone, one of them another config: stale twice over."""
    from tuner.db import make_engine, queries, session_factory
    from tuner.export import build_lookup, write_lookup

    with session_factory(make_engine(url))() as s:
        bests = queries.best_rows(s, H100_SXM.key)
    doc = build_lookup(bests)
    doc["entries"][0]["params"] = {**doc["entries"][0]["params"], "stages": 3}
    write_lookup(doc, path)


def test_every_page_renders_by_its_url_in_chromium(tmp_path: Path) -> None:
    assert set(EXPECT) == {p.url_path for p in PAGES}
    url = fleet_db(tmp_path / "results.db")
    env = {**os.environ, "TUNER_LOOKUP": str(tmp_path / "best.json")}
    env.pop("TUNER_DB", None)  # the URL comes through argv, as `tuner dashboard --db` passes it
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    _stale_lookup(url, tmp_path / "best.json")
    with browser.serve(url, tmp_path, env) as base, browser.chromium() as tab:
        for page, (path, text, charts) in EXPECT.items():
            try:
                dom = tab.load(base + path, lambda d: browser.rendered(d, text, charts))
            except browser.RenderError as e:
                (ARTIFACTS / f"dashboard-{page}.failed.html").write_text(e.dom)
                pytest.fail(f"{page}: {e} (its DOM in {ARTIFACTS}); server log:\n"
                            f"{(tmp_path / 'streamlit.log').read_text()[-3000:]}")
            shot = ARTIFACTS / f"dashboard-{page}.png"
            tab.screenshot(shot)
            assert not browser.exceptions_shown(dom), (page, browser.exceptions_shown(dom))
            assert "stAlertContentError" not in dom and "Page not found" not in dom, page
            assert 'data-testid="stAppDeployButton"' not in dom, page  # client.toolbarMode = viewer
            assert shot.stat().st_size > 20_000, page  # a rendered page, not a blank one
            if page == "explore":  # the study came from the query string, not the default pick
                assert 'value="' + "|".join(STUDY) + '"' in dom or "|".join(STUDY) in dom


def test_readme_screenshots_of_a_recorded_h100_database(tmp_path: Path) -> None:
    """benchmarks/dashboard_screenshots.py on a migrated copy of the recorded H100 sweep: the
    overview and the study page, as the README shows them."""
    import runpy
    import shutil

    from tuner.db import make_engine

    db = tmp_path / "results.db"
    shutil.copy(ROOT / "tests" / "fixtures" / "h100_simt.db", db)
    make_engine(f"sqlite:///{db}").dispose()
    script = runpy.run_path(str(ROOT / "benchmarks" / "dashboard_screenshots.py"))
    assert script["main"]([str(db), str(tmp_path / "shots")]) == 0
    for name in ("dashboard-overview.png", "dashboard-study.png"):
        assert (tmp_path / "shots" / name).stat().st_size > 50_000, name
