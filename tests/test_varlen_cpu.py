"""Packed sequences (tuner/varlen.py) without a GPU: the varlen variants compile for sm_80 and
sm_90a with no spills, the inputs are checked in one line each, the flashtune::attention_varlen op
passes opcheck with a CPU stand-in and traces under torch.compile(fullgraph=True) on fake CUDA
tensors, and torch's per-sequence answer (forward and gradients) matches float64 sequence by
sequence, lengths 0 and 1, GQA and the three masks included.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tuner
import tuner.op  # noqa: F401  (registers the ops)
from tuner import varlen as V
from tuner.compile import compile_kernel
from tuner.gpu import A100_SXM, H100_SXM
from tuner.kernel_templates import FAMILIES, VARLEN_VARIANTS
from tuner.problem import Problem
from tuner.reference import attention_fp64


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _packed(lens_q, lens_k, h, hk, d, dtype=torch.float32, grad=False):
    q = torch.randn(sum(lens_q), h, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(sum(lens_k), hk, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(sum(lens_k), hk, d, dtype=dtype, requires_grad=grad)
    return q, k, v, _offsets(lens_q), _offsets(lens_k)


# ---- the variants compile ----

def _variant_points(base, variant, gpu, problem):
    """The variant's point of each seed of its family (several seeds fold into one)."""
    seen, out = set(), []
    for seed in base.seeds(gpu, problem):
        p = variant.from_tuned(seed, problem)
        key = tuple(sorted(p.items()))
        if key not in seen and variant.check(p, gpu, problem) is None:
            seen.add(key)
            out.append(p)
    return out


def _compile_cases():
    cases = []
    for name, gpu, arch in (("flash_fwd_sm90", H100_SXM, "sm_90a"), ("flash_fwd_mma", A100_SXM, "sm_80"),
                            ("flash_fwd_mma", H100_SXM, "sm_90a"), ("flash_decode", A100_SXM, "sm_80"),
                            ("flash_decode", H100_SXM, "sm_90a")):
        base, variant = FAMILIES[name], VARLEN_VARIANTS[name]
        for d in (64, 128, 256):
            for mask in ("none", "causal", "causal_br"):
                problem = Problem(3, 8, 16 if name == "flash_decode" else 1000, 1000, d, "bf16", mask, 2)
                points = _variant_points(base, variant, gpu, problem)
                if name == "flash_fwd_sm90":   # persistent by default: the grid schedule too
                    points += [variant.schedule(p, False, problem) for p in points]
                # every seed's point where the mask changes the most code (causal: FROM_END blocks) on
                # the arch each family serves, one elsewhere
                every = mask == "causal" and (name == "flash_fwd_sm90" or arch == "sm_80")
                for p in points if every else points[:1]:
                    cases.append(pytest.param(variant, p, problem, arch, id=f"{variant.name}-{arch}-d{d}-{mask}-{len(cases)}"))
    return cases


@pytest.mark.parametrize("variant,params,problem,arch", _compile_cases())
def test_varlen_variants_compile_without_spills(variant, params, problem, arch):
    """None in the Hopper and decode kernels; in flash_fwd_mma, none where the family's own kernel
    has none at the same point, and at most 16 B more where it has some (d=256 on sm_80: its O
    alone is 128 registers per m16 tile)."""
    got = compile_kernel(variant, params, problem, arch).resources
    assert got.registers > 0
    if variant is not VARLEN_VARIANTS["flash_fwd_mma"]:
        assert (got.spill_bytes, got.stack_bytes) == (0, 0), (params, got)
    elif got.spill_bytes or got.stack_bytes:   # the family's own kernel at the same point
        base = compile_kernel(FAMILIES[variant.name.removesuffix("_varlen")], params, problem, arch).resources
        # where that already spills (d=256 on sm_80), the sequence's offsets may add a few bytes
        # (NVRTC 13.0, the GPU machine's: 20 B at Bc=32)
        assert base.spill_bytes and got.spill_bytes <= base.spill_bytes + 24, (params, got, base)


