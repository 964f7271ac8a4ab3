"""The Streamlit dashboard through streamlit.testing's AppTest, on copies of a real H100 sweep.

The app reads its database from TUNER_DB here (AppTest cannot pass argv after `--`), and the
lookup file from TUNER_LOOKUP, both set per test so nothing touches the user's data dir.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")
import pandas as pd  # noqa: E402
from sqlalchemy import insert  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

from tuner.dashboard.plain import unmd  # noqa: E402
from tuner.db import make_engine, queries, session_factory  # noqa: E402
from tuner.db.models import MeasurementRow, utcnow  # noqa: E402
from tuner.gpu import H100_SXM  # noqa: E402
from tuner.problem import Problem  # noqa: E402
from tuner.records import Measurement, Resources  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "dashboard" / "app.py")
FIXTURE = ROOT / "tests" / "fixtures" / "h100_simt.db"
GPU_KEY = "NVIDIA-H100-80GB-HBM3/sm_90"
PROBLEM = "B2-H4-N512-D64-fp32-causal"
STUDY = f"{GPU_KEY}|flash_fwd_simt|{PROBLEM}"  # as the study picker shows it
STUDY_PARTS = (GPU_KEY, "flash_fwd_simt", PROBLEM)
EXTRA = Problem(4, 8, 1024, 1024, 128, "bf16", False)
PAGES = ("overview", "explore", "compare", "live", "lookup")  # URL paths (dashboard/nav.py)


def _copy_fixture(tmp_path: Path, *, upgrade: bool = True) -> str:
    """A copy (never the committed file in place), migrated to this schema as any tuner command would."""
    dst = tmp_path / "results.db"
    shutil.copy(FIXTURE, dst)
    url = f"sqlite:///{dst}"
    if upgrade:
        make_engine(url).dispose()
    return url


def _sessions(url: str):
    return session_factory(make_engine(url))


def _add_extra_problem(url: str) -> None:
    """A second problem (bf16, d128, non-causal) so the filters have something to remove."""
    with _sessions(url)() as s, s.begin():
        for i, (br, bc) in enumerate(((64, 64), (128, 64), (64, 32))):
            ms = 0.5 + 0.1 * i
            queries.record_measurement(
                s, H100_SXM, EXTRA, "flash_fwd_simt", {"Br": br, "Bc": bc, "TM": 4, "TN": 4, "stages": 2},
                Measurement("ok", ms, ms, ms, EXTRA.tflops(ms), resources=Resources(96)), run_id="extra",
            )
        queries.record_measurement(s, H100_SXM, EXTRA, "flash_fwd_simt", {"Br": 256, "Bc": 256, "TM": 8, "TN": 8},
                                   Measurement("compile_error", message="ptxas: too much shared data"))
        queries.record_measurement(s, H100_SXM, EXTRA, "sdpa_flash", {}, Measurement("ok", 0.4, 0.4, 0.4, EXTRA.tflops(0.4)))
        queries.update_best(s, GPU_KEY, EXTRA.key, "flash_fwd_simt")


def _fixture_facts(url: str) -> dict:
    with _sessions(url)() as s:
        best = [b for b in queries.best_rows(s) if b.problem.key == PROBLEM]
        counts = queries.status_counts(s, GPU_KEY, "flash_fwd_simt")
        return {"best": best[0], "ok": counts["ok"], "failed": sum(counts.values()) - counts["ok"]}


@pytest.fixture
def db_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = _copy_fixture(tmp_path)
    monkeypatch.setenv("TUNER_DB", url)
    monkeypatch.setenv("TUNER_LOOKUP", str(tmp_path / "best.json"))
    return url


def _app(page: str | None = None, **query: str) -> AppTest:
    """The app on the page whose URL path is `page` (the overview by default), with `query` in its URL."""
    at = AppTest.from_file(APP, default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, at.exception
    if page is not None:
        _go(at, page)
    return at


def _go(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"views/{page}.py").run()
    assert not at.exception, (page, at.exception)
    return at


def _figures(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def _values(trace: dict, key: str) -> list:
    """A trace's array as a list: Plotly writes numeric arrays as base64 (`bdata` with a dtype)."""
    import base64

    import numpy as np

    v = trace.get(key, [])
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
    return list(v)


def _query(at: AppTest) -> dict[str, str]:
    """The query string the page left in the URL."""
    return {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}


def _titles(at: AppTest) -> set[str]:
    return {(f["layout"].get("title") or {}).get("text") for f in _figures(at)}


