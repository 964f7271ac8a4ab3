"""The search loop end to end on the CPU: a ReplayRunner answers from recorded measurements.

`replay_db` is tests/fixtures/h100_simt.db (measured on an H100) when it exists, else a synthetic
database built here from a deterministic formula over every valid point of a small problem. The
tests read the problem, the GPU and the answers from whichever database they got, so they hold
for both.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest

from tuner.db import queries
from tuner.db.engine import make_engine, session_factory
from tuner.gpu import H100_SXM, GpuSpec
from tuner.kernel_templates import get_family
from tuner.problem import Problem
from tuner.records import Measurement, params_key
from tuner.runner import ReplayRunner
from tuner.search import Progress, Search, study_name

FAM = get_family("flash_fwd_simt")
FIXTURE = Path(__file__).parent / "fixtures" / "h100_simt.db"
SYNTH_PROBLEM = Problem(2, 4, 512, 512, 64, "fp32", True)
SYNTH_VERSIONS = {"driver": "580.00", "nvrtc": "13.0", "torch": "2.11.0", "tuner": "0.1.0"}

optuna.logging.set_verbosity(optuna.logging.WARNING)


def synth_tflops(p: dict) -> float:
    """Deterministic and structured (bigger tiles, TM=TN=4 best), unique through a hash term."""
    h = int(hashlib.sha256(params_key(p).encode()).hexdigest()[:6], 16) / 16**6
    shape = math.log2(p["Br"]) + math.log2(p["Bc"]) - abs(math.log2(p["TM"]) - 2) - abs(math.log2(p["TN"]) - 2)
    return round(5.0 + shape + 0.5 * p["stages"] + 0.25 * p["min_blocks"] + h, 6)


def synth_wrong(p: dict) -> bool:
    return p["TN"] == 8 and p["stages"] == 2


@dataclass
class Replay:
    url: str
    gpu: GpuSpec
    problem: Problem
    answers: dict[str, dict]  # params_key -> latest replay row of flash_fwd_simt
    synthetic: bool

    @property
    def ok(self) -> dict[str, dict]:
        return {k: r for k, r in self.answers.items() if r["status"] == "ok" and r["tflops"]}

    @property
    def answered_valid(self) -> list[dict]:
        return [p for p in FAM.valid_points(self.gpu, self.problem) if params_key(p) in self.answers]

    @property
    def shape_arg(self) -> str:
        p = self.problem
        return f"{p.batch},{p.heads},{p.seqlen_q},{p.head_dim}" + (",causal" if p.causal else "")


def _build_synthetic(url: str) -> None:
    sessions = session_factory(make_engine(url))
    points = FAM.valid_points(H100_SXM, SYNTH_PROBLEM)
    assert any(synth_wrong(p) for p in points) and not all(synth_wrong(p) for p in points)
    with sessions.begin() as s:
        for p in points:
            tf = synth_tflops(p)
            if synth_wrong(p):  # fast but wrong: must never win
                m = Measurement("wrong_result", median_ms=SYNTH_PROBLEM.flops() / 100e12 * 1e3, tflops=100.0,
                                rel_err=0.5, versions=SYNTH_VERSIONS, message="rel err 0.5 over budget")
            else:
                ms = SYNTH_PROBLEM.flops() / (tf * 1e12) * 1e3
                m = Measurement("ok", median_ms=ms, min_ms=ms * 0.98, max_ms=ms * 1.05, tflops=tf,
                                rel_err=1e-6, versions=SYNTH_VERSIONS, reps=50)
            queries.record_measurement(s, H100_SXM, SYNTH_PROBLEM, FAM.name, p, m, run_id="synthetic")
            if m.ok:
                queries.update_best(s, H100_SXM.key, SYNTH_PROBLEM.key, FAM.name)
        for backend, tf in (("sdpa_efficient", 12.0), ("sdpa_math", 3.0)):
            ms = SYNTH_PROBLEM.flops() / (tf * 1e12) * 1e3
            queries.record_measurement(s, H100_SXM, SYNTH_PROBLEM, backend, {},
                                       Measurement("ok", median_ms=ms, tflops=tf, versions=SYNTH_VERSIONS))


def _load(url: str, synthetic: bool) -> Replay:
    sessions = session_factory(make_engine(url, readonly=True))
    with sessions() as s:
        gpus = queries.list_gpus(s)
        gpu = GpuSpec(**gpus[0].spec)
        rows = queries.measurements(s, gpu_key=gpu.key, family=FAM.name)
    by_problem: dict[str, list[dict]] = {}
    for r in rows:
        by_problem.setdefault(r["problem_key"], []).append(r)
    pkey = max(by_problem, key=lambda k: len(by_problem[k]))  # the most measured problem
    first = by_problem[pkey][0]
    problem = Problem(first["batch"], first["heads"], first["seqlen_q"], first["seqlen_k"], first["head_dim"],
                      first["dtype"], bool(first["causal"]), first["kv_heads"])
    answers: dict[str, dict] = {}
    for r in sorted(by_problem[pkey], key=lambda r: (r["created_at"], r["id"])):
        answers[params_key(r["params"])] = r  # latest wins, as ReplayRunner answers
    return Replay(url, gpu, problem, answers, synthetic)


@pytest.fixture(scope="session")
def synthetic_db(tmp_path_factory) -> Replay:
    """Always the synthetic DB: it has wrong_result rows faster than every ok row."""
    url = f"sqlite:///{tmp_path_factory.mktemp('synthetic') / 'synthetic.db'}"
    _build_synthetic(url)
    return _load(url, synthetic=True)


@pytest.fixture(scope="session")
def replay_db(tmp_path_factory) -> Replay:
    if FIXTURE.exists():  # copied: opening a SQLite file writes to it (schema check, WAL); never the fixture
        d = tmp_path_factory.mktemp("replay")
        shutil.copy(FIXTURE, d / FIXTURE.name)
        (d / FIXTURE.name).chmod(0o644)
        replay = _load(f"sqlite:///{d / FIXTURE.name}", synthetic=False)
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp('replay') / 'synthetic.db'}"
        _build_synthetic(url)
        replay = _load(url, synthetic=True)
    assert replay.ok, "the replay database has no ok measurement"
    if replay.problem.seqlen_q != replay.problem.seqlen_k or replay.problem.kv_heads != replay.problem.heads:
        pytest.fail(f"the replay problem {replay.problem.key} is not expressible as --shape B,H,N,D")
    return replay


class SpyRunner(ReplayRunner):
    """A ReplayRunner that remembers what it was asked to measure."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.asked: list[dict] = []

    def measure(self, family, params, problem):
        self.asked.append(dict(params))
        return super().measure(family, params, problem)


