"""What the search tells Optuna, which families it keeps, and where a new study starts: on the CPU,
through the H100 replay fixture and a runner that answers from a table."""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna
import pytest

from tuner.db.engine import make_engine, session_factory
from tuner.gpu import H100_SXM
from tuner.kernel_templates import get_family
from tuner.problem import Problem
from tuner.records import Measurement
from tuner.runner import ReplayRunner
from tuner.search import Search, study_name

SIMT, MMA = get_family("flash_fwd_simt"), get_family("flash_fwd_mma")
FIXTURE = Path(__file__).parent / "fixtures" / "h100_simt.db"
P = Problem(2, 8, 1024, 1024, 64, "bf16", "causal")


class TableRunner:
    """Answers every point at once: TFLOP/s per family (scaled a little by Br), `fails` for the
    points it names; remembers what was measured and what was prefetched."""

    def __init__(self, speed: dict[str, float], fails=lambda params: False) -> None:
        self.gpu, self.speed, self.fails = H100_SXM, speed, fails
        self.asked: list[tuple[str, dict]] = []
        self.prefetched: list[tuple[str, list[dict]]] = []

    def versions(self) -> dict:
        return {"table": "1"}

    def prefetch(self, family, points, problem) -> None:
        self.prefetched.append((family.name, [dict(p) for p in points]))

    def measure(self, family, params, problem) -> Measurement:
        self.asked.append((family.name, dict(params)))
        if self.fails(params):
            return Measurement("wrong_result", message="error over budget", versions=self.versions())
        tflops = self.speed[family.name] * (1 + params["Br"] / 1000)
        return Measurement("ok", median_ms=problem.flops() / tflops / 1e9, tflops=tflops, versions=self.versions())

    def peer(self, backend, problem):
        return None

    def close(self) -> None:
        pass


def _violated(t: optuna.trial.FrozenTrial) -> bool:
    """TPE's view: Optuna 5 keeps set_constraint's values in trial.constraints, 4 a system attr."""
    found = getattr(t, "constraints", None)
    values = found.values() if isinstance(found, dict) else t.system_attrs.get("constraints") or ()
    return any(v > 0 for v in values)


def _search(runner, tmp_path, name="r.db", **kw) -> tuple[Search, str]:
    url = f"sqlite:///{tmp_path / name}"
    return Search(runner, session_factory(make_engine(url)), url, seed=0, **kw), url


def _trials(url: str, family, problem) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study_name(H100_SXM.key, family.name, problem.key), storage=url).trials


def test_failures_are_failed_trials_and_refusals_constraint_violations(tmp_path):
    """Optuna never sees 0 TFLOP/s for a point that failed (a FAIL trial) or that check refused
    (a violated constraint, so TPE ranks it by the violation, not by a made-up speed)."""
    runner = TableRunner({MMA.name: 100.0}, fails=lambda p: p["stages"] == 3)
    s, url = _search(runner, tmp_path)
    result = s.tune(MMA, P, trials=20)
    trials = _trials(url, MMA, P)
    by_status: dict[str, list] = {}
    for t in trials:
        by_status.setdefault(t.user_attrs.get("status"), []).append(t)
    assert by_status["wrong_result"] and by_status["invalid"] and by_status["ok"]
    assert all(t.state == optuna.trial.TrialState.FAIL and t.value is None for t in by_status["wrong_result"])
    for t in by_status["invalid"]:
        assert t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs["violation"] == 1.0
        assert _violated(t)
    assert all(t.value > 0 for t in by_status["ok"])
    # a failed point counts as measured: the study holds 20, and a resumed search asks for no more
    assert sum(1 for t in trials if t.user_attrs.get("counted")) == 20 and result.counts["wrong_result"] >= 1
    asked = len(runner.asked)
    s.tune(MMA, P, trials=20)
    assert len(runner.asked) == asked


def test_replay_fixture_invalid_points_are_constraint_violations(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "rec.db")
    (tmp_path / "rec.db").chmod(0o644)
    runner = ReplayRunner(f"sqlite:///{tmp_path / 'rec.db'}")
    problem = Problem(2, 4, 512, 512, 64, "fp32", True)
    s, url = _search(runner, tmp_path)
    s.tune(SIMT, problem, trials=25)
    trials = [t for t in _trials(url, SIMT, problem) if t.state != optuna.trial.TrialState.FAIL]   # FAIL: replay misses
    invalid = [t for t in trials if t.user_attrs["status"] == "invalid"]
    assert invalid and all(t.user_attrs["violation"] == 1.0 and _violated(t) for t in invalid)
    assert all(t.value > 0 for t in trials if t.user_attrs["status"] == "ok")
    assert {t.user_attrs["status"] for t in trials} <= {"ok", "invalid"}


