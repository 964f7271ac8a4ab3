"""Without a GPU: flash_fwd_sm90's variants on a dense KV cache of per-sequence lengths
(kernel_templates/flash_fwd_sm90_cache.py, CACHE_LENS) compile for sm_90a without spills, run their
family's configs on the grid, and serve exactly the cache calls attention serves with a Hopper
kernel (tuner.kvcache.held_keys_config)."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from tuner.compile import compile_kernel, sass_listing
from tuner.dispatch import Dispatcher
from tuner.gpu import H100_SXM
from tuner.kernel_templates import FAMILIES, configs_family
from tuner.kernel_templates.flash_fwd_sm90 import k_tail, tile_dim
from tuner.kernel_templates.flash_fwd_sm90_cache import CACHE_VARIANTS
from tuner.kvcache import held_keys_config
from tuner.problem import Problem

H200 = replace(H100_SXM, name="NVIDIA H200", memory_bytes=141 * 2**30, l2_bytes=60 * 2**20)

# cache calls (the cache's capacity as Nk): speculative GQA steps of 48-128 packed rows, d=64-256, and
# chunks of a prompt, GQA and not
CACHE_PROBLEMS = [Problem(8, 32, 16, 8192, 128, "bf16", "causal_br", 8), Problem(4, 64, 8, 3000, 64, "fp16", "causal_br", 8),
                  Problem(2, 16, 8, 20000, 256, "bf16", "none", 2), Problem(1, 8, 16, 7001, 80, "bf16", "causal_br", 1),
                  Problem(4, 16, 150, 3000, 128, "bf16", "causal_br", 2), Problem(2, 8, 333, 9000, 64, "fp16", "none", 8)]


def _assert_builds_clean(variant, params: dict, problem: Problem) -> None:
    """`params` of `variant` compile for sm_90a with no spills or local memory, Q, K and V by TMA."""
    ck = compile_kernel(variant, params, problem, H100_SXM.arch)
    assert (ck.resources.spill_bytes, ck.resources.stack_bytes) == (0, 0), (variant.name, params, ck.resources)
    sass = sass_listing(ck.cubin)
    assert re.search(r"\bUTMALDG(\.\w+)*\b", sass) and re.search(r"\bHGMMA\.64x", sass), (variant.name, params)
    assert not re.search(r"\b(LDL|STL)(\.\w+)*\b", sass), f"local memory (spills) in SASS: {variant.name} {params}"


@pytest.mark.parametrize("problem", CACHE_PROBLEMS, ids=lambda p: p.key)
def test_variants_compile_for_sm90a_without_spills(problem):
    """Each variant's family seeds that take the call, in the variant's grid form: CACHE_LENS among
    the defines, the lengths one more parameter, no spills or local memory, Q, K and V by TMA."""
    built = 0
    for base, variant in CACHE_VARIANTS.items():
        fam = FAMILIES[base]
        if variant.supports(H100_SXM, problem) is not None:
            continue
        for seed in fam.seeds(H100_SXM, problem)[:3]:
            params = variant.cache_form(seed, problem)
            if variant.check(params, H100_SXM, problem) is not None:
                continue
            assert variant.defines(params, problem) == {**fam.defines(params, problem), "CACHE_LENS": 1}
            assert variant.param_kinds(params) == fam.param_kinds(params) + ("ptr",)
            _assert_builds_clean(variant, params, problem)
            built += 1
    assert built >= 2, problem.key


# a page of several slots of a tile (16), of a whole tile's (256), of slots of their common rows (48)
@pytest.mark.parametrize("page", [16, 48, 256])
@pytest.mark.parametrize("problem", CACHE_PROBLEMS[::2], ids=lambda p: p.key)
def test_paged_variants_compile_for_sm90a_without_spills(problem, page):
    """On a paged cache (CACHE_PAGES): the page's rows among the defines, the block table and its row
    stride two more parameters, no spills or local memory; K and V by a TMA box a slot, or where a
    tile is several slots and the producer keeps 40 registers by its warpgroup's cp.async
    (GATHER_KV: LDGSTS in the SASS, and only there)."""
    built = 0
    for base, dense in CACHE_VARIANTS.items():
        fam, variant = FAMILIES[base], dense.paged(page)
        assert variant is dense.paged(page) and variant.name == f"{dense.name}_paged{page}" and variant.pages == page
        if variant.supports(H100_SXM, problem) is not None:
            continue
        for seed in fam.seeds(H100_SXM, problem)[:2]:
            params = variant.cache_form(seed, problem)
            if variant.check(params, H100_SXM, problem) is not None:
                continue
            cols = tile_dim(problem) * 2   # bytes of a tile row, in 128-byte panels where they divide it
            boxes = params["Bc"] // math.gcd(params["Bc"], page) * cols // (128 if cols % 128 == 0 else 64)
            gathers = math.gcd(params["Bc"], page) < params["Bc"] <= 128 and params["split"] == 40 and boxes >= 16
            assert variant.gathers(params, problem) == gathers
            assert variant.defines(params, problem) == {**dense.defines(params, problem), "CACHE_PAGES": page,
                                                        **({"GATHER_KV": 1} if gathers else {})}
            assert variant.param_kinds(params) == dense.param_kinds(params) + ("ptr", "i32")
            _assert_builds_clean(variant, params, problem)
            sass = sass_listing(compile_kernel(variant, params, problem, H100_SXM.arch).cubin)
            assert bool(re.search(r"\bLDGSTS(\.\w+)*\b", sass)) == gathers, (variant.name, params)
            built += 1
    assert built >= 2, problem.key


@pytest.mark.parametrize("d", [72, 80])
def test_paged_gather_with_a_k_tail_panel_compiles_without_spills(d):
    """At d=72-80 K's ring row is a 128-byte panel and a 32-byte tail panel (K_TAIL): GATHER_KV copies
    the tail's chunks into it, each family's two-consumer form on pages of 16 and 8 with no spills or
    local memory (one offset a segment there: two spilled 8 B), and LDGSTS in the SASS."""
    problem = Problem(4, 32, 512, 8192, d, "bf16", "causal_br", 4)
    for base, dense in CACHE_VARIANTS.items():
        seed = dict(FAMILIES[base].seeds(H100_SXM, problem)[0], Bc=128, split=24, cwg=2)
        for page in (16, 8):
            variant = dense.paged(page)
            params = variant.cache_form(seed, problem)
            assert k_tail(params, problem) == 16 and variant.gathers(params, problem), (base, page, params)
            assert variant.defines(params, problem)["GATHER_KV"] == 1 and variant.defines(params, problem)["K_TAIL"] == 16
            _assert_builds_clean(variant, params, problem)
            sass = sass_listing(compile_kernel(variant, params, problem, H100_SXM.arch).cubin)
            assert re.search(r"\bLDGSTS(\.\w+)*\b", sass), (base, page)


def test_paged_caches_take_the_variant_where_pages_are_whole_swizzle_atoms(tmp_path):
    """held_keys_config on a paged cache: the paged form of the variant and config the dense problem
    gets (a smaller Bc where it shares more rows with a page: page_tile), for any page of whole
    8-row atoms (also those sharing only part of a tile's rows: 48, 80); none for pages of 12 rows,
    which flash_decode (row by row) or attention serves."""
    none = Dispatcher(tmp_path / "none.json")
    step, chunk = Problem(8, 32, 16, 8192, 128, "bf16", "causal_br", 8), Problem(4, 16, 150, 3040, 128, "bf16", "causal_br", 2)
    # the chunk's Bc 176 on pages it shares fewer rows with than a smaller tile does: that tile; on
    # pages of 8 and 16, Bc 128 by the producer's copies (GATHER_KV); and the producer's 40 registers,
    # not 24, where a tile is several slots (all but these: whole tiles)
    tiles = {(chunk, 8): 128, (chunk, 16): 128, (chunk, 48): 96, (chunk, 80): 80, (chunk, 256): 128, (chunk, 1024): 128}
    whole = {(step, 256), (step, 1024), (chunk, 80), (chunk, 256), (chunk, 1024)}
    for problem in (step, chunk):
        dense = held_keys_config(none, problem, H100_SXM)
        assert dense[1]["Bc"] == (64 if problem is step else 176) and dense[1]["split"] == 24, dense
        for page in (8, 16, 48, 80, 256, 1024):
            variant, params = held_keys_config(none, problem, H100_SXM, page)
            assert variant is dense[0].paged(page), (problem.key, page)
            assert params == dict(dense[1], Bc=tiles.get((problem, page), dense[1]["Bc"]),
                                  split=24 if (problem, page) in whole else 40), (problem.key, page)
        assert held_keys_config(none, problem, H100_SXM, 12) is None
        assert "8-row" in dense[0].paged(12).check(dense[1], H100_SXM, problem)


def _boxes(variant, page: int):
    """`variant` on pages of `page` rows with its `gather` off: K/V a TMA box per slot and panel."""
    boxes = type(variant)()
    boxes.gather, boxes.pages = False, page
    return boxes


def test_paged_tiles_take_the_largest_boxes_a_smaller_bc_gives():
    """By boxes (gather off), on pages a tile shares few rows with (Bc 176 on 256: eleven 16-row
    boxes), the form takes the largest smaller Bc of the family with the most rows a box (128: one);
    on pages every Bc shares alike (16) or that the tile divides, the tuned Bc stays; a dense cache
    keeps it always."""
    problem = Problem(2, 28, 256, 16384, 128, "bf16", "causal_br", 4)
    for base, dense in CACHE_VARIANTS.items():
        seed = dict(FAMILIES[base].seeds(H100_SXM, problem)[0], Bc=176)
        assert dense.cache_form(seed, problem)["Bc"] == 176
        for page, bc in ((16, 176), (32, 128), (256, 128), (1024, 128), (8, 176)):
            assert _boxes(dense, page).cache_form(seed, problem)["Bc"] == bc, (base, page)
        for page in (16, 32, 48, 64, 80, 256):
            for b in dense.space["Bc"]:
                got = dense.paged(page).page_tile(b)
                assert got <= b and got in dense.space["Bc"], (base, page, b)
                assert math.gcd(got, page) >= max(math.gcd(c, page) for c in dense.space["Bc"] if c <= b), (base, page, b)
                assert got == b or math.gcd(got, page) > math.gcd(b, page), (base, page, b)


def test_producer_keeps_40_registers_where_a_tile_is_several_slots():
    """split 24 becomes 40 on pages of several slots a tile, up to d=128 and where the consumers'
    estimate fits their 232 registers; a whole-tile page, a dense cache, d=256 and three consumers
    keep 24 (or whatever else the config has)."""
    chunk = Problem(2, 28, 256, 16384, 128, "bf16", "causal_br", 4)
    wide = Problem(2, 16, 300, 20000, 256, "bf16", "causal_br", 2)
    variant = CACHE_VARIANTS["flash_fwd_sm90"]
    seed = dict(FAMILIES["flash_fwd_sm90"].seeds(H100_SXM, chunk)[0], Bc=176, split=24, cwg=2)
    assert variant.cache_form(seed, chunk)["split"] == 24                      # dense
    assert _boxes(variant, 16).cache_form(seed, chunk)["split"] == 40          # 11 slots
    assert variant.paged(256).cache_form(seed, chunk)["split"] == 24           # Bc 128: one slot
    assert variant.paged(16).cache_form(dict(seed, split=0), chunk)["split"] == 0
    assert variant.paged(16).cache_form(dict(seed, Bc=64), wide)["split"] == 24   # d=256: spills in 232
    three = dict(seed, Bc=128, cwg=3)
    assert variant.paged(16).cache_form(three, Problem(2, 8, 333, 9000, 64, "fp16", "none", 8))["split"] == 24
    # three consumers with P through shared memory (d=96): 80 B spilled under 40, the estimate fitting
    assert variant.paged(16).cache_form(three, Problem(2, 16, 200, 9000, 96, "bf16", "causal_br", 4))["split"] == 24
    for form in (variant.paged(16).cache_form(seed, chunk), variant.paged(8).cache_form(dict(seed, Bc=64), chunk)):
        assert variant.paged(16).check(form, H100_SXM, chunk) is None, form


def test_paged_forms_gather_where_a_tile_is_several_slots():
    """GATHER_KV where a K/V tile is several slots of a page, 16 TMA boxes or more, and the producer
    keeps 40 registers; fewer boxes (d=128 on pages of 32 or 48, d=64 on pages of 16), a whole-tile
    page, a dense cache, the producer's 24 registers (d=256) or the variant's `gather` off take a
    TMA box per slot and panel."""
    chunk = Problem(2, 28, 256, 16384, 128, "bf16", "causal_br", 4)
    narrow = Problem(2, 28, 256, 16384, 64, "bf16", "causal_br", 4)
    wide = Problem(2, 16, 300, 20000, 256, "bf16", "causal_br", 2)
    seed = dict(FAMILIES["flash_fwd_sm90"].seeds(H100_SXM, chunk)[0], Bc=128, split=24, cwg=2)
    variant = CACHE_VARIANTS["flash_fwd_sm90"]
    for problem, page, boxes, gathers in ((chunk, 8, 32, True), (chunk, 16, 16, True), (chunk, 32, 8, False),
                                          (chunk, 48, 4, False), (chunk, 256, 2, False), (narrow, 8, 16, True),
                                          (narrow, 16, 8, False)):
        paged = variant.paged(page)
        form = paged.cache_form(seed, problem)
        assert paged.tile_boxes(form["Bc"], problem) == boxes, (problem.head_dim, page, form)
        assert paged.gathers(form, problem) == gathers, (problem.head_dim, page, form)
        assert ("GATHER_KV" in paged.defines(form, problem)) == gathers, (problem.head_dim, page)
    assert not variant.gathers(variant.cache_form(seed, chunk), chunk) and "GATHER_KV" not in variant.defines(seed, chunk)
    form = variant.paged(16).cache_form(dict(seed, Bc=64), wide)
    assert form["split"] == 24 and not variant.paged(16).gathers(form, wide)
    assert not _boxes(variant, 16).gathers(variant.paged(16).cache_form(seed, chunk), chunk)


@pytest.mark.parametrize("page", [8, 16])
def test_three_packed_consumers_gather_in_the_producer_s_24_registers_at_d64(page):
    """The packed family's three consumers at d=64 (split 24: no registers to raise) gather on pages
    of 8 (16 boxes a tile), with no spills or local memory and LDGSTS in the SASS; on pages of 16 (8
    boxes) they take the boxes. At d=56 and in flash_fwd_sm90 the copies need 40 registers."""
    problem = Problem(8, 40, 200, 8192, 64, "bf16", "causal_br", 5)
    variant = CACHE_VARIANTS["flash_fwd_sm90_gqa"].paged(page)
    params = variant.cache_form(FAMILIES["flash_fwd_sm90_gqa"].default(H100_SXM, problem), problem)
    assert (params["Bc"], params["cwg"], params["split"]) == (128, 3, 24), params
    assert variant.gathers(params, problem) == (page == 8) and variant.check(params, H100_SXM, problem) is None
    _assert_builds_clean(variant, params, problem)
    sass = sass_listing(compile_kernel(variant, params, problem, H100_SXM.arch).cubin)
    assert bool(re.search(r"\bLDGSTS(\.\w+)*\b", sass)) == (page == 8)
    odd = replace(problem, head_dim=56)
    assert variant.gather_split(odd) == 40 and not variant.gathers(params, odd)
    plain = CACHE_VARIANTS["flash_fwd_sm90"].paged(page)
    assert plain.gather_split(problem) == 40 and not plain.gathers(dict(params, Bc=128, cwg=3, split=24), problem)


def test_paged_tiles_wider_than_a_gather_narrow_to_one():
    """A tuned Bc over 128 (which GATHER_KV does not take) on pages of several slots a tile runs at
    Bc 128 by the producer's copies, in every family, where that form gathers; by boxes (gather
    off), where the form at 128 would not gather (one consumer: no producer registers to raise;
    d=64 on pages of 16: 8 boxes), on a dense cache, or on pages of whole 128-key tiles, the tile
    stays as page_tile gives it."""
    chunk = Problem(2, 28, 256, 16384, 128, "bf16", "causal_br", 4)
    tail = Problem(2, 16, 300, 9000, 80, "bf16", "causal_br", 2)
    narrow = Problem(2, 28, 256, 16384, 64, "bf16", "causal_br", 4)
    for base, dense in CACHE_VARIANTS.items():
        seed = dict(FAMILIES[base].seeds(H100_SXM, chunk)[0], Bc=176, split=24, cwg=2)
        for page in (8, 16):
            form = dense.paged(page).cache_form(seed, chunk)
            assert form == dict(_boxes(dense, page).cache_form(seed, chunk), Bc=128), (base, page, form)
            assert dense.paged(page).gathers(form, chunk) and dense.paged(page).check(form, H100_SXM, chunk) is None
            assert _boxes(dense, page).cache_form(seed, chunk)["Bc"] == 176
            one = dense.paged(page).cache_form(dict(seed, cwg=1, split=0), chunk)
            assert one["Bc"] == 176 and not dense.paged(page).gathers(one, chunk), (base, page, one)
        assert dense.cache_form(seed, chunk)["Bc"] == 176 and dense.paged(256).cache_form(seed, chunk)["Bc"] == 128
        assert not dense.paged(256).gathers(dense.paged(256).cache_form(seed, chunk), chunk)
        form = dense.paged(16).cache_form(seed, tail)   # d=80: K's tail panel gathers too
        assert form["Bc"] == 128 and k_tail(form, tail) and dense.paged(16).gathers(form, tail), form
        # d=64: Bc 128 on pages of 16 is 8 boxes, too few to gather (Bc 176's 11 stay); on pages of 8, 16
        form = dense.paged(16).cache_form(seed, narrow)
        assert form["Bc"] == 176 and not dense.paged(16).gathers(form, narrow), form
        form = dense.paged(8).cache_form(seed, narrow)
        assert form["Bc"] == 128 and dense.paged(8).gathers(form, narrow), form


def test_paged_views_of_strides_past_int32_are_not_kernel_ready():
    """A paged cache view with a stride of 2^31 elements or more (GATHER_KV steps by 32-bit strides)
    is not kernel-ready (kvcache_attention then copies it); one under takes the kernel's values."""

    class View:   # a tensor's strides and address
        def __init__(self, *strides):
            self.strides = strides

        def stride(self, dim=None):
            return self.strides if dim is None else self.strides[dim]

        def data_ptr(self):
            return 4096

    variant = CACHE_VARIANTS["flash_fwd_sm90"].paged(16)
    small, table = View(2**20, 128, 1024, 1), View(64, 1)
    make = lambda *views: ("values",)   # noqa: E731 - the family's arg maker, whose views pass
    assert variant.cache_args(make, None, small, small, None, None, 1.0, None, table) == ("values", 0, 4096, 64)
    for huge in (View(2**31, 128, 1024, 1), View(2**20, 2**31, 1024, 1)):
        assert variant.cache_args(make, None, huge, small, None, None, 1.0, None, table) is None
        assert variant.cache_args(make, None, small, huge, None, None, 1.0, None, table) is None


