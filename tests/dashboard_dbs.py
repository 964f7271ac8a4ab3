"""Small, deterministic results databases for the dashboard's tests, written through the project's
own db API: two GPUs (an H100 and an H200) whose winners differ on some shapes, grid and model
shapes, the peers sdpa_flash, sdpa_cudnn and fa4, and trials that `check` rejects or that fail
to compile, each with its reason. Nothing random: every figure follows from the params."""

from __future__ import annotations

import itertools
from pathlib import Path

from tuner.db import make_engine, queries, session_factory
from tuner.gpu import H100_SXM, GpuSpec
from tuner.problem import Problem
from tuner.records import Measurement, Resources
from tuner.search import study_name

H200 = GpuSpec("NVIDIA H200", 9, 0, 132, 232448, 233472, 65536, 60 * 2**20, 141 * 2**30)
GRID = (Problem(16, 32, 1024, 1024, 64, "bf16", False), Problem(4, 16, 4096, 4096, 128, "bf16", True))
MODEL = (Problem(1, 32, 8192, 8192, 128, "bf16", True, kv_heads=8),  # Llama-3-8B prefill, GQA
         Problem(64, 16, 197, 197, 64, "bf16", False))               # ViT-L/16
FLAT = Problem(32, 16, 197, 197, 64, "fp16", False)  # a study whose every point is equally fast
SPACE = {"Bc": (64, 128, 176), "stages": (2, 3), "cwg": (1, 2, 3)}
PEERS = {"sdpa_cudnn": 0.93, "fa4": 1.02, "sdpa_flash": 0.60}  # peer TFLOP/s as a share of the H100 winner
INVALID = "Bc=176 with 3 stages needs 245760 bytes of shared memory; the GPU allows 232448"


def _favourite(gpu: GpuSpec, p: Problem) -> int:
    """The Bc that wins: 128 on the H100; on the H200 176 at d=64, so winners differ there."""
    return 176 if gpu is H200 and p.head_dim == 64 else 128


def _tflops(gpu: GpuSpec, p: Problem, params: dict) -> float:
    base = 400.0 + p.head_dim + (60.0 if gpu is H200 else 0.0)
    return base - 0.5 * abs(params["Bc"] - _favourite(gpu, p)) - 8.0 * (params["stages"] == 3) + 5.0 * params["cwg"]


def _study(s, gpu: GpuSpec, p: Problem, flat: bool = False) -> None:
    """Every point of SPACE as trials of one study, in order; the invalid point and one compile error kept."""
    name = study_name(gpu.key, "flash_fwd_sm90", p.key)
    for n, (bc, stages, cwg) in enumerate(itertools.product(*SPACE.values())):
        params = {"Bc": bc, "stages": stages, "cwg": cwg}
        if bc == 176 and stages == 3:
            m = Measurement("invalid", message=INVALID)
        elif (bc, stages, cwg) == (64, 3, 2):
            m = Measurement("compile_error", message="ptxas error: entry function uses too much shared data",
                            resources=Resources(255, 64))
        else:
            tf = 300.0 if flat else _tflops(gpu, p, params)
            ms = p.flops() / tf / 1e9
            m = Measurement("ok", ms, ms, ms, tf, resources=Resources(168, 0, 0, 0, 1024 * bc), reps=50)
        queries.record_measurement(s, gpu, p, "flash_fwd_sm90", params, m, study_name=name, trial_number=n,
                                   run_id="fixture")
    queries.update_best(s, gpu.key, p.key, "flash_fwd_sm90")


def _peers(s, gpu: GpuSpec, p: Problem) -> None:
    top = _tflops(gpu, p, {"Bc": _favourite(gpu, p), "stages": 2, "cwg": max(SPACE["cwg"])})  # the winner
    for family, share in PEERS.items():
        tf = top * share
        ms = p.flops() / tf / 1e9
        queries.record_measurement(s, gpu, p, family, {}, Measurement("ok", ms, ms, ms, tf), run_id="fixture")


def fleet_db(path: Path) -> str:
    """The H100 with grid and model shapes, the H200 with the grid; peers beside every best, and
    one flat study (fp16, ViT-sized) on the H100 whose importances mean nothing."""
    url = f"sqlite:///{path}"
    with session_factory(make_engine(url))() as s, s.begin():
        for gpu, shapes in ((H100_SXM, GRID + MODEL), (H200, GRID)):
            for p in shapes:
                _study(s, gpu, p)
                _peers(s, gpu, p)
        _study(s, H100_SXM, FLAT, flat=True)
    return url
