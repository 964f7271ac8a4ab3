"""On the GPU: packed sequences (tuner/varlen.py) against float64, sequence by sequence, on fresh
random batches: ragged lengths up to 3000 with 0 and 1 among them, queries and keys of their own
lengths or shared offsets, GQA ratios 1 to 8, head dims 64/128/256 (and 40, 80, 192 where the tile pads), the three masks; each varlen
variant at its default and random points (the Hopper one's persistent and on the grid) with NaN-poisoned outputs; the public call with its
gradients, under torch.compile and in a CUDA graph."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from cuda_graphs import capture
from tuner.problem import Problem

pytestmark = pytest.mark.gpu


def _lengths(rng: random.Random, b: int, decode: bool = False) -> list[int]:
    pool = [0, 1, 2, 5, 16, 64] if decode else [0, 1, 63, 64, 65, 127, 192, 1000, rng.randint(1, 3000), rng.randint(1, 3000)]
    return [rng.choice(pool) for _ in range(b)]


def _batch(rng: random.Random, torch, dt, d: int, cross: bool, decode: bool = False, rows: bool = False):
    """Packed q, k, v with their offsets: keys of their own lengths (cross) or the queries' (self);
    `decode`: at most 64 queries a sequence, against up to 20000 keys. `rows`: some query and some
    key in the batch (a kernel's tensor maps need rows; tuner.varlen answers an empty side itself)."""
    while True:
        b, kvh, group = rng.randint(1, 6), rng.choice([1, 2]), rng.choice([1, 2, 4, 8])
        lens_q = _lengths(rng, b, decode)
        lens_k = ([rng.choice([0, 1, 100, 4097, rng.randint(1, 20000)]) for _ in range(b)] if decode else
                  _lengths(rng, b) if cross else lens_q)
        if not rows or (sum(lens_q) and sum(lens_k)):
            break
    off = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    cu_q = off(lens_q)
    cu_k = off(lens_k) if cross else cu_q
    q = torch.randn(sum(lens_q), kvh * group, d, device="cuda", dtype=dt)
    k, v = (torch.randn(sum(lens_k), kvh, d, device="cuda", dtype=dt) for _ in range(2))
    return q, k, v, cu_q, cu_k, lens_q, lens_k


def _check_sequences(o, lse, q, k, v, lens_q, lens_k, mask, dtype, scale, what):
    """Each sequence of O (total_q, H, D) and LSE (H, total_q) against float64 within its budget."""
    import torch

    from tuner.reference import attention_fp64, compare

    assert not bool(torch.isnan(o).any()), f"{what}: rows of O left unwritten (NaN)"
    a = c = 0
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            oi, li = o[a:a + nq].transpose(0, 1)[None], lse[:, a:a + nq][None]
            if nk == 0:
                assert torch.equal(oi, torch.zeros_like(oi)) and bool(torch.isneginf(li).all()), f"{what}: empty keys"
            else:
                qi = q[a:a + nq].transpose(0, 1)[None]
                ki, vi = (t[c:c + nk].transpose(0, 1)[None] for t in (k, v))
                ref_o, ref_lse = attention_fp64(qi, ki, vi, mask, scale)
                err = compare(oi, li, ref_o, ref_lse)
                p = Problem(1, q.shape[1], nq, nk, q.shape[2], dtype, mask, k.shape[1])
                assert err.finite, f"{what}: sequence ({nq}, {nk}) not finite, or LSE not -inf where no key is seen"
                assert err.rel <= p.rel_budget and err.lse <= p.lse_budget, f"{what}: sequence ({nq}, {nk}): {err}"
        a, c = a + nq, c + nk


def _variant_points(rng, base, variant, gpu, problem):
    points, valid = {}, base.valid_points(gpu, problem)
    for p in [variant.from_tuned(x, problem) for x in base.seeds(gpu, problem) + rng.sample(valid, min(6, len(valid)))]:
        if variant.check(p, gpu, problem) is None:
            points.setdefault(tuple(sorted(p.items())), p)
    chosen = list(points.values())
    chosen = chosen[:1] + rng.sample(chosen[1:], min(2, len(chosen) - 1))
    if hasattr(variant, "schedule"):   # flash_fwd_sm90: each point persistent and on the grid
        chosen = [q for p in chosen for q in _schedules(variant, p, problem) if variant.check(q, gpu, problem) is None]
    return chosen


def _schedules(variant, p, problem) -> list[dict]:
    """flash_fwd_sm90_varlen's point `p` persistent (the sequences longest first) and on the grid (in the batch's order)."""
    return [variant.schedule(p, True, problem), variant.schedule(p, False, problem)]


@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("family", ["flash_fwd_sm90", "flash_fwd_mma", "flash_decode"])
def test_varlen_variant_matches_reference(family, dtype, mask):
    import torch

    from tuner.gpu import detect
    from tuner.kernel_templates import FAMILIES, VARLEN_VARIANTS

    seed = random.randrange(2**32)   # in every failure's message: the draw can be replayed
    gpu, rng = detect(), random.Random(seed)
    base, variant = FAMILIES[family], VARLEN_VARIANTS[family]
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    if why := variant.supports(gpu, Problem(1, 8, 16, 128, 64, dtype, mask)):   # (16 queries: decode takes them too)
        pytest.skip(f"{variant.name} on {gpu.name}: {why}")
    for cross in (False, True):
        # (the families pad their tiles: Phi-2's 80, Stable Diffusion's 40, 192 too; flash_fwd_mma_varlen
        # leaves d=256 on Hopper to flash_fwd_sm90_varlen)
        dims = [64, 128, 256, 40, 80, 192] if base.pads_head_dim else [64, 128, 256]
        d = rng.choice([x for x in dims if not (family == "flash_fwd_mma" and gpu.major >= 9 and x > 192)])
        decode = family == "flash_decode"
        q, k, v, cu_q, cu_k, lens_q, lens_k = _batch(rng, torch, dt, d, cross or decode, decode, rows=True)
        problem = Problem(len(lens_q), q.shape[1], max(max(lens_q), 1), max(max(lens_k), 1), d, dtype, mask, k.shape[1])
        scale = rng.choice([None, 0.1])
        points = _variant_points(rng, base, variant, gpu, problem)
        assert points, f"no {variant.name} point for {problem.key}"
        for params in points:
            _run_and_check(variant, params, problem, gpu, q, k, v, cu_q, cu_k, lens_q, lens_k, mask, dtype, scale, seed)


def _run_and_check(variant, params, problem, gpu, q, k, v, cu_q, cu_k, lens_q, lens_k, mask, dtype, scale, seed,
                   longest_q=None):
    """`variant` at `params` launched directly on the packed batch into NaN-poisoned O and LSE,
    then each sequence against float64 (_check_sequences); `longest_q` the longest query length the
    launch is told (default: the true one)."""
    import torch

    from tuner.compile import compile_kernel
    from tuner.launch import LaunchError, LoadedKernel, launch_on

    ck = compile_kernel(variant, params, problem, gpu.arch)
    launch = variant.packed_launch(params, problem, gpu, q.shape[0], k.shape[0])
    launcher = LoadedKernel.load(ck, launch.smem_bytes, gpu.index).launcher(launch, variant.param_kinds(params))
    o = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, o)]
    args = variant.varlen_values(variant.arg_maker(params), params, problem, launch.grid, views, lse, scale,
                                 cu_q, cu_k, longest_q or max(lens_q), max(lens_k))
    what = (f"{variant.name} {params} longest q told {longest_q or max(lens_q)} d{q.shape[2]} H{q.shape[1]}/kv{k.shape[1]} lens q {lens_q} k {lens_k} {mask} "
            f"scale {scale} (seed {seed}, {launch})")
    try:
        launch_on(launcher, gpu.index, *args)
    except LaunchError as exc:
        raise AssertionError(f"{what}: {exc}") from exc
    torch.cuda.synchronize()
    _check_sequences(o, lse, q, k, v, lens_q, lens_k, mask, dtype, 1 / math.sqrt(q.shape[2]) if scale is None else scale,
                     what)