def test_cache_form_is_a_grid_launch_of_the_familys_keys():
    """A persistent, chained config storing O by TMA (or a served form's, with keys of its own) runs
    on the grid, unchained, O by ordinary stores, its producer split as the grid takes it; a
    persistent packed config's splits come from the occupancy. The variants are not served by name:
    no lookup entry or family list holds them."""
    problem = Problem(4, 32, 16, 8192, 128, "bf16", "causal_br", 8)
    for base, variant in CACHE_VARIANTS.items():
        assert variant.name not in FAMILIES and variant.name.startswith(base)
        params = dict(FAMILIES[base].seeds(H100_SXM, problem)[0], persistent=1, chain=1, split=32, cut=3, tma_store=1)
        if base == "flash_fwd_sm90_gqa":
            params["splits"] = 4
        form = variant.cache_form(params, problem)
        assert set(form) == set(variant.space) and form["persistent"] == form["chain"] == form["tma_store"] == 0, form
        assert form["split"] == 24, form
        if base == "flash_fwd_sm90_gqa":
            assert form["splits"] == 0
        assert variant.check(form, H100_SXM, problem) is None, form
        assert variant.check(dict(form, persistent=1), H100_SXM, problem) is not None


@pytest.mark.parametrize("gpu", [H100_SXM, H200], ids=["H100", "H200"])
def test_held_keys_config_follows_what_attention_serves(gpu, tmp_path, monkeypatch):
    """Under the shipped lookups and under none: a cache call gets the variant of the family
    attention serves its dense problem with, in that config's grid form, and none where flash_decode
    or an SDPA backend serves it (a step of few packed rows stays on flash_decode)."""
    from tuner.dispatch import served_params
    from tuner.export import SHIPPED_ENV

    seen = set()
    for shipped in ("1", "0"):   # (the tests' default leaves the shipped lookups out)
        monkeypatch.setenv(SHIPPED_ENV, shipped)
        dispatcher = Dispatcher(tmp_path / "none.json")
        # (two more steps; and prompts into an empty cache, which the H100's shipped lookup serves
        # persistent with O stored by TMA, whose grid form stores it plainly)
        for problem in CACHE_PROBLEMS + [Problem(8, 32, 1, 8192, 128, "bf16", "causal_br", 8),
                                         Problem(32, 8, 2, 4096, 128, "fp16", "causal_br", 2),
                                         Problem(32, 16, 197, 197, 64, "bf16", "none", 16),
                                         Problem(1, 20, 1500, 1500, 64, "bf16", "none", 20)]:
            entry = dispatcher.serving_entry(problem, gpu)
            config = held_keys_config(dispatcher, problem, gpu)
            variant = CACHE_VARIANTS.get(configs_family(entry["family"]))
            if variant is None:
                assert config is None, (problem.key, entry["family"])
                continue
            assert config is not None and config[0] is variant, (problem.key, entry["family"], served_params(entry, problem))
            assert config[1] == variant.cache_form(served_params(entry, problem), problem)
            seen.add(variant.name)
    none = Dispatcher(tmp_path / "none.json")
    assert held_keys_config(none, Problem(8, 32, 16, 8192, 128, "bf16", "causal_br", 8), gpu)[0].name == "flash_fwd_sm90_gqa_cache"
    assert held_keys_config(none, Problem(8, 32, 1, 8192, 128, "bf16", "causal_br", 8), gpu) is None   # 4 rows: flash_decode
    assert {"flash_fwd_sm90_gqa_cache", "flash_fwd_sm90_cache"} <= seen, seen