def _frame(at: AppTest, *columns: str, nth: int = 0):
    """The nth dataframe holding all `columns` (AppTest does not expose dataframe keys)."""
    found = [d.value for d in at.dataframe if set(columns) <= set(d.value.columns)]
    assert len(found) > nth, f"no dataframe with {columns}; have {[list(d.value.columns) for d in at.dataframe]}"
    return found[nth]


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def _texts(at: AppTest) -> str:
    """The page's Markdown as it reads once rendered (untrusted text in it is escaped)."""
    parts = [e.value for kind in ("warning", "info", "error", "markdown", "caption", "text") for e in getattr(at, kind)]
    return "\n".join(unmd(str(p)) for p in parts)


def _best_table(at: AppTest):
    """The overview's best-config table as it reads once rendered (st.table renders Markdown)."""
    return at.table[0].value.map(lambda v: unmd(v) if isinstance(v, str) else v)


# ---- pages on the fixture ----

def test_overview_shows_best_config_counts_and_peers(db_url: str) -> None:
    facts = _fixture_facts(db_url)
    at = _app()
    best = _best_table(at)
    row = best[best["problem"] == PROBLEM].iloc[0]
    assert json.loads(row["params"]) == facts["best"].params
    assert row["TFLOP/s"] == f"{facts['best'].tflops:.2f}"
    assert row["efficient TFLOP/s"] != "-" and row["vs best peer"].endswith("x")
    status = _frame(at, "family", "total").set_index("family")
    assert status.loc["flash_fwd_simt", "ok"] == facts["ok"] == 217
    assert status.loc["flash_fwd_simt", "invalid"] == facts["failed"]
    studies = _frame(at, "problem_key", "trials")
    assert list(studies["problem_key"]) == [PROBLEM] and studies["trials"].iloc[0] == 324
    assert list(_frame(at, "key", "SMs")["key"]) == [GPU_KEY]
    assert _metric(at, "measurements") == "326"


def test_explore_plots_each_param_history_and_every_trial(db_url: str) -> None:
    facts = _fixture_facts(db_url)
    at = _app("explore")
    assert at.selectbox(key="study").value == STUDY_PARTS
    assert _query(at) == dict(zip(("gpu", "family", "problem"), STUDY_PARTS))  # the URL names the study
    figs = {(f["layout"].get("title") or {}).get("text"): f for f in _figures(at)}
    assert {"Br", "Bc", "TM", "TN", "stages", "min_blocks", "Search history"} <= set(figs), set(figs)
    # numeric order on categorical axes: 32 before 64 before 128 (never as strings: 128, 32, 64)
    assert figs["Br"]["layout"]["xaxis"]["categoryarray"] == ["32", "64", "128"]
    # the history: TFLOP/s on the y axis, the invalid points in their own lane with their reason, never at 0
    hist = figs["Search history"]
    assert hist["layout"]["yaxis"]["title"]["text"] == "TFLOP/s"
    measured = next(t for t in hist["data"] if t["name"] == "measured")
    apart = next(t for t in hist["data"] if t["name"] == "not measured")
    assert len(_values(measured, "y")) == facts["ok"] and min(_values(measured, "y")) > 0
    assert len(_values(apart, "x")) == facts["failed"] == 107 and set(_values(apart, "y")) == {"invalid"}
    assert all(h.startswith("invalid: ") and len(h) > len("invalid: ") for h in apart["hovertext"])
    assert "Objective Value" not in json.dumps(hist)
    trials = _frame(at, "trial", "outcome", "registers", "spill_bytes", "static_smem")
    assert len(trials) == 324 and (trials["outcome"] != "ok").sum() == 107
    assert trials["link"].str.startswith("explore?gpu=").all()
    assert _metric(at, "ok") == str(facts["ok"])
    assert "Parameter importances (measured points only)" in _titles(at)


def test_filters_change_what_is_shown(db_url: str) -> None:
    _add_extra_problem(db_url)
    at = _app()
    assert len(_frame(at, "problem_key", "trials")) == 2 and len(_best_table(at)) == 2
    at.sidebar.multiselect(key="f_dtype").set_value(["bf16"]).run()
    assert not at.exception
    assert list(_frame(at, "problem_key", "trials")["problem_key"]) == [EXTRA.key]
    assert list(_best_table(at)["problem"]) == [EXTRA.key]
    at.sidebar.multiselect(key="f_dtype").set_value([]).run()
    at.sidebar.multiselect(key="f_mask").set_value(["causal"]).run()
    assert list(_frame(at, "problem_key", "trials")["problem_key"]) == [PROBLEM]

    _go(at, "explore")
    assert at.selectbox(key="study").options == [STUDY]
    at.sidebar.multiselect(key="f_mask").set_value(["none"]).run()
    assert at.selectbox(key="study").options == [f"{GPU_KEY}|flash_fwd_simt|{EXTRA.key}"]
    assert not at.exception
    trials = _frame(at, "trial", "outcome")
    assert [o.split(":")[0] for o in trials["outcome"] if o != "ok"] == ["compile_error"]
    at.sidebar.multiselect(key="f_head_dim").set_value([64]).run()  # full + d64: nothing left
    assert "Nothing matches the filters" in _texts(at)