@pytest.mark.parametrize("mask", ["causal", "causal_br", "none"])
@pytest.mark.parametrize("family", ["flash_fwd_sm90", "flash_fwd_mma"])
def test_many_short_sequences(family, mask):
    """Hundreds of short sequences (0, 1, a block's edges), few heads: more work tiles than SMs and
    more sequences than a warp walks in one step, so the walk that finds a tile's sequence
    (a CTA's persistent walk on from its last tile's, longest first; each grid block's from the
    start) crosses many 32-sequence steps, and short blocks end in every place of a wave. The
    persistent walk starts at the octave of the longest length it is told: told too short a one,
    it still runs every sequence."""
    import torch

    from tuner.gpu import detect
    from tuner.kernel_templates import FAMILIES, VARLEN_VARIANTS

    seed = random.randrange(2**32)
    gpu, rng = detect(), random.Random(seed)
    base, variant = FAMILIES[family], VARLEN_VARIANTS[family]
    if why := variant.supports(gpu, Problem(1, 2, 128, 128, 64, "bf16", mask)):
        pytest.skip(f"{variant.name} on {gpu.name}: {why}")
    lens = [rng.choice([0, 1, 2, 17, 63, 64, 65, 127, 128, 129, 191, 192, 193, 300]) for _ in range(rng.randint(150, 400))]
    lens[rng.randrange(len(lens))] = 1000   # one long one among them, somewhere
    hk, group, d = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([64, 128])
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), hk * group, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    problem = Problem(len(lens), hk * group, max(lens), max(lens), d, "bf16", mask, hk)
    fits = (variant.from_tuned(p, problem) for p in base.seeds(gpu, problem))
    params = next((p for p in fits if variant.check(p, gpu, problem) is None), None)
    assert params is not None, f"no {variant.name} point for {problem.key}"
    points = [params]
    if hasattr(variant, "schedule"):   # flash_fwd_sm90: persistent and on the grid
        points = _schedules(variant, params, problem)
    for params in points:
        _run_and_check(variant, params, problem, gpu, q, k, v, cu, cu, lens, lens, mask, "bf16", None, seed)
    if points[0].get("persistent"):
        _run_and_check(variant, points[0], problem, gpu, q, k, v, cu, cu, lens, lens, mask, "bf16", None, seed,
                       longest_q=300)


