"""flash_fwd_sm90's spec on the CPU: what `check` rejects and why, FA3's tiles admitted, launch geometry."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from tuner.family import ceil_div
from tuner.gpu import A100_SXM, H100_SXM
from tuner.kernel_templates import get_family
from tuner.problem import Problem

H100_PCIE = replace(H100_SXM, name="NVIDIA H100 PCIe", sm_count=114)

SM90 = get_family("flash_fwd_sm90")
BASE = dict(Bc=128, stages=2, cwg=2, split=24, overlap=1, pingpong=1, persistent=0, tma_store=0, chain=0)


def problem(d: int = 128, causal: bool = False, n: int = 4096, dtype: str = "bf16"):
    return Problem(4, 16, n, n, d, dtype, causal)


def pt(**kw) -> dict:
    return {**BASE, **kw}


@pytest.mark.parametrize(
    "params,d,words",
    [
        (pt(persistent=1, split=24), 128, "24 registers"),      # the producer's scheduler state spills
        (pt(cwg=1, split=24, pingpong=0), 128, "no split"),
        (pt(cwg=1, split=0, pingpong=1), 128, "ping-pong"),
        (pt(Bc=176, split=0), 128, "registers"),                 # 232 needed, 168 without a split
        (pt(Bc=176, stages=3, split=40), 128, "shared memory"),
        (pt(Bc=128, cwg=3, split=40, persistent=1), 64, "registers"),  # 152 of split 40 are too few
        (pt(Bc=176, split=40, persistent=1, tma_store=1), 128, "shared memory"),    # O's 32 KB slabs beside 2 x 176 K/V
        (pt(split=40, tma_store=1), 64, "persistent only"),           # nothing to overlap the store with
        (pt(cwg=3, split=32, persistent=1, tma_store=1), 64, "TMA epilogue"),
        (pt(cwg=2, split=32, persistent=1), 64, "split=32"),          # two consumers: 40 gives as much
        (pt(cwg=3, split=32, persistent=1, Bc=64), 128, "split=32"),  # d=64 only
        (pt(split=40, chain=1), 64, "persistent, overlapped"),         # a grid CTA has no next tile
        (pt(split=40, persistent=1, overlap=0, chain=1), 64, "persistent, overlapped"),
        (pt(cwg=3, split=32, persistent=1, chain=1), 64, "two persistent"),
        (pt(split=0, persistent=1, tma_store=1, chain=1), 64, "register split"),
        (pt(Bc=176, split=40, persistent=1, chain=1), 128, "shared memory"),  # a second 32 KB Q beside 2 x 176 K/V
    ],
)
def test_check_names_what_does_not_fit(params, d, words):
    why = SM90.check(params, H100_SXM, problem(d))
    assert why is not None and words in why, why


@pytest.mark.parametrize(
    "params,d",
    [
        (pt(Bc=128, cwg=3, split=24, pingpong=1), 64),                 # FA3's 192 x 128 at d=64
        (pt(Bc=176, cwg=2, split=40, pingpong=1, persistent=1), 128),  # FA3's 128 x 176 at d=128, persistent
        (pt(Bc=96, cwg=3, split=40, pingpong=1, persistent=1), 64),    # three-way ping-pong, persistent
        (pt(Bc=80, cwg=2, split=24, pingpong=1), 256),                 # FA3's 128 x 80 at d=256
        (pt(Bc=128, split=40, persistent=1, tma_store=1), 128),        # TMA-stored O beside 2 x 128 K/V
        (pt(Bc=128, cwg=3, split=32, pingpong=1, persistent=1), 64),   # FA3's 192 x 128 persistent, warp-wide producer
        (pt(Bc=128, split=40, persistent=1, chain=1), 128),            # chained work tiles: a second Q beside 2 x 128 K/V
        (pt(Bc=128, split=40, persistent=1, tma_store=1, chain=1), 64),
    ],
)
def test_check_admits_the_hand_tuned_tiles(params, d):
    assert SM90.check(params, H100_SXM, problem(d)) is None


@pytest.mark.parametrize(
    "params,words",
    [
        (pt(Bc=96, split=40), "128 keys"),          # V^T is read in whole 128-key panels
        (pt(split=24), "24 registers"),              # the transposers do not fit the 24-register producer
    ],
)
def test_check_names_what_fp8_does_not_take(params, words):
    why = SM90.check(params, H100_SXM, problem(dtype="fp8"))
    assert why is not None and words in why, why


def test_fp8_takes_every_head_dim_with_a_bf16_output_and_a_vt_ring():
    for d in (64, 128, 256):
        p = problem(d, dtype="fp8")
        assert SM90.supports(H100_SXM, p) is None and p.out_dtype == "bf16"
        seeds = SM90.seeds(H100_SXM, p)
        assert seeds and all(SM90.check(s, H100_SXM, p) is None for s in seeds)
        # one byte per element, and a third ring (V^T) beside K and V
        s = seeds[0]
        assert SM90.smem_bytes(s, p) == d * (64 * s["cwg"] + 3 * s["stages"] * 128) + 1280
    # the same config in bf16 takes two bytes per element and two rings
    s = pt(split=40)
    assert SM90.smem_bytes(s, problem(128)) == 2 * 128 * (64 * 2 + 2 * 2 * 128) + 1280
    # a TMA-stored O adds its Br x d slabs, 16-bit whatever the inputs
    for dtype in ("bf16", "fp8"):
        p = problem(128, dtype=dtype)
        assert SM90.smem_bytes(pt(split=40, tma_store=1), p) - SM90.smem_bytes(s, p) == 2 * 128 * 128
    # chaining work tiles adds a second Q buffer (Br x d in the input precision)
    for dtype, esize in (("bf16", 2), ("fp8", 1)):
        p, base = problem(128, dtype=dtype), pt(split=40, persistent=1)
        assert SM90.smem_bytes({**base, "chain": 1}, p) - SM90.smem_bytes(base, p) == esize * 128 * 128


def test_hopper_only():
    assert SM90.supports(A100_SXM, problem()) is not None
    assert SM90.supports(H100_SXM, problem()) is None


@pytest.mark.parametrize("cwg", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 1000, 4096, 16384])
def test_launch_grid_per_tile_or_one_per_sm(cwg, n):
    p = problem(64, n=n)
    tiles = ceil_div(n, 64 * cwg)
    grid = SM90.launch(pt(cwg=cwg, persistent=0), p, H100_SXM)
    assert grid.grid == (tiles, p.batch * p.heads, 1) and grid.block == (128 * (cwg + 1), 1, 1)
    for gpu in (H100_SXM, H100_PCIE):   # one CTA per SM of the GPU it runs on: 132, or 114
        persistent = SM90.launch(pt(cwg=cwg, persistent=1), p, gpu)
        assert persistent.grid == (min(tiles * p.batch * p.heads, gpu.sm_count), 1, 1)


@pytest.mark.parametrize("shape,cwg", [
    ("2,32,715:5389,80,causal_br", 3),   # 3 waves of 128 rows against 2 of 192: three consumers (1.07x, j2)
    ("4,32,147:3350,80,none", 3),        # two 128-row blocks a head against one of 192 (1.33x)
    ("4,16,488:3058,80,none", 2),        # two waves either way, of 192 rows for 128 (three: 0.74x)
    ("1,8,875,80,causal", 2),            # 56 blocks of 128 rows, 40 of 192: one wave either way (three: 0.84x)
    ("4,32,925,80,causal", 3),           # 463 keys a row: 7.8 waves of 128 rows against 4.8 of 192 (1.10x, x9)
    ("2,16,593,80,none", 3),             # short unmasked rows: one wave of 192 rows against two of 128 (1.29x, x8)
    ("1,4,5146:251,80,none", 3),         # 251 keys: the same waves (1.24x, x8)
    ("16,8,7434:111,96,none", 3),        # 111 keys at d=96: 38 waves of 192 rows against 57 of 128 (x9: 0.99-1.19x on 15)
    ("4,8,1024:77,80,none", 2),          # 77 keys: two waves either way (three: 0.90x, x8)
    ("2,8,1817:32607,96,causal_br", 2),  # d=96's 96-column tile: three read 0.75x
    ("1,32,8192,80,causal", 3),          # Phi-2's 8k prefill, as its search found
    ("2,16,4096,72,none", 3),            # 8 waves of 128 rows against 5.3 of 192, its last rounds cut
    ("1,8,7781,80,none", 3),             # 3.7 waves of 128 rows against 2.5 of 192, both cut (1.14x, x2)
    ("8,4,592:2723,96,none", 3),         # 1.2 waves of 128 rows cut against one of 192: a cut counts for three only
    ("8,8,1806,80,none", 3),             # 1806 keys: three 1.10x two (z1)
    ("16,32,2251,80,causal", 3),         # 1126 keys a row on average (1.09x)
    ("4,8,595:1797,80,none", 3),         # 128 of 192 against 160 of 128 (1.29x)
    ("8,8,1024,80,none", 2),             # 3 waves of 192 rows against 4 of 128 (three: 0.97x)
    ("16,32,68:6188,80,none", 2),        # 68 queries: a third consumer would have no rows (two: 1.10x)
    ("4,4,1324:2054,80,causal_br", 2),   # 112 blocks of 192 rows, 32% of the pairs masked (three: 0.88x)
    ("1,32,688:4442,80,causal_br", 3),   # 128 blocks of 192 rows, but 8% masked (two: 0.76x, x2)
    ("16,32,159:8823,96,causal_br", 3),  # one 192-row block a head against two of 128 (1.33x, x2)
    ("16,4,1059,96,none", 3),            # 4 waves of 192 rows against 6 of 128 (1.12x)
    ("16,4,1068:10401,96,causal_br", 3),  # 1.13x
    ("2,4,2562:3135,96,causal_br", 2),   # 112 blocks of 192 rows, 41% masked (three: 0.78x)
    ("4,16,464:1339,96,none", 2),        # one wave of 128-row blocks against one of 192 (three: 0.79x)
    ("8,16,205:3875,96,causal_br", 2),   # the same (three: 0.77x)
])
def test_the_untuned_default_takes_three_consumers_on_long_rows_at_d72_96(shape, cwg):
    """flash_fwd_sm90's default at d = 72-96 (tiles of 64-byte panels, or at d = 72-80 the 128-column
    tile): three consumers on more than 128 query rows, of any length, where waves x rows a CTA
    computes x THREE_CONSUMER_COST come out lower, and not where a causal mask spreads the work of a
    wave of 192-row blocks (rows_spread_idle), else two; an unmasked call's waves are counted whole and,
    where a persistent launch cuts its last rounds, as they are, and three take either count's
    verdict for them (two on a cut count alone read 0.89-0.98x three on 6 of 9 H200 calls, x2). It is
    the first seed, so a search starts from it too: persistent, but on the grid under a mask at d=96,
    where the persistent form spills."""
    from tuner.kernel_templates.flash_fwd_sm90 import three_consumers_pay

    problem = Problem.parse(shape, "bf16")
    assert three_consumers_pay(H100_SXM, problem) == (cwg == 3)
    default = SM90.default(H100_SXM, problem)
    assert default["cwg"] == cwg and default == SM90.seeds(H100_SXM, problem)[0]
    assert SM90.check(default, H100_SXM, problem) is None
    if cwg == 3:
        assert default["persistent"] == int(not (problem.causal and problem.head_dim == 96))


@pytest.mark.parametrize("shape,cwg", [
    ("1,12,548,64,causal", 2),      # 36 CTAs of 192 rows: 60 of 128 still one wave (1.23x at two, j3)
    ("1,16,1000,64,causal", 2),     # 96 of 192, 128 of 128
    ("1,25,764,64,causal", 3),      # 100 of 192 but 150 of 128: two waves at two consumers
    ("1,25,1090:4346,64,causal_br", 2),   # 150 of 192 (two waves, the second 18 CTAs), 225 of 128 (b2: 1.13x)
    ("2,25,605:6304,64", 2),        # 200 of 192, 250 of 128: two waves either way (b2: 1.22x)
    ("8,3,1567:2802,64,causal_br", 3),    # 216 of 192 but 312 of 128: three waves at two
    ("4,25,600:4805,64,causal_br", 3),    # 400 of 192: past TWO_CONSUMER_WAVES (b2: 0.93x at two)
    ("8,25,1024,64,causal", 3),     # blocks that fill the GPU: FA3's 192-row tile
    ("1,12,548,128,causal", 2),     # d=128's default has two anyway
])
def test_the_default_takes_two_consumers_where_192_row_blocks_leave_a_wave_short(shape, cwg):
    """At d=64 the default's three consumers (FA3's 192 x 128) give way to two where, in under
    TWO_CONSUMER_WAVES waves, the waves of 128-row blocks x their rows come out TWO_CONSUMER_MARGIN
    below those of 192-row ones: a CTA's rows are the critical path."""
    from tuner.kernel_templates.flash_fwd_sm90 import two_consumers_pay

    problem = Problem.parse(shape, "bf16")
    default = SM90.default(H100_SXM, problem)
    assert default["cwg"] == cwg and SM90.check(default, H100_SXM, problem) is None
    if problem.head_dim == 64:
        assert two_consumers_pay(H100_SXM, problem) == (cwg == 2)