def test_compare_bars_and_roofline(db_url: str) -> None:
    at = _app("compare")
    table = _frame(at, "GPU", "problem")
    assert list(table["problem"]) == [PROBLEM]
    assert {"tuned flash_fwd_simt", "sdpa_efficient", "sdpa_math"} <= set(table.columns)
    roof = next(f for f in _figures(at) if f["layout"]["title"]["text"].startswith("Achieved"))
    names = {t.get("name") for t in roof["data"]}
    assert any(n and n.startswith("ceiling fp32 (52") for n in names), names
    assert not any(n and n.startswith("ceiling bf16") for n in names), names  # no fp32 point ran in bf16
    for axis in ("xaxis", "yaxis"):  # log ticks read as numbers: 1, 10, 100, never "2 5 100 2 5"
        ticks = roof["layout"][axis]
        assert ticks["type"] == "log" and ticks["ticktext"] == [f"{v:g}" for v in ticks["tickvals"]]
        assert all(math.log10(v) == round(math.log10(v)) for v in ticks["tickvals"])
    assert "Ceilings unknown" not in _texts(at)
    cited = [w.rstrip(".,") for c in at.main.caption for w in unmd(c.value).split() if "/" in w and "." in w]
    assert cited and all((ROOT / w).exists() for w in cited), cited  # the caption cites files that exist


def test_compare_unknown_gpu_says_ceilings_unknown(db_url: str) -> None:
    path = db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as c:
        c.execute("UPDATE ft_gpus SET name = 'Mystery GPU 9000'")
    at = _app("compare")
    assert "Ceilings unknown for Mystery GPU 9000" in _texts(at)


def test_lookup_from_db_and_file(db_url: str, tmp_path: Path) -> None:
    from tuner.export import build_lookup, write_lookup

    facts = _fixture_facts(db_url)
    at = _app("lookup")
    entries = _frame(at, "bucket", "params")
    assert len(entries) == 1 and json.loads(entries["params"].iloc[0]) == facts["best"].params
    assert entries["bucket"].iloc[0] == "fp32/d64/causal/n512/small"
    assert "No lookup file" in _texts(at)

    write_lookup(build_lookup([facts["best"]]), tmp_path / "best.json")
    at = _app("lookup")
    assert len(_frame(at, "bucket", "params", nth=1)) == 1

    (tmp_path / "best.json").write_text('{"schema": "flashtune.best-configs", "entries": [')
    at = _app("lookup")
    assert at.error and "not JSON" in at.error[0].value


# ---- databases that cannot be shown ----

def test_missing_db_says_what_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "nothing" / "here.db"
    monkeypatch.setenv("TUNER_DB", f"sqlite:///{path}")
    at = _app()
    assert "no database yet" in at.warning[0].value and "tuner search --gpu auto" in _texts(at)
    assert not path.exists() and not path.parent.exists()  # the dashboard never creates it


def test_empty_db_says_what_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    make_engine(url).dispose()  # flashtune's tables, no rows
    monkeypatch.setenv("TUNER_DB", url)
    at = _app()
    assert "no measurements yet" in at.warning[0].value and "tuner search --gpu auto" in _texts(at)


def test_foreign_sqlite_file_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE notes (x)")
    monkeypatch.setenv("TUNER_DB", f"sqlite:///{path}")
    at = _app()
    assert "no flashtune tables" in at.warning[0].value
    with sqlite3.connect(path) as c:
        assert {r[0] for r in c.execute("SELECT name FROM sqlite_master")} == {"notes"}


def test_older_schema_says_how_to_upgrade_and_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tuner.db.engine import SCHEMA_VERSION

    url = _copy_fixture(tmp_path, upgrade=False)
    path = url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as c:
        c.execute("UPDATE ft_meta SET schema_version = ?", (SCHEMA_VERSION - 1,))
    before = Path(path).read_bytes()
    monkeypatch.setenv("TUNER_DB", url)
    at = _app()
    assert "older flashtune" in at.warning[0].value and "tuner migrate --db" in _texts(at)
    assert Path(path).read_bytes() == before


def test_newer_schema_says_upgrade(db_url: str) -> None:
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as c:
        c.execute("UPDATE ft_meta SET schema_version = 99")
    at = _app()
    assert "newer flashtune" in at.warning[0].value and "upgrade" in _texts(at)


def test_db_url_from_argv_then_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from tuner.dashboard.data import resolve_url

    monkeypatch.setenv("TUNER_DB", "sqlite:///env.db")
    assert resolve_url(["--db", "sqlite:///argv.db"]) == "sqlite:///argv.db"
    assert resolve_url(["-q", "tests/test_dashboard.py"]) == "sqlite:///env.db"