def test_a_family_far_behind_is_dropped_after_its_starts(tmp_path):
    dropped = []
    runner = TableRunner({SIMT.name: 8.0, MMA.name: 100.0})
    s, _ = _search(runner, tmp_path)
    results = s.tune_all([SIMT, MMA], P, trials=16, on_drop=lambda f, why: dropped.append((f.name, why)))
    simt_starts = s.starts(SIMT, P)
    assert [name for name, _ in dropped] == ["flash_fwd_simt"] and "under 0.6x" in dropped[0][1]
    assert [p for f, p in runner.asked if f == SIMT.name] == simt_starts   # its starts, then nothing
    assert sum(1 for f, _ in runner.asked if f == MMA.name) == 16
    by = {r.family: r for r in results}
    assert by[SIMT.name].dropped and not by[MMA.name].dropped and by[MMA.name].best.tflops > 100
    # near enough: both kept
    runner = TableRunner({SIMT.name: 70.0, MMA.name: 100.0})
    s, _ = _search(runner, tmp_path, "r2.db")
    assert not any(r.dropped for r in s.tune_all([SIMT, MMA], P, trials=12))
    assert sum(1 for f, _ in runner.asked if f == SIMT.name) == 12


def test_a_new_study_starts_from_the_nearest_tuned_problems(tmp_path):
    """The best config of the nearest problem this family was tuned on (same GPU, dtype, head dim,
    mask) is the first trial of a new study, and the starts are handed to prefetch."""
    runner = TableRunner({MMA.name: 100.0})
    s, url = _search(runner, tmp_path)
    s.tune(MMA, P, trials=10)
    best = s._best_entry(MMA, P).params
    near = Problem(4, 8, 2048, 2048, 64, "bf16", "causal")
    assert s.starts(MMA, near)[0] == best
    s.tune(MMA, near, trials=2)
    assert _trials(url, MMA, near)[0].params == best
    assert runner.prefetched[-1] == (MMA.name, s.starts(MMA, near)[1:])
    for other in (Problem(4, 8, 2048, 2048, 64, "bf16", "none"), Problem(4, 8, 2048, 2048, 128, "bf16", "causal"),
                  Problem(4, 8, 2048, 2048, 64, "fp16", "causal"), Problem(4, 8, 2048, 4096, 64, "bf16", "causal_br")):
        assert s.starts(MMA, other)[0] == MMA.default(H100_SXM, other), other.key   # nothing comparable tuned


class CompilingRunner(TableRunner):
    """A runner whose prefetch compiles (as the GPU runner's does): the search asks ahead for it."""

    compiles = True

    def measure(self, family, params, problem) -> Measurement:
        self.events.append(("measure", dict(params)))
        return super().measure(family, params, problem)

    def prefetch(self, family, points, problem) -> None:
        self.events.extend(("prefetch", dict(p)) for p in points)
        super().prefetch(family, points, problem)


def test_the_next_point_compiles_while_this_one_is_measured(tmp_path):
    """With a compiling runner, each point but the first is prefetched while an earlier one is
    measured; the one asked ahead when the search ends is a failed trial that does not count,
    and no trial is left running."""
    runner = CompilingRunner({MMA.name: 100.0})
    runner.events = []
    s, url = _search(runner, tmp_path)
    result = s.tune(MMA, P, trials=12)
    measured = [p for what, p in runner.events if what == "measure"]
    assert len(measured) == 12 and result.best is not None
    at = lambda event: runner.events.index(event)
    # every point is compiled before it is measured, most while the point before it was measured
    # (not where a refused point, never measured, came between them); not the first (it compiles
    # in line) nor the last (with one trial to go nothing is asked ahead that may not be needed)
    assert all(at(("prefetch", p)) < at(("measure", p)) for p in measured[1:-1])
    overlapped = sum(at(("prefetch", p)) < at(("measure", q)) for q, p in zip(measured, measured[1:-1]))
    assert overlapped >= 6, overlapped
    trials = _trials(url, MMA, P)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    counted = [t for t in trials if t.user_attrs.get("counted")]
    assert len(counted) == 12
    left = [t for t in trials if t.user_attrs.get("status") == "unmeasured"]
    assert all(t.state == optuna.trial.TrialState.FAIL for t in left) and len(left) <= 1


def test_a_replay_does_not_ask_ahead(tmp_path):
    runner = TableRunner({MMA.name: 100.0})
    s, url = _search(runner, tmp_path)
    s.tune(MMA, P, trials=8)
    assert not [t for t in _trials(url, MMA, P) if t.user_attrs.get("status") == "unmeasured"]
    assert len(runner.prefetched) == 1   # the starts only, once, when the study opens
