"""benchmarks/sampler_study.py on the committed sweep: its reported trial counts are what a replayed
search does (the same seed gives the same count), and its arithmetic on a curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_scripts import script

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "h100_simt.db"
REPORT = ROOT / "benchmarks" / "results" / "NVIDIA-H100-80GB-HBM3_sm_90-sampler-study-simt.json"


def test_first_within():
    study = script("sampler_study")
    assert study.first_within([5.0, 9.0, 9.85, 10.0], 10.0, 0.02) == 3
    assert study.first_within([5.0, 9.0, 9.85, 10.0], 10.0, 0.01) == 4
    assert study.first_within([5.0], 10.0, 0.01) is None


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_replayed_search_reproduces_the_reported_trial_counts(sampler):
    """Seed 0 of the committed report, run again through the replay of the sweep (each sampler)."""
    from tuner.problem import Problem

    study = script("sampler_study")
    report = json.loads(REPORT.read_text())
    url = f"sqlite:///{FIXTURE}"
    problem = Problem.from_key(report["problem"])
    for seed in (0,):
        curve = study.run(url, report["family"], problem, sampler, seed, report["budget"])
        assert curve == sorted(curve) and len(curve) <= report["budget"]
        for within, trials in report["samplers"][sampler].items():
            gap = int(within.rstrip("%")) / 100
            assert study.first_within(curve, report["sweep_best_tflops"], gap) == trials[seed], (sampler, seed, within)


# ---- the Hopper sweeps (issue 22): four problems, every valid flash_fwd_sm90 point measured on the H100 ----

SM90_FIXTURE = ROOT / "tests" / "fixtures" / "h100_sm90_sweeps.db"
SM90_REPORT = ROOT / "benchmarks" / "results" / "NVIDIA-H100-80GB-HBM3_sm_90-sampler-study-sm90.json"


def test_the_hopper_sweeps_hold_every_valid_point():
    """Each recorded problem has one ok measurement per point flash_fwd_sm90 allows there, no more and
    no fewer: the sweep is the whole space (a change to the space shows here as a sweep to redo)."""
    from tuner.db import queries
    from tuner.kernel_templates import get_family
    from tuner.problem import Problem
    from tuner.records import params_key
    from tuner.runner import ReplayRunner

    family = get_family("flash_fwd_sm90")
    replay = ReplayRunner(f"sqlite:///{SM90_FIXTURE}")
    try:
        keys = replay.recorded_problems()
        assert len(keys) >= 4
        with replay.sessions() as s:
            for key in keys:
                problem = Problem.from_key(key)
                rows = [r for r in queries.measurements(s, replay.gpu.key, family.name, key) if r["status"] == "ok"]
                measured = [params_key(r["params"]) for r in rows]
                assert len(measured) == len(set(measured)), key
                assert set(measured) == {params_key(p) for p in family.valid_points(replay.gpu, problem)}, key
                assert all(r["tflops"] > 0 for r in rows)
        assert {Problem.from_key(k).head_dim for k in keys} >= {64, 128, 256}
        assert any(Problem.from_key(k).causal for k in keys) and any(not Problem.from_key(k).causal for k in keys)
    finally:
        replay.close()


def _sm90_cases():
    report = json.loads(SM90_REPORT.read_text())
    # one cheap case per way of starting: seed 0 of each, replayed in full
    picks = {("warm", "tpe"), ("cold", "tpe"), ("none", "tpe"), ("none", "random"), ("none", "ga")}
    out = []
    for r in report["studies"]:
        for sampler in r["samplers"]:
            if (r["starts"], sampler) in picks and "D256" in r["problem"]:
                out.append(pytest.param(r, sampler, id=f"{r['starts']}-{sampler}-{r['problem']}"))
    return out


@pytest.mark.parametrize("report,sampler", _sm90_cases())
def test_a_replayed_hopper_search_reproduces_the_reported_trial_counts(report, sampler):
    from tuner.problem import Problem

    study = script("sampler_study")
    best = report["sweep_best_tflops"]
    curve = study.run(f"sqlite:///{SM90_FIXTURE}", report["family"], Problem.from_key(report["problem"]), sampler, 0,
                      report["budget"], report["starts"], until=(1 - min(study.WITHIN)) * best)
    for within, trials in report["samplers"][sampler].items():
        gap = int(within.rstrip("%")) / 100
        assert study.first_within(curve, report["sweep_best_tflops"], gap) == trials[0], within