def test_every_hopper_seed_has_a_varlen_point():
    """A tuned config of any kind (grid or persistent, TMA-stored, chained) turns into a valid
    varlen point, persistent (each seed's tile keeps its registers under the persistent split), and
    runs on the grid too."""
    base, variant = FAMILIES["flash_fwd_sm90"], VARLEN_VARIANTS["flash_fwd_sm90"]
    for d in (64, 128, 256):
        problem = Problem(2, 8, 2048, 2048, d, "bf16", "causal")
        for seed in base.seeds(H100_SXM, problem):
            p = variant.from_tuned(seed, problem)
            assert variant.check(p, H100_SXM, problem) is None, (seed, variant.check(p, H100_SXM, problem))
            assert p["persistent"] and not (p["tma_store"] or p["chain"]), (seed, p)
            moved = ("persistent", "split", "tma_store", "chain")
            assert {k: v for k, v in p.items() if k not in moved} == {k: v for k, v in seed.items() if k not in moved}
            grid = variant.schedule(p, False, problem)
            assert not grid["persistent"] and variant.check(grid, H100_SXM, problem) is None, grid


def test_persistent_varlen_launches_one_cta_an_sm_at_most():
    """Persistent: as many CTAs as SMs, or as the grid schedule's blocks where those are fewer (its
    query blocks, rounded up to 32, by heads); on the grid, those blocks by heads."""
    variant = VARLEN_VARIANTS["flash_fwd_sm90"]
    problem = Problem(3, 8, 1000, 1000, 128, "bf16", "causal", 2)
    p = variant.from_tuned(FAMILIES["flash_fwd_sm90"].seeds(H100_SXM, problem)[0], problem)
    assert variant.packed_launch(p, problem, H100_SXM, 3000, 3000).grid == (H100_SXM.sm_count, 1, 1)
    one_head = Problem(3, 1, 100, 100, 128, "bf16", "causal")
    assert variant.packed_launch(p, one_head, H100_SXM, 300, 300).grid == (32, 1, 1)
    grid = variant.packed_launch(variant.schedule(p, False, problem), problem, H100_SXM, 3000, 3000).grid
    assert grid == (32, 8, 1)   # ceil(3000 / 128) + 3 blocks, rounded up to 32, by 8 heads


def test_varlen_defines_and_parameters():
    variant = VARLEN_VARIANTS["flash_fwd_mma"]
    problem = Problem(2, 8, 512, 512, 64, "fp16", "none")
    p = variant.default(A100_SXM, problem)
    assert variant.defines(p, problem)["VARLEN"] == 1
    assert "VARLEN" not in FAMILIES["flash_fwd_mma"].defines(p, problem)
    assert variant.param_kinds(p)[-4:] == ("ptr", "ptr", "i32", "i32")
    args = tuple(range(22))
    assert variant.packed_args(args, 70, 80, 1000, 2000, 300, 5) == (*range(7), 70, 80, *range(9, 22), 1000, 2000, 300, 5)
    # one block per query block of each sequence, by head: at most total / Br + B, rounded up to 32
    launch = variant.packed_launch(p, Problem(5, 8, 512, 512, 64, "fp16", "none"), A100_SXM, 1000, 1000)
    assert launch.grid[1:] == (8, 1) and launch.grid[0] % 32 == 0 and launch.grid[0] >= -(-1000 // p["Br"]) + 5
    assert variant.supports(A100_SXM, Problem(2, 8, 512, 512, 64, "fp32", "none")) is not None   # 16-bit only


# ---- inputs ----

def _good():
    q, k, v, cu_q, cu_k = _packed([3, 4], [3, 4], 4, 2, 64)
    return dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=4, max_k=4)