def _search(replay: Replay, target: str, **kw) -> tuple[Search, SpyRunner, list[Progress]]:
    events: list[Progress] = []
    runner = SpyRunner(replay.url)
    s = Search(runner, session_factory(make_engine(target)), target, observer=events.append, **kw)
    return s, runner, events


def _rows(target: str, replay: Replay) -> list[dict]:
    with session_factory(make_engine(target, readonly=True))() as s:
        return queries.measurements(s, gpu_key=replay.gpu.key, family=FAM.name, problem_key=replay.problem.key)


def _study(target: str, replay: Replay) -> optuna.Study:
    return optuna.load_study(study_name=study_name(replay.gpu.key, FAM.name, replay.problem.key), storage=target)


def test_replay_runner_answers_like_the_db(replay_db):
    runner = ReplayRunner(replay_db.url)
    assert runner.gpu.key == replay_db.gpu.key
    for k, row in list(replay_db.answers.items())[:20]:
        m = runner.measure(FAM, row["params"], replay_db.problem)
        assert m is not None and m.status == row["status"] and m.tflops == row["tflops"]
    miss = runner.measure(FAM, {**row["params"], "Br": 4096}, replay_db.problem)
    assert miss is None
    with pytest.raises(ValueError, match="no GPU"):
        ReplayRunner(replay_db.url, gpu_key="Nope/sm_00")


def test_replay_runner_rejects_empty_or_missing_db(tmp_path):
    from tuner.db.engine import DatabaseError

    with pytest.raises(DatabaseError, match="no database at"):
        ReplayRunner(f"sqlite:///{tmp_path / 'missing.db'}")
    make_engine(f"sqlite:///{tmp_path / 'empty.db'}").dispose()  # a real, empty results database
    with pytest.raises(ValueError, match="holds no measurements"):
        ReplayRunner(f"sqlite:///{tmp_path / 'empty.db'}")


