"""Results database: real SQLite files, real concurrency."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import func, inspect, select, text

from tuner.db import (
    SCHEMA_VERSION,
    BestRow,
    ConfigRow,
    DatabaseError,
    GpuRow,
    MeasurementRow,
    MetaRow,
    ProblemRow,
    best_rows,
    default_url,
    find_measurement,
    list_gpus,
    list_problems,
    make_engine,
    measurements,
    peer_rows,
    record_measurement,
    session_factory,
    status_counts,
    update_best,
    upsert_config,
    upsert_gpu,
    upsert_problem,
)
from tuner.gpu import A100_SXM, H100_SXM
from tuner.problem import Problem
from tuner.records import Measurement, Resources, versions_key

P1 = Problem(8, 12, 1024, 1024, 64, "fp32", True)
P2 = Problem(2, 16, 512, 2048, 128, "bf16", False, kv_heads=4)
V1 = {"driver": "580", "nvrtc": "13.0", "torch": "2.11", "tuner": "0.1.0"}
V2 = {**V1, "tuner": "0.2.0"}


def ok(tflops: float, versions: dict = V1) -> Measurement:
    return Measurement("ok", median_ms=100.0 / tflops, min_ms=90.0 / tflops, max_ms=110.0 / tflops,
                       tflops=tflops, max_abs_err=1e-6, rel_err=1e-7, lse_err=1e-8, versions=versions, reps=50)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'sub' / 'ft.db'}"


@pytest.fixture
def Session(url: str):
    engine = make_engine(url)
    yield session_factory(engine)
    engine.dispose()


def count(s, model) -> int:
    return s.scalar(select(func.count()).select_from(model))


# --- engine -----------------------------------------------------------------------------------


def test_pragmas_wal_and_busy_timeout(url: str) -> None:
    engine = make_engine(url)
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() == 60000
        assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    engine.dispose()
    # WAL is a property of the file: a plain sqlite3 connection sees it too
    path = url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_tables_prefixed_and_schema_version(Session, url: str) -> None:
    engine = make_engine(url)
    names = set(inspect(engine).get_table_names())
    assert {"ft_meta", "ft_gpus", "ft_problems", "ft_configs", "ft_measurements", "ft_best"} <= names
    assert all(n.startswith("ft_") for n in names)
    with Session() as s:
        assert s.scalars(select(MetaRow)).one().schema_version == SCHEMA_VERSION
    make_engine(url).dispose()  # reopening keeps one meta row
    with Session() as s:
        assert count(s, MetaRow) == 1


def test_newer_schema_refused(Session, url: str) -> None:
    with Session() as s, s.begin():
        s.scalars(select(MetaRow)).one().schema_version = SCHEMA_VERSION + 1
    with pytest.raises(DatabaseError, match="newer flashtune"):
        make_engine(url)


def test_coexists_with_optuna_tables(url: str) -> None:
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    Path(url.removeprefix("sqlite:///")).parent.mkdir()  # optuna first: it does not create folders
    study = optuna.create_study(storage=url, study_name="s1")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    Session = session_factory(make_engine(url))
    with Session() as s, s.begin():
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 64}, ok(5.0), study_name="s1", trial_number=1)
    assert len(optuna.load_study(study_name="s1", storage=url).trials) == 2
    with Session() as s:
        assert count(s, MeasurementRow) == 1


def test_malformed_url_is_value_error() -> None:
    with pytest.raises(ValueError, match="malformed database URL"):
        make_engine("this is not a url")
    with pytest.raises(ValueError, match="nosuchdb"):
        make_engine("nosuchdb://host/x")


def test_unopenable_path_names_it(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    bad = blocker / "deeper" / "ft.db"
    with pytest.raises(DatabaseError, match=str(bad.parent)):
        make_engine(f"sqlite:///{bad}")
    folder = tmp_path / "isadir.db"
    folder.mkdir()
    with pytest.raises(DatabaseError, match=str(folder)):
        make_engine(f"sqlite:///{folder}")


def test_default_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TUNER_DB", "sqlite:////somewhere/x.db")
    assert default_url() == "sqlite:////somewhere/x.db"
    monkeypatch.delenv("TUNER_DB")
    monkeypatch.setattr("tuner.db.engine.user_data_dir", lambda app: str(tmp_path / "data" / app))
    assert default_url() == f"sqlite:///{tmp_path / 'data' / 'flashtune' / 'flashtune.db'}"
    assert (tmp_path / "data" / "flashtune").is_dir()


# --- upserts and round trips -------------------------------------------------------------------


def test_upserts_idempotent_and_round_trip(Session) -> None:
    with Session() as s, s.begin():
        g1, g2 = upsert_gpu(s, H100_SXM), upsert_gpu(s, H100_SXM)
        p1, p2 = upsert_problem(s, P2), upsert_problem(s, P2)
        c1, c2 = upsert_config(s, "simt", {"b": 2, "a": 1}), upsert_config(s, "simt", {"a": 1, "b": 2})
        c3 = upsert_config(s, "wgmma", {"a": 1, "b": 2})
        assert (g1.id, p1.id, c1.id) == (g2.id, p2.id, c2.id)
        assert c3.id != c1.id
    with Session() as s, s.begin():  # a later session too
        assert upsert_gpu(s, H100_SXM).id == g1.id
        assert upsert_problem(s, P2).id == p1.id
        assert count(s, GpuRow) == 1 and count(s, ProblemRow) == 1 and count(s, ConfigRow) == 2
    with Session() as s:
        (gi,) = list_gpus(s)
        assert gi.key == H100_SXM.key and gi.cc == "9.0" and gi.sm_count == 132
        assert gi.spec == H100_SXM.to_dict()
        assert gi.first_seen is not None and gi.first_seen.tzinfo is not None
        assert list_problems(s) == [P2]
        assert s.scalars(select(ProblemRow)).one().bucket_key == P2.bucket().key
        assert s.get(ConfigRow, c1.id).params_json == '{"a":1,"b":2}'


def test_measurement_round_trip_all_fields(Session) -> None:
    m = Measurement(
        "ok", median_ms=1.5, min_ms=1.25, max_ms=2.0, tflops=123.5, max_abs_err=3e-3, rel_err=2e-4,
        lse_err=1e-5, resources=Resources(168, 8, 16, 1024, 98304), compile_seconds=2.5,
        versions=V1, message="fine", reps=77,
    )
    with Session() as s, s.begin():
        row = record_measurement(s, H100_SXM, P2, "simt", {"Br": 64, "Bc": 32}, m,
                                 study_name="st", trial_number=4, run_id="run-1")
        rid = row.id
    with Session() as s:
        got = find_measurement(s, H100_SXM.key, P2.key, "simt", {"Bc": 32, "Br": 64}, versions_key(V1))
        assert got == m
        (flat,) = measurements(s)
        assert flat["id"] == rid and flat["family"] == "simt" and flat["p_Br"] == 64 and flat["p_Bc"] == 32
        assert flat["kv_heads"] == 4 and flat["dtype"] == "bf16" and flat["registers"] == 168
        assert (flat["study_name"], flat["trial_number"], flat["run_id"]) == ("st", 4, "run-1")
        assert flat["created_at"].tzinfo is not None


def test_failure_rows_and_unknown_status(Session) -> None:
    with Session() as s, s.begin():
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 128}, Measurement("compile_error", message="ptxas: too much smem"))
    with Session() as s:
        got = find_measurement(s, H100_SXM.key, P1.key, "simt", {"Br": 128}, versions_key({}))
        assert got is not None and got.status == "compile_error" and "ptxas" in got.message
    bad = Measurement("ok")
    bad.status = "exploded"
    with Session() as s, s.begin(), pytest.raises(ValueError):
        record_measurement(s, H100_SXM, P1, "simt", {}, bad)


def test_find_measurement_respects_versions_and_takes_latest(Session) -> None:
    with Session() as s, s.begin():
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 64}, ok(10.0, V1))
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 64}, ok(11.0, V1))
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 64}, ok(99.0, V2))
    with Session() as s:
        f = lambda params, v, gpu=H100_SXM, fam="simt": find_measurement(s, gpu.key, P1.key, fam, params, versions_key(v))
        assert f({"Br": 64}, V1).tflops == 11.0
        assert f({"Br": 64}, V2).tflops == 99.0
        assert f({"Br": 64}, {**V1, "torch": "2.12"}) is None
        assert f({"Br": 32}, V1) is None
        assert f({"Br": 64}, V1, gpu=A100_SXM) is None
        assert f({"Br": 64}, V1, fam="wgmma") is None


def test_a_timing_answers_only_for_the_sources_it_was_measured_with(tmp_path) -> None:
    """The versions a stored timing is reused under carry a hash of the kernel templates and the
    measuring code, which moves with any change to either (the package version does not)."""
    import shutil
    from pathlib import Path

    import tuner
    from tuner.kernel_templates import __file__ as templates_init
    from tuner.versions import software_versions, sources_hash, sources_version

    templates, code = tmp_path / "kernel_templates", tmp_path / "tuner"
    shutil.copytree(Path(templates_init).parent, templates, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(tuner.__file__).parent, code, ignore=shutil.ignore_patterns("__pycache__", "kernel_templates"))
    before = sources_hash(templates, code)
    assert before == sources_version() and software_versions()["sources"] == before
    (templates / "common.cuh").write_text((templates / "common.cuh").read_text() + "\n// a changed kernel\n")
    after_kernel = sources_hash(templates, code)
    (code / "length_mix.py").write_text((code / "length_mix.py").read_text().replace("DRAWS = 4", "DRAWS = 3"))
    assert len({before, after_kernel, sources_hash(templates, code)}) == 3
    assert versions_key({**V1, "sources": before}) != versions_key({**V1, "sources": after_kernel})


def test_update_best_picks_fastest_ok(Session) -> None:
    with Session() as s, s.begin():
        assert update_best(s, H100_SXM.key, P1.key, "simt") is None  # nothing known yet
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 32}, ok(10.0))
        winner = record_measurement(s, H100_SXM, P1, "simt", {"Br": 64}, ok(20.0)).id
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 128}, replace(ok(500.0), status="wrong_result"))
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 256}, replace(ok(900.0), status="crash"))
        record_measurement(s, H100_SXM, P1, "wgmma", {"x": 1}, ok(300.0))  # other family
        record_measurement(s, A100_SXM, P1, "simt", {"Br": 64}, ok(400.0))  # other GPU
        record_measurement(s, H100_SXM, P2, "simt", {"Br": 64}, ok(600.0))  # other problem
        best = update_best(s, H100_SXM.key, P1.key, "simt")
        assert best is not None and best.measurement_id == winner and best.tflops == 20.0
        first_id = best.id
    with Session() as s, s.begin():
        newer = record_measurement(s, H100_SXM, P1, "simt", {"Br": 16}, ok(30.0)).id
        best = update_best(s, H100_SXM.key, P1.key, "simt")
        assert best.id == first_id and best.measurement_id == newer and best.tflops == 30.0
        assert update_best(s, H100_SXM.key, P1.key, "wgmma").tflops == 300.0
        assert count(s, BestRow) == 2
    with Session() as s:
        rows = best_rows(s, H100_SXM.key)
        assert [(r.family, r.tflops, r.params) for r in rows] == [("simt", 30.0, {"Br": 16}), ("wgmma", 300.0, {"x": 1})]
        assert rows[0].problem == P1 and rows[0].bucket_key == P1.bucket().key
        assert rows[0].median_ms == pytest.approx(100.0 / 30.0)
        assert best_rows(s, A100_SXM.key) == []


def test_peer_rows_latest_ok_per_backend(Session) -> None:
    with Session() as s, s.begin():
        record_measurement(s, H100_SXM, P1, "sdpa_flash", {}, ok(40.0), run_id="r1")
        record_measurement(s, H100_SXM, P1, "sdpa_flash", {}, ok(42.0), run_id="r2")
        record_measurement(s, H100_SXM, P1, "sdpa_math", {}, replace(ok(1.0), status="launch_error"), run_id="r2")
        record_measurement(s, H100_SXM, P1, "sdpa_efficient", {}, ok(30.0), run_id="r1")
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 64}, ok(50.0), run_id="r2")  # not a peer
    with Session() as s:
        peers = peer_rows(s, H100_SXM.key, P1.key)
        assert set(peers) == {"sdpa_flash", "sdpa_efficient"}
        assert peers["sdpa_flash"].tflops == 42.0 and peers["sdpa_flash"].run_id == "r2"
        r1 = peer_rows(s, H100_SXM.key, P1.key, run_id="r1")
        assert r1["sdpa_flash"].tflops == 40.0 and set(r1) == {"sdpa_flash", "sdpa_efficient"}
        assert peer_rows(s, A100_SXM.key, P1.key) == {}


def test_status_counts_and_filters(Session) -> None:
    with Session() as s, s.begin():
        record_measurement(s, H100_SXM, P1, "simt", {"a": 1}, ok(1.0))
        record_measurement(s, H100_SXM, P1, "simt", {"a": 2}, Measurement("timeout"))
        record_measurement(s, H100_SXM, P1, "wgmma", {"a": 1}, Measurement("invalid"))
        record_measurement(s, A100_SXM, P2, "simt", {"a": 1}, ok(2.0))
    with Session() as s:
        allc = status_counts(s)
        assert allc["ok"] == 2 and allc["timeout"] == 1 and allc["invalid"] == 1 and allc["crash"] == 0
        h = status_counts(s, gpu_key=H100_SXM.key, family="simt")
        assert (h["ok"], h["timeout"], h["invalid"]) == (1, 1, 0)
        assert len(measurements(s, gpu_key=A100_SXM.key)) == 1
        assert len(measurements(s, family="simt", problem_key=P1.key)) == 2
        assert list_problems(s, gpu_key=A100_SXM.key) == [P2]
        assert [g.key for g in list_gpus(s)] == sorted([H100_SXM.key, A100_SXM.key])


# --- concurrency -------------------------------------------------------------------------------

N_PER_WORKER = 25


def _writer(url: str, worker: int, n: int) -> None:
    """One process or thread: its own engine; every write races the others on the same rows."""
    engine = make_engine(url)
    Session = session_factory(engine)
    for i in range(n):
        with Session() as s, s.begin():
            p = P1 if i % 2 else P2
            record_measurement(s, H100_SXM, p, "simt", {"Br": 16 * (i % 5)}, ok(1.0 + i),
                               run_id=f"w{worker}", trial_number=i)
            update_best(s, H100_SXM.key, p.key, "simt")
    engine.dispose()


def _check_after_concurrency(url: str, workers: int) -> None:
    Session = session_factory(make_engine(url))
    with Session() as s:
        assert count(s, MeasurementRow) == workers * N_PER_WORKER
        assert count(s, GpuRow) == 1 and count(s, ProblemRow) == 2 and count(s, ConfigRow) == 5
        assert count(s, BestRow) == 2
        pairs = s.execute(select(MeasurementRow.run_id, MeasurementRow.trial_number)).all()
        assert len(set(pairs)) == len(pairs) == workers * N_PER_WORKER
        assert {b.tflops for b in best_rows(s)} == {float(N_PER_WORKER), float(N_PER_WORKER - 1)}


def test_concurrent_threads(url: str) -> None:
    make_engine(url).dispose()
    errors: list[BaseException] = []

    def run(w: int) -> None:
        try:
            _writer(url, w, N_PER_WORKER)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    _check_after_concurrency(url, 4)


def test_concurrent_processes(url: str) -> None:
    # no pre-creation: the processes also race to create the schema
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(url, w, N_PER_WORKER)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    _check_after_concurrency(url, 3)


def test_readonly_reader_does_not_block_writer(Session, url: str) -> None:
    reader = session_factory(make_engine(url, readonly=True))
    with reader() as r:
        assert r.scalar(select(func.count()).select_from(MeasurementRow)) == 0  # read txn stays open
        with Session() as s, s.begin():
            record_measurement(s, H100_SXM, P1, "simt", {}, ok(1.0))
        assert r.execute(text("SELECT 1")).scalar() == 1
    with reader() as r:
        assert len(measurements(r)) == 1