@pytest.mark.parametrize("change,words", [
    (lambda a: a.update(q=a["q"][None]), "3-D"),
    (lambda a: a.update(k=a["k"].half(), v=a["v"].half()), "share one of"),
    (lambda a: a.update(v=a["v"][:, :1]), "shapes differ"),
    (lambda a: a.update(k=torch.randn(7, 3, 64), v=torch.randn(7, 3, 64)), "divide"),
    (lambda a: a.update(q=torch.randn(7, 4, 72), k=torch.randn(7, 2, 64), v=torch.randn(7, 2, 64)), "head dim must match"),
    (lambda a: a.update(cu_q=a["cu_q"].long()), "int32"),
    (lambda a: a.update(cu_k=torch.tensor([0], dtype=torch.int32)), "at least 2"),
    (lambda a: a.update(cu_k=torch.tensor([0, 3, 5, 7], dtype=torch.int32)), "sequences"),
    (lambda a: a.update(max_q=4.0), "max_seqlen_q"),
    (lambda a: a.update(max_k=-1), "max_seqlen_k"),
])
def test_inputs_are_checked_in_one_line(change, words):
    a = _good()
    change(a)
    with pytest.raises(ValueError, match=words) as info:
        V.check_varlen_inputs(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], a["max_q"], a["max_k"], cuda=False)
    assert "\n" not in str(info.value)


def test_attention_routes_packed_inputs_and_refuses_what_they_do_not_take():
    a = _good()
    with pytest.raises(ValueError, match="both cu_seqlens_q and cu_seqlens_k"):
        tuner.attention(a["q"], a["k"], a["v"], cu_seqlens_q=a["cu_q"])
    with pytest.raises(ValueError, match="no attn_mask, dropout_p or max_error"):
        tuner.attention(a["q"], a["k"], a["v"], dropout_p=0.1, cu_seqlens_q=a["cu_q"], cu_seqlens_k=a["cu_k"])
    with pytest.raises(ValueError, match="on CUDA tensors"):   # checked before anything runs
        tuner.attention(a["q"], a["k"], a["v"], cu_seqlens_q=a["cu_q"], cu_seqlens_k=a["cu_k"], max_seqlen_q=4,
                        max_seqlen_k=4)


def test_ragged_decode_splits_follow_the_longest_sequence_against_an_even_spread():
    """Few long caches among short ones: splits so that the longest sequence's keys per CTA are no
    more than an even share of all keys per CTA slot (a padded batch's wave fill would give it one)."""
    from tuner.kernel_templates.flash_decode import auto_splits, ragged_splits

    variant = VARLEN_VARIANTS["flash_decode"]
    problem = Problem(32, 32, 8, 30831, 128, "bf16", "causal_br", 8)
    p = variant.default(H100_SXM, problem)
    smem = variant.smem_bytes(p, problem)
    ragged = ragged_splits(p, problem, H100_SXM, smem, 346197)
    even = ragged_splits(p, problem, H100_SXM, smem, 32 * 30831)   # every cache full: the longest is an even share
    assert ragged > even >= 1 and auto_splits(p, problem, H100_SXM, smem) <= ragged
    launch = variant.packed_launch(p, problem, H100_SXM, 126, 346197)
    assert launch.grid[2] == ragged and launch.grid[:2] == variant.launch(p, problem, H100_SXM).grid[:2]


def test_short_queries_default_to_the_decode_variant(monkeypatch):
    """With nothing tuned, a packed batch of at most 64 queries a sequence plans flash_decode_varlen
    (each K/V head read once for its query heads), a longer one a prefill variant."""
    from tuner import compile as compiling, dispatch

    monkeypatch.setattr(dispatch.Dispatcher, "_gpu", lambda self, index: H100_SXM)
    monkeypatch.setattr(dispatch.Dispatcher, "candidates", lambda self, problem, gpu, octaves=2.0: iter(()))

    def no_gpu(*args):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(compiling, "compile_kernel", no_gpu)
    decode = V._plan(Problem(4, 32, 16, 9000, 128, "bf16", "causal_br", 8), 0)
    prefill = V._plan(Problem(4, 32, 2000, 2000, 128, "bf16", "causal", 8), 0)
    assert "flash_decode_varlen" in decode.reason and "flash_fwd_sm90_varlen" in prefill.reason