@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_varlen_attention_and_its_gradients(mask):
    """The public call (the dispatcher's varlen plan: prefill, and decode-shaped batches of a few
    queries a sequence) and autograd against float64 autograd, per sequence: FA2's varlen backward,
    and each sequence in float32 where it does not take the case (top-left causal with queries and
    keys of different lengths)."""
    import torch

    import tuner
    from tuner.reference import attention_fp64

    rng = random.Random()
    for dt, cross, decode in ((torch.bfloat16, False, False), (torch.float16, True, False), (torch.bfloat16, True, True)):
        d = rng.choice([64, 128])
        q, k, v, cu_q, cu_k, lens_q, lens_k = _batch(rng, torch, dt, d, cross, decode)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o = tuner.attention(q, k, v, mask=mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        grad = torch.randn_like(o)
        o.backward(grad)
        a = c = 0
        for nq, nk in zip(lens_q, lens_k):
            if nq and nk:
                qi, ki, vi = (t.detach()[s:s + n].double().transpose(0, 1)[None].requires_grad_()
                              for t, s, n in ((q, a, nq), (k, c, nk), (v, c, nk)))
                ref, _ = attention_fp64(qi, ki, vi, mask, 1 / math.sqrt(d))
                gq, gk, gv = torch.autograd.grad(ref, (qi, ki, vi), grad[a:a + nq].double().transpose(0, 1)[None])
                for name, got, want in (("O", o.detach()[a:a + nq], ref), ("dq", q.grad[a:a + nq], gq),
                                        ("dk", k.grad[c:c + nk], gk), ("dv", v.grad[c:c + nk], gv)):
                    want = want[0].transpose(0, 1)
                    # relative, with a floor of 0.01 per element: a sequence whose gradient is ~0
                    # (one key seen by one row) is rounding noise against nothing
                    rel = float((got.double() - want).norm() / (want.norm() + 0.01 * want.numel() ** 0.5))
                    assert rel < 2e-2, f"{name} of sequence ({nq}, {nk}), {dt}, {mask}, lens {lens_q}/{lens_k}: rel {rel:.3g}"
            a, c = a + nq, c + nk


def test_varlen_under_compile_and_in_a_cuda_graph():
    import torch

    import tuner

    rng = random.Random()
    q, k, v, cu, _, lens, _ = _batch(rng, torch, torch.bfloat16, 128, False)
    longest = max(lens)

    def f(q, k, v):
        return tuner.attention(q, k, v, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                               max_seqlen_k=longest) * 2

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    graph, captured = capture(lambda: f(q, k, v))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, f(q, k, v))