@pytest.mark.parametrize("shape,bc,columns", [
    ("2,25,390:4362,64,causal_br", 176, 176),   # a chunk's rows see 3.9k-4.4k keys (x6: 1.06x at 176)
    ("1,3,3636:4649,64", 176, 176),             # unmasked, 4.7k keys: 37 tiles of 128 or 27 of 176 (1.04x)
    ("1,6,1618:2866,64,causal_br", 176, 176),   # 2058 keys a row on average (1.03x)
    ("1,25,202:877,64,causal_br", 128, 176),    # 7 tiles of 128 a block, 5 of 176, on rows under WIDE_KEYS_MIN
    ("1,25,356,64", 128, 128),                  # 356 keys: 3 tiles of 128 (384 columns), 3 of 176 (528; 0.85x)
    ("1,25,359,64,causal", 128, 128),           # its blocks' 128, 256 and 359 keys (0.91x at 176)
    ("2,6,710,64,causal", 128, 128),            # (0.95x)
])
def test_the_two_consumer_default_takes_176_key_tiles_where_the_keys_fill_them(shape, bc, columns):
    """flash_fwd_sm90's d=64 default at two consumers loads K/V in tiles of 176 keys on rows of
    WIDE_KEYS_MIN keys or more where the whole tiles of the keys each query block sees come within
    WIDE_KEYS_GAIN of 128-key tiles' columns."""
    from tuner.kernel_templates.flash_fwd_sm90 import WIDE_KEYS_GAIN, key_columns, two_consumers_pay, wide_keys_pay

    problem = Problem.parse(shape, "bf16")
    assert two_consumers_pay(H100_SXM, problem)
    default = SM90.default(H100_SXM, problem)
    assert (default["cwg"], default["Bc"]) == (2, bc) and SM90.check(default, H100_SXM, problem) is None
    assert wide_keys_pay(problem) == (bc == 176)
    assert (key_columns(problem, 128, 176) < WIDE_KEYS_GAIN * key_columns(problem, 128, 128)) == (columns == 176)
    assert default["stages"] == (3 if bc == 176 else 2)
    # the columns counted block by block, key by key
    for tile in (128, 176):
        want = 0
        for start in range(0, problem.seqlen_q, 128):
            last = min(start + 128, problem.seqlen_q) - 1
            shift = problem.seqlen_k - problem.seqlen_q if problem.bottom_right else 0
            seen = problem.seqlen_k if not problem.causal else min(problem.seqlen_k, max(0, last + shift + 1))
            want += -(-seen // tile) * tile
        assert key_columns(problem, 128, tile) == want


@pytest.mark.parametrize("shape,cwg", [
    ("2,12,1122:17528,64,causal_br", 2),   # 216 blocks of 128 rows fill the SMs: the plain default's tile
    ("4,12,412:14602,64,causal_br", 2),    # 192 of 128 (b2: 304 TFLOP/s against 277 at three)
    ("2,25,189:5079,64", 3),               # 100 of 128: splits fill the SMs, three consumers' rows (b2: 0.91x at two)
    ("2,3,180:2793,64,causal_br", 3),      # 12 of 128
    ("4,25,600:4805,64,causal_br", 3),     # the plain default keeps three
])
def test_the_split_default_takes_the_plain_defaults_two_consumers_where_they_fill_the_sms(shape, cwg):
    """flash_fwd_sm90_split's default tile follows flash_fwd_sm90's two consumers where 128-row
    blocks fill the SMs on their own; under that, splitting 192-row blocks fills them better."""
    from tuner.kernel_templates import FAMILIES

    split = FAMILIES["flash_fwd_sm90_split"]
    problem = Problem.parse(shape, "bf16")
    default = split.default(H100_SXM, problem)
    assert default["cwg"] == cwg and split.check(default, H100_SXM, problem) is None


@pytest.mark.parametrize("d", [8, 40, 64, 72, 80, 96, 112, 128, 136, 144, 160, 200, 208, 256])
def test_k_takes_a_tail_panel_where_the_products_end_short_of_the_tiles_last_panel(d):
    """At d = 72-80, 136-144 and 200-208 (16-bit) the products end 16 columns into the tile's last
    panel: K's ring holds those columns only (K_TAIL), so its stage is that much smaller; V keeps the
    tile (its tail read slower, PERF_NOTES "y3"), so P V stays one wgmma. The kernel always takes the
    tail's map (the parameter list does not depend on the shape). Not with a TMA-stored O (whose
    products run over the whole tile), nor in e4m3."""
    from tuner.kernel_templates.flash_fwd_sm90 import k_tail, prod_cols, tile_dim

    p = problem(d)
    params = pt(Bc=64, stages=2, split=0, cwg=1, pingpong=0)
    tail, width, prod = k_tail(params, p), tile_dim(p), prod_cols(params, p)
    assert tail == (16 if d in (72, 80, 136, 144, 200, 208) else 0), d
    assert SM90.defines(params, p)["K_TAIL"] == tail
    k_stage = ceil_div(2 * params["Bc"] * (prod if tail else width), 1024) * 1024
    assert SM90.smem_bytes(params, p) == 2 * 64 * width + params["stages"] * (k_stage + 2 * params["Bc"] * width) + 1280
    text = SM90.render(params, p)
    assert {int(n) for n in re.findall(r"struct Wgmma<(\d+)>", text)} == {params["Bc"], prod}
    assert SM90.param_kinds(params).count("tmap") == 5
    assert k_tail(dict(params, tma_store=1, persistent=1, split=40, cwg=2), p) == 0   # products over the tile
    assert k_tail(params, problem(d, dtype="fp16")) == tail
    if d in (64, 128, 256):
        assert k_tail(dict(params, Bc=128), problem(d, dtype="fp8")) == 0