def test_no_keys_at_all_is_zeros_and_no_gradient():
    """A batch whose sequences hold no key: O 0, LSE -inf, zero gradients (no kernel, no map)."""
    q, k, v, cu_q, cu_k = _packed([3, 2], [0, 0], 4, 2, 64)
    dq, dk, dv = V.varlen_backward(torch.randn_like(q), q, k, v, torch.zeros_like(q), torch.full((4, 5), float("-inf")),
                                   cu_q, cu_k, 3, 0, "causal", None)
    assert dq.abs().max() == 0 and dk.shape == (0, 2, 64) and dv.shape == (0, 2, 64)


def test_longest_reads_the_offsets():
    assert V.longest(_offsets([3, 0, 9, 1])) == 9


# ---- torch's per-sequence answer against float64 ----

@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_per_sequence_forward_and_gradients_match_float64(mask):
    lens_q, lens_k = [5, 0, 1, 17, 9], [7, 3, 1, 17, 0]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 32, grad=True)
    scale = 0.2
    o, lse = V.torch_varlen_forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 17, 17, mask, scale)
    grad = torch.randn_like(o)
    dq, dk, dv = V.varlen_backward(grad, q.detach(), k.detach(), v.detach(), o, lse, cu_q, cu_k, 17, 17, mask, scale)
    for (a, b), (c, d) in V._spans(cu_q, cu_k):
        if b == a:
            continue
        if d == c:   # no keys: O 0, LSE -inf, and nothing flows
            assert o[a:b].abs().max() == 0 and bool((lse[:, a:b] == float("-inf")).all())
            assert dq[a:b].abs().max() == 0
            continue
        qd, kd, vd = (t.detach().double().transpose(0, 1)[None].requires_grad_() for t in (q[a:b], k[c:d], v[c:d]))
        ref_o, ref_lse = attention_fp64(qd, kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1), mask, scale)
        ref_o = ref_o.nan_to_num(0.0)   # rows that see no key: 0
        assert torch.allclose(o[a:b].double(), ref_o[0].transpose(0, 1), atol=1e-5), (mask, a, b)
        assert torch.allclose(lse[:, a:b].double(), ref_lse[0], atol=1e-5), (mask, a, b)
        gq, gk, gv = torch.autograd.grad(ref_o, (qd, kd, vd), grad[a:b].double().transpose(0, 1)[None])
        assert torch.allclose(dq[a:b].double(), gq[0].transpose(0, 1), atol=1e-4)
        assert torch.allclose(dk[c:d].double(), gk[0].transpose(0, 1), atol=1e-4)
        assert torch.allclose(dv[c:d].double(), gv[0].transpose(0, 1), atol=1e-4)


# ---- the operator ----

@pytest.fixture()
def cpu_varlen():
    """The varlen ops on the CPU through torch's per-sequence path, so opcheck runs them for real."""
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, mask="none", scale=None):
        return V.torch_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, scale)

    lib = torch.library.Library("flashtune", "IMPL")
    lib.impl("attention_varlen", forward, "CPU")
    lib.impl("attention_varlen_backward", V.varlen_backward, "CPU")
    yield
    lib._destroy()


@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_opcheck_varlen(cpu_varlen, mask):
    q, k, v, cu_q, cu_k = _packed([4, 1, 6], [5, 2, 6], 4, 2, 64, grad=True)
    result = torch.library.opcheck(torch.ops.flashtune.attention_varlen, (q, k, v, cu_q, cu_k, 6, 6, mask, None))
    assert set(result.values()) == {"SUCCESS"}, result


