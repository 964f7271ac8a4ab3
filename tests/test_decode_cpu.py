"""The decode path without a GPU: flash_decode's space, checks, split counts and rendering, and
kvcache_attention's input checks (tests/test_gpu_decode.py runs them)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from tuner.gpu import A100_SXM, H100_SXM
from tuner.kernel_templates import get_family
from tuner.family import ceil_div
from tuner.kernel_templates.flash_decode import MAX_QUERIES, PAGED, auto_splits, stage_keys
from tuner.kvcache import check_cache_inputs
from tuner.problem import Problem

FAM = get_family("flash_decode")
LLAMA_DECODE = Problem(1, 32, 1, 8192, 128, "bf16", "causal_br", 8)


@pytest.mark.parametrize("nq, nk, cache", [(1, 8192, True), (16, 1000, True), (64, 65, True),
                                           (64, 64, False), (65, 4096, False), (2048, 2048, False)])
def test_a_decode_step_is_measured_on_a_token_major_cache(nq, nk, cache):
    """The search ranks decode configs on K/V laid out as a KV cache holds them ((B, N, Hk, D)
    storage), prefill ones on head-major (B, Hk, N, D); q is head-major either way."""
    from tuner.measure import random_inputs

    p = replace(LLAMA_DECODE, batch=2, heads=4, kv_heads=2, seqlen_q=nq, seqlen_k=nk, head_dim=80)
    assert p.decode_step is cache
    q, k, v = random_inputs(p, 5, device="cpu")
    assert q.shape == (2, 4, nq, 80) and q.is_contiguous()
    for t in (k, v):
        assert t.shape == (2, 2, nk, 80)
        assert t.transpose(1, 2).is_contiguous() is cache and t.is_contiguous() is not cache
        assert t.float().std() > 0.8
    assert not torch.equal(k, v)


def test_prefill_is_refused_by_name():
    why = FAM.supports(H100_SXM, replace(LLAMA_DECODE, seqlen_q=MAX_QUERIES + 1))
    assert why and "at most 64 queries" in why
    assert FAM.supports(H100_SXM, replace(LLAMA_DECODE, seqlen_q=MAX_QUERIES)) is None
    assert "fp32" in FAM.supports(H100_SXM, replace(LLAMA_DECODE, dtype="fp32"))


@pytest.mark.parametrize("gpu", [A100_SXM, H100_SXM], ids=lambda g: g.arch)
@pytest.mark.parametrize("batch", [1, 8, 32, 128])
@pytest.mark.parametrize("nk", [1, 1000, 8192, 32768])
def test_auto_splits_fill_the_gpu_without_empty_splits(gpu, batch, nk):
    """Splits from the occupancy: at least one stage of keys each, and a last wave at least 85% as
    full as the best count up to 4 waves would give."""
    p = replace(LLAMA_DECODE, batch=batch, seqlen_k=nk)
    params = FAM.default(gpu, p)
    smem = FAM.smem_bytes(params, p)
    s = auto_splits(params, p, gpu, smem)
    tiles = -(-nk // stage_keys(params))
    assert 1 <= s <= tiles
    per_sm = min(gpu.smem_per_sm // (smem + 1024), 64 // params["warps"], 32,
                 gpu.regs_per_sm // (32 * params["warps"] * FAM.register_estimate(params, p)))
    slots, ctas = gpu.sm_count * per_sm, batch * 8
    fill = lambda n: ctas * n / (-(-ctas * n // slots) * slots)
    assert fill(s) >= 0.85 * max(fill(n) for n in range(1, min(tiles, -(-4 * slots // ctas)) + 1)) - 1e-9
    # the launch takes the family's count: this one on the A100, the bytes-in-flight rule's on sm_90
    assert FAM.launch(params, p, gpu).grid == (batch * 8, 1, FAM.splits(params, p, gpu))
    if gpu.major < 9:
        assert FAM.splits(params, p, gpu) == s


def test_explicit_splits_beyond_the_keys_are_refused():
    p = replace(LLAMA_DECODE, seqlen_k=100)
    params = dict(FAM.default(H100_SXM, p), splits=64)
    why = FAM.check(params, H100_SXM, p)
    assert why and "splits=64" in why


def test_every_valid_point_fits_shared_memory_and_splits_share_a_cubin():
    for gpu in (A100_SXM, H100_SXM):
        for d in FAM.head_dims:
            p = replace(LLAMA_DECODE, head_dim=d, seqlen_q=5)
            valid = FAM.valid_points(gpu, p)
            assert valid, (gpu.arch, d)
            for params in valid:
                assert FAM.smem_bytes(params, p) <= gpu.smem_per_block_optin
            a = dict(valid[0], splits=0)
            b = dict(valid[0], splits=1)
            assert FAM.render(a, p).split("\n", 1)[1] == FAM.render(b, p).split("\n", 1)[1]


def test_packed_rows_decide_the_row_tiles():
    """Row tiles hold group x Nq packed rows: a second m16 tile must have rows in it."""
    two_tiles = dict(Bc=16, warps=4, stages=3, MT=2, splits=0)
    p = Problem(2, 8, 1, 4096, 128, "bf16", "none", 8)   # one row per K/V head
    assert "empty" in FAM.check(two_tiles, H100_SXM, p)
    p = Problem(2, 32, 16, 4096, 128, "bf16", "causal_br", 8)   # 4 x 16 = 64 rows: 2 CTAs of 32
    params = two_tiles
    assert FAM.check(params, H100_SXM, p) is None
    # a CTA per (sequence, K/V head, row block) on x, the row blocks of one K/V head side by side
    assert FAM.launch(params, p, H100_SXM).grid == (2 * 8 * 2, 1, FAM.splits(params, p, H100_SXM))


def test_paged_variant_differs_in_its_defines_alone():
    """The row-by-row pages form: PAGED, and no tensor maps (flash_decode_paged_boxes is the
    form that reads pages as boxes)."""
    params = FAM.default(H100_SXM, LLAMA_DECODE)
    a, b = FAM.render(params, LLAMA_DECODE).splitlines(), PAGED.render(params, LLAMA_DECODE).splitlines()
    assert [(x, y) for x, y in zip(a[1:], b[1:]) if x != y] == [("#define KV_TMA 1", "#define KV_TMA 0"),
                                                              ("#define PAGED 0", "#define PAGED 1")]
    assert PAGED.name not in __import__("tuner.kernel_templates", fromlist=["FAMILIES"]).FAMILIES   # never searched


def _cache(b=2, hk=2, n=64, d=64, dtype=torch.float16):
    q = torch.randn(b, 2 * hk, 1, d, dtype=dtype)
    k = torch.randn(b, hk, n, d, dtype=dtype)
    return q, k, k.clone()


def test_kvcache_inputs_are_checked_with_one_line_errors():
    q, k, v = _cache()
    assert check_cache_inputs(q, k, v, None, None, cuda=False) == (64, 0)
    with pytest.raises(ValueError, match="CUDA tensors"):
        check_cache_inputs(q, k, v, None, None)
    lens = torch.tensor([3, 64], dtype=torch.int32)
    assert check_cache_inputs(q, k, v, lens, None, cuda=False) == (64, 0)
    bad = [
        ((q[0], k, v, None, None), "4-D"),
        ((q, k, v[..., :32], None, None), "shapes differ"),
        ((q, k[:, :1].expand(2, 3, 64, 64), v[:, :1].expand(2, 3, 64, 64), None, None), "divide"),
        ((q, k, v, lens.long(), None), "int32"),
        ((q, k, v, lens[:1], None), "1 rows for a batch of 2"),
        ((q.float(), k, v, None, None), "share one of"),
        ((q, k[:1], v[:1], None, None), "block_table"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            check_cache_inputs(*args, cuda=False)
    pages = torch.randn(10, 2, 16, 64, dtype=torch.float16)   # (num_pages, Hk, page, D)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    assert check_cache_inputs(q, pages, pages, lens, table, cuda=False) == (64, 16)
    with pytest.raises(ValueError, match="contiguous"):
        check_cache_inputs(q, pages, pages, lens, table.t().contiguous().t(), cuda=False)


def test_an_untuned_decode_call_gets_flash_decode_default_not_a_prefill_config(tmp_path):
    """A lookup tuned only for prefill does not serve one query against 8192 keys (its buckets are
    7 octaves of Nq away); the dispatcher's last resort there is flash_decode's default, and for
    what flash_decode cannot run (prefill, fp32) nothing."""
    from tuner.dispatch import Dispatcher
    from tuner.untuned import decode_default
    from tuner.export import lookup_of, write_lookup

    sm90 = get_family("flash_fwd_sm90")
    prefill = replace(LLAMA_DECODE, seqlen_q=8192, batch=1)
    path = tmp_path / "lookup.json"
    write_lookup(lookup_of(H100_SXM.key, [(prefill, sm90.name, sm90.default(H100_SXM, prefill), 500.0)]), path)
    d = Dispatcher(path)
    assert d.select(prefill, H100_SXM)["family"] == "flash_fwd_sm90"
    assert d.select(LLAMA_DECODE, H100_SXM) is None
    entry = decode_default(LLAMA_DECODE, H100_SXM)
    assert entry == {"family": "flash_decode", "params": FAM.default(H100_SXM, LLAMA_DECODE)}
    assert decode_default(prefill, H100_SXM) is None
    assert decode_default(replace(LLAMA_DECODE, dtype="fp32"), H100_SXM) is None


def test_a_tuned_split_count_serves_only_the_grid_it_was_measured_on(tmp_path):
    """flash_decode's explicit splits were timed on one grid: the dispatcher serves them to shapes
    of that many CTAs per split and that length bucket, and splits by the occupancy elsewhere (B32's
    one split at B8 would use 64 of 132 SMs); a ragged batch always takes its own split count."""
    from tuner.autotune import shortlist
    from tuner.dispatch import Dispatcher, served_params
    from tuner.export import lookup_of, write_lookup
    from tuner.kernel_templates.flash_decode import VARLEN_FAMILY

    tuned = replace(LLAMA_DECODE, batch=32, seqlen_k=8192)
    params = dict(FAM.default(H100_SXM, tuned), splits=64)
    assert FAM.check(params, H100_SXM, tuned) is None
    path = tmp_path / "lookup.json"
    write_lookup(lookup_of(H100_SXM.key, [(tuned, FAM.name, params, 1.0)]), path)
    entry = Dispatcher(path).select(tuned, H100_SXM)
    assert entry["params"] == params and served_params(entry, tuned) == params
    same_grid = replace(tuned, seqlen_k=5000)   # one bucket, the same CTAs per split: kept
    assert served_params(entry, same_grid) == params
    for other in (replace(tuned, batch=8), replace(tuned, batch=128), replace(tuned, kv_heads=4, heads=16),
                  replace(tuned, seqlen_k=2048)):
        served = served_params(entry, other)
        assert served == dict(params, splits=0), other
        assert FAM.launch(served, other, H100_SXM).grid[2] == auto_splits(served, other, H100_SXM, FAM.smem_bytes(served, other))
    # 64 explicit splits of 2048 keys (two octaves away) would be refused: 32 stages; adapted, it serves
    short = replace(tuned, seqlen_k=2048)
    assert FAM.check(params, H100_SXM, short) is not None
    assert Dispatcher(path).select(short, H100_SXM) == entry
    assert [e["params"] for e in shortlist(replace(tuned, batch=8), H100_SXM, [entry])
            if e["family"] == FAM.name] == [dict(params, splits=0)]
    assert VARLEN_FAMILY.from_tuned(params, tuned)["splits"] == 0
    peer = {"family": "sdpa_cudnn", "params": {}, "problem": tuned.to_dict()}   # a measured SDPA backend
    assert served_params(peer, replace(tuned, batch=8)) == {}


# ---- flashtune::kvcache_attention: the operator torch.compile traces ----

def test_kvcache_attention_traces_under_compile_fullgraph():
    """Inside torch.compile(fullgraph=True) the call is the registered operator, its fake giving O
    in q's layout and the LSE: no graph break, on fake CUDA tensors (paged, with lengths)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tuner.op  # noqa: F401  (registers the operators)
    from tuner import kvcache_attention

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q, k, v, lens, table):
        return kvcache_attention(q, k, v, lens, table) * 2

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        lens = torch.empty(4, device="cuda", dtype=torch.int32)
        table = torch.empty(4, 16, device="cuda", dtype=torch.int32)
        y = torch.compile(step, fullgraph=True, backend=backend)(q, k, k, lens, table)
    assert len(graphs) == 1
    assert "flashtune.kvcache_attention" in [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert y.shape == (4, 32, 1, 128) and y.dtype == torch.bfloat16


def test_kvcache_operator_opcheck_with_a_cpu_stand_in():
    """opcheck (schema, fake, dispatch) with torch's per-sequence float32 answer as the CPU kernel."""
    from tuner.dispatch import out_layout
    from tuner.kvcache import gather_sequence
    from tuner.torch_attention import MATH

    def forward(q, k, v, lens=None, table=None, mask="causal_br", scale=None):
        nk, _ = check_cache_inputs(q, k, v, lens, table, cuda=False)
        size, stride = out_layout(q)
        o = torch.empty_strided(size, stride, dtype=q.dtype)
        lse = torch.empty(q.shape[:3], dtype=torch.float32)
        for i in range(q.shape[0]):
            ki, vi = (gather_sequence(t, lens, table, i, nk)[None] for t in (k, v))
            oi, li = MATH.forward(q[i:i + 1], ki, vi, mask, scale)
            o[i], lse[i] = oi[0], li[0]
        return o, lse

    import tuner.op  # noqa: F401

    lib = torch.library.Library("flashtune", "IMPL")
    lib.impl("kvcache_attention", forward, "CPU")
    try:
        q = torch.randn(3, 4, 2, 64)
        k, v = torch.randn(3, 2, 50, 64), torch.randn(3, 2, 50, 64)
        lens = torch.tensor([0, 17, 50], dtype=torch.int32)
        for mask in ("causal_br", "none"):
            result = torch.library.opcheck(torch.ops.flashtune.kvcache_attention, (q, k, v, lens, None, mask, None))
            assert set(result.values()) == {"SUCCESS"}, result
    finally:
        lib._destroy()


def test_stages_come_as_tensor_map_boxes_where_a_box_can_hold_them():
    """KV_TMA: dense caches or packed sequences with tiles up to 192 columns (panels of 64 columns,
    or 32 where the tile is not whole 64s; d=256 spills with the zeroing of the rows past a
    sequence, and d=192 at 32 keys a warp), at most 256 keys a stage (one box); pages
    row by row keep cp.async (flash_decode_paged_boxes is the pages' boxes form). The kernel's
    arguments carry K's and V's maps either way (empty where unread), so the launch's layout does
    not depend on it."""
    from tuner.kernel_templates.flash_decode import VARLEN_FAMILY

    p = dict(Bc=32, warps=4, stages=2, MT=1, splits=0)
    assert FAM.kv_tma(p, 128) and FAM.kv_tma(p, 64)
    assert FAM.kv_tma(p, 96) and FAM.kv_tma(p, 32) and FAM.kv_tma(p, 80) and FAM.kv_tma(p, 160)   # 32-column panels
    assert not FAM.kv_tma(p, 256) and not FAM.kv_tma(p, 192) and FAM.kv_tma(dict(p, Bc=16), 192)
    assert not FAM.kv_tma(dict(p, Bc=64, warps=8), 128)   # 512 keys a stage
    assert not PAGED.kv_tma(p, 128) and VARLEN_FAMILY.kv_tma(p, 128)
    assert FAM.param_kinds(p)[-2:] == ("tmap", "tmap") == PAGED.param_kinds(p)[-2:]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("d", [64, 128])
def test_paged_boxes_form_compiles_without_spills(arch, d):
    """flash_decode_paged_boxes, which the family sweep (tests/test_compile.py) does not reach: every
    seed at d=64 and 128 compiles for sm_80 (cp.async only) and sm_90a (the page boxes, issued by warp
    0's lanes, and the zeroing of V rows past a sequence), with no spills."""
    from tuner.compile import compile_kernel
    from tuner.kernel_templates.flash_decode import PAGED_BOXES

    gpu = H100_SXM if arch == "sm_90a" else A100_SXM
    problem = replace(LLAMA_DECODE, head_dim=d, seqlen_q=4)
    seeds = [p for p in FAM.seeds(gpu, problem) if FAM.check(p, gpu, problem) is None and PAGED_BOXES.kv_tma(p, d)]
    assert len(seeds) >= 4
    for params in seeds:
        ck = compile_kernel(PAGED_BOXES, params, problem, arch)
        assert ck.resources.registers > 0 and ck.resources.spill_bytes == 0 and ck.resources.stack_bytes == 0, (params, ck.log)


def test_pages_come_as_boxes_where_their_size_fits_a_stage():
    """flash_decode_paged_boxes: a page size that a stage's rows divide or are divided by, in whole
    8-row swizzle atoms; any other page size keeps the row-by-row form. The two differ in KV_TMA."""
    from tuner.kernel_templates.flash_decode import PAGED_BOXES

    p = dict(Bc=32, warps=4, stages=2, MT=1, splits=0)   # 128 keys a stage
    assert all(PAGED_BOXES.page_fits(p, n) for n in (8, 16, 64, 128, 256, 1024))
    assert not any(PAGED_BOXES.page_fits(p, n) for n in (1, 4, 12, 48, 96, 200))
    assert PAGED_BOXES.kv_tma(p, 128) and not PAGED.kv_tma(p, 128)
    params = FAM.default(H100_SXM, LLAMA_DECODE)
    a, b = PAGED.render(params, LLAMA_DECODE).splitlines(), PAGED_BOXES.render(params, LLAMA_DECODE).splitlines()
    assert [(x, y) for x, y in zip(a[1:], b[1:]) if x != y] == [("#define KV_TMA 0", "#define KV_TMA 1")]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("d", [8, 40, 72, 80, 144, 160, 192, 248])
def test_any_head_dim_pads_the_tile_and_compiles_without_spills(arch, d):
    """Head dims off the listed ones (Phi-2's 80, Stable Diffusion's 40 and 160, 192, ...): the tile
    is d rounded up to 32 columns, or 128 at d = 72-80 (HEAD_DIM; D_VALID is d, the width of every
    load and store), the K/V ring by cp.async (tensor maps only at 64 and 128). Every valid seed of
    the dense form, and the default of the paged (rows and boxes) and packed forms, compiles with no
    spills; on sm_90a K/V come as boxes of 64- or 32-column panels (flash_decode.panel: 64 at d=80)
    where `kv_tma` says."""
    from tuner.compile import compile_kernel
    from tuner.family import padded_head_dim
    from tuner.kernel_templates.flash_decode import PAGED_BOXES, VARLEN_FAMILY, panel, tail_cols, tile

    gpu = H100_SXM if arch == "sm_90a" else A100_SXM
    problem = replace(LLAMA_DECODE, head_dim=d, seqlen_q=4)
    assert FAM.supports(gpu, problem) is None and d not in FAM.head_dims
    seeds = [p for p in FAM.seeds(gpu, problem) if FAM.check(p, gpu, problem) is None]
    assert seeds   # at d > 128 only Bc=16 fits, as at d=256 (one seed on an A100)
    cases = [(FAM, p) for p in seeds] + [(PAGED, seeds[0]), (PAGED_BOXES, seeds[0]), (VARLEN_FAMILY, seeds[0])]
    assert any(FAM.kv_tma(p, d) for p in seeds) == (d <= 192)
    for fam, params in cases:
        defines = fam.defines(params, problem)
        width = 128 if d in (72, 80) else padded_head_dim(d)   # d=72-80: one 128-byte panel tile, as flash_fwd_sm90's
        assert (defines["HEAD_DIM"], defines["D_VALID"], defines["KV_TMA"]) == (width, d, int(fam.kv_tma(params, d)))
        assert defines["PANEL_COLS"] == panel(d) == (64 if width % 64 == 0 else 32) and tile(d) == width
        tail = tail_cols(d) if fam.kv_tma(params, d) else 0   # d = 72-80, 136-144: a tail panel of 16 columns
        assert tail == (16 if d in (72, 80, 144) and fam.kv_tma(params, d) else 0)
        assert (defines.get("RING_COLS"), defines.get("TAIL_COLS")) == (((d + 15) // 16 * 16, 16) if tail else (None, None))
        ck = compile_kernel(fam, params, problem, arch)
        assert ck.resources.registers > 0 and (ck.resources.spill_bytes, ck.resources.stack_bytes) == (0, 0), (fam.name, params, ck.log)


def test_a_tail_panel_holds_the_ring_to_the_head_dim_rounded_to_16():
    """Where the head dim rounded up to 16 ends 16 or 32 columns into the tile's last panel, the ring
    holds those columns only, the last of them as a tail panel of its own box (16 or 32 columns),
    after at least one whole panel: at d = 80, 64 + 16 of the tile's 128. Each ring slot is whole KB
    (the 128-byte swizzle's period), and the shared memory a config asks counts the ring so."""
    from tuner.kernel_templates.flash_decode import panel, ring_cols, stage_elems, tail_cols, tile

    for d in range(8, 257, 8):
        tail, ring, width = tail_cols(d), ring_cols(d), tile(d)
        if not tail:
            assert ring == width, d
            continue
        assert tail in (16, 32) and ring == (d + 15) // 16 * 16 < width and tail < panel(d), d
        assert (ring - tail) % panel(d) == 0 and ring - tail >= panel(d), d
    assert (tail_cols(80), ring_cols(80), tail_cols(72), ring_cols(72)) == (16, 80, 16, 80)
    assert all(tail_cols(d) == 0 for d in (32, 64, 96, 112, 128, 160, 192, 256))
    one_warp = dict(Bc=16, warps=1, stages=3, MT=1, splits=0)
    assert stage_elems(one_warp, 80) == 1536 and stage_elems(one_warp, 64) == 16 * 64   # 2560 bytes -> 3 KB
    params = dict(Bc=16, warps=4, stages=3, MT=1, splits=0)
    p = replace(LLAMA_DECODE, head_dim=80, kv_heads=32)
    ring = 2 * 2 * 3 * 64 * 80
    assert FAM.kv_tma(params, 80) and FAM.smem_bytes(params, p) == 2 * 16 * 128 + max(ring, 4 * 4 * 16 * 130) + 1024
    assert not PAGED.kv_tma(params, 80) and PAGED.smem_bytes(params, p) > FAM.smem_bytes(params, p)   # rows: the tile


def test_the_tail_probe_compiles_every_form_for_sm90a():
    """benchmarks/tma_tail_probe.py, the copy-engine figure behind tail_cols: each of its box forms
    builds (sm_90a, NVRTC), stages of 64 and 128 rows."""
    from benchmark_scripts import script

    probe = script("tma_tail_probe")
    for mode in probe.MODES:
        for tk in (64, 128):
            assert probe.cubin(mode, tk)[:4] == b"\x7fELF", (mode, tk)


def test_head_dims_past_the_padded_range_are_refused_by_name():
    for d in (4, 84, 264):
        why = FAM.supports(H100_SXM, replace(LLAMA_DECODE, head_dim=d))
        assert why and "8 to 256 in steps of 8" in why and str(d) in why


def test_the_default_follows_the_stream_a_cta_reads_where_kv_comes_by_boxes():
    """On sm_90 (K/V by tensor-map boxes), a CTA that streams 32 stages or more (B8 x 8k keys, no
    splits needed) defaults to 8 warps of 16 keys, tiles of 160-192 columns to 16 keys in 3 stages
    of 4 warps. d = 72-80 (a 128-column tile whose ring holds 80 columns) takes 4 warps of 16 keys
    where that grid runs in one wave (three CTAs an SM), in 2 stages where a CTA streams
    WIDE_LONG_STREAM stages of the first seed, else 3; past one wave 32 keys a warp in 3 stages (one
    an SM). Short streams (B32 x 1k) and the A100 (cp.async) keep 32 keys a warp in 2 stages. The
    search's seeds are the same points in either order."""
    from tuner.kernel_templates.flash_decode import LONG_STREAM, WIDE_LONG_STREAM

    long = Problem(8, 32, 1, 8192, 128, "bf16", "causal_br", 32)
    short = replace(long, batch=32, seqlen_k=1024)
    pick = lambda gpu, p: tuple(FAM.default(gpu, p)[k] for k in ("Bc", "warps", "stages"))
    assert FAM.stages_per_cta(FAM.seeds(A100_SXM, long)[0], long, H100_SXM) >= LONG_STREAM
    assert pick(H100_SXM, long) == (16, 8, 2) and pick(A100_SXM, long) == (32, 4, 2)
    assert FAM.stages_per_cta(FAM.default(H100_SXM, short), short, H100_SXM) < LONG_STREAM
    assert pick(H100_SXM, short) == (32, 4, 2) == pick(A100_SXM, short)
    for d in (160, 192):
        assert pick(H100_SXM, replace(long, head_dim=d, heads=16, kv_heads=16)) == (16, 4, 3)
    wide = {(d, shape): replace(p, head_dim=d) for d in (72, 80) for shape, p in [
        ("one wave", replace(long, seqlen_k=4096)), ("many waves", short), ("GQA", replace(long, kv_heads=8)),
        ("32 packed rows", replace(long, heads=64, kv_heads=4, seqlen_q=2)),
        ("many long waves", replace(long, batch=64, seqlen_k=32768)), ("one long wave", replace(long, seqlen_k=32768))]}
    want = {"one wave": (16, 4, 3), "GQA": (16, 4, 3), "many waves": (32, 4, 3), "32 packed rows": (16, 4, 3),
            "many long waves": (32, 4, 3), "one long wave": (16, 4, 2)}
    for (d, shape), p in wide.items():
        params = FAM.default(H100_SXM, p)
        assert pick(H100_SXM, p) == want[shape], p.key
        assert pick(A100_SXM, p) == (32, 4, 2) or shape == "32 packed rows", p.key   # cp.async: the first seed
        narrow = dict(params, Bc=16)
        assert FAM.fits_one_wave(narrow, p, H100_SXM) == (want[shape][0] == 16), p.key
        assert params["MT"] == (2 if shape == "32 packed rows" else 1)
        ring_ctas = H100_SXM.smem_per_sm // (FAM.smem_bytes(params, p) + 1024)
        assert ring_ctas == {(16, 4, 2): 4, (16, 4, 3): 3, (32, 4, 3): 1}[want[shape]], (p.key, ring_ctas)
        streams = FAM.stages_per_cta(FAM.seeds(A100_SXM, p)[0], p, H100_SXM)
        assert (streams >= WIDE_LONG_STREAM) == (shape in ("one long wave", "many long waves")), (p.key, streams)
    for p in (long, short):
        key = lambda seeds: sorted(map(str, seeds))
        assert key(FAM.seeds(H100_SXM, p)) == key(FAM.seeds(A100_SXM, p))


def test_splits_keep_the_gpu_s_bytes_in_flight_where_kv_comes_by_boxes():
    """Where K/V come by tensor-map boxes (sm_90), the occupancy's count is the fewest power of two
    whose first wave keeps GPU_IN_FLIGHT bytes of K/V on their way: at d=96, B8 x 8 K/V heads of the
    default (64 CTAs a split) takes 2 splits, not every slot's count; the row-by-row pages and the
    A100 (cp.async) keep the slot rule."""
    from tuner.kernel_templates.flash_decode import GPU_IN_FLIGHT, cta_slots, in_flight_bytes

    p = Problem(8, 32, 1, 8192, 96, "bf16", "causal_br", 8)
    params = FAM.default(H100_SXM, p)
    smem = FAM.smem_bytes(params, p)
    assert cta_slots(params, p, H100_SXM, smem) >= 2 * H100_SXM.sm_count and FAM.kv_tma(params, 96)
    by_slots = auto_splits(params, p, H100_SXM, smem)
    assert 64 * in_flight_bytes(params, p) < GPU_IN_FLIGHT <= 128 * in_flight_bytes(params, p)
    assert FAM.splits(params, p, H100_SXM) == 2 < by_slots
    assert PAGED.splits(params, p, H100_SXM) == by_slots
    a100 = FAM.default(A100_SXM, p)
    assert FAM.splits(a100, p, A100_SXM) == auto_splits(a100, p, A100_SXM, FAM.smem_bytes(a100, p))
    assert FAM.launch(params, p, H100_SXM).grid == (64, 1, 2)


@pytest.mark.parametrize("batch,nk,want", [(2, 16384, 32), (4, 16384, 16), (8, 16384, 8), (16, 16384, 4), (64, 16384, 1),
                                           (2, 1024, 4), (1, 256, 1)])
def test_a_cta_with_little_in_flight_takes_more_splits_up_to_a_few_stages_each(batch, nk, want):
    """d=64, two warps of 32 keys in 2 stages: 16 KB a CTA on its way, a CTA a sequence and K/V head
    in each split. The count doubles until GPU_IN_FLIGHT (6 MB) is on its way, 384 such CTAs: the 64
    of B8 x 8 K/V heads split 8 ways (one CTA an SM, 2 splits, read 0.80-0.87x the best count here,
    PERF_NOTES "s3"), B2's 32; but each split keeps 3 stages of 64 keys: 1024 keys split 4 ways at
    most, 256 keys not at all."""
    from tuner.kernel_templates.flash_decode import GPU_IN_FLIGHT, MIN_SPLIT_STAGES, in_flight_bytes

    p = Problem(batch, 32, 1, nk, 64, "bf16", "causal_br", 8)
    thin = dict(Bc=32, warps=2, stages=2, MT=1, splits=0)
    assert in_flight_bytes(thin, p) == 16 << 10 and GPU_IN_FLIGHT == 6 << 20 and MIN_SPLIT_STAGES == 3
    got = FAM.splits(thin, p, H100_SXM)
    assert got == want and got & (got - 1) == 0
    assert ceil_div(ceil_div(nk, 64), got) >= MIN_SPLIT_STAGES or got == 1


def test_splits_of_a_hopper_call_merge_in_a_cluster_where_they_pack(monkeypatch):
    """flash_decode's served form (FlashDecode.served_form): on sm_90 a call whose keys split 2, 4 or
    8 ways runs as flash_decode_cluster with that explicit count, where its clusters all run at once;
    other counts, too many clusters for one wave, an A100, and the paged and packed variants keep
    the workspace's merge. The cluster form compiles its size in: a define, and no workspace."""
    from tuner import launch
    from tuner.kernel_templates import configs_family
    from tuner.kernel_templates.flash_decode import CLUSTER_FAMILY, VARLEN_FAMILY
    from tuner.launch import clusters_at_once

    monkeypatch.setattr(launch, "one_sm_clusters", lambda gpu, size: None)   # the spec's estimate
    b8 = replace(LLAMA_DECODE, batch=8, mask="none")   # 64 (sequence, K/V head) groups: 2 splits fill 132 SMs
    params = FAM.default(H100_SXM, b8)
    assert FAM.splits(params, b8, H100_SXM) == 2
    form, served = FAM.served_form(params, H100_SXM, b8)
    assert form is CLUSTER_FAMILY and served == dict(params, splits=2) and configs_family(form.name) == FAM.name
    assert form.launch(served, b8, H100_SXM).grid == (64, 1, 2)
    assert form.defines(served, b8)["MERGE_CLUSTER"] == 2 and "MERGE_CLUSTER" not in FAM.defines(params, b8)
    assert form.smem_bytes(served, b8) >= FAM.smem_bytes(params, b8)
    assert FAM.served_form(params, A100_SXM, b8) == (FAM, params)
    for p in (PAGED, VARLEN_FAMILY):
        assert p.served_form(params, H100_SXM, b8) == (p, params)
    for n in (1, 3, 16):   # counts that are no cluster of 2, 4 or 8
        assert FAM.served_form(dict(params, splits=n), H100_SXM, b8) == (FAM, dict(params, splits=n))
    assert clusters_at_once(H100_SXM, 2) == 66 and clusters_at_once(H100_SXM, 8) == 16
    many = replace(b8, batch=9)   # 72 groups: more pairs than the GPU runs at once
    assert FAM.served_form(dict(params, splits=2), H100_SXM, many)[0] is FAM
    assert CLUSTER_FAMILY.check(dict(params, splits=4), A100_SXM, b8) is not None   # sm_90 and later only


def test_the_cluster_form_needs_the_drivers_count_of_clusters_at_once(monkeypatch):
    """Where the device's driver says fewer clusters run at once than whole 16-SM groups would hold
    (GPCs keep different numbers of SMs), a split count whose clusters would not all fit keeps the
    workspace's merge: a second wave of clusters costs 15-20% (PERF_NOTES "s3"). Without a device
    (a reference spec) the estimate stands."""
    from tuner import launch
    from tuner.kernel_templates.flash_decode import CLUSTER_FAMILY
    from tuner.launch import clusters_at_once

    monkeypatch.setattr(launch, "one_sm_clusters", lambda gpu, size: None)   # the spec's estimate
    b2 = replace(LLAMA_DECODE, batch=2, mask="none")   # 16 (sequence, K/V head) groups
    params = dict(FAM.default(H100_SXM, b2), splits=8)
    assert clusters_at_once(H100_SXM, 8) == 16 and FAM.served_form(params, H100_SXM, b2)[0] is CLUSTER_FAMILY
    asked = []

    def driver(gpu, size):
        asked.append((gpu, size))
        return {2: 66, 4: 30, 8: 15}[size]

    monkeypatch.setattr(launch, "one_sm_clusters", driver)
    assert [clusters_at_once(H100_SXM, n) for n in (2, 4, 8)] == [66, 30, 15]
    assert FAM.served_form(params, H100_SXM, b2) == (FAM, params)   # 16 clusters of 8, 15 at once
    assert FAM.served_form(dict(params, splits=4), H100_SXM, b2)[0] is CLUSTER_FAMILY   # 16 of 4 fit
    b4 = replace(b2, batch=4)   # 32 groups: 32 clusters of 4 where 30 fit
    assert FAM.served_form(dict(params, splits=4), H100_SXM, b4) == (FAM, dict(params, splits=4))
    assert (H100_SXM, 8) in asked


def test_no_device_has_no_drivers_cluster_count():
    """one_sm_clusters answers None for a spec that is not a visible device (here: no GPU, or an A100
    spec), so callers fall back to their estimate rather than raising."""
    from tuner.launch import one_sm_clusters

    assert one_sm_clusters(A100_SXM, 2) is None
    if not torch.cuda.is_available():
        assert one_sm_clusters(H100_SXM, 8) is None


def test_a_tuned_decode_entry_serves_its_cluster_form_with_the_calls_split_count(tmp_path):
    """An entry tuned at B32 (one split there) serving a B8 call: its split count is the call's (2),
    and the cluster form keeps it (its own adapt would have reset it and compiled no cluster)."""
    from tuner.dispatch import Dispatcher, served_params
    from tuner.export import lookup_of, write_lookup
    from tuner.kernel_templates import FAMILIES

    b32 = replace(LLAMA_DECODE, batch=32)
    path = tmp_path / "lookup.json"
    write_lookup(lookup_of(H100_SXM.key, [(b32, FAM.name, dict(FAM.default(H100_SXM, b32), splits=1), 1.0)]), path)
    b8 = replace(b32, batch=8)
    entry = Dispatcher(path).serving_entry(b8, H100_SXM)
    fam = FAMILIES[entry["family"]]
    params = served_params(entry, b8)
    assert fam.name == "flash_decode_cluster" and params["splits"] == 2
    assert fam.defines(params, b8)["MERGE_CLUSTER"] == 2 and fam.launch(params, b8, H100_SXM).grid[2] == 2
    assert "splits=0" in fam.check(dict(params, splits=0), H100_SXM, b8)   # no cluster of the occupancy's count


@pytest.mark.parametrize("name", ["FAMILY", "CLUSTER_FAMILY", "PAGED_BOXES", "VARLEN_FAMILY"])
def test_the_first_kv_boxes_go_out_before_q_and_the_first_barrier(name):
    """On sm_90a a CTA's first K/V tensor-map copies are issued before Q's cp.async loads and before
    any CTA barrier: a short decode call waits on them once a wave (PERF_NOTES "q6")."""
    import tuner.kernel_templates.flash_decode as fd
    from tuner.compile import compile_kernel, disassemble

    fam = getattr(fd, name)
    params = dict(FAM.default(H100_SXM, LLAMA_DECODE), splits=2 if fam is fd.CLUSTER_FAMILY else 0)
    assert fam.kv_tma(params, LLAMA_DECODE.head_dim)
    sass = disassemble(compile_kernel(fam, params, LLAMA_DECODE, H100_SXM.arch).cubin)

    def first(pattern: str) -> int:
        return next(i for i, insn in enumerate(sass) if re.search(pattern, insn))

    assert first(r"\bUTMALDG\b") < first(r"\bLDGSTS\b"), name
    assert first(r"\bUTMALDG\b") < first(r"\bBAR\.SYNC\b"), name
