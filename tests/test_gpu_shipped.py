"""On the GPU: what a user gets with no lookup of their own, the shipped lookups, on random shapes
that no test tuned and no bucket was searched at: batches 1-4, GQA 1-8, odd lengths from one query
to 64k keys, decode steps, chunks against longer caches, Nq > Nk, head dims 32-256 (80, 112, 160
and 192, which no lookup tunes, and 36, which no kernel takes), the three masks,
both layouts and any scale. Whatever serves (a tuned config, a borrowed bucket, a split entry that
gives way, SDPA), O and the LSE must agree with float64, and the gradients as closely as SDPA's own.
Packed batches and KV caches (dense or paged, ragged lengths, decode steps and chunks past
flash_decode's 64 queries) too. FLASHTUNE_FUZZ_CASES sets how many shapes a run draws (default 24
forward, a third as many with gradients, a quarter packed, a quarter cached); FLASHTUNE_FUZZ_SEED
replays one run's draws."""

from __future__ import annotations

import math
import os
import random
import warnings

import pytest
from benchmark_scripts import script
from cuda_graphs import capture
from test_gpu_decode import _cache, _poison_past, check_cached_sequences
from test_gpu_op import FLOOR, _errors, _inputs
from test_gpu_varlen import _batch, _check_sequences

from tuner.problem import Problem

pytestmark = pytest.mark.gpu
_log_uniform = script("random_shapes").log_uniform   # one home for drawing lengths

CASES = int(os.environ.get("FLASHTUNE_FUZZ_CASES", "24"))
SEED = int(os.environ.get("FLASHTUNE_FUZZ_SEED", str(random.randrange(2**31))))
WORK = 4e9   # at most B * H * Nq * Nk of one draw (the float64 reference's time)


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """The process's dispatcher as a user's fresh install has it: no lookup of their own, the shipped ones on."""
    from tuner import dispatch

    monkeypatch.setenv("FLASHTUNE_SHIPPED_LOOKUPS", "1")
    yield dispatch.reset(tmp_path / "none.json")
    dispatch.reset()