def test_tpe_search_end_to_end(replay_db, tmp_path):
    target = f"sqlite:///{tmp_path / 'results.db'}"
    trials = 25
    s, runner, events = _search(replay_db, target, seed=0)
    result = s.tune(FAM, replay_db.problem, trials=trials)
    gpu, problem = replay_db.gpu, replay_db.problem

    study = _study(target, replay_db)
    assert study.trials[0].params == FAM.default(gpu, problem)
    counted = [t for t in study.trials if t.user_attrs.get("counted")]
    assert len(counted) == trials == events[-1].done
    assert [e.done for e in events] == sorted(e.done for e in events)

    # invalid points: recorded as such, never handed to the runner
    asked = {params_key(p) for p in runner.asked}
    assert all(FAM.check(p, gpu, problem) is None for p in runner.asked)
    rows = _rows(target, replay_db)
    invalid_rows = [r for r in rows if r["status"] == "invalid"]
    for r in invalid_rows:
        assert FAM.check(r["params"], gpu, problem) == r["message"]
        assert params_key(r["params"]) not in asked
    for e in events:
        if e.source == "invalid":
            assert e.measurement.status == "invalid" and FAM.check(e.params, gpu, problem) is not None
        else:
            assert FAM.check(e.params, gpu, problem) is None
    for t in study.trials:
        if t.user_attrs.get("source") == "invalid":
            assert t.user_attrs["status"] == "invalid" and not t.user_attrs["counted"] and t.value == 0.0

    # every counted trial has its measurement row; measured ones carry the study and trial number
    by_params = {params_key(r["params"]): r for r in rows}
    for t in counted:
        assert params_key(t.params) in by_params
        if t.user_attrs["source"] == "measured":
            assert any(r["trial_number"] == t.number and r["study_name"] == study.study_name for r in rows)
    assert sum(result.counts.values()) == len([e for e in events])

    # best = the fastest ok point the search saw, as stored in ft_best and the result
    ok_rows = [r for r in rows if r["status"] == "ok"]
    assert ok_rows
    top = max(ok_rows, key=lambda r: r["tflops"])
    assert result.best is not None and result.best.tflops == top["tflops"]
    assert result.best_params == top["params"]
    with session_factory(make_engine(target, readonly=True))() as ses:
        (b,) = [b for b in queries.best_rows(ses, gpu.key) if b.problem == problem]
    assert b.tflops == top["tflops"] and b.params == top["params"]
    assert replay_db.answers[params_key(b.params)]["status"] == "ok"
    assert b.tflops <= max(r["tflops"] for r in replay_db.ok.values())
    assert events[-1].best_tflops == b.tflops
    # the optimizer saw TFLOP/s for ok points and 0 for every failure
    for t in study.trials:
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert (t.value > 0) == (t.user_attrs["status"] == "ok")


def test_search_resumes_and_reuses_the_db(replay_db, tmp_path):
    target = f"sqlite:///{tmp_path / 'results.db'}"
    s1, r1, ev1 = _search(replay_db, target, seed=0)
    first = s1.tune(FAM, replay_db.problem, trials=8)
    rows1 = _rows(target, replay_db)
    seen = {params_key(e.params) for e in ev1}

    # same budget again: the study is complete, nothing is asked, nothing is measured
    s2, r2, ev2 = _search(replay_db, target, seed=0)
    again = s2.tune(FAM, replay_db.problem, trials=8)
    assert ev2 == [] and r2.asked == []
    assert len(_rows(target, replay_db)) == len(rows1)
    assert again.study_name == first.study_name and again.best_params == first.best_params

    # a larger budget resumes the same study up to it; seen points answer from the DB
    s3, r3, ev3 = _search(replay_db, target, seed=1)
    s3.tune(FAM, replay_db.problem, trials=14)
    study = _study(target, replay_db)
    assert len([t for t in study.trials if t.user_attrs.get("counted")]) == 14
    assert next(e for e in ev3 if e.source != "invalid").done == 9  # continues from 8
    for e in ev3:
        if params_key(e.params) in seen:
            assert e.source in ("database", "invalid"), e
    assert all(params_key(p) not in seen for p in r3.asked)
    new_rows = _rows(target, replay_db)[len(rows1):]
    assert len(new_rows) == len({params_key(e.params) for e in ev3} - seen)
    assert all(r["run_id"] == s3.run_id for r in new_rows)