def test_fp32_packed_batch_falls_back_with_one_warning():
    import warnings

    import torch

    import tuner

    rng = random.Random()
    q, k, v, cu_q, cu_k, lens_q, lens_k = _batch(rng, torch, torch.float32, 64, True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, lse = tuner.varlen_attention(q, k, v, cu_q, cu_k, mask="causal_br", return_lse=True)
        tuner.varlen_attention(q, k, v, cu_q, cu_k, mask="causal_br")
    assert sum("flashtune" in str(w.message) for w in caught) <= 1
    _check_sequences(o, lse, q, k, v, lens_q, lens_k, "causal_br", "fp32", 1 / 8, "fp32 fallback")


def test_search_tunes_a_varlen_variant_on_its_length_mix(tmp_path):
    """`tuner search --family flash_fwd_sm90_varlen`: each trial runs the padded problem's
    representative length mixes (checked sequence by sequence against float64); the database holds
    the variant's rows at the mixes' useful TFLOP/s, the lookup its entry, and a packed call of
    that bucket plans and runs it."""
    import os
    import subprocess
    import sys

    import torch

    import tuner
    from tuner import dispatch
    from tuner import varlen as V
    from tuner.db import queries
    from tuner.db.engine import make_engine, session_factory
    from tuner.export import read_lookup
    from tuner.gpu import detect
    from tuner.length_mix import representative_mix, representative_mixes

    gpu, variant = detect(), "flash_fwd_sm90_varlen"
    problem = Problem(12, 8, 1024, 1024, 128, "bf16", "causal", 2)
    if gpu.major != 9:
        pytest.skip(f"{variant} is Hopper's; {gpu.name} is {gpu.cc}")
    db, lookup = f"sqlite:///{tmp_path / 'results.db'}", tmp_path / "best.json"
    cmd = [sys.executable, "-m", "tuner.cli", "search", "--gpu", "auto", "--family", variant, "--shape", "12,8:2,1024,128,causal",
           "--dtype", "bf16", "--trials", "3", "--db", db, "--lookup", str(lookup)]
    out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    mix = representative_mix(problem)   # the first of the trials' batches, which a call of the bucket now runs
    with session_factory(make_engine(db))() as s:
        rows = [r for r in queries.measurements(s, gpu_key=gpu.key, family=variant, problem_key=problem.key)
                if r["status"] == "ok"]
    assert rows, out.stdout[-3000:]
    for r in rows:
        assert r["tflops"] == pytest.approx(representative_mixes(problem).tflops(r["median_ms"]), rel=1e-9)
    entry = next(e for e in read_lookup(lookup)["entries"] if e["family"] == variant)
    assert entry["bucket"] == problem.bucket().key
    try:
        dispatch.reset(lookup)
        q, k, v, cu_q, cu_k = mix.inputs(seed=7)
        o, lse = tuner.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1024,
                                        max_seqlen_k=1024, mask="causal", return_lse=True)
        plan = V._plan_for(V.padded_problem(q, k, cu_q, 1024, 1024, "causal", "bf16"), q)
        assert plan.family is not None and plan.family.name == variant and plan.params == entry["params"], plan.reason
        torch.cuda.synchronize()
        _check_sequences(o, lse, q, k, v, list(mix.lengths_q), list(mix.lengths_k), "causal", "bf16", 1 / math.sqrt(128),
                         f"{variant} {plan.params}")
    finally:
        dispatch.reset()
