"""The Streamlit dashboard through streamlit.testing's AppTest, on copies of a real H100 sweep.

The app reads its database from TUNER_DB here (AppTest cannot pass argv after `--`), and the
lookup file from TUNER_LOOKUP, both set per test so nothing touches the user's data dir.
"""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")
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


def _app(page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, at.exception
    if page is not None:
        at.sidebar.radio(key="page").set_value(page).run()
        assert not at.exception, at.exception
    return at


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


def test_explore_plots_each_param_optuna_and_failures(db_url: str) -> None:
    facts = _fixture_facts(db_url)
    at = _app("Explore a study")
    assert at.selectbox(key="study").value == STUDY_PARTS
    titles = [(json.loads(c.proto.spec)["layout"].get("title") or {}).get("text") for c in at.get("plotly_chart")]
    assert {"Br", "Bc", "TM", "TN", "stages", "min_blocks"} <= set(titles), titles
    assert {"Optimization History Plot", "Hyperparameter Importances"} <= set(titles), titles
    assert "Optuna could not" not in _texts(at) and "unavailable" not in _texts(at)
    failed = _frame(at, "status", "message")
    assert len(failed) == facts["failed"] == 107
    assert set(failed["status"]) == {"invalid"} and failed["message"].str.len().min() > 0
    assert _metric(at, "ok") == str(facts["ok"])


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

    at.sidebar.radio(key="page").set_value("Explore a study").run()
    assert at.selectbox(key="study").options == [STUDY]
    at.sidebar.multiselect(key="f_mask").set_value(["full"]).run()
    assert at.selectbox(key="study").options == [f"{GPU_KEY}|flash_fwd_simt|{EXTRA.key}"]
    assert not at.exception
    failed = _frame(at, "status", "message")
    assert list(failed["status"]) == ["compile_error"]
    at.sidebar.multiselect(key="f_head_dim").set_value([64]).run()  # full + d64: nothing left
    assert "Nothing matches the filters" in _texts(at)


def test_compare_bars_and_roofline(db_url: str) -> None:
    at = _app("Compare")
    table = _frame(at, "GPU", "problem")
    assert list(table["problem"]) == [PROBLEM]
    assert {"tuned flash_fwd_simt", "sdpa_efficient", "sdpa_math"} <= set(table.columns)
    figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    names = {t.get("name") for f in figs for t in f["data"]}
    assert any(n and n.startswith("ceiling fp32 (52") for n in names), names
    assert "Ceilings unknown" not in _texts(at)


def test_compare_unknown_gpu_says_ceilings_unknown(db_url: str) -> None:
    path = db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as c:
        c.execute("UPDATE ft_gpus SET name = 'Mystery GPU 9000'")
    at = _app("Compare")
    assert "Ceilings unknown for Mystery GPU 9000" in _texts(at)


def test_lookup_from_db_and_file(db_url: str, tmp_path: Path) -> None:
    from tuner.export import build_lookup, write_lookup

    facts = _fixture_facts(db_url)
    at = _app("Lookup")
    entries = _frame(at, "bucket", "params")
    assert len(entries) == 1 and json.loads(entries["params"].iloc[0]) == facts["best"].params
    assert entries["bucket"].iloc[0] == "fp32/d64/causal/n512/small"
    assert "No lookup file" in _texts(at)

    write_lookup(build_lookup([facts["best"]]), tmp_path / "best.json")
    at = _app("Lookup")
    assert len(_frame(at, "bucket", "params", nth=1)) == 1

    (tmp_path / "best.json").write_text('{"schema": "flashtune.best-configs", "entries": [')
    at = _app("Lookup")
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
    at.sidebar.radio(key="page").set_value("Compare").run()  # cached queries: a rerun is cheap
    assert not at.exception and time.perf_counter() - t0 < 10


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
    for page in ("Explore a study", "Compare", "Lookup"):
        at.sidebar.radio(key="page").set_value(page).run()
        assert not at.exception, at.exception
    assert "Optimization History Plot" in {(json.loads(c.proto.spec)["layout"].get("title") or {}).get("text")
                                           for c in _app("Explore a study").get("plotly_chart")}
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.db"]
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_a_crafted_lookup_shows_as_plain_text(db_url: str, tmp_path: Path) -> None:
    from tuner.export import build_lookup, write_lookup

    write_lookup({**build_lookup([_fixture_facts(db_url)["best"]]), "generated_at": EVIL}, tmp_path / "best.json")
    at = _app("Lookup")
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
    for page in ("Explore a study", "Compare", "Lookup"):
        at.sidebar.radio(key="page").set_value(page).run()
        assert not at.exception, (page, at.exception)
        for source in _markdown_sources(at):
            _assert_inert(source)
        if page == "Explore a study":
            assert at.selectbox(key="study").value == (key, "flash_fwd_simt", PROBLEM)
            assert _metric(at, "trials") == "324"
        if page == "Compare":
            figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
            texts = json.dumps(figs)
            assert "<b>" not in texts and "&lt;b&gt;" in texts  # Plotly shows the tag, not bold text


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
    jobs = _frame(at, "GPU model", "queued", "done")
    assert jobs.set_index("GPU model").loc[GPU_KEY, "done"] == 1
    assert _frame(at, "worker", "state")["state"].tolist() == ["stopped"]
    at.sidebar.radio(key="page").set_value("Explore a study").run()
    assert not at.exception, at.exception
    with open_readonly(pg_url).connect() as c, pytest.raises(InternalError, match="read-only transaction"):
        c.execute(text("DELETE FROM ft_jobs"))