def test_db_answer_reused_by_a_fresh_study(replay_db, tmp_path):
    """Another study (other sampler) on the same DB: a point measured once is not measured again."""
    target = f"sqlite:///{tmp_path / 'results.db'}"
    s1, _, ev1 = _search(replay_db, target, seed=0)
    s1.tune(FAM, replay_db.problem, trials=6)
    # delete the study but keep the measurements: the next run must reuse them
    optuna.delete_study(study_name=study_name(replay_db.gpu.key, FAM.name, replay_db.problem.key), storage=target)
    s2, r2, ev2 = _search(replay_db, target, seed=0)
    s2.tune(FAM, replay_db.problem, trials=6)
    assert ev2 and [e.source for e in ev2[:1]] == ["database"]  # the default again, from the DB
    assert r2.asked == [e.params for e in ev2 if e.source == "measured"]
    assert sum(e.source == "database" for e in ev2) >= 1


def test_wrong_results_never_win(synthetic_db, tmp_path):
    replay_db = synthetic_db
    wrong = {k for k, r in replay_db.answers.items() if r["status"] == "wrong_result"}
    assert wrong and all(replay_db.answers[k]["tflops"] > max(r["tflops"] for r in replay_db.ok.values())
                         for k in wrong)
    target = f"sqlite:///{tmp_path / 'results.db'}"
    s, runner, events = _search(replay_db, target, seed=3, sampler="random")
    result = s.tune(FAM, replay_db.problem, trials=60)
    hit = [e for e in events if params_key(e.params) in wrong]
    assert hit, "the random search never met a wrong_result point"
    for e in hit:
        assert e.measurement.status == "wrong_result"
        assert e.best_tflops is None or e.best_tflops < 100.0
    assert result.best_params is not None and params_key(result.best_params) not in wrong
    assert result.best.tflops < 100.0
    assert result.counts.get("wrong_result", 0) == len(hit)
    with session_factory(make_engine(target, readonly=True))() as ses:
        (b,) = queries.best_rows(ses, replay_db.gpu.key)
    assert params_key(b.params) not in wrong and b.tflops == result.best.tflops


def test_grid_visits_every_valid_point(replay_db, tmp_path):
    target = f"sqlite:///{tmp_path / 'results.db'}"
    valid = replay_db.answered_valid
    s, runner, events = _search(replay_db, target, seed=0, sampler="grid")
    result = s.tune(FAM, replay_db.problem, trials=len(valid))
    visited = {params_key(e.params) for e in events if e.source != "invalid"}
    assert visited == {params_key(p) for p in valid}
    assert len(runner.asked) == len(valid)  # each valid point measured exactly once
    assert {params_key(p) for p in runner.asked} == visited
    # having seen everything, the best is the best of the replay DB
    best = max(replay_db.ok.values(), key=lambda r: r["tflops"])
    assert result.best.tflops == best["tflops"]
    assert all(e.source != "invalid" for e in events)   # only valid points are asked: no trial on the rest

    # asking for more than the grid holds ends cleanly once it is exhausted (no study.stop error)
    s2, runner2, events2 = _search(replay_db, target, seed=0, sampler="grid")
    again = s2.tune(FAM, replay_db.problem, trials=len(valid) + 5)
    assert runner2.asked == [] and all(e.source != "measured" for e in events2)
    assert again.best.tflops == result.best.tflops


def test_grid_cut_short_goes_on_where_it_stopped(replay_db, tmp_path):
    target = f"sqlite:///{tmp_path / 'results.db'}"
    valid = replay_db.answered_valid
    first, runner, _ = _search(replay_db, target, seed=0, sampler="grid")
    first.tune(FAM, replay_db.problem, trials=3)
    assert len(runner.asked) == 3
    # the points are queued one an ask (Optuna's ask reads every waiting trial), so none is left waiting
    assert _study(target, replay_db).get_trials(states=(optuna.trial.TrialState.WAITING,)) == []
    rest, runner2, events = _search(replay_db, target, seed=0, sampler="grid")
    rest.tune(FAM, replay_db.problem, trials=10_000)
    assert len(runner2.asked) == len(valid) - 3   # nothing measured twice, nothing left out
    assert {e.wanted for e in events} == {len(valid)}   # progress counts towards the space, not --trials
    assert [e.done for e in events] == list(range(4, len(valid) + 1))
    assert {params_key(p) for p in runner.asked + runner2.asked} == {params_key(p) for p in valid}
    assert all(e.source == "measured" for e in events)


