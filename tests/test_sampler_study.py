"""benchmarks/sampler_study.py on the committed sweep: its reported trial counts are what a replayed
search does (the same seed gives the same count), and its arithmetic on a curve."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "h100_simt.db"
REPORT = ROOT / "benchmarks" / "results" / "NVIDIA-H100-80GB-HBM3_sm_90-sampler-study-simt.json"


def _study():
    spec = importlib.util.spec_from_file_location("sampler_study", ROOT / "benchmarks" / "sampler_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_within():
    study = _study()
    assert study.first_within([5.0, 9.0, 9.85, 10.0], 10.0, 0.02) == 3
    assert study.first_within([5.0, 9.0, 9.85, 10.0], 10.0, 0.01) == 4
    assert study.first_within([5.0], 10.0, 0.01) is None


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_replayed_search_reproduces_the_reported_trial_counts(sampler):
    """Seed 0 of the committed report, run again through the replay of the sweep (each sampler)."""
    from tuner.problem import Problem

    study = _study()
    report = json.loads(REPORT.read_text())
    url = f"sqlite:///{FIXTURE}"
    problem = Problem.from_key(report["problem"])
    for seed in (0,):
        curve = study.run(url, report["family"], problem, sampler, seed, report["budget"])
        assert curve == sorted(curve) and len(curve) <= report["budget"]
        for within, trials in report["samplers"][sampler].items():
            gap = int(within.rstrip("%")) / 100
            assert study.first_within(curve, report["sweep_best_tflops"], gap) == trials[seed], (sampler, seed, within)
