"""On the GPU: flash_fwd_sm90_split (each query block's keys split across CTAs, merged by the last
split) against float64, on fresh random shapes that leave SMs idle; its relaunches and graph
replays (the self-resetting counters), and `attention` serving it from a lookup."""

from __future__ import annotations

import math
import random

import pytest
from cuda_graphs import assert_replays_match_reference, capture
from test_gpu_kernel import _assert_within_budget, _run, _run_inputs

from tuner.problem import Problem

pytestmark = pytest.mark.gpu


def _split_problem(rng: random.Random, mask: str, d: int) -> Problem:
    """A chunk against a longer cache (or a few heads of one long prompt): few query blocks, keys
    not a multiple of any tile, GQA 1 to 8."""
    kvh = rng.choice([1, 2])
    nq = rng.choice([1, 63, 200, 511, 777])
    nk = max(nq, rng.choice([129, 1000, 4097, 9001])) if mask == "causal" else rng.choice([129, 1000, 4097, 9001])
    return Problem(rng.randint(1, 2), kvh * rng.choice([1, 4, 8]), nq, nk, d, rng.choice(["fp16", "bf16"]), mask, kvh)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_every_split_count_matches_reference(mask, d):
    """The default (splits from the occupancy) and a random config at each explicit split count the
    keys allow, launched twice on fresh inputs (the second launch finds the counters the first reset)."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family

    fam, gpu, rng = get_family("flash_fwd_sm90_split"), detect(), random.Random()
    problem = _split_problem(rng, mask, d)   # where its blocks fill the GPU, the default runs one split
    valid = fam.valid_points(gpu, problem)
    configs = [fam.default(gpu, problem)]
    for splits in fam.space["splits"][1:]:
        with_count = [p for p in valid if p["splits"] == splits]
        configs += rng.sample(with_count, min(1, len(with_count)))
    assert len(configs) >= 2, (problem.key, "no explicit split count is valid")
    for params in configs:
        for _ in range(2):
            err = _run(fam, params, problem, rng.randrange(2**31), rng.choice(["bhnd", "bnhd"]))
            _assert_within_budget(err, problem, f"{problem.key} {params}")


def test_split_launch_replays_in_a_cuda_graph():
    """A captured split launch, replayed on new inputs: the counters reset within each replay, so
    every replay merges its own splits."""
    import torch

    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import poisoned_outputs

    fam, gpu = get_family("flash_fwd_sm90_split"), detect()
    problem = Problem(1, 8, 300, 5000, 128, "bf16", "causal_br", 1)
    params = dict(fam.default(gpu, problem), splits=8)
    assert fam.launch(params, problem, gpu).grid[2] == 8
    q = torch.randn(1, 8, 300, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1, 5000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = poisoned_outputs(problem, q)
    graph, _ = capture(lambda: _run_inputs(fam, params, problem, q, k, v, sync=False, out=out))
    assert_replays_match_reference(graph, (q, k, v), out, problem)


def _serving_split(tmp_path, problem: Problem, gpu_key: str | None = None):
    """(GPU, the split family, the process's dispatcher) on a lookup holding the family's default
    for `problem`, keyed to `gpu_key` (default: this GPU's); `dispatch.reset()` undoes it."""
    from tuner import dispatch
    from tuner.export import lookup_of, write_lookup
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family

    gpu, fam = detect(), get_family("flash_fwd_sm90_split")
    path = tmp_path / "lookup.json"
    write_lookup(lookup_of(gpu_key or gpu.key, [(problem, fam.name, fam.default(gpu, problem), 1.0)]), path)
    return gpu, fam, dispatch.reset(path)


def test_attention_serves_a_split_entry(tmp_path):
    """`attention` on a chunk of a tensor-parallel shard (8 query heads, 1 K/V head) runs the
    flash_fwd_sm90_split config its bucket holds, with auto splits, and agrees with float64; a
    batch of the same bucket whose blocks fill the GPU (which a search would not tune it on) runs
    it too, not SDPA (192 blocks: 1.45 waves, so still 2 splits)."""
    import torch

    from tuner import dispatch
    from tuner.dispatch import problem_of
    from tuner.reference import attention_fp64, compare

    problem = Problem(1, 8, 1024, 8192, 128, "bf16", "causal_br", 1)
    gpu, fam, d = _serving_split(tmp_path, problem)
    try:
        q = torch.randn(1, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)   # the same bucket, another chunk
        k, v = (torch.randn(1, 1, 7000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        o, lse = d(q, k, v, "causal_br", return_lse=True)
        assert d.plan(q, k, v, "causal_br").family == fam.name
        ref_o, ref_lse = attention_fp64(q, k, v, "causal_br", 1.0 / math.sqrt(128))
        err = compare(o, lse, ref_o, ref_lse)
        assert err.within(problem.rel_budget, problem.lse_budget), err
        params = fam.default(gpu, problem)
        assert fam.splits(params, problem_of(q, k, v, "causal_br"), gpu) > 1   # 64 blocks of 128 rows: split
        q, k, v = q.repeat(3, 1, 1, 1), k.repeat(3, 1, 1, 1), v.repeat(3, 1, 1, 1)   # B3: 192 blocks, the same bucket
        q.normal_()
        o, lse = d(q, k, v, "causal_br", return_lse=True)
        plan = d.plan(q, k, v, "causal_br")
        assert plan.family == fam.name and fam.tune_skip(gpu, problem_of(q, k, v, "causal_br")) is not None
        ref_o, ref_lse = attention_fp64(q, k, v, "causal_br", 1.0 / math.sqrt(128))
        assert compare(o, lse, ref_o, ref_lse).within(problem.rel_budget, problem.lse_budget)
    finally:
        dispatch.reset()


def test_compiled_forward_and_backward_through_a_split_entry(tmp_path):
    """torch.compile(fullgraph=True) of `attention` where its lookup serves the split (cross-attention
    of 512 queries over 6000 keys, 8 heads sharing 2 K/V heads: 32 blocks, so the keys split), then
    the backward from the merged LSE: O and dq, dk, dv against float64 autograd, as close as SDPA's."""
    from test_gpu_op import compiled_as_close_as_sdpa

    from tuner import dispatch
    from tuner.dispatch import problem_of

    problem = Problem(1, 8, 512, 6000, 128, "bf16", "none", 2)
    gpu, fam, d = _serving_split(tmp_path, problem)
    try:
        q, k, v = compiled_as_close_as_sdpa(problem, d, fam.name)
        assert fam.splits(fam.default(gpu, problem), problem_of(q, k, v, False), gpu) > 1
    finally:
        dispatch.reset()


def test_a_sibling_gpu_s_entry_serves_with_one_warning(tmp_path, monkeypatch):
    """A lookup holding only an entry of another GPU of this architecture (an H200's here on an
    H100, an H100's on an H200) serves this GPU (Dispatcher.kin): the split runs, agrees with
    float64, and one warning names the GPU it was tuned on."""
    import re

    import torch

    from tuner import dispatch, export
    from tuner.gpu import detect
    from tuner.reference import attention_fp64, compare

    monkeypatch.setenv(export.SHIPPED_ENV, "0")
    sibling = "NVIDIA-H100-80GB-HBM3/sm_90" if "H200" in detect().key else "NVIDIA-H200/sm_90"
    problem = Problem(1, 8, 512, 6000, 128, "bf16", "causal_br", 1)
    gpu, fam, d = _serving_split(tmp_path, problem, sibling)
    try:
        q = torch.randn(1, 8, 500, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 1, 5999, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        with pytest.warns(UserWarning, match=f"serving configs tuned on {re.escape(sibling)}"):
            o, lse = d(q, k, v, "causal_br", return_lse=True)
        assert d.plan(q, k, v, "causal_br").family == fam.name
        ref_o, ref_lse = attention_fp64(q, k, v, "causal_br", 1.0 / math.sqrt(128))
        assert compare(o, lse, ref_o, ref_lse).within(problem.rel_budget, problem.lse_budget)
    finally:
        dispatch.reset()