def _draw(rng: random.Random) -> Problem:
    """A shape a model might pose: a prompt, a decode or speculative step, a chunk after a cache, or
    cross-attention; its work bounded by WORK."""
    dtype = rng.choices(["bf16", "fp16", "fp32"], [5, 4, 1])[0]
    # 80, 112, 160, 192: no lookup's (flash_fwd_sm90's default where the call fills the GPU); 36: SDPA's
    d = rng.choices([32, 36, 64, 80, 96, 112, 128, 160, 192, 256], [1, 1, 4, 1, 1, 1, 6, 1, 1, 3])[0]
    kvh, group = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8])
    kind = rng.choice(["prompt", "decode", "chunk", "cross"])
    if kind == "prompt":
        nq = nk = _log_uniform(rng, 1, 20000)
    elif kind == "decode":
        nq, nk = rng.choice([1, 1, 2, 5, 16]), _log_uniform(rng, 1, 65536)
    elif kind == "chunk":
        nq = _log_uniform(rng, 17, 4096)
        nk = nq + _log_uniform(rng, 1, 60000)
    else:
        nq, nk = _log_uniform(rng, 1, 8192), _log_uniform(rng, 1, 8192)
    mask = rng.choice(["none", "causal", "causal_br"])
    batch = rng.randint(1, 4)
    while batch > 1 and batch * kvh * group * nq * nk > WORK:
        batch -= 1
    while kvh * group > 1 and batch * kvh * group * nq * nk > WORK:
        group, kvh = (group // 2, kvh) if group > 1 else (group, kvh // 2)
    return Problem(batch, kvh * group, nq, nk, d, dtype, mask, kvh)


def _served_by(d, q, k, v, mask: str) -> str:
    plan = d.plan(q, k, v, mask)
    return plan.family or f"sdpa {plan.peer or ''}".strip()


@pytest.mark.parametrize("case", range(CASES))
def test_forward_on_shapes_nobody_tuned(shipped, case):
    """O and the LSE of a drawn shape within the problem's float64 budget, through the shipped lookups."""
    import torch

    import tuner
    from tuner.reference import attention_fp64, compare

    rng = random.Random(SEED * 1000 + case)
    p = _draw(rng)
    layout, scale = rng.choice(["bhnd", "bnhd"]), rng.choice([None, rng.uniform(0.02, 0.2)])
    q, k, v = (t.detach() for t in _inputs(p, layout, rng.randrange(2**31)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a fallback's or a borrowed bucket's one warning: not what is tested
        o, lse = shipped(q, k, v, p.mask, scale, return_lse=True)
        served = _served_by(shipped, q, k, v, p.mask)
    torch.cuda.synchronize()
    what = f"seed {SEED} case {case}: {p.key} {layout} scale={scale} served by {served}"
    assert o.shape == q.shape and o.dtype == q.dtype, what
    ref_o, ref_lse = attention_fp64(q, k, v, p.mask, scale if scale is not None else 1.0 / math.sqrt(p.head_dim))
    err = compare(o, lse, ref_o, ref_lse)
    assert err.finite, f"{what}: O not finite, or the LSE not -inf exactly where a row sees no key"
    assert err.rel <= p.rel_budget and err.lse <= p.lse_budget, f"{what}: {err}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        public = tuner.attention(q, k, v, mask=p.mask, scale=scale)   # no LSE asked: SDPA's own call in a fallback
    assert public.stride() == o.stride(), what
    err = compare(public, None, ref_o, ref_lse)
    assert err.finite and err.rel <= p.rel_budget, f"{what}: tuner.attention's O: {err}"
    print(what, f"rel {err.rel:.2e}")   # -rA lists what served each draw


def _sdpa_masked(q, k, v, p: Problem, scale):
    """SDPA with the problem's mask: where bottom-right rows see no key (Nq > Nk, which SDPA answers
    with NaN), those rows are 0 and the others SDPA's own top-left causal on their square."""
    import torch
    import torch.nn.functional as F

    from tuner.reference import hidden_keys

    if p.mask == "causal_br" and p.seqlen_q > p.seqlen_k:
        empty = p.seqlen_q - p.seqlen_k
        seen = F.scaled_dot_product_attention(q[:, :, empty:], k, v, is_causal=True, scale=scale, enable_gqa=True)
        return torch.cat([seen.new_zeros(*seen.shape[:2], empty, seen.shape[3]), seen], dim=2)
    hidden = hidden_keys(p.seqlen_q, p.seqlen_k, p.mask, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if hidden is None else ~hidden, scale=scale,
                                          enable_gqa=True)


def _reference64(q, k, v, p: Problem, scale):
    """The formula in float64 autograd: softmax over the keys each row sees, rows that see none 0."""
    import torch

    from tuner.reference import hidden_keys

    group = p.heads // p.kv_heads
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else p.head_dim ** -0.5)
    hidden = hidden_keys(p.seqlen_q, p.seqlen_k, p.mask, q.device)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("case", range(max(1, CASES // 3)))
def test_gradients_on_shapes_nobody_tuned(shipped, case):
    """O, dq, dk, dv of a drawn shape through `attention` and autograd, no worse than twice SDPA's
    error on the same inputs (or the dtype's floor)."""
    import torch

    import tuner

    rng = random.Random(SEED * 1000 + 500 + case)
    while True:
        p = _draw(rng)
        if p.batch * p.heads * p.seqlen_q * p.seqlen_k <= WORK / 16:
            break
    layout, scale = rng.choice(["bhnd", "bnhd"]), rng.choice([None, 0.05])
    seed = rng.randrange(2**31)

    def ours(q, k, v, *_):   # _errors passes the mask and scale it was given too
        return tuner.attention(q, k, v, mask=p.mask, scale=scale)

    def sdpa(q, k, v, *_):
        return _sdpa_masked(q, k, v, p, scale)

    def reference(q, k, v):
        return _reference64(q, k, v, p, scale)

    def fresh():
        return _inputs(p, layout, seed)

    what = f"seed {SEED} case {case}: {p.key} {layout} scale={scale}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mine = _errors(ours, *fresh(), p.mask, scale, reference=reference)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {str(exc).splitlines()[0]}") from None
        what += f" served by {_served_by(shipped, *fresh(), p.mask)}"
        theirs = _errors(sdpa, *fresh(), p.mask, scale, reference=reference)
    for name, a, b in zip(("O", "dq", "dk", "dv"), mine, theirs):
        assert a <= max(FLOOR[p.dtype], 2 * b), f"{what}: {name} error {a:.3g} (SDPA's {b:.3g})"
    print(what)


@pytest.mark.parametrize("case", range(max(1, CASES // 4)))
def test_packed_batches_nobody_tuned(shipped, case):
    """A packed batch of ragged sequences (0 and 1 among the lengths), self- or cross-attention or
    decode-like, each sequence against float64, through the shipped varlen entries."""
    import torch

    from tuner import varlen_attention

    rng = random.Random(SEED * 1000 + 900 + case)
    dtype, d = rng.choice(["fp16", "bf16"]), rng.choice([64, 128, 256])
    mask, kind = rng.choice(["none", "causal", "causal_br"]), rng.choice(["self", "cross", "decode"])
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    q, k, v, cu_q, cu_k, lens_q, lens_k = _batch(rng, torch, dt, d, cross=kind != "self", decode=kind == "decode",
                                                 rows=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, lse = varlen_attention(q, k, v, cu_q, cu_k, mask=mask, return_lse=True)
    torch.cuda.synchronize()
    what = f"seed {SEED} case {case}: {dtype} d{d} {mask} {kind} H{q.shape[1]}/kv{k.shape[1]} q {lens_q} k {lens_k}"
    _check_sequences(o, lse, q, k, v, lens_q, lens_k, mask, dtype, 1.0 / math.sqrt(d), what)


@pytest.mark.parametrize("case", range(max(1, CASES // 4)))
def test_kv_caches_nobody_tuned(shipped, case):
    """kvcache_attention on a drawn cache: dense or paged (pages of 16 to 256 rows), each sequence
    holding its own number of keys (0 and 1 among them, NaN past them), decode steps, speculative
    steps and chunks past flash_decode's 64 queries, bottom-right causal or not; each sequence
    against float64 on the keys it holds."""
    import torch

    from tuner import kvcache_attention

    rng = random.Random(SEED * 1000 + 700 + case)
    dtype, d = rng.choice(["fp16", "bf16"]), rng.choices([64, 128, 256], [2, 4, 1])[0]
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    b, kvh, group = rng.randint(1, 6), rng.choice([1, 2, 8]), rng.choice([1, 2, 4, 8])
    nq, page = rng.choice([1, 1, 2, 5, 16, 65, 200]), rng.choice([0, 0, 16, 64, 256])
    cap = rng.choice([300, 4000, 20000])
    lens = [rng.randint(0, cap) for _ in range(b)]
    lens[rng.randrange(b)] = rng.choice([0, 1, cap])
    causal = rng.random() < 0.7
    k, v, table = _cache(rng, torch, b, kvh, d, cap, page, dt)
    cap = _poison_past(torch, k, v, table, lens, page)
    q = torch.randn(b, nq, kvh * group, d, device="cuda", dtype=dt).transpose(1, 2)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, lse = kvcache_attention(q, k, v, seqlens, table, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    what = f"seed {SEED} case {case}: {dtype} B{b} H{kvh * group}/kv{kvh} nq{nq} d{d} lens {lens} page {page}"
    what += f" causal {causal}"
    check_cached_sequences(o, lse, q, k, v, seqlens, table, lens, cap, causal, dtype, what)
    print(what)


@pytest.mark.parametrize("case", range(2))
def test_compiled_with_dynamic_shapes_and_graph_captured_on_shapes_nobody_tuned(shipped, case):
    """One torch.compile(dynamic=True, fullgraph=True) of `attention` called on three drawn shapes
    of a dtype, head dim and mask (other batches, heads and lengths: served by other buckets, split
    or not, or SDPA), then each shape captured in a CUDA graph and replayed on new inputs: every O
    within the problem's float64 budget."""
    import torch

    import tuner
    from tuner.reference import attention_fp64, compare

    rng = random.Random(SEED * 1000 + 800 + case)
    first = _draw(rng)
    while first.dtype == "fp32" or first.head_dim not in (64, 128, 256):
        first = _draw(rng)
    shapes = [first]
    while len(shapes) < 3:
        p = _draw(rng)
        if p.seqlen_q > 1:   # dynamic shapes specialise sizes 0 and 1
            shapes.append(Problem(p.batch, p.heads, p.seqlen_q, p.seqlen_k, first.head_dim, first.dtype, first.mask,
                                  p.kv_heads))
    fn = torch.compile(lambda q, k, v: tuner.attention(q, k, v, mask=first.mask), dynamic=True, fullgraph=True)

    def check(o, q, k, v, what):
        ref_o, ref_lse = attention_fp64(q, k, v, first.mask, 1.0 / math.sqrt(first.head_dim))
        err = compare(o, None, ref_o, ref_lse)
        assert err.finite and err.rel <= first.rel_budget, f"seed {SEED} case {case}: {what}: {err}"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p in shapes:
            q, k, v = (t.detach() for t in _inputs(p, rng.choice(["bhnd", "bnhd"]), rng.randrange(2**31)))
            check(fn(q, k, v), q, k, v, f"compiled {p.key}")
            graph, o = capture(lambda: tuner.attention(q, k, v, mask=first.mask))
            for t in (q, k, v):
                t.normal_()
            graph.replay()
            torch.cuda.synchronize()
            check(o, q, k, v, f"graph replay of {p.key} served by {_served_by(shipped, q, k, v, first.mask)}")
            print(f"seed {SEED} case {case}: {p.key}")
