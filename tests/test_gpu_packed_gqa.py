"""On the GPU: flash_fwd_sm90_gqa (the query heads of a K/V head packed into the Hopper kernel's tile
rows) against float64 on fresh random GQA shapes, few queries against ragged keys, every mask,
split keys or not; a graph replay; and `attention` serving it for a GQA decode step."""

from __future__ import annotations

import math
import random

import pytest
from cuda_graphs import assert_replays_match_reference, capture
from test_gpu_kernel import _assert_within_budget, _run, _run_inputs

from tuner.problem import Problem

pytestmark = pytest.mark.gpu


def _packed_problem(rng: random.Random, mask: str, d: int) -> Problem:
    """A decode or speculative step (1-64 queries), or a short prefill (200, 417), of 2-16 query heads
    a K/V head (groups that divide a block's rows and groups that do not: 3, 5, 6, 7, 12) against keys
    not a multiple of any tile; with the top-left diagonal the queries are no more than the keys. Now
    and then keys fewer than the queries (bottom-right: rows that see no key, O 0 and LSE -inf)."""
    g = rng.choice([2, 3, 4, 5, 6, 7, 8, 8, 12, 16])
    kvh = rng.choice([1, 2, 3])
    nq = rng.choice([1, 2, 5, 16, 23, 64, 200, 417])   # and short prefill rows (gqa_packing.packs_prefill)
    nk = rng.choice([77, 1000, 4097, 9001])
    if mask == "causal_br" and rng.random() < 0.2:
        nk = rng.randint(1, nq)
    return Problem(rng.randint(1, 4), kvh * g, nq, max(nk, nq) if mask == "causal" else nk, d, rng.choice(["fp16", "bf16"]),
                   mask, kvh)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_packed_rows_match_reference(mask, d):
    """The default (splits from the occupancy) and random valid configs at one split and at each
    explicit split count the keys allow, and a persistent one (the tile counter, each tile's keys
    whole), both layouts, launched twice on fresh NaN-poisoned outputs."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family

    fam, gpu, rng = get_family("flash_fwd_sm90_gqa"), detect(), random.Random()
    problem = _packed_problem(rng, mask, d)
    valid = fam.valid_points(gpu, problem)
    assert valid, f"no valid config for {problem.key}"
    configs = [fam.default(gpu, problem)]
    for splits in fam.space["splits"]:
        with_count = [p for p in valid if p["splits"] == splits and not p["persistent"]]
        configs += rng.sample(with_count, min(1, len(with_count)))
    persistent = [p for p in valid if p["persistent"]]
    assert persistent or d > 128, f"no persistent config for {problem.key}"   # (past d=128: split 24 only)
    configs += rng.sample(persistent, min(1, len(persistent)))
    for params in configs:
        for layout in ("bhnd", "bnhd"):
            err = _run(fam, params, problem, rng.randrange(2**31), layout)
            _assert_within_budget(err, problem, f"{problem.key} {params} {layout}")


def test_packed_launch_replays_in_a_cuda_graph():
    """A captured packed launch with split keys, replayed on new inputs (its counters reset within
    each replay)."""
    import torch

    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import poisoned_outputs

    fam, gpu = get_family("flash_fwd_sm90_gqa"), detect()
    problem = Problem(2, 16, 5, 3001, 128, "bf16", "causal_br", 2)
    params = dict(fam.default(gpu, problem), splits=4)
    assert fam.launch(params, problem, gpu).grid == (1, 4, 4)
    q = torch.randn(2, 16, 5, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 3001, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = poisoned_outputs(problem, q)
    graph, _ = capture(lambda: _run_inputs(fam, params, problem, q, k, v, sync=False, out=out))
    assert_replays_match_reference(graph, (q, k, v), out, problem)


def test_persistent_packed_launch_replays_in_a_cuda_graph():
    """A captured persistent packed prefill (a short chunk: more work tiles than SMs, drawn from the
    tile counter, which resets itself within each replay), replayed on new inputs."""
    import torch

    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import poisoned_outputs

    fam, gpu = get_family("flash_fwd_sm90_gqa"), detect()
    problem = Problem(16, 32, 169, 718, 128, "bf16", "causal_br", 4)
    params = fam.default(gpu, problem)
    assert params["persistent"] and fam.launch(params, problem, gpu).grid == (gpu.sm_count, 1, 1)
    q = torch.randn(16, 32, 169, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(16, 4, 718, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = poisoned_outputs(problem, q)
    graph, _ = capture(lambda: _run_inputs(fam, params, problem, q, k, v, sync=False, out=out))
    assert_replays_match_reference(graph, (q, k, v), out, problem)


def _served_matches_reference(d, q, k, v, mask: str):
    """O and the LSE `d` serves for the call, against float64 within the problem's budgets; O returned."""
    from tuner import dispatch
    from tuner.reference import attention_fp64, compare

    o, lse = d(q, k, v, mask, return_lse=True)
    ref_o, ref_lse = attention_fp64(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1]))
    problem = dispatch.problem_of(q, k, v, mask)
    assert compare(o, lse, ref_o, ref_lse).within(problem.rel_budget, problem.lse_budget)
    return o


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_attention_serves_a_speculative_gqa_step_packed(layout):
    """`attention` on a speculative step of a GQA-8 model (16 queries x 8 query heads a K/V head,
    128 packed rows, against a ragged cache) runs flash_fwd_sm90_gqa, not flash_decode, in the
    model's layout, and agrees with float64; 2 queries (16 rows) stay with flash_decode."""
    import torch

    from tuner import dispatch

    d = dispatch.reset()
    try:
        for nq, family in ((16, "flash_fwd_sm90_gqa"), (2, None)):
            shape = (4, 32, nq, 128) if layout == "bhnd" else (4, nq, 32, 128)
            q = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
            kv_shape = (4, 4, 5003, 128) if layout == "bhnd" else (4, 5003, 4, 128)
            k, v = (torch.randn(*kv_shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            if layout == "bnhd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            o = _served_matches_reference(d, q, k, v, "causal_br")
            served = d.plan(q, k, v, "causal_br").family
            if family:
                assert served == family
            else:
                assert served != "flash_fwd_sm90_gqa"
            assert o.stride() == dispatch.out_layout(q)[1]
    finally:
        dispatch.reset()


def test_attention_packs_a_wide_head_step_from_fewer_rows():
    """At d=256 a step of 4 queries or of one on 8 K/V heads of two sequences (8 and 2 packed rows,
    under PACK_ROWS_WIDE; 16 K/V heads x 4 splits of the keys: a grid that fills the GPU) runs
    flash_fwd_sm90_gqa (gqa_packing.packs); 2 queries on one sequence's 2 K/V heads (2 CTAs) do not, nor
    the same 4 queries at d=128; each agrees with float64 on an odd-length cache."""
    import torch

    from tuner import dispatch

    d = dispatch.reset()
    try:
        for dim, b, h, kvh, nq, nk, packed in ((256, 2, 16, 8, 4, 3001, True), (256, 2, 16, 8, 1, 3001, True),
                                               (256, 1, 4, 2, 2, 1669, False), (128, 2, 16, 8, 4, 3001, False)):
            q = torch.randn(b, h, nq, dim, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, kvh, nk, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            served = d.plan(q, k, v, "causal_br").family   # the shipped lookups serve our kernels here
            assert (served == "flash_fwd_sm90_gqa") == packed, (dim, nq, served)
            _served_matches_reference(d, q, k, v, "causal_br")
    finally:
        dispatch.reset()


# (B, H, KVH, queries, keys, head dim, packs): 28-32 packed rows pack over PACK_ROWS_LONG_KEYS keys
LONG_CACHE_STEPS = [(2, 28, 4, 4, 5003, 128, True), (2, 16, 4, 8, 3001, 128, True), (2, 32, 4, 4, 4097, 64, True),
                    (3, 24, 4, 5, 3001, 80, True), (2, 16, 4, 8, 2999, 128, False), (2, 32, 4, 3, 9001, 128, False)]


@pytest.mark.parametrize("b,h,kvh,nq,nk,dim,packed", LONG_CACHE_STEPS)
def test_attention_packs_a_step_of_few_rows_on_a_long_cache(b, h, kvh, nq, nk, dim, packed):
    """A GQA step of 28-32 packed rows (4-8 queries x 4-8 query heads a K/V head) over 3000 keys or
    more runs flash_fwd_sm90_gqa (gqa_packing.PACK_ROWS_LONG); the same rows over fewer keys, and 24
    rows, stay with flash_decode; each agrees with float64 on an odd-length cache, fp16 and bf16."""
    import torch

    from tuner import dispatch

    d = dispatch.reset()
    try:
        for dtype in (torch.bfloat16, torch.float16):
            q = torch.randn(b, h, nq, dim, device="cuda", dtype=dtype)
            k, v = (torch.randn(b, kvh, nk, dim, device="cuda", dtype=dtype) for _ in range(2))
            served = d.plan(q, k, v, "causal_br").family   # the shipped lookups serve our kernels here
            assert (served == "flash_fwd_sm90_gqa") == packed, (nq, nk, served)
            _served_matches_reference(d, q, k, v, "causal_br")
    finally:
        dispatch.reset()


def test_compiled_forward_and_backward_through_a_packed_step():
    """torch.compile(fullgraph=True) of `attention` on a GQA step the dispatcher packs (16 queries x 8
    query heads a K/V head, 5003 keys, the model's (B, N, H, D) views), then the backward from the
    packed kernel's LSE: O and dq, dk, dv against float64 autograd, as close as SDPA's."""
    from test_gpu_op import compiled_as_close_as_sdpa

    from tuner import dispatch

    try:
        compiled_as_close_as_sdpa(Problem(2, 32, 16, 5003, 128, "bf16", "none", 4), dispatch.reset(), "flash_fwd_sm90_gqa")
    finally:
        dispatch.reset()


@pytest.mark.parametrize("shape", ["4,32:4,417:5000,96,causal", "8,28:4,194:4839,128,none", "16,32:4,169:718,128,causal_br"])
def test_attention_packs_a_short_gqa_prefill(shape):
    """A GQA prefill of short query rows (a chunk, a cross-attention) whose packed rows fill the blocks
    better runs flash_fwd_sm90_gqa through the dispatcher (gqa_packing.packs_prefill), the model's
    (B, N, H, D) views, against float64, persistent under PERSISTENT_KEYS keys; the same call with
    one query head per K/V head does not pack."""
    import torch

    from tuner import dispatch
    from tuner.gpu import detect
    from tuner.kernel_templates.flash_fwd_sm90_gqa import PERSISTENT_KEYS

    p = Problem.parse(shape, "bf16")
    d = dispatch.reset()
    try:
        for kvh, packed in ((p.kv_heads, True), (p.heads, False)):
            q = torch.randn(p.batch, p.seqlen_q, p.heads, p.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            k, v = (torch.randn(p.batch, p.seqlen_k, kvh, p.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                    for _ in range(2))
            assert (d.plan(q, k, v, p.mask).family == "flash_fwd_sm90_gqa") == packed, (shape, kvh)
            if packed:
                served = d.serving_entry(dispatch.problem_of(q, k, v, p.mask), detect())["params"]
                assert served["persistent"] == (p.seqlen_k < PERSISTENT_KEYS), (shape, served)
            _served_matches_reference(d, q, k, v, p.mask)
    finally:
        dispatch.reset()


@pytest.mark.parametrize("shape", ["1,8:2,122:4596,128,none", "1,7:1,192:3138,128,causal_br", "1,16:4,101:3039,64,causal",
                                   "1,8:2,150:4000,96,none"])
def test_attention_runs_a_few_block_gqa_prefill_packed_on_one_consumer(shape):
    """A GQA prefill of few blocks whose keys the split form would split (gqa_packing.one_consumer_packed:
    shares of PACK_ONE_CONSUMER_KEYS keys or fewer) runs flash_fwd_sm90_gqa at one consumer through the
    dispatcher, the model's (B, N, H, D) views, against float64, its keys split two ways or more."""
    import torch

    from tuner import dispatch
    from tuner.gpu import detect
    from tuner.gqa_packing import one_consumer_packed
    from tuner.kernel_templates import get_family

    p = Problem.parse(shape, "bf16")
    d, gpu = dispatch.reset(), detect()
    try:
        q = torch.randn(p.batch, p.seqlen_q, p.heads, p.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(p.batch, p.seqlen_k, p.kv_heads, p.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        problem = dispatch.problem_of(q, k, v, p.mask)
        served = d.serving_entry(problem, gpu)
        assert served["family"] == "flash_fwd_sm90_gqa" and served["params"] == one_consumer_packed(problem, gpu), served
        assert get_family("flash_fwd_sm90_gqa").launch(served["params"], problem, gpu).grid[2] >= 2
        _served_matches_reference(d, q, k, v, p.mask)
    finally:
        dispatch.reset()


@pytest.mark.parametrize("keys", [2000, 4100])
def test_compiled_forward_and_backward_through_a_packed_prefill(keys):
    """torch.compile(fullgraph=True) of `attention` on a GQA prefill the dispatcher packs (517 queries
    x 8 query heads a K/V head, unmasked), persistent under PERSISTENT_KEYS keys and the grid form
    past them, then the backward from the packed kernel's LSE: O and dq, dk, dv against float64
    autograd, as close as SDPA's."""
    from test_gpu_op import compiled_as_close_as_sdpa

    from tuner import dispatch
    from tuner.gpu import detect
    from tuner.kernel_templates.flash_fwd_sm90_gqa import PERSISTENT_KEYS

    try:
        d = dispatch.reset()
        q, k, v = compiled_as_close_as_sdpa(Problem(4, 16, 517, keys, 128, "bf16", "none", 2), d, "flash_fwd_sm90_gqa")
        served = d.serving_entry(dispatch.problem_of(q, k, v, "none"), detect())["params"]
        assert served["persistent"] == (keys < PERSISTENT_KEYS), served
    finally:
        dispatch.reset()
