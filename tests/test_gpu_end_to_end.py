"""On the GPU: a short real search on the GPT-2 shapes, then `attention` runs the winner."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest

pytestmark = pytest.mark.gpu


def _gpt2_args() -> list[str]:
    """The GPT-2 fp32 shapes on the command line (the default problem set is the bf16 grid and models)."""
    from tuner.problem import GPT2_FP32

    shapes = [f"{p.batch},{p.heads},{p.seqlen_q},{p.head_dim}{',causal' if p.causal else ''}" for p in GPT2_FP32]
    return [a for s in shapes for a in ("--shape", s)] + ["--dtype", "fp32"]


GPT2_ARGS = _gpt2_args()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    db = f"sqlite:///{d / 'results.db'}"
    lookup = d / "best.json"
    env = dict(os.environ, TUNER_DB=db)
    trials = os.environ.get("FLASHTUNE_E2E_TRIALS", "30")
    cmd = [sys.executable, "-m", "tuner.cli", "search", "--gpu", "auto", *GPT2_ARGS, "--trials", trials,
           "--lookup", str(lookup)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    print(out.stdout[-5000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stderr
    return db, lookup, out.stdout


def test_search_stores_and_exports(tuned):
    from tuner.db import queries
    from tuner.db.engine import make_engine, session_factory
    from tuner.export import read_lookup
    from tuner.gpu import detect
    from tuner.problem import GPT2_FP32

    db, lookup, stdout = tuned
    gpu = detect()
    with session_factory(make_engine(db))() as s:
        best = {b.problem.key: b for b in queries.best_rows(s, gpu.key)}
        for p in GPT2_FP32:
            assert p.key in best, f"no best config for {p.key}"
            rows = queries.measurements(s, gpu_key=gpu.key, family="flash_fwd_simt", problem_key=p.key)
            assert sum(r["status"] == "ok" for r in rows) >= 5
            assert best[p.key].tflops == max(r["tflops"] for r in rows if r["status"] == "ok")
            peers = queries.peer_rows(s, gpu.key, p.key)
            assert "sdpa_efficient" in peers and peers["sdpa_efficient"].tflops > 0
    doc = read_lookup(lookup)
    assert {e["bucket"] for e in doc["entries"]} >= {p.bucket().key for p in GPT2_FP32}


def test_bench_times_the_winner_beside_the_peers(tuned, tmp_path):
    """`tuner bench` re-times each tuned best in one job with the peers: every row has both
    figures, and the DB holds them under the bench's own run."""
    import json

    from tuner.db import queries
    from tuner.db.engine import make_engine, session_factory
    from tuner.gpu import detect
    from tuner.problem import GPT2_FP32

    db, _, _ = tuned
    out_json = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "tuner.cli", "bench", "--gpu", "auto", *GPT2_ARGS, "--json", str(out_json)]
    out = subprocess.run(cmd, env=dict(os.environ, TUNER_DB=db), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == len(GPT2_FP32)
    gpu = detect()
    with session_factory(make_engine(db))() as s:
        for row, p in zip(rows, GPT2_FP32):
            assert row["family"] == "flash_fwd_simt" and row["tuned_tflops"] > 0
            assert row["tuned_ms"][0] <= row["tuned_ms"][1] <= row["tuned_ms"][2]
            assert row["sdpa_efficient_ms"][0] <= row["sdpa_efficient_ms"][1] <= row["sdpa_efficient_ms"][2]
            assert row["sdpa_efficient_tflops"] > 0 and row["sdpa_math_tflops"] > 0
            ours = queries.measurements(s, gpu_key=gpu.key, family="flash_fwd_simt", problem_key=p.key)[-1]
            assert ours["status"] == "ok" and ours["reps"] >= 10 and ours["tflops"] == row["tuned_tflops"]
            peers = queries.peer_rows(s, gpu.key, p.key, run_id=ours["run_id"])
            assert peers["sdpa_efficient"].tflops == row["sdpa_efficient_tflops"]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_attention_runs_the_winner(tuned, layout):
    import torch

    from tuner.dispatch import Dispatcher
    from tuner.problem import GPT2_FP32
    from tuner.reference import attention_fp64, compare

    from tuner.export import read_lookup
    from tuner.gpu import detect

    _, lookup, _ = tuned
    disp = Dispatcher(lookup)
    entries = read_lookup(lookup)["entries"]
    gpu_key = detect().key
    for p in GPT2_FP32[:2]:
        # the bucket's fastest entry: the tuned kernel, or an SDPA backend the search measured faster
        winner = max((e for e in entries if e["gpu_key"] == gpu_key and e["bucket"] == p.bucket().key),
                     key=lambda e: e["tflops"])["family"]
        b, h, n, d = p.batch, p.heads, p.seqlen_q - 5, p.head_dim  # same bucket, ragged length
        q, k, v = (torch.randn(b, h, n, d, device="cuda") for _ in range(3))
        if layout == "bnhd":
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback warning would mean the winner did not run
            o = disp(q, k, v, causal=True)
        plan = next(iter(disp._plans.values()))
        assert plan.family == winner and winner in ("flash_fwd_simt", "sdpa_efficient", "sdpa_math"), winner
        ref, _ = attention_fp64(q, k, v, True, 1.0 / math.sqrt(d))
        err = compare(o, None, ref, None)
        assert err.rel < 1e-4, err
        disp._plans.clear()


def test_attention_falls_back_and_rejects_bad_input(tuned):
    import torch

    from tuner.dispatch import Dispatcher

    _, lookup, _ = tuned
    disp = Dispatcher(lookup)
    # fp32 without a mask: no bucket of it tuned, and no default of ours for fp32 (an untuned 16-bit
    # call would run flash_fwd_sm90's default on Hopper)
    q = torch.randn(1, 2, 100, 64, device="cuda")
    with pytest.warns(UserWarning, match="scaled_dot_product_attention"):
        o = disp(q, q, q)
    torch.testing.assert_close(o, torch.nn.functional.scaled_dot_product_attention(q, q, q))
    with pytest.raises(ValueError, match="cpu"):
        disp(q, q.cpu(), q)
    with pytest.raises(ValueError, match="different dtypes"):
        disp(q, q.half(), q)
    x = torch.randn(1, 2, 16, 84, device="cuda")   # no kernel takes d=84 (not a multiple of 8): SDPA's, with a warning
    with pytest.warns(UserWarning, match="head dim 84"):
        o = disp(x, x, x)
    torch.testing.assert_close(o, torch.nn.functional.scaled_dot_product_attention(x, x, x))


def test_fp32_on_tensor_cores_only_where_the_budget_allows(tmp_path):
    """`--max-error` lets flash_fwd_mma's tf32/bf16 kernels tune fp32 problems; the dispatcher
    serves them only to calls that allow that error, others fall back."""
    import torch

    from tuner.dispatch import Dispatcher
    from tuner.reference import attention_fp64, compare

    lookup = tmp_path / "best.json"
    env = dict(os.environ, TUNER_DB=f"sqlite:///{tmp_path / 'r.db'}")
    cmd = [sys.executable, "-m", "tuner.cli", "search", "--gpu", "auto", "--shape", "2,8,1000,64,causal",
           "--dtype", "fp32", "--max-error", "2e-2", "--family", "flash_fwd_mma", "--trials", "6",
           "--no-peers", "--lookup", str(lookup)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    assert "err0.02" in out.stdout and "flash_fwd_mma" in out.stdout

    disp = Dispatcher(lookup)
    q, k, v = (torch.randn(2, 8, 990, 64, device="cuda") for _ in range(3))  # same bucket, ragged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = disp(q, k, v, causal=True, max_error=2e-2)
    plan = next(iter(disp._plans.values()))
    assert plan.family == "flash_fwd_mma"
    ref, _ = attention_fp64(q, k, v, True, 1.0 / math.sqrt(64))
    err = compare(o, None, ref, None)
    assert err.finite and 1e-6 < err.rel <= 2e-2, err  # tensor-core precision, inside the budget
    with pytest.warns(UserWarning, match="scaled_dot_product_attention"):
        disp(q, k, v, causal=True)  # the default fp32 budget: nothing tuned for it here


def test_fp8_search_then_attention_serves_it(tmp_path):
    """fp8 end to end on Hopper: a short search of flash_fwd_sm90 on e4m3 inputs, then the
    dispatcher runs the winner on float8 tensors (a ragged length of the same bucket) and returns
    bf16 within the fp8 budget, with no fallback."""
    import torch

    from tuner.dispatch import Dispatcher
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.problem import Problem
    from tuner.reference import attention_fp64, compare

    problem = Problem(2, 8, 1000, 1000, 128, "fp8", True)
    if reason := get_family("flash_fwd_sm90").supports(detect(), problem):
        pytest.skip(reason)
    lookup = tmp_path / "best.json"
    env = dict(os.environ, TUNER_DB=f"sqlite:///{tmp_path / 'r.db'}")
    cmd = [sys.executable, "-m", "tuner.cli", "search", "--gpu", "auto", "--shape", "2,8,1000,128,causal",
           "--dtype", "fp8", "--family", "flash_fwd_sm90", "--trials", "4", "--no-peers", "--lookup", str(lookup)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    assert "fp8" in out.stdout and "flash_fwd_sm90" in out.stdout

    disp = Dispatcher(lookup)
    q, k, v = (torch.randn(2, 8, 990, 128, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = disp(q, k, v, causal=True)
    assert next(iter(disp._plans.values())).family == "flash_fwd_sm90"
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    ref, _ = attention_fp64(q, k, v, True, 1.0 / math.sqrt(128))
    err = compare(o, None, ref, None)
    assert err.finite and 1e-3 < err.rel <= problem.rel_budget, err  # e4m3 P: a real error, inside the budget