@pytest.mark.parametrize("name", ["kvcache_steps", "paged_copies_ab"])
def test_the_benchmark_says_it_needs_a_gpu(name, capsys, monkeypatch):
    """benchmarks/kvcache_steps.py and paged_copies_ab.py without a GPU (none visible here, or made
    so): one clear line and exit status 2, no traceback; their bad arguments: argparse's one line."""
    import torch

    from benchmark_scripts import script

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script(name).main([]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
    bad = ["--boxes"] if name == "kvcache_steps" else ["--page", "12"]   # boxes without pages; a page of 12 rows
    with pytest.raises(SystemExit) as exit_:
        script(name).main(bad)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


def test_plans_are_chosen_again_after_a_reset(tmp_path):
    """kvcache's and varlen's plans are made once per key, threads racing on a miss share one, and
    after tuner.dispatch.reset (another lookup) they are made again from the new dispatcher's."""
    import threading

    from tuner import dispatch, kvcache, varlen
    from tuner.plan_cache import DispatcherPlans

    assert isinstance(kvcache._plans, DispatcherPlans) and isinstance(varlen._plans, DispatcherPlans)
    plans, made = DispatcherPlans(), []

    def make():
        made.append(dispatch.default())
        return object()

    try:
        dispatch.reset(tmp_path / "a.json")
        got = []
        threads = [threading.Thread(target=lambda: got.append(plans.plan("k", make))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(made) == 1 and all(g is got[0] for g in got)
        assert plans.plan("k", make) is got[0] and len(made) == 1
        dispatch.reset(tmp_path / "b.json")
        again = plans.plan("k", make)
        assert again is not got[0] and len(made) == 2 and made[1] is dispatch.default()
    finally:
        dispatch.reset()