def test_cli_dashboard_runs_streamlit_on_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from typer.testing import CliRunner

    from tuner import cli

    seen: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: seen.append(cmd) or 0)
    result = CliRunner().invoke(cli.app, ["dashboard", "--db", "sqlite:////x/r.db", "--port", "8765"])
    assert result.exit_code == 0, result.output
    cmd = seen[0]
    assert cmd[1:4] == ["-m", "streamlit", "run"] and Path(cmd[4]) == Path(APP)
    assert cmd[cmd.index("--server.port") + 1] == "8765" and "--server.headless" in cmd
    assert cmd[cmd.index("--") + 1:] == ["--db", "sqlite:////x/r.db"]


# ---- scale ----

def _bulk_db(path: Path, n: int) -> str:
    """n measurement rows (+8 peers) over 4 problems x 2 families x 60 configs, in one executemany."""
    url = f"sqlite:///{path}"
    rng = random.Random(0)
    problems = [Problem(b, 12, s, s, 64, "fp32", True) for b, s in ((8, 1024), (6, 4096), (1, 8192), (4, 2048))]
    with _sessions(url)() as s, s.begin():
        gpu_id = queries.upsert_gpu(s, H100_SXM).id
        prob_ids = [queries.upsert_problem(s, p).id for p in problems]
        configs = [(fam, queries.upsert_config(s, fam, {"Br": br, "Bc": bc, "TM": tm, "TN": 4, "stages": st}).id)
                   for fam in ("flash_fwd_simt", "flash_fwd_mma")
                   for br in (32, 64, 128) for bc in (32, 64) for tm in (2, 4) for st in (1, 2, 3, 4, 5)]
        peer_ids = [queries.upsert_config(s, f, {}).id for f in ("sdpa_efficient", "sdpa_math")]
        now = utcnow()
        studies = {(fam, pi): f"{H100_SXM.key}|{fam}|{p.key}" for fam, _ in configs for pi, p in enumerate(problems)}
        tflops = [p.flops() / 1e9 for p in problems]  # / ms -> TFLOP/s
        rows = []
        for i in range(n):
            pi = i % len(problems)
            fam, cid = configs[rng.randrange(len(configs))]
            ok = rng.random() < 0.7
            ms = rng.uniform(0.2, 5.0)
            rows.append({
                "gpu_id": gpu_id, "problem_id": prob_ids[pi], "config_id": cid,
                "status": "ok" if ok else rng.choice(("invalid", "compile_error", "timeout")),
                "median_ms": ms if ok else None, "min_ms": ms if ok else None, "max_ms": ms if ok else None,
                "tflops": tflops[pi] / ms if ok else None, "versions_key": "v1", "versions_json": "{}",
                "message": "" if ok else "synthetic failure", "study_name": studies[fam, pi],
                "trial_number": i, "run_id": "bulk", "created_at": now,
            })
        for pi in range(len(problems)):
            for cid in peer_ids:
                rows.append({**rows[0], "problem_id": prob_ids[pi], "config_id": cid, "status": "ok",
                             "median_ms": 1.0, "min_ms": 1.0, "max_ms": 1.0, "tflops": problems[pi].tflops(1.0),
                             "message": "", "study_name": None, "trial_number": None})
        # Core executemany on the connection, every row with the same keys: one statement, not 100k.
        s.connection().execute(insert(MeasurementRow.__table__), rows)
        for p in problems:
            for fam in ("flash_fwd_simt", "flash_fwd_mma"):
                queries.update_best(s, H100_SXM.key, p.key, fam)
    return url


def test_overview_of_100k_measurements_opens_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _bulk_db(tmp_path / "big.db", 100_000)
    monkeypatch.setenv("TUNER_DB", url)
    monkeypatch.setenv("TUNER_LOOKUP", str(tmp_path / "best.json"))
    t0 = time.perf_counter()
    at = AppTest.from_file(APP, default_timeout=60).run()
    elapsed = time.perf_counter() - t0
    assert not at.exception, at.exception
    assert _metric(at, "measurements") == str(100_000 + 8)
    assert len(at.table[0].value) == 8  # 4 problems x 2 families
    assert elapsed < 10, f"overview of 100k measurements took {elapsed:.1f} s"
    t0 = time.perf_counter()
    _go(at, "compare")  # cached queries: a rerun is cheap
    assert time.perf_counter() - t0 < 10


# ---- what a crafted database or lookup can do to the page: nothing ----

EVIL = "![x](http://evil.example/x.png) [click](http://evil.example) :red[red] <b>b</b> $x^2$"


def _markdown_sources(at: AppTest) -> list[str]:
    kinds = ("warning", "info", "error", "markdown", "caption", "success")
    return [str(e.value) for kind in kinds for e in getattr(at, kind)]


