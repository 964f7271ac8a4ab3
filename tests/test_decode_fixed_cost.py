"""benchmarks/decode_fixed_cost.py's fit: a fixed cost a call and a streaming rate, from timings
over key lengths (CPU; the timings themselves need the GPU)."""

from __future__ import annotations

import pytest

from benchmark_scripts import script


def _row(batch: int, mb: float, fixed: dict, kernel_fixed: dict, tb_s: dict) -> dict:
    names = ("served", "sdpa_cudnn", "copy", "read")
    nbytes = {n: mb * 1e6 * (2 if n == "copy" else 1) for n in names}
    us = {n: fixed[n] + nbytes[n] / (tb_s[n] * 1e6) for n in names}
    kernels = {n: dict(count=1, us=kernel_fixed[n] + nbytes[n] / (tb_s[n] * 1e6)) for n in names}
    return dict(batch=batch, keys=int(mb), bytes=nbytes, us=us, kernels=kernels)


def test_the_fit_recovers_each_contenders_fixed_cost_and_rate():
    fixed = {"served": 8.8, "sdpa_cudnn": 7.9, "copy": 0.5, "read": 10.7}
    kernel_fixed = {n: f - 3.0 for n, f in fixed.items()}
    tb_s = {"served": 3.17, "sdpa_cudnn": 3.12, "copy": 3.02, "read": 3.11}
    rows = [_row(32, mb, fixed, kernel_fixed, tb_s) for mb in (134.0, 268.0, 537.0, 1074.0)]
    rows.append(_row(8, 34.0, fixed, kernel_fixed, tb_s))   # one length only: no fit for B8
    fits = script("decode_fixed_cost").fit_rows(rows)
    assert not any(k.startswith("B8 ") for k in fits)
    for n in fixed:
        assert fits[f"B32 {n}"]["fixed_us"] == pytest.approx(fixed[n], abs=1e-6)
        assert fits[f"B32 {n}"]["tb_s"] == pytest.approx(tb_s[n], rel=1e-9)
        assert fits[f"B32 {n}, kernels"]["fixed_us"] == pytest.approx(kernel_fixed[n], abs=1e-6)
