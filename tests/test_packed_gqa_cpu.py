"""flash_fwd_sm90_gqa without a GPU: which calls it runs, its launch over K/V heads of packed rows,
Q's 5-d tensor-map geometry, the dispatcher's rule that serves it, and its seeds' resources."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from test_split_kv_cpu import assert_seeds_compile_clean

from tuner.dispatch import Dispatcher
from tuner.export import SHIPPED_DIR
from tuner.gpu import A100_SXM, H100_SXM
from tuner.gqa_packing import (PACK_FEW_ROWS_SM_SHARE, PACK_ONE_CONSUMER_KEYS, PACK_PREFILL_FEW_CTAS_KEYS,
                               PACK_PREFILL_FILL_GAIN, PACK_PREFILL_KEYS, PACK_PREFILL_L2_FILL_GAIN, PACK_PREFILL_L2_TIMES,
                               PACK_PERSISTENT_KEYS, PACK_PERSISTENT_WAVE_GAIN, PACK_PREFILL_SHORT_KEYS,
                               PACK_PREFILL_SHORT_WAVE_GAIN, PACK_PREFILL_WAVES, PACK_ROWS, PACK_ROWS_LONG,
                               PACK_ROWS_LONG_KEYS, PACK_ROWS_WIDE, packed_gqa,
                               one_consumer_packed, packs, packs_prefill)
from tuner.kernel_templates import get_family
from tuner.kernel_templates.flash_fwd_sm90_gqa import (block_fill, block_rows, fill_gain, group_of, packed_blocks,
                                                       packed_problem, packed_rows, persistent_pays, wave_gain)
from tuner.problem import DECODE_QUERIES, Problem

GQA = get_family("flash_fwd_sm90_gqa")
SPEC = Problem(32, 64, 16, 8192, 128, "bf16", "causal_br", 8)   # a speculative step of a GQA-8 model: 128 rows


def test_runs_gqa_in_16_bits_on_hopper_only():
    assert GQA.supports(H100_SXM, SPEC) is None
    assert "one query head per K/V head" in GQA.supports(H100_SXM, Problem(4, 8, 16, 8192, 128, "bf16", "none", 8))
    assert GQA.supports(A100_SXM, SPEC) is not None
    assert GQA.supports(H100_SXM, Problem(4, 64, 16, 8192, 128, "fp8", "none", 8)) is not None


def test_a_block_holds_whole_groups_of_query_heads():
    qwen = Problem(8, 28, 16, 8192, 128, "bf16", "causal_br", 4)   # 7 query heads a K/V head: 112 packed rows
    for params in GQA.valid_points(H100_SXM, qwen)[::7]:
        rows = block_rows(params, qwen)
        assert rows == 64 * params["cwg"] // 7 * 7 and rows % 7 == 0 and 64 * params["cwg"] - rows < 7
        tiles = (-(-112 // rows), 8 * 4)   # packed blocks x (batch x K/V heads): the grid, or a persistent launch's tiles
        grid = GQA.launch(params, qwen, H100_SXM).grid
        assert grid == (min(tiles[0] * tiles[1], H100_SXM.sm_count), 1, 1) if params["persistent"] else grid[:2] == tiles
    wide = Problem(1, 96, 4, 8192, 128, "bf16", "none", 1)   # 96 heads on one K/V head: no group in 64 rows
    assert {p["cwg"] for p in GQA.valid_points(H100_SXM, wide)} == {2, 3}


def test_searched_on_decode_steps_only():
    assert GQA.tune_skip(H100_SXM, SPEC) is None
    assert GQA.tune_skip(H100_SXM, Problem(1, 32, 2048, 2048, 128, "bf16", "causal", 8)) is not None


@pytest.mark.parametrize("seed", range(20))
def test_the_grid_runs_packed_rows_of_each_k_v_head(seed):
    rng = random.Random(seed)
    g, kvh, nq = rng.choice([2, 3, 4, 5, 7, 8, 12, 16]), rng.randint(1, 8), rng.choice([1, 3, 16, 40, 64])
    p = Problem(rng.randint(1, 64), g * kvh, nq, rng.randint(100, 70000), rng.choice([64, 128, 256]), "bf16", "causal_br", kvh)
    params = GQA.default(H100_SXM, p)
    rows = block_rows(params, p)
    x, y, z = GQA.launch(params, p, H100_SXM).grid
    assert (x, y) == (-(-g * nq // rows), p.batch * kvh)
    assert z == GQA.splits(params, p, H100_SXM) and 1 <= z <= 16
    assert packed_problem(params, p).query_blocks(64 * params["cwg"]) == x * y
    if g * nq <= 64 // g * g and not 64 < p.head_dim <= 128:   # one consumer holds the call's rows
        assert params["cwg"] == 1
    if 64 < p.head_dim <= 128:   # K/V tiles as narrow as two consumers' blocks are empty
        narrow = 64 if block_fill(p) <= 0.5 else 80 if block_fill(p) <= 0.75 else 128
        assert params["Bc"] == narrow or (narrow, params["Bc"]) == (80, 128)   # Bc 80: one block, one wave


@pytest.mark.parametrize("shape,fill,bc", [
    ("16,32:8,16:16384,128,causal_br", 0.5, 64),      # 64 rows: one consumer's worth
    ("32,32:8,12:8192,128,causal_br", 0.375, 64),
    ("64,32:8,16:4096,128,causal_br", 0.5, 64),       # at any number of waves
    ("16,40:8,16:8192,128,causal_br", 0.625, 80),     # 80 rows, 128 CTAs: one wave on 132 SMs
    ("8,48:8,16:16384,128,causal_br", 0.75, 80),
    ("32,40:8,16:8192,128,causal_br", 0.625, 128),    # two waves
    ("4,40:8,32:16384,96,causal_br", 160 / 256, 128),  # 125 + 35 rows: two blocks a K/V head
    ("16,28:4,16:8192,128,causal_br", 0.875, 128),    # 112 rows of 7-head groups
    ("8,32:8,64:8192,128,causal_br", 1.0, 128),       # two full blocks
])
def test_the_first_seed_narrows_k_v_tiles_as_the_blocks_empty(shape, fill, bc):
    p = Problem.parse(shape, "bf16")
    assert block_fill(p) == pytest.approx(fill)
    first = GQA.default(H100_SXM, p)
    assert (first["Bc"], first["cwg"], first["split"]) == (bc, 2, 24 if bc < 128 else 40)
    assert GQA.seeds(H100_SXM, p)[0] == first


def test_one_cubin_per_tile_the_split_count_a_launch_parameter():
    a = GQA.default(H100_SXM, SPEC)
    lines = GQA.define_lines(a, SPEC)
    assert "#define PACK_GQA 1" in lines and "#define SPLIT_KV 1" in lines
    assert GQA.define_lines(dict(a, splits=4), SPEC) == lines
    assert GQA.param_kinds(a) == get_family("flash_fwd_sm90_split").param_kinds(a)


@pytest.mark.parametrize("shape,fill3,fill2,cwg", [
    ("8,40:5,200:8192,64,causal_br", 1600 / 1728, 1600 / 1664, 3),   # ratio 0.96 (1.04x at three, x19)
    ("16,32:8,200:8192,64,causal_br", 800 / 960, 800 / 896, 3),       # 0.93 (1.09x)
    ("32,32:8,48:8192,64,causal_br", 1.0, 0.75, 3),                   # 192 rows: 1.33 (1.57x)
    ("8,32:8,64:8192,64,causal_br", 256 / 384, 1.0, 2),               # 256 rows: 0.67 (0.81x at three)
    ("4,24:8,400:8192,64,causal_br", 1200 / 1344, 1200 / 1260 * 126 / 128, 3),   # groups of 3: 126-row blocks
    ("16,32:8,200:8192,128,causal_br", 800 / 960, 800 / 896, 2),      # d=128: two consumers' Bc 176
])
def test_a_packed_prefill_at_d64_takes_three_consumers_where_their_blocks_fill(shape, fill3, fill2, cwg):
    """At d <= 64 the packed kernel's default is three consumers at Bc 128 (192-row blocks) where
    they hold the packed rows THREE_CONSUMERS_FILL times as full as two consumers' blocks, on a
    prefill or a step (48 and 64 queries); else, and past d=64, two consumers (a prefill's Bc 176)."""
    from tuner.kernel_templates.flash_fwd_sm90_gqa import THREE_CONSUMERS_FILL, three_consumers_pay

    p = Problem.parse(shape, "bf16")
    assert (block_fill(p, 3), block_fill(p)) == (pytest.approx(fill3), pytest.approx(fill2))
    assert three_consumers_pay(p) == (cwg == 3) == (p.head_dim <= 64 and fill3 >= THREE_CONSUMERS_FILL * fill2)
    params = GQA.default(H100_SXM, p)
    two = (176, 2, 24) if p.seqlen_q > DECODE_QUERIES else (128, 2, 40)   # a prefill's, a step's
    assert (params["Bc"], params["cwg"], params["split"]) == ((128, 3, 24) if cwg == 3 else two), params
    assert GQA.check(params, H100_SXM, p) is None and GQA.seeds(H100_SXM, p)[0] == params


@pytest.mark.parametrize("shape,persistent", [
    ("16,32:4,169:718,128,causal_br", True),     # 704 packed tiles over 718 keys: 1.19x the grid (x11)
    ("4,8:1,1038:713,128,none", True),
    ("8,16:4,416:3761,128,causal_br", True),     # under PERSISTENT_KEYS
    ("8,16:4,416:6679,128,causal_br", False),    # from it the grid read level or ahead (0.95-1.02x)
    ("16,14:2,138:25196,128,causal_br", False),
    ("1,16:4,153:3000,128,none", False),         # 12 packed CTAs: the grid splits the keys
])
def test_a_short_packed_prefill_runs_persistent(shape, persistent):
    """A packed prefill under PERSISTENT_KEYS keys whose grid would run one split runs persistent: one
    CTA an SM (at most one a work tile), the tile counter in place of the split workspace, no SPLIT_KV."""
    p = Problem.parse(shape, "bf16")
    params = GQA.default(H100_SXM, p)
    grid = next(s for s in GQA.seeds(H100_SXM, p) if not s["persistent"])   # the grid default it weighs
    assert bool(params["persistent"]) == persistent == persistent_pays(grid, p, H100_SXM)
    launch = GQA.launch(params, p, H100_SXM).grid
    tiles = packed_blocks(params, p) * p.batch * p.kv_heads
    if persistent:
        assert (params["Bc"], params["split"], params["splits"]) == (128, 40, 0)
        assert launch == (min(tiles, H100_SXM.sm_count), 1, 1) and GQA.splits(params, p, H100_SXM) == 1
        assert "#define SPLIT_KV 0" in GQA.define_lines(params, p) and "#define PACK_GQA 1" in GQA.define_lines(params, p)
        assert GQA.param_kinds(params) == get_family("flash_fwd_sm90").param_kinds(params)
        assert "splits 0" in GQA.check(dict(params, splits=2), H100_SXM, p)
    else:
        assert launch[:2] == (packed_blocks(params, p), p.batch * p.kv_heads)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_q_map_lands_row_r_as_query_r_over_g_of_head_r_mod_g(layout):
    """The 5-d geometry's dims and byte strides address element (query r // g, head hk * g + r % g)
    for the box's row r, in either storage; heads or box rows the group does not divide are refused."""
    from tuner.kernel_templates.sm90_tma import TmaError, _geometry

    b, h, n, d, g = 2, 16, 37, 128, 8
    t = torch.empty(b, h, n, d, dtype=torch.bfloat16) if layout == "bhnd" else \
        torch.empty(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)
    _, dims, strides, box, _, _ = _geometry(t, 64, 64, group=g)
    assert dims == (d, g, n, h // g, b) and box == (64, g, 64 // g)
    for _ in range(50):
        bi, hk, r = random.randrange(b), random.randrange(h // g), random.randrange(g * n)
        coords = (r % g, r // g, hk, bi)   # the box's row r, from its (head in group, query) origin
        offset = sum(c * s for c, s in zip(coords, strides)) // t.element_size()
        expect = bi * t.stride(0) + (hk * g + r % g) * t.stride(1) + (r // g) * t.stride(2)
        assert offset == expect
    with pytest.raises(TmaError):
        _geometry(t, 64, 64, group=3)   # 3 do not divide 16 heads
    t24 = torch.empty(b, 24, n, d, dtype=torch.bfloat16)
    assert _geometry(t24, 64, 64, group=3)[3] == (64, 3, 21)   # whole groups: 63 of a box's 64 rows
    with pytest.raises(TmaError):
        _geometry(t24, 2, 64, group=3)   # no whole group in 2 rows


@pytest.fixture(scope="module")
def shipped():
    return Dispatcher(SHIPPED_DIR / "NVIDIA-H100-80GB-HBM3_sm_90.json")


@pytest.mark.parametrize("nq,g,nk,packed", [(16, 8, 8192, True), (8, 8, 2048, True), (16, 4, 1200, True), (32, 2, 8192, True),
                                            (64, 2, 2048, True), (16, 7, 8192, True), (8, 7, 2048, True), (12, 4, 1200, True),
                                            (4, 8, 8192, True), (8, 4, 3000, True), (4, 7, 20000, True), (5, 8, 4097, True),
                                            (4, 8, 2999, False), (8, 4, 2048, False), (23, 2, 1200, False), (1, 16, 8192, False),
                                            (3, 8, 8192, False), (2, 8, 65536, False)])
def test_a_decode_step_packs_from_a_consumer_s_rows(shipped, nq, g, nk, packed):
    """A step packs from PACK_ROWS packed rows, and from PACK_ROWS_LONG over PACK_ROWS_LONG_KEYS keys."""
    p = Problem(8, 8 * g, nq, nk, 128, "bf16", "causal_br", 8)
    entry = shipped.serving_entry(p, H100_SXM)
    rows = g * nq
    assert (entry["family"] == GQA.name) == packed == (rows >= PACK_ROWS or (rows >= PACK_ROWS_LONG and nk >= PACK_ROWS_LONG_KEYS))
    if packed:
        assert GQA.check(entry["params"], H100_SXM, p) is None


# (call, packs past d=128): 16 packed rows or more always; fewer where the packed grid (K/V heads x
# splits) makes a quarter of the SMs' CTAs, as the H200's random calls measured (PERF_NOTES "y1")
WIDE_STEPS = [("1,16:2,2:1000", True),          # 16 rows, 2 CTAs
              ("8,8:4,4:2586", True),           # 8 rows, 32 K/V heads x 3 splits
              ("16,2:1,1:2201", True),          # MQA, 2 rows, 16 x 4
              ("2,16:8,4:3001", True),          # 8 rows, 16 x 4
              ("2,4:2,2:1669", False),          # 4 rows, 4 x 1: 34.2 µs packed against flash_decode's 16.1
              ("1,2:1,1:55404", False),         # 1 x 14 splits: 75.6 µs against 39.1
              ("4,16:8,4:1843", False),         # 32 x 1: 0.95x
              ("2,8:2,2:3001", False)]          # 4 x 4


@pytest.mark.parametrize("shape,packed", WIDE_STEPS, ids=[s for s, _ in WIDE_STEPS])
def test_a_wide_head_step_packs_from_fewer_rows_on_a_full_grid(shipped, shape, packed):
    """Past d=128 a step of our kernels packs from PACK_ROWS_WIDE rows (flash_decode's 256-wide m16
    rows fall behind the packed kernel's one consumer), and from fewer where the packed grid fills
    PACK_FEW_ROWS_SM_SHARE of the SMs (on fewer CTAs each walks its keys alone, or a head's many
    splits wait on one merge); d=128 keeps flash_decode under PACK_ROWS. A measured SDPA entry keeps
    its bucket either way."""
    gpu, p = H100_SXM, Problem.parse(f"{shape},256,causal_br", "bf16")
    grid = GQA.launch(GQA.default(gpu, p), p, gpu).grid
    assert packed == (packed_rows(p) >= PACK_ROWS_WIDE or math.prod(grid) >= PACK_FEW_ROWS_SM_SHARE * gpu.sm_count)
    assert packs(p, gpu) == packed
    decode = {"family": "flash_decode", "params": {}}
    assert (packed_gqa(decode, p, gpu)["family"] == GQA.name) == packed
    narrow = replace(p, head_dim=128)
    assert (packed_gqa(decode, narrow, gpu)["family"] == GQA.name) == (packed_rows(p) >= PACK_ROWS)
    assert (shipped.serving_entry(p, gpu)["family"] == GQA.name) == packed


# (call, packs): short GQA query rows whose packed rows fill two consumers' blocks 15% better, in two
# waves of CTAs (in fewer, over 6144 keys), over 1536 keys (over 700 where they make 30% fewer waves
# x rows; over 300 where 10% fewer and the packed form runs persistent), at d <= 128, as the H200
# measured them (PERF_NOTES "y1", "x3", "x10", "x11")
PREFILLS = [("16,64:8,417:6683,128,none", "bf16", True),            # 738.3 TFLOP/s packed against 622.6
            ("4,16:2,517:8162,128,causal_br", "bf16", True),        # 743.6 against 543.7
            ("8,28:4,194:4839,128,none", "bf16", True),             # 7 heads a group: blocks of 126 rows
            ("4,28:4,400:16384,96,causal_br", "bf16", True),
            ("1,4:1,1209:21494,128,causal_br", "bf16", False),      # 1209 queries fill their blocks (fill gain 1.05)
            ("8,64:8,151:3594,128,causal_br", "bf16", True),        # 569.2 against 416.7 ("x3")
            ("16,14:2,264:1549,128,none", "bf16", True),            # 526.6 against 384.4
            ("2,28:4,162:1274,128,causal_br", "bf16", False),       # 1274 keys
            ("16,8:2,534:1247,128,none", "bf16", False),            # packed 444.4 against 512.3
            ("2,16:4,276:27118,128,causal_br", "bf16", True),       # 72 CTAs, keys split: 578.5 against 431.2
            ("4,28:4,145:18113,128,causal_br", "bf16", True),       # 547.7 against 390.6
            ("2,16:4,518:4117,128,causal_br", "bf16", False),       # 136 CTAs over 4117 keys: 368.6 against 391.2
            ("8,32:8,406:406,128,causal", "bf16", False),           # packed 169.6 against 209.5
            ("2,16:8,195:7789,256,causal_br", "bf16", False),       # d=256: packed 374.6 against 444.6
            ("1,8:2,273:7887,128,causal_br", "bf16", True),         # 10 packed CTAs, their keys split (7887)
            ("16,8:2,350:29787,128,causal_br", "bf16", True),       # fill gain 1.09, 465 MB of K/V: 746.7 against 648.4 ("x4")
            ("16,32:4,713:4221,128,causal_br", "bf16", True),       # fill gain 1.07, 132 MB: 739.2 against 712.4
            ("16,16:4,1779:5661,128,none", "bf16", False),          # fill gain 1.0, 177 MB: level (0.98-1.03x on 15)
            ("16,8:2,2169:2169,128,causal", "bf16", False),         # 34 MB in L2: packed 533.1 against 628.8
            ("8,32:8,1536:1536,128,none", "bf16", False),           # 48 MB: packed 646.8 against 734.9
            ("16,32:4,169:718,128,causal_br", "bf16", True),        # 8 waves plain, 6 packed: 1.15x ("x10")
            ("16,14:2,129:1251,128,causal_br", "bf16", True),       # 4 waves, 2: 1.41x
            ("4,28:4,136:824,128,causal_br", "bf16", True),         # 2 waves, 1: 1.42x
            ("8,28:4,166:898,128,none", "bf16", True),              # 4 waves, 3: 1.12x
            ("4,16:4,397:1270,128,causal_br", "bf16", False),       # 2 waves either way: packed 0.95x
            ("1,28:4,210:783,128,causal_br", "bf16", False),        # 1 wave either way: 0.98x (one consumer 1.22x)
            ("8,14:2,162:77,128,none", "bf16", False),              # 77 keys: packed 0.78x
            ("8,7:1,532:532,128,none", "bf16", True),               # persistent packed from 300 keys, wave gain 1.1: 1.22x ("x11")
            ("16,28:4,317:317,128,none", "bf16", True),             # wave gain 1.22: 1.05x
            ("4,64:8,279:1230,128,causal_br", "bf16", True),        # 1.20x
            ("8,64:8,436:2730,128,none", "bf16", True),             # fill gain under 1.15, wave gain 1.14: 1.13x
            ("1,32:4,1104:2229,128,none", "bf16", False),           # wave gain 1.0: persistent packed 0.86x
            ("16,64:8,513:169,128,none", "bf16", False),            # 169 keys: 0.997x
            ("16,28:4,341:341,128,causal", "bf16", False),          # the mask spreads the work: 0.945x
            ("16,64,417:6683,128,none", "bf16", False),             # one query head a K/V head
            ("16,64:8,417:6683,128", "fp8", False)]


@pytest.mark.parametrize("shape,dtype,packed", PREFILLS, ids=[f"{s}-{dt}" for s, dt, _ in PREFILLS])
def test_a_gqa_prefill_of_short_rows_packs_where_the_blocks_fill_better(shipped, shape, dtype, packed):
    """A prefill of our Hopper kernels runs flash_fwd_sm90_gqa's default (Bc 176, split 24) where its packed
    rows fill two consumers' blocks PACK_PREFILL_FILL_GAIN times as well (PACK_PREFILL_L2_FILL_GAIN times
    where its K/V outgrow PACK_PREFILL_L2_TIMES times the L2), in PACK_PREFILL_WAVES waves of
    CTAs (or fewer over PACK_PREFILL_FEW_CTAS_KEYS keys, split), over PACK_PREFILL_KEYS keys, at d <= 128
    (gqa_packing.packs_prefill); a measured SDPA entry, an
    A100, and every other call keep what they had."""
    p = Problem.parse(shape, dtype)
    assert packs_prefill(p, H100_SXM) == packed
    persistent = packed and GQA.default(H100_SXM, p)["persistent"] and wave_gain(p, H100_SXM) >= PACK_PERSISTENT_WAVE_GAIN
    if persistent:   # the persistent form: fewer waves of CTAs x rows from 300 keys
        assert p.seqlen_k >= PACK_PERSISTENT_KEYS
    elif packed and p.seqlen_k < PACK_PREFILL_KEYS:   # short rows of keys: fewer waves of CTAs x rows
        assert p.seqlen_k >= PACK_PREFILL_SHORT_KEYS and wave_gain(p, H100_SXM) >= PACK_PREFILL_SHORT_WAVE_GAIN
    elif packed:
        assert fill_gain(p) >= PACK_PREFILL_FILL_GAIN or (
            fill_gain(p) >= PACK_PREFILL_L2_FILL_GAIN and p.kv_bytes >= PACK_PREFILL_L2_TIMES * H100_SXM.l2_bytes)
        ctas = packed_blocks(dict(cwg=2), p) * p.batch * p.kv_heads
        assert ctas >= PACK_PREFILL_WAVES * H100_SXM.sm_count or p.seqlen_k >= PACK_PREFILL_FEW_CTAS_KEYS
    for fam in ("flash_fwd_sm90", "flash_fwd_sm90_tail", "flash_fwd_sm90_pairs", "flash_fwd_sm90_split"):
        entry = {"family": fam, "params": {}}
        got = packed_gqa(entry, p, H100_SXM)
        assert got == ({"family": GQA.name, "params": GQA.default(H100_SXM, p)} if packed
                       else entry), fam
    if packed:
        assert GQA.check(packed_gqa({"family": "flash_fwd_sm90", "params": {}}, p, H100_SXM)["params"], H100_SXM, p) is None
        served = shipped.serving_entry(p, H100_SXM)["family"]
        assert served == GQA.name or served.startswith("sdpa"), served
    peer = {"family": "sdpa_cudnn", "params": {}}
    assert packed_gqa(peer, p, H100_SXM) is peer
    assert not packs_prefill(p, A100_SXM)


FEW_BLOCKS = [("1,4:1,178:4410,128,none", True),          # 1.16x on the H200
              ("1,7:1,192:3138,128,causal_br", True),     # 1.15x
              ("1,16:4,221:3712,128,none", True),         # 0.97x, two splits of 1856 keys
              ("1,4:1,1172:25966,128,causal_br", False),  # shares of 8655 keys: 0.72x
              ("1,4:4,178:4410,128,none", False),         # one query head a K/V head
              ("1,4:1,178:4410,256,none", False),         # d=256
              ("1,4:1,4:4410,128,none", False)]           # a decode step (packs, flash_decode)


@pytest.mark.parametrize("shape,packed", FEW_BLOCKS, ids=[s for s, _ in FEW_BLOCKS])
def test_a_split_gqa_prefill_of_short_key_shares_runs_packed_on_one_consumer(shape, packed):
    """Where the split form serves a GQA prefill (few blocks) and one consumer's packed blocks split its
    keys into shares of PACK_ONE_CONSUMER_KEYS or fewer, the packed grid's tile at one consumer serves it
    (one_consumer_packed); the split entry stays elsewhere, a plain entry (its blocks fill the SMs)
    and a measured SDPA backend stay, and so does a split entry its own bucket's search timed beside a
    packed one."""
    p = Problem.parse(shape, "bf16")
    params = one_consumer_packed(p, H100_SXM)
    assert (params is not None) == packed
    split = {"family": "flash_fwd_sm90_split", "params": {}, "bucket": p.bucket().key}
    got = packed_gqa(split, p, H100_SXM)
    if not packed:
        if not p.decode_step:   # (a decode step follows `packs`)
            assert got is split
        return
    assert (params["cwg"], params["pingpong"], params["split"], params["persistent"], params["splits"]) == (1, 0, 0, 0, 0)
    assert GQA.check(params, H100_SXM, p) is None
    splits = GQA.launch(params, p, H100_SXM).grid[2]
    assert splits >= 2 and p.seqlen_k / splits <= PACK_ONE_CONSUMER_KEYS
    assert got == {"family": GQA.name, "params": params}
    assert packed_gqa(split, p, H100_SXM, timed_packed=True) is split   # its bucket's search timed packing
    plain = {"family": "flash_fwd_sm90", "params": {}}
    assert packed_gqa(plain, p, H100_SXM) is plain
    peer = {"family": "sdpa_flash", "params": {}}
    assert packed_gqa(peer, p, H100_SXM) is peer
    assert one_consumer_packed(p, A100_SXM) is None


def test_the_one_consumer_packed_prefill_is_what_the_dispatcher_serves():
    """Through a dispatcher with no lookup: the split default that a few-block GQA prefill took now
    runs packed on one consumer, and its MHA twin keeps the split default."""
    d = Dispatcher(None)
    p = Problem.parse("1,8:2,122:4596,128,none", "bf16")
    got = d.serving_entry(p, H100_SXM)
    assert got == {"family": GQA.name, "params": one_consumer_packed(p, H100_SXM)}
    twin = replace(p, kv_heads=p.heads)
    assert d.serving_entry(twin, H100_SXM)["family"] == "flash_fwd_sm90_split"


@pytest.mark.parametrize("d,mask", [(64, "none"), (96, "causal"), (128, "causal_br")])
def test_the_one_consumer_packed_config_compiles_without_spills(d, mask):
    from tuner.compile import compile_kernel

    p = Problem(1, 8, 150, 4000, d, "bf16", mask, 2)
    params = one_consumer_packed(p, H100_SXM)
    assert params is not None and params["cwg"] == 1
    ck = compile_kernel(GQA, params, p, H100_SXM.arch)
    assert (ck.resources.spill_bytes, ck.resources.stack_bytes) == (0, 0), ck.resources
    assert "warning" not in ck.log and "C75" not in ck.log, ck.log


def test_a_search_weighs_packing_on_the_prefills_the_rule_takes():
    """The packed family is tuned on a prefill that packs (tune_skip), so an entry of the call's own
    bucket stands where that bucket's search timed the packed family (timed_packed), whichever family
    won; one whose search did not (a lookup tuned before the rule took it), or a borrowed one, gives way
    to the packed default, and a packed entry borrowed for a prefill that does not pack to flash_fwd_sm90's."""
    sm90 = get_family("flash_fwd_sm90")
    short = Problem.parse("4,16:2,517:8162,128,causal_br", "bf16")
    long_rows = Problem.parse("1,4:1,1209:21494,128,causal_br", "bf16")
    assert packs_prefill(short, H100_SXM) and not packs_prefill(long_rows, H100_SXM)
    assert GQA.tune_skip(H100_SXM, short) is None and "fill the plain kernel's tiles" in GQA.tune_skip(H100_SXM, long_rows)
    assert GQA.tune_skip(H100_SXM, Problem.parse("4,16:2,517:8162,256,causal_br", "bf16")) is not None   # d=256
    assert GQA.default(H100_SXM, short)["Bc"] == 176
    plain = {"family": sm90.name, "params": sm90.default(H100_SXM, short), "bucket": short.bucket().key,
             "problem": short.to_dict()}
    assert packed_gqa(plain, short, H100_SXM, timed_packed=True) is plain   # its search timed the packed family too
    assert packed_gqa(plain, short, H100_SXM) == {"family": GQA.name, "params": GQA.default(H100_SXM, short)}
    near = replace(short, seqlen_q=530)   # the same bucket, another call that packs
    assert near.bucket() == short.bucket() and packs_prefill(near, H100_SXM)
    assert packed_gqa(plain, near, H100_SXM, timed_packed=True) is plain
    borrowed = {**plain, "bucket": "elsewhere"}
    assert packed_gqa(borrowed, short, H100_SXM, timed_packed=True) == {"family": GQA.name, "params": GQA.default(H100_SXM, short)}
    packed = {"family": GQA.name, "params": GQA.default(H100_SXM, short), "bucket": short.bucket().key,
              "problem": short.to_dict()}
    assert packed_gqa(packed, short, H100_SXM) is packed
    assert packed_gqa(packed, long_rows, H100_SXM) == {"family": sm90.name, "params": sm90.default(H100_SXM, long_rows)}


def test_a_bucket_search_that_timed_the_packed_family_keeps_its_plain_winner(tmp_path):
    """Through the dispatcher: a plain entry of a call's own bucket stands where the bucket also holds a
    (slower) packed entry, its search having timed both; alone, as in a lookup tuned before the rule took
    the bucket's calls, it gives way to the packed default."""
    from test_dispatch_choices import entry, lookup

    sm90 = get_family("flash_fwd_sm90")
    p = Problem.parse("16,8:2,350:29787,128,causal_br", "bf16")   # packs by its K/V (465 MB), fill gain 1.09
    assert packs_prefill(p, H100_SXM) and fill_gain(p) < PACK_PREFILL_FILL_GAIN
    plain = entry(p, sm90.name, sm90.default(H100_SXM, p), 700.0)
    packed = entry(p, GQA.name, GQA.default(H100_SXM, p), 650.0)
    both = Dispatcher(lookup(tmp_path / "both.json", [plain, packed])).serving_entry(p, H100_SXM)
    assert both["family"] == sm90.name and both["tflops"] == 700.0
    alone = Dispatcher(lookup(tmp_path / "alone.json", [plain])).serving_entry(p, H100_SXM)
    assert alone == {"family": GQA.name, "params": GQA.default(H100_SXM, p)}


def test_a_persistent_packed_entry_runs_on_the_grid_where_its_keys_would_split(tmp_path):
    """A persistent packed entry tuned on a speculative batch of 32 (256 packed tiles) serves the same
    bucket's batch of 8 (64 tiles) on the grid, its keys split from the occupancy: a persistent launch
    splits none; at the batch it was tuned on it stays as it is."""
    from test_dispatch_choices import entry, lookup

    tuned, small = (Problem(b, 32, 16, 8192, 128, "bf16", "causal_br", 8) for b in (32, 8))
    assert tuned.bucket().key == small.bucket().key
    params = dict(GQA.default(H100_SXM, tuned), Bc=128, split=40, persistent=1, splits=0)
    assert GQA.check(params, H100_SXM, tuned) is None and GQA.check(params, H100_SXM, small) is None
    d = Dispatcher(lookup(tmp_path / "spec.json", [entry(tuned, GQA.name, params, 300.0)]))
    assert d.serving_entry(tuned, H100_SXM)["params"] == params
    served = d.serving_entry(small, H100_SXM)
    assert served["family"] == GQA.name and served["params"] == dict(params, persistent=0)
    assert GQA.splits(served["params"], small, H100_SXM) > 1
    assert GQA.launch(served["params"], small, H100_SXM).grid[2] > 1


def test_wave_gain_counts_whole_waves_of_ctas_x_rows():
    """Plain blocks of 128 rows against packed ones, in waves of 132 SMs: 1024 CTAs (8 waves) against
    704 (6); 448 (4) against 256 (2); one wave either way (112 against 72) gains nothing, though the
    packed rows fill their blocks 1.56x as well."""
    assert wave_gain(Problem(16, 32, 169, 718, 128, "bf16", "causal_br", 4), H100_SXM) == pytest.approx(8 / 6)
    assert wave_gain(Problem(16, 14, 129, 1251, 128, "bf16", "causal_br", 2), H100_SXM) == pytest.approx(2.0)
    one = Problem(2, 28, 162, 1274, 128, "bf16", "causal_br", 4)
    assert wave_gain(one, H100_SXM) == pytest.approx(1.0) and fill_gain(one) > 1.5


def test_fill_gain_counts_whole_groups_of_query_heads():
    assert fill_gain(Problem(1, 64, 417, 6683, 128, "bf16", "none", 8)) == pytest.approx((3336 / 3456) / (417 / 512))
    assert fill_gain(Problem(1, 28, 194, 4839, 128, "bf16", "none", 4)) == pytest.approx((1358 / (11 * 128)) / (194 / 256))
    assert fill_gain(Problem(1, 16, 1024, 4096, 128, "bf16", "none", 2)) == 1.0


def test_packing_leaves_other_calls_and_entries_alone(shipped):
    decode = {"family": "flash_decode", "params": {}}
    mha = Problem(8, 8, 16, 8192, 128, "bf16", "causal_br", 8)
    prefill = Problem(8, 64, 512, 8192, 128, "bf16", "causal_br", 8)
    for p in (mha, prefill):
        assert packed_gqa(decode, p, H100_SXM) is decode, p.key
    qwen = Problem(8, 28, 16, 8192, 128, "bf16", "causal_br", 4)   # 7 heads a group: blocks of 63 or 126 rows
    assert packed_gqa(decode, qwen, H100_SXM)["family"] == GQA.name
    assert packed_gqa(decode, SPEC, A100_SXM) is decode
    peer = {"family": "sdpa_cudnn", "params": {}}
    assert packed_gqa(peer, SPEC, H100_SXM) is peer and packed_gqa(None, SPEC, H100_SXM) is None
    assert packed_gqa(decode, SPEC, H100_SXM)["family"] == GQA.name
    for borrowed in ("flash_fwd_sm90", "flash_fwd_sm90_tail", "flash_fwd_sm90_split"):   # a prefill config on a decode step
        assert packed_gqa({"family": borrowed, "params": {}}, SPEC, H100_SXM)["family"] == GQA.name
    assert packed_gqa({"family": "flash_fwd_mma", "params": {}}, SPEC, H100_SXM)["family"] == "flash_fwd_mma"
    assert group_of(SPEC) * SPEC.seqlen_q == 128


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_seeds_compile_for_sm90a_without_spills(d, mask):
    """Every seed that passes check, with no spill, no stack and no warning: the packed rows' own
    diagonals cost the consumers registers (d=256 Bc=80 spilled, and is refused)."""
    assert_seeds_compile_clean(GQA, Problem(2, 32, 16, 8192, d, "bf16", mask, 4))


@pytest.mark.parametrize("d,mask,heads,kvh", [(128, "causal_br", 16, 8), (96, "causal", 28, 4), (64, "none", 32, 4)])
def test_the_packed_prefill_config_compiles_without_spills(d, mask, heads, kvh):
    """The default of a short GQA prefill as it runs (groups of 2, 7 and 8): Bc 176 and split 24 on
    the grid (at d=64, where 192-row blocks fill as well, three consumers at Bc 128), and under
    PERSISTENT_KEYS keys persistent, Bc 128 and split 40."""
    from tuner.compile import compile_kernel

    grid = (128, 24, 3, 0) if d <= 64 else (176, 24, 2, 0)
    for nk, want in ((8192, grid), (2000, (128, 40, 2, 1))):
        p = Problem(8, heads, 300, nk, d, "bf16", mask, kvh)
        params = GQA.default(H100_SXM, p)
        assert (params["Bc"], params["split"], params["cwg"], params["persistent"]) == want
        assert GQA.check(params, H100_SXM, p) is None
        ck = compile_kernel(GQA, params, p, H100_SXM.arch)
        assert (ck.resources.spill_bytes, ck.resources.stack_bytes) == (0, 0), ck.resources
        assert "warning" not in ck.log and "C75" not in ck.log, ck.log


def test_a_packed_entry_tuned_on_many_rows_gives_way_to_flash_decode_on_few():
    tuned = Problem(16, 40, 16, 8192, 128, "bf16", "causal_br", 8)   # 80 rows
    entry = {"family": GQA.name, "params": GQA.default(H100_SXM, tuned), "bucket": tuned.bucket().key,
             "problem": tuned.to_dict()}
    few = Problem(16, 16, 12, 8192, 128, "bf16", "causal_br", 8)     # 24 rows, the same bucket (groups mix)
    assert few.bucket() == tuned.bucket()
    got = packed_gqa(entry, few, H100_SXM)
    assert got["family"] == "flash_decode" and got["params"] == get_family("flash_decode").default(H100_SXM, few)
    own = {**entry, "problem": few.to_dict()}   # tuned on such steps: kept
    assert packed_gqa(own, few, H100_SXM) is own
    nameless = {k: v for k, v in entry.items() if k != "problem"}
    assert packed_gqa(nameless, few, H100_SXM) is nameless   # what it was tuned on unknown: as it is
    assert packed_gqa(entry, tuned, H100_SXM) is entry   # enough rows: served as tuned
    long32 = Problem(16, 16, 16, 8192, 128, "bf16", "causal_br", 8)   # 32 rows on a long cache pack (PACK_ROWS_LONG)
    tuned32 = {**entry, "problem": long32.to_dict()}
    got = packed_gqa(tuned32, few, H100_SXM)
    assert got["family"] == "flash_decode" and got["params"] == get_family("flash_decode").default(H100_SXM, few)
    prefill = Problem(16, 40, 512, 8192, 128, "bf16", "causal_br", 8)   # 512 queries fill their blocks: no packing
    got = packed_gqa(entry, prefill, H100_SXM)
    assert got == {"family": "flash_fwd_sm90", "params": get_family("flash_fwd_sm90").default(H100_SXM, prefill)}