def _assert_inert(source: str) -> None:
    """No piece of EVIL's markup is left as it was: escaped, none starts a link, an image, a
    directive, a tag or math."""
    import re

    for piece in ("](http", "![", ":red[", "<b>", "$x"):
        assert not re.search(r"(?<!\\)" + re.escape(piece), source), source


def test_reading_the_database_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every page over a rollback-journal database leaves it as it was: no WAL switch, no
    migration, no Optuna tables or stamps, no side files."""
    url = _copy_fixture(tmp_path, upgrade=False)
    db = Path(url.removeprefix("sqlite:///"))
    before = db.read_bytes()
    monkeypatch.setenv("TUNER_DB", url)
    monkeypatch.setenv("TUNER_LOOKUP", str(tmp_path / "best.json"))
    at = _app()
    for page in PAGES:
        _go(at, page)
        assert _figures(at) or page in ("lookup", "live"), page  # live: no trial in the last minutes
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.db"]
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_a_crafted_lookup_shows_as_plain_text(db_url: str, tmp_path: Path) -> None:
    from tuner.export import build_lookup, write_lookup

    write_lookup({**build_lookup([_fixture_facts(db_url)["best"]]), "generated_at": EVIL}, tmp_path / "best.json")
    at = _app("lookup")
    assert any(EVIL in str(t.value) for t in at.text)  # shown, as text
    for source in _markdown_sources(at):
        _assert_inert(source)


def test_crafted_database_strings_show_as_plain_text(db_url: str) -> None:
    """A GPU key holding "|" and Markdown, a family and params of Markdown: every page renders,
    the study picker keeps the three parts apart, and nothing turns into a link or an image."""
    key = f"Evil|GPU {EVIL}/sm_90"
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as c:
        c.execute("UPDATE ft_gpus SET key = ?, name = ?", (key, f"GPU {EVIL}"))
        c.execute("UPDATE ft_configs SET params_json = ? WHERE id = (SELECT config_id FROM ft_best)",
                  (json.dumps({"Br": EVIL}),))
    at = _app()
    best = _best_table(at)
    assert list(best["GPU"]) == [key] and json.loads(best["params"].iloc[0]) == {"Br": EVIL}
    for cell in at.table[0].value[["GPU", "params"]].to_numpy().ravel():
        _assert_inert(cell)
    for page in PAGES:
        _go(at, page)
        for source in _markdown_sources(at):
            _assert_inert(source)
        if page == "explore":
            assert at.selectbox(key="study").value == (key, "flash_fwd_simt", PROBLEM)
            assert _metric(at, "trials") == "324"
        texts = json.dumps(_figures(at))
        assert "<b>" not in texts, page  # Plotly would draw it bold
        if page in ("compare", "explore"):  # the GPU's name, the params: the tag shown as text
            assert "&lt;b&gt;" in texts, page


# ---- two GPUs, grid and model shapes, the peers sdpa_flash, sdpa_cudnn and fa4 (tests/dashboard_dbs.py) ----

@pytest.fixture
def fleet_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    from dashboard_dbs import fleet_db

    url = fleet_db(tmp_path / "fleet.db")
    monkeypatch.setenv("TUNER_DB", url)
    monkeypatch.setenv("TUNER_LOOKUP", str(tmp_path / "best.json"))
    return url


def test_overview_pictures_each_gpu_against_each_peer(fleet_url: str) -> None:
    from dashboard_dbs import GRID, H200, MODEL, PEERS

    at = _app()
    maps = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    heat = [f for f in maps if f["data"][0]["type"] == "heatmap"]
    assert sorted(f["layout"]["title"]["text"] for f in heat) == [
        "model and other shapes", "standard grid (docs/benchmarks.md)", "standard grid (docs/benchmarks.md)"]
    grid_h100 = heat[0]["data"][0]  # H100 first (GPUs sorted), grid before model
    assert grid_h100["x"] == ["cudnn", "fa4", "flash"]  # the strongest peer first
    assert grid_h100["y"] == [GRID[0].key, GRID[1].key]
    ratios = {x: 1 / PEERS[f] for f, x in (("sdpa_cudnn", "cudnn"), ("fa4", "fa4"), ("sdpa_flash", "flash"))}
    assert grid_h100["text"][0] == [f"{ratios[x]:.2f}x" for x in grid_h100["x"]]
    z = _values(grid_h100, "z")  # log2 of each ratio, row by row: red where FA4 is faster, blue where ours is
    assert len(z) == 6 and z[1] < 0 < z[0] < z[2]
    assert heat[1]["data"][0]["y"] == [MODEL[1].key, MODEL[0].key]  # the H100's model shapes, d=64 first
    texts = _texts(at)
    assert f"**{H200.key}**: at or above every peer on 0 of 2 shapes" in texts
    winners = _frame(at, "problem", "winners differ").set_index("problem")
    assert bool(winners.loc[GRID[0].key, "winners differ"]) is True  # Bc 176 wins on the H200 at d=64
    assert bool(winners.loc[GRID[1].key, "winners differ"]) is False
    assert "1 of 2 shapes tuned on more than one GPU" in texts


def test_a_varlen_variants_best_ranks_beside_no_dense_run(fleet_url: str) -> None:
    """A varlen variant tuned by name stores the TFLOP/s of its padded problem's length mix: shown in
    the best table with no peers, never the fastest family against the peers or across GPUs, no
    roofline point; even where its figure is the larger."""
    from dashboard_dbs import GRID, H200, PEERS

    from tuner.kernel_templates import VARIANTS_BY_NAME

    variant, p = VARIANTS_BY_NAME["flash_fwd_sm90_varlen"], GRID[0]
    with _sessions(fleet_url)() as s, s.begin():
        for gpu in (H100_SXM, H200):
            ms = p.flops() / 2000.0 / 1e9   # 2000 TFLOP/s: above every dense row and peer
            queries.record_measurement(s, gpu, p, variant.name, {"Bc": 128, "cwg": 2 if gpu is H200 else 3},
                                       Measurement("ok", ms, ms, ms, 2000.0), run_id="mix")
            queries.update_best(s, gpu.key, p.key, variant.name)
    at = _app()
    best = _best_table(at)
    mine = best[best["family"] == variant.name]
    assert len(mine) == 2 and set(mine["vs best peer"]) == {"-"} and set(mine["fa4 TFLOP/s"]) == {"-"}
    heat = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    grid_h100 = next(f for f in heat if f["data"][0]["type"] == "heatmap")["data"][0]
    ratios = {x: 1 / PEERS[f] for f, x in (("sdpa_cudnn", "cudnn"), ("fa4", "fa4"), ("sdpa_flash", "flash"))}
    assert grid_h100["y"][0] == p.key and grid_h100["text"][0] == [f"{ratios[x]:.2f}x" for x in grid_h100["x"]]
    winners = _frame(at, "problem", "winners differ").set_index("problem")
    assert bool(winners.loc[p.key, "winners differ"]) is True   # the dense winners (Bc 128 / 176), not the mix's
    assert not any(variant.name in str(v) for v in winners.to_numpy().ravel())
    _go(at, "compare")
    bars = _frame(at, "GPU", "problem")
    assert f"tuned {variant.name}" in bars.columns
    roof = next(f for f in _figures(at) if f["layout"]["title"]["text"].startswith("Achieved"))
    assert not any(variant.name in str(t.get("name")) or variant.name in json.dumps(t.get("customdata", ""))
                   for t in roof["data"])


def test_explore_opens_the_study_and_trial_in_the_link(fleet_url: str) -> None:
    from dashboard_dbs import GRID, H200, INVALID

    study = (H200.key, "flash_fwd_sm90", GRID[0].key)
    at = _app("explore")
    first = at.selectbox(key="study").value
    with _sessions(fleet_url)() as s:
        row = next(r for r in queries.measurements(s, *study) if r["status"] == "invalid")
    at = _app("explore", **dict(zip(("gpu", "family", "problem"), study)), m=str(row["id"]))
    assert at.selectbox(key="study").value == study != first  # the link's study, not the default pick
    assert f"Trial {row['trial_number']}" in [h.value for h in at.subheader]
    assert _metric(at, "status") == "invalid" and INVALID in _texts(at)
    trials = _frame(at, "trial", "outcome", "registers")
    assert (trials["outcome"] == f"invalid: {INVALID}").sum() == 3  # Bc 176 x 3 stages x 3 cwg
    link = trials.loc[trials["trial"] == row["trial_number"], "link"].iloc[0]
    assert link == nav_link(study, m=row["id"])
    assert "Parameter importances (measured points only)" in _titles(at)  # 15 points that differ


def nav_link(study: tuple[str, str, str], **extra: object) -> str:
    from tuner.dashboard.nav import study_link

    return study_link(study, **extra)


def test_explore_leaves_out_importances_that_say_nothing(fleet_url: str) -> None:
    from dashboard_dbs import FLAT

    at = _app("explore", gpu=H100_SXM.key, family="flash_fwd_sm90", problem=FLAT.key)
    assert "Parameter importances (measured points only)" not in _titles(at)
    assert "Not drawn: every measured point has the same TFLOP/s." in _texts(at)


def test_explore_opens_on_a_study_with_measured_points(fleet_url: str) -> None:
    """A study that sorts first but holds only failures is not what the page opens on."""
    from tuner.gpu import A100_SXM

    p = Problem(1, 8, 256, 256, 64, "bf16", False)
    with _sessions(fleet_url)() as s, s.begin():
        queries.record_measurement(s, A100_SXM, p, "flash_fwd_mma", {"Br": 64}, Measurement("invalid", message="no"),
                                   study_name="x", trial_number=0)
    at = _app("explore")
    assert at.selectbox(key="study").value[0] != A100_SXM.key
    assert at.selectbox(key="study").options[0].startswith(A100_SXM.key)  # it is there, just not the default
    at = _app("explore", gpu="no such GPU", family="f", problem="p")
    assert "not in this database" in _texts(at)


def test_compare_draws_the_ceiling_of_each_dtype_run(fleet_url: str) -> None:
    at = _app("compare")
    roof = next(f for f in _figures(at) if f["layout"]["title"]["text"].startswith("Achieved"))
    names = {t.get("name") or "" for t in roof["data"]}
    assert any(n.startswith("ceiling bf16 (684") for n in names)
    assert not any(n.startswith("ceiling fp32") for n in names)  # no point ran in fp32
    assert {"fa4", "sdpa_cudnn", "sdpa_flash"} <= set(_frame(at, "GPU", "problem").columns)
    at.selectbox(key="roof_gpu").set_value("NVIDIA-H200/sm_90").run()
    assert "Ceilings unknown for NVIDIA H200" in _texts(at)  # nothing measured on it: no ceiling made up


def test_live_shows_progress_per_study_and_no_fleet(fleet_url: str) -> None:
    at = _app("live")
    table = _frame(at, "state", "study", "trials / min")
    assert len(table) == 7 and set(table["state"]) == {"running"}  # every fixture trial was stored just now
    assert set(table["in window"]) == {18} and set(table["trials"]) == {18}
    assert _metric(at, "trials, last 15 min") == str(7 * 18)
    assert "No worker has run on this database" in " ".join(str(i.value) for i in at.info)
    assert "Trials per minute, last 15 min" in _titles(at)


def test_live_counts_trials_in_flight(db_url: str) -> None:
    path = db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as c:
        c.execute("UPDATE trials SET state = 'RUNNING' WHERE trial_id = (SELECT MAX(trial_id) FROM trials)")
    at = _app("live")
    table = _frame(at, "state", "in flight")
    assert table["in flight"].sum() == 1 and list(table["state"]) == ["running"]
    assert "No trial stored in the last 15 minutes" in _texts(at)  # a recording from November


def test_lookup_says_when_the_file_is_stale(fleet_url: str, tmp_path: Path) -> None:
    from tuner.export import build_lookup, write_lookup

    with _sessions(fleet_url)() as s:
        bests = queries.best_rows(s)
    write_lookup(build_lookup(bests), tmp_path / "best.json")
    assert "The file serves every slot" in " ".join(str(s.value) for s in _app("lookup").success)

    doc = build_lookup([b for b in bests if b.gpu_key == H100_SXM.key])
    doc["entries"][0]["params"] = {**doc["entries"][0]["params"], "stages": 3}
    write_lookup(doc, tmp_path / "best.json")
    at = _app("lookup")
    assert at.warning and "The file is stale: 2 slots" in unmd(at.warning[0].value)
    stale = _frame(at, "in the file", "bucket")
    assert sorted(stale["in the file"]) == ["another config", "missing", "missing"]
    assert list(_frame(at, "bucket", "params", nth=0).columns)[-1] == "params"  # the widest column last


# ---- the pieces ----

def test_pages_have_their_own_scripts_and_links_round_trip() -> None:
    from urllib.parse import parse_qs, urlsplit

    from tuner.dashboard.nav import PAGES, VIEWS, study_link

    assert [p.url_path for p in PAGES] == list(PAGES_IN_ORDER)
    assert all((VIEWS / p.script).is_file() for p in PAGES)
    study = ("Evil|GPU & co/sm_90", "flash_fwd_sm90", "B1-H32/kv8-N8192-D128-bf16-causal")
    parts = urlsplit(study_link(study, m=7))
    assert parts.path == "explore"
    assert {k: v[0] for k, v in parse_qs(parts.query).items()} == {"gpu": study[0], "family": study[1],
                                                                   "problem": study[2], "m": "7"}


PAGES_IN_ORDER = ("overview", "explore", "compare", "live", "lookup")


def test_launch_hides_the_deploy_button() -> None:
    from tuner.dashboard.launch import streamlit_command

    cmd = streamlit_command("sqlite:////x.db", 8501)
    assert cmd[cmd.index("--client.toolbarMode") + 1] == "viewer"
    assert cmd[cmd.index("--") + 1:] == ["--db", "sqlite:////x.db"]


def test_shape_kinds_ticks_and_order() -> None:
    from tuner.dashboard.charts import log_ticks
    from tuner.dashboard.frames import ordered, shape_kind
    from tuner.problem import standard_grid

    assert shape_kind(standard_grid("bf16")[0]) == "grid"
    assert shape_kind(Problem(8, 12, 1024, 1024, 64, "fp32", True)) == "grid"
    assert shape_kind(Problem(1, 32, 8192, 8192, 128, "bf16", True, kv_heads=8)) == "model"
    assert log_ticks(0.5, 2000) == ([0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0],
                                    ["0.1", "1", "10", "100", "1000", "10000"])
    assert ordered(pd.Series([128, 32, 64, 32])) == [32, 64, 128]
    assert ordered(pd.Series(["tf32", "bf16", "in"])) == ["bf16", "in", "tf32"]


def test_importances_only_where_they_mean_something() -> None:
    from tuner.dashboard.importance import importances

    rows = [{"p_Bc": bc, "p_stages": st, "tflops": 100.0 + bc + st} for bc in (64, 128, 176) for st in (1, 2, 3)] * 2
    imp, why = importances(pd.DataFrame(rows), ["p_Bc", "p_stages"])
    assert why is None and set(imp) == {"Bc", "stages"} and imp["Bc"] > imp["stages"]
    flat = pd.DataFrame([{**r, "tflops": 5.0} for r in rows])
    assert importances(flat, ["p_Bc", "p_stages"]) == (None, "every measured point has the same TFLOP/s")
    assert importances(pd.DataFrame(rows[:4]), ["p_Bc"])[1].startswith("4 measured points")
    one = pd.DataFrame([{**r, "p_Bc": 64} for r in rows])
    assert importances(one, ["p_Bc"])[1].startswith("no parameter took more than one value")


def test_recent_trials_reads_only_the_window(fleet_url: str) -> None:
    from datetime import timedelta

    with _sessions(fleet_url)() as s:
        assert len(queries.recent_trials(s, utcnow() - timedelta(minutes=5))) == 7 * 18  # peers have no study
        assert queries.recent_trials(s, utcnow() + timedelta(seconds=1)) == []


def test_stale_slots_of_a_lookup() -> None:
    from tuner.export import lookup_of, stale_slots

    p1, p2 = Problem(4, 16, 4096, 4096, 128, "bf16", True), Problem(16, 32, 1024, 1024, 64, "bf16", False)
    db = lookup_of(GPU_KEY, [(p1, "flash_fwd_sm90", {"Bc": 128}, 500.0), (p2, "flash_fwd_sm90", {"Bc": 176}, 450.0)])
    old = lookup_of(GPU_KEY, [(p1, "flash_fwd_sm90", {"Bc": 64}, 480.0)])
    other = lookup_of("NVIDIA-H200/sm_90", [(p1, "flash_fwd_sm90", {"Bc": 64}, 480.0)])
    stale = stale_slots({"entries": old["entries"] + other["entries"]}, db)
    assert [e["params"] for e in stale["changed"]] == [{"Bc": 128}] and [e["bucket"] for e in stale["missing"]] == [
        p2.bucket().key]
    assert stale_slots(db, db) == {"missing": [], "changed": []}


def test_the_dashboard_reads_the_fleets_postgresql_database(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay worker fills a PostgreSQL database through the queue; the dashboard shows its results
    and the fleet from it, through a connection the server keeps read-only."""
    from sqlalchemy import text
    from sqlalchemy.exc import InternalError

    from tuner import queue
    from tuner.db.engine import open_readonly
    from tuner.fleet import FleetWorker, WorkerOptions
    from tuner.runner import ReplayRunner

    sessions = _sessions(pg_url)
    problem = Problem(2, 4, 512, 512, 64, "fp32", True)
    queue.submit(sessions, [queue.JobSpec(GPU_KEY, "flash_fwd_simt", problem, 5, "random", 1, True)])
    runner = ReplayRunner(f"sqlite:///{FIXTURE}")
    worker = FleetWorker(runner, sessions, pg_url, 0, WorkerOptions(poll_s=0.1, exit_when_idle=True), say=lambda m: None)
    assert worker.run() == 1
    monkeypatch.setenv("TUNER_DB", pg_url)
    at = _app()
    best = _best_table(at)
    assert list(best["problem"]) == [PROBLEM]
    with sessions() as s:
        (entry,) = queries.best_rows(s)
    assert best.iloc[0]["TFLOP/s"] == f"{entry.tflops:.2f}"
    at = _app("live")
    jobs = _frame(at, "GPU model", "queued", "done")
    assert jobs.set_index("GPU model").loc[GPU_KEY, "done"] == 1
    assert _frame(at, "worker", "state")["state"].tolist() == ["stopped"]
    _go(at, "explore")
    with open_readonly(pg_url).connect() as c, pytest.raises(InternalError, match="read-only transaction"):
        c.execute(text("DELETE FROM ft_jobs"))