def test_peers_measured_and_recorded(replay_db, tmp_path):
    target = f"sqlite:///{tmp_path / 'results.db'}"
    s, _, _ = _search(replay_db, target, seed=0)
    peers = s.measure_peers(replay_db.problem)
    with session_factory(make_engine(target, readonly=True))() as ses:
        stored = queries.peer_rows(ses, replay_db.gpu.key, replay_db.problem.key, run_id=s.run_id)
    assert set(stored) == {k for k, m in peers.items() if m.ok}
    if replay_db.synthetic:
        assert set(peers) == {"sdpa_efficient", "sdpa_math"} and stored["sdpa_efficient"].tflops == 12.0


def test_unsupported_problem_is_refused(replay_db, tmp_path):
    target = f"sqlite:///{tmp_path / 'results.db'}"
    s, _, _ = _search(replay_db, target, seed=0)
    with pytest.raises(ValueError, match="head dim"):
        s.tune(FAM, Problem(1, 1, 128, 128, 80, "fp32"), trials=3)
    with pytest.raises(ValueError, match="sampler"):
        _search(replay_db, target, sampler="annealing")


def test_cli_search_replay(replay_db, tmp_path):
    from typer.testing import CliRunner

    from tuner.cli import app
    from tuner.export import read_lookup

    db = f"sqlite:///{tmp_path / 'cli.db'}"
    lookup = tmp_path / "best.json"
    args = ["search", "--replay", replay_db.url, "--db", db, "--shape", replay_db.shape_arg,
            "--dtype", replay_db.problem.dtype, "--trials", "10", "--no-peers", "--seed", "0",
            "--lookup", str(lookup)]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, (out.output, out.exception)
    assert replay_db.problem.key in out.output and "best config" in out.output
    assert "entries written to" in out.output
    doc = read_lookup(lookup)
    (entry,) = doc["entries"]
    assert entry["gpu_key"] == replay_db.gpu.key and entry["family"] == FAM.name
    assert entry["bucket"] == replay_db.problem.bucket().key
    assert replay_db.answers[params_key(entry["params"])]["status"] == "ok"
    assert entry["tflops"] == replay_db.answers[params_key(entry["params"])]["tflops"]
    with session_factory(make_engine(db, readonly=True))() as ses:
        counts = queries.status_counts(ses, replay_db.gpu.key, FAM.name)
    assert sum(v for k, v in counts.items() if k != "invalid") == 10


def test_replay_never_writes_to_the_recording(tmp_path):
    """`tuner search --replay FILE` reads the recording through SQLite's read-only mode."""
    import os
    import stat

    fixture = Path(__file__).parent / "fixtures" / "h100_simt.db"
    copy = tmp_path / "recording.db"
    shutil.copy(fixture, copy)
    os.chmod(copy, stat.S_IRUSR)  # a write would fail loudly, not silently change the file
    before = hashlib.sha256(copy.read_bytes()).hexdigest()
    runner = ReplayRunner(f"sqlite:///{copy}")
    fam = get_family("flash_fwd_simt")
    problem = Problem(2, 4, 512, 512, 64, "fp32", True)
    m = runner.measure(fam, fam.default(runner.gpu, problem), problem)
    assert m is not None and m.status == "ok" and m.tflops > 0
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recording.db"]  # no -wal / -shm either


def test_retry_failed_measures_stored_failures_again(replay_db, tmp_path):
    """A failure stored for a point answers for it (no re-measure) unless --retry-failed; then the
    study queues the failed points again (after the seeds still waiting) and the new result counts."""
    target = f"sqlite:///{tmp_path / 'retry.db'}"
    s, runner, _ = _search(replay_db, target)
    point = FAM.default(replay_db.gpu, replay_db.problem)
    with s.sessions.begin() as db:  # a host-side failure recorded for the default point
        queries.record_measurement(db, replay_db.gpu, replay_db.problem, FAM.name, point,
                                   Measurement("launch_error", message="TypeError: host bug", versions=runner.versions()))
    s.tune(FAM, replay_db.problem, trials=3)
    assert params_key(point) not in {params_key(p) for p in runner.asked}  # the stored failure answered

    s2, runner2, _ = _search(replay_db, target, retry_failed=True)
    s2.tune(FAM, replay_db.problem, trials=10)
    assert params_key(point) in {params_key(p) for p in runner2.asked}  # measured again this time
    latest = [r for r in _rows(target, replay_db) if params_key(r["params"]) == params_key(point)]
    assert [r["status"] for r in sorted(latest, key=lambda r: r["id"])][-1] == replay_db.answers[params_key(point)]["status"]