def test_compile_fullgraph_traces_the_varlen_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v, cu):
        return tuner.attention(q, k, v, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300,
                               max_seqlen_k=300) * 2

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(700, 8, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(700, 2, 128, device="cuda", dtype=torch.bfloat16)
        cu = torch.empty(4, device="cuda", dtype=torch.int32)
        y = torch.compile(f, fullgraph=True, backend=backend)(q, k, k, cu)
    assert len(graphs) == 1
    assert "flashtune.attention_varlen" in [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert y.shape == (700, 8, 128) and y.dtype == torch.bfloat16


# ---- a varlen variant tuned on a representative length mix ----

@pytest.mark.parametrize("key", ["B16-H32/kv8-N4096-D128-bf16-causal", "B64-H32/kv8-N2048-D128-bf16-full",
                                 "B8-H32/kv8-N512x4096-D128-bf16-causal_br", "B32-H32/kv8-N8x32768-D128-bf16-causal_br",
                                 "B1-H8-N100-D64-fp16-causal"])
def test_representative_mix_of_a_padded_problem(key):
    """One draw per padded problem (the same each time), its batch of sequences, the first at the
    longest lengths and the rest at most that (at least 1, at least longest / 2^7 for a prefill),
    queries = keys for self-attention; its work is each sequence's own visible pairs."""
    from tuner.length_mix import OCTAVES, representative_mix
    from tuner.problem import visible_pairs

    p = Problem.from_key(key)
    mix = representative_mix(p)
    assert mix == representative_mix(p) and mix.problem == p
    assert len(mix.lengths_q) == len(mix.lengths_k) == p.batch
    assert (mix.lengths_q[0], mix.lengths_k[0]) == (p.seqlen_q, p.seqlen_k)
    assert all(1 <= q <= p.seqlen_q and 1 <= k <= p.seqlen_k for q, k in zip(mix.lengths_q, mix.lengths_k))
    if p.seqlen_q > 64:
        assert min(mix.lengths_q) >= p.seqlen_q >> OCTAVES
    if p.seqlen_q == p.seqlen_k:
        assert mix.lengths_q == mix.lengths_k
    if p.batch > 8:   # a mix, not one length (a decode batch's few query counts: its caches)
        assert len(set(mix.lengths_q if p.seqlen_q > 64 else mix.lengths_k)) > p.batch // 2
    pairs = sum(visible_pairs(q, k, p.mask) for q, k in zip(mix.lengths_q, mix.lengths_k))
    assert mix.flops() == 4.0 * p.heads * p.head_dim * pairs and mix.tflops(2.0) == mix.flops() / 2e-3 / 1e12


def test_a_trial_runs_several_draws_of_the_mix():
    """A varlen variant's work is DRAWS batches of its padded problem, draw 0 first, each its own
    lengths (the first at the longest), the same every time; TFLOP/s count all of them."""
    from tuner.kernel_templates import VARIANTS_BY_NAME
    from tuner.length_mix import DRAWS, representative_mix, representative_mixes

    p = Problem.from_key("B16-H8/kv1-N5762-D256-bf16-causal")
    work = VARIANTS_BY_NAME["flash_fwd_sm90_varlen"].work(p)
    assert work == representative_mixes(p) and DRAWS > 1 and len(work.mixes) == DRAWS
    assert work.mixes == tuple(representative_mix(p, d) for d in range(DRAWS)) and work.mixes[0] == representative_mix(p)
    assert len({m.lengths_q for m in work.mixes}) == DRAWS and all(m.lengths_q[0] == p.seqlen_q for m in work.mixes)
    assert work.flops() == sum(m.flops() for m in work.mixes) and work.tflops(4.0) == work.flops() / 4e-3 / 1e12


def test_varlen_variants_are_tuned_by_name_only():
    """`--family flash_fwd_sm90_varlen` finds the variant (its points: the family's seeds made
    varlen), `auto` never includes one, and it counts its TFLOP/s by its length mix."""
    from tuner.choices import family_names
    from tuner.cli import _families
    from tuner.kernel_templates import VARIANTS_BY_NAME, get_family
    from tuner.length_mix import representative_mix

    p = Problem(16, 32, 4096, 4096, 128, "bf16", "causal", 8)
    for name, variant in VARIANTS_BY_NAME.items():
        assert get_family(name) is variant and variant.packed and name in family_names(auto=True)
    variant = get_family("flash_fwd_sm90_varlen")
    assert _families("flash_fwd_sm90_varlen", H100_SXM, p) == [variant]
    assert all(not f.packed for f in _families("auto", H100_SXM, p))
    seeds = variant.seeds(H100_SXM, p)
    assert seeds and all(variant.check(s, H100_SXM, p) is None for s in seeds)
    assert variant.default(H100_SXM, p) == seeds[0]
    assert variant.work(p).mixes[0] == representative_mix(p) and FAMILIES["flash_fwd_sm90"].work(p) is p


def test_the_varlen_plan_prefers_an_entry_tuned_on_a_mix(tmp_path, monkeypatch):
    """A lookup holding, for the padded problem's bucket, the family's dense entry and the variant's
    own (a search of it on the bucket's length mix): a packed call plans the variant's own config;
    without it, the dense entry's config made varlen; a dense call never plans a variant's entry."""
    from tuner import compile as compiling, dispatch
    from tuner.export import lookup_of, write_lookup

    p = Problem(16, 32, 4096, 4096, 128, "bf16", "causal", 8)
    dense = dict(Bc=176, stages=2, cwg=2, split=24, overlap=1, pingpong=1, persistent=0, tma_store=0, chain=0)
    own = dict(Bc=128, stages=2, cwg=2, split=40, overlap=1, pingpong=0, persistent=1, tma_store=0, chain=0)
    entries = [(p, "flash_fwd_sm90", dense, 600.0), (p, "flash_fwd_sm90_varlen", own, 500.0)]
    monkeypatch.setattr(dispatch.Dispatcher, "_gpu", lambda self, index: H100_SXM)

    def compile_stub(variant, params, problem, arch):
        raise RuntimeError(f"would compile {variant.name} {sorted(params.items())}")

    monkeypatch.setattr(compiling, "compile_kernel", compile_stub)
    for served, want in ((entries, own), (entries[:1], VARLEN_VARIANTS["flash_fwd_sm90"].from_tuned(dense, p))):
        path = tmp_path / f"lookup-{len(served)}.json"
        write_lookup(lookup_of(H100_SXM.key, served), path)
        d = dispatch.reset(path)
        plan = V._plan(p, 0)
        assert f"would compile flash_fwd_sm90_varlen {sorted(want.items())}" in plan.reason, plan.reason
        assert [e["family"] for _, e in d.candidates(p, H100_SXM)] == ["flash_fwd_sm90"]
    dispatch.reset()


def test_varlen_bench_shapes_are_the_buckets_its_batches_are_served_from():
    """benchmarks/varlen_bench.py --shapes (what gpu_session.sh varlen-ship tunes the varlen variants on)
    names each batch's padded problem exactly as varlen_forward builds it from the packed tensors, so
    the tuned entries land in the bucket the batch's call reads."""
    import runpy
    from pathlib import Path

    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "varlen_bench.py"))
    cases = bench["CASES"]
    for kind in ("prefill", "decode"):
        shapes = bench["padded_shapes"](kind, [])
        names = [n for n, c in cases.items() if (len(c) > 6) == (kind == "decode")]
        assert len(shapes) == len(names) > 0
        for text, name in zip(shapes, names):
            h, hk, d, count, (low, high), seed, *decode = cases[name]
            if decode:   # the draw run_decode makes
                lens_q, lens_k = bench["decode_lengths"](count, low, high, seed, decode[0])
            else:
                lens_q = lens_k = bench["lengths"](count, low, high, seed)
            q = torch.empty(sum(lens_q), h, d, device="meta")
            k = torch.empty(sum(lens_k), hk, d, device="meta")
            cu_q = torch.zeros(count + 1, dtype=torch.int32)
            want = V.padded_problem(q, k, cu_q, max(lens_q), max(lens_k), "causal_br" if decode else "causal", "bf16")
            assert Problem.parse(text, "bf16").key == want.key, name
    every = bench["padded_shapes"]("prefill", [])   # --case narrows by the case's name
    assert bench["padded_shapes"]("prefill", ["d256"]) == [s for s in every if s.endswith(",256,causal")]
