"""On the GPU: every family against the float64 reference, on fresh random ragged shapes."""

from __future__ import annotations

import math
import random

import pytest

from tuner.problem import Problem

pytestmark = pytest.mark.gpu


def _run(family, params, problem, seed, layout="bhnd"):
    from tuner.gpu import detect
    from tuner.measure import random_inputs
    from tuner.reference import attention_fp64, compare

    assert family.check(params, detect(), problem) is None
    q, k, v = random_inputs(problem, seed)   # a decode step's K/V token-major already (a cache's)
    if layout == "bnhd":  # (B, N, H, D) storage seen as (B, H, N, D) strides: no copy
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    else:                 # (B, H, N, D) storage
        q, k, v = (t.contiguous() for t in (q, k, v))
    o, lse = _run_inputs(family, params, problem, q, k, v, with_lse=True)
    ref_o, ref_lse = attention_fp64(q, k, v, problem.mask, 1.0 / math.sqrt(problem.head_dim))
    return compare(o, lse, ref_o, ref_lse)


def _assert_within_budget(err, problem: Problem, what: str) -> None:
    """Every element written (outputs are NaN-poisoned), O and the LSE within the problem's budgets."""
    assert err.finite, f"NaN/Inf (unwritten output?) for {what}"
    assert err.rel <= problem.rel_budget, f"{what}: rel err {err.rel:.3g}"
    assert err.lse is not None and err.lse <= problem.lse_budget, f"{what}: lse err {err.lse}"


def _inputs_and_reference(rng: random.Random, problem: Problem):
    """Fresh random q, k, v for `problem` and the float64 reference O and LSE on them."""
    from tuner.measure import random_inputs
    from tuner.reference import attention_fp64

    q, k, v = random_inputs(problem, rng.randrange(2**31))
    ref_o, ref_lse = attention_fp64(q, k, v, problem.mask, 1.0 / math.sqrt(problem.head_dim))
    return q, k, v, ref_o, ref_lse


def _random_problem(rng: random.Random, dtype: str, causal: bool | str, d: int) -> Problem:
    """Half the time the keys are as many as the queries; otherwise fewer or more (a cache of
    past keys, cross-attention). `causal` is a mask (a bool: SDPA's top-left diagonal)."""
    lengths = [1, 7, 63, 65, 127, 129, 200, 333, 1000, 1031]
    nq = rng.choice(lengths)
    nk = nq if rng.random() < 0.5 else rng.choice(lengths)
    kvh = rng.choice([1, 2, 4])
    return Problem(rng.randint(1, 3), kvh * rng.choice([1, 2]), nq, nk, d, dtype, causal, kvh)


def _check_configs(fam, gpu, problem: Problem, rng: random.Random) -> None:
    """The family's default and 3 random valid configs on `problem`, both layouts, within budget."""
    valid = fam.valid_points(gpu, problem)
    for params in [fam.default(gpu, problem)] + rng.sample(valid, min(3, len(valid))):
        for layout in ("bhnd", "bnhd"):
            err = _run(fam, params, problem, rng.randrange(2**31), layout)
            _assert_within_budget(err, problem, f"{problem.key} {params} {layout}")


FAMILY_DTYPES_DIMS = (
    ("flash_fwd_simt", ("fp32", "fp16", "bf16"), (64, 128)),
    ("flash_fwd_mma", ("fp16", "bf16"), (32, 64, 96, 128, 256)),
    ("flash_fwd_sm90", ("fp16", "bf16"), (64, 128, 256)),
    ("flash_fwd_sm90", ("fp8",), (64, 128, 256)),   # e4m3 inputs, bf16 O
    ("flash_fwd_sm90_split", ("fp16", "bf16"), (64, 128, 256)),
)
CASES = [(f, dt, m, d) for f, dts, dims in FAMILY_DTYPES_DIMS for dt in dts for m in ("none", "causal", "causal_br")
         for d in dims]


@pytest.mark.parametrize("family,dtype,causal,d", CASES)
def test_family_matches_reference(family, dtype, causal, d):
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family

    fam = get_family(family)
    gpu = detect()
    rng = random.Random()  # fresh shapes, configs and inputs every run; printed on failure
    problem = _random_problem(rng, dtype, causal, d)
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    _check_configs(fam, gpu, problem, rng)


# Head dims the Hopper kernel pads to its tile (tile_cols, tile_width): 64-byte panels (8; 96, 160; 144
# padded to 160), 128-byte ones with the head dim ending inside the last panel (40, 56, 112, 248; 72 and
# 80 padded to 128) or filling it (192). At 72, 80 and 144 K and V come with a tail panel (ring_tail).
ANY_DIMS = [("flash_fwd_sm90", d) for d in (8, 40, 56, 72, 80, 96, 112, 144, 160, 192, 248)] + [
    ("flash_fwd_sm90_split", d) for d in (40, 80, 96, 192, 248)] + [("flash_fwd_mma", d) for d in (8, 40, 80, 112, 184)]


@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
@pytest.mark.parametrize("family,d", ANY_DIMS, ids=[f"{f}-d{d}" for f, d in ANY_DIMS])
def test_any_head_dim_matches_reference(family, d, mask):
    """The families that pad their tile (flash_fwd_sm90 and its split to 64 bytes, flash_fwd_mma to
    32 columns) at head dims off their tuned ones: the default and random valid configs, both
    layouts, fresh ragged GQA shapes, fp16 or bf16, NaN-poisoned outputs (so the columns past the
    head dim must not be written over the next row's, nor left unwritten)."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family

    fam, gpu, rng = get_family(family), detect(), random.Random()
    problem = _random_problem(rng, rng.choice(["fp16", "bf16"]), mask, d)
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    _check_configs(fam, gpu, problem, rng)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_sm90_two_consumer_default_on_176_key_tiles(dtype, mask):
    """flash_fwd_sm90's d=64 default where two consumers pay and the keys fill 176-key tiles
    (wide_keys_pay: three stages of them): fresh ragged GQA shapes of few query blocks and more keys
    than tiles of either width divide, both layouts, NaN-poisoned outputs."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.kernel_templates.flash_fwd_sm90 import two_consumers_pay, wide_keys_pay

    fam, gpu, rng = get_family("flash_fwd_sm90"), detect(), random.Random()
    for _ in range(1000):
        kvh = rng.choice([1, 2, 3])
        nq = rng.randrange(129, 1500)
        nk = rng.randrange(nq + 1500, nq + 6000) if mask == "causal" else rng.randrange(1500, 7000)
        nq = nk if mask == "causal" else nq   # top-left: a prompt, its rows see its own keys
        problem = Problem(1, kvh * rng.choice([2, 4]), nq, nk, 64, dtype, mask, kvh)
        if two_consumers_pay(gpu, problem) and wide_keys_pay(problem) and nk % 176 and nk % 128:
            break
    else:
        pytest.fail("no shape drawn where the 176-key default serves")
    params = fam.default(gpu, problem)
    assert (params["cwg"], params["Bc"], params["stages"]) == (2, 176, 3), (problem.key, params)
    for layout in ("bhnd", "bnhd"):
        err = _run(fam, params, problem, rng.randrange(2**31), layout)
        _assert_within_budget(err, problem, f"{problem.key} {params} {layout}")


@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
@pytest.mark.parametrize("d", [72, 80, 96])
def test_sm90_p_through_shared_memory(d, mask):
    """Three consumers on a 64-byte-panel tile stage P in shared memory (P_SMEM): FA4's 192 x 128 at
    d <= 96, every schedule that fits (overlap, ping-pong, persistent, serial), fresh ragged GQA
    shapes, both layouts, NaN-poisoned outputs."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.kernel_templates.flash_fwd_sm90 import p_in_smem

    fam, gpu, rng = get_family("flash_fwd_sm90"), detect(), random.Random()
    problem = _random_problem(rng, rng.choice(["fp16", "bf16"]), mask, d)
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    points = [p for p in fam.valid_points(gpu, problem) if p_in_smem(p, problem)]
    assert any(p["Bc"] == 128 for p in points)
    for params in [p for p in points if p["Bc"] == 128][:1] + rng.sample(points, min(4, len(points))):
        for layout in ("bhnd", "bnhd"):
            err = _run(fam, params, problem, rng.randrange(2**31), layout)
            _assert_within_budget(err, problem, f"{problem.key} {params} {layout}")


@pytest.mark.parametrize("family", ["flash_fwd_simt", "flash_fwd_mma", "flash_fwd_sm90", "flash_fwd_sm90_split"])
@pytest.mark.parametrize("nq,nk", [(1000, 133), (133, 1000), (1, 700), (700, 1)], ids=["more-q", "fewer-q", "decode", "one-key"])
def test_bottom_right_with_rows_that_see_no_key(family, nq, nk):
    """MASK_BR: query i sees keys j <= i + nk - nq. With more queries than keys the first nq - nk
    rows see none: O = 0 and LSE = -inf there (NaN-poisoned outputs, so they must be written);
    with fewer, every row sees a key and the last sees them all. GQA, fresh inputs, a few configs."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family

    fam, gpu, rng = get_family(family), detect(), random.Random()
    kvh = rng.choice([1, 2])
    problem = Problem(rng.randint(1, 2), 4 * kvh, nq, nk, rng.choice([64, 128]), "bf16", "causal_br", kvh)
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    valid = fam.valid_points(gpu, problem)
    for params in [fam.default(gpu, problem)] + rng.sample(valid, min(3, len(valid))):
        err = _run(fam, params, problem, rng.randrange(2**31))
        _assert_within_budget(err, problem, f"{problem.key} {params}")


@pytest.mark.parametrize("family", ["flash_fwd_mma", "flash_fwd_sm90"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_tensor_core_error_no_worse_than_sdpa_flash(family, dtype, causal):
    """Same inputs through our tensor-core kernel and SDPA's FlashAttention-2: our error against
    float64 must not exceed FA2's by more than rounding noise."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.reference import attention_fp64, compare

    gpu = detect()
    fam = get_family(family)
    if reason := fam.supports(gpu, Problem(1, 1, 1, 1, 64, dtype)):
        pytest.skip(reason)
    dt = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype])
    for d in (64, 128):
        p = Problem(2, 8, 1000, 1000, d, dtype, causal)
        q, k, v = (torch.randn(2, 8, 1000, d, device="cuda", dtype=dt) for _ in range(3))
        ours = _run_inputs(fam, fam.default(gpu, p), p, q, k, v)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        ref, _ = attention_fp64(q, k, v, causal, 1.0 / math.sqrt(d))
        e_ours, e_fa2 = compare(ours, None, ref, None), compare(theirs, None, ref, None)
        assert e_ours.finite and e_ours.rel <= 1.1 * e_fa2.rel, (d, e_ours, e_fa2)


def _run_inputs(family, params, problem, q, k, v, with_lse=False, sync=True, out=None):
    """Compile, load and launch one point on NaN-poisoned outputs (`out`: (O, LSE) of the caller's
    own layout) on torch's current stream, synchronized unless `sync` is off; O (and the LSE)."""
    import torch

    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.launch import LoadedKernel, launch_on
    from tuner.measure import poisoned_outputs

    gpu = detect()
    ck = compile_kernel(family, params, problem, gpu.arch)
    launch = family.launch(params, problem, gpu)
    launcher = LoadedKernel.load(ck, launch.smem_bytes, gpu.index).launcher(launch, family.param_kinds(params))
    o, lse = out if out is not None else poisoned_outputs(problem, q)
    launch_on(launcher, gpu.index, *family.kernel_args(params, q, k, v, o, lse, 1.0 / math.sqrt(problem.head_dim)))
    if sync:
        torch.cuda.synchronize()
    return (o, lse) if with_lse else o


@pytest.mark.parametrize("compute", ["tf32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_mma_fp32_inputs_on_tensor_cores(compute, causal, d):
    """fp32 inputs at tf32 or bf16 precision: within what the family claims each costs
    (COMPUTE_MIN_BUDGET), on fresh ragged shapes, several configs, both layouts."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.kernel_templates.flash_fwd_mma import COMPUTE_MIN_BUDGET

    fam = get_family("flash_fwd_mma")
    gpu = detect()
    rng = random.Random()
    base = _random_problem(rng, "fp32", causal, d)
    budget = COMPUTE_MIN_BUDGET[compute]
    problem = Problem(base.batch, base.heads, base.seqlen_q, base.seqlen_k, d, "fp32", causal, base.kv_heads, budget)
    valid = [p for p in fam.valid_points(gpu, problem) if p["compute"] == compute]
    seeds = [p for p in fam.seeds(gpu, problem) if p["compute"] == compute and fam.check(p, gpu, problem) is None]
    for params in seeds[:1] + rng.sample(valid, 3):
        for layout in ("bhnd", "bnhd"):
            err = _run(fam, params, problem, rng.randrange(2**31), layout)
            assert err.finite, f"NaN/Inf for {problem.key} {params} {layout}"
            assert err.rel <= budget, f"{problem.key} {params} {layout}: rel err {err.rel:.3g} over {budget:g}"
            assert err.lse is not None and err.lse <= problem.lse_budget, f"{problem.key} {params}: lse err {err.lse}"


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_persistent_scheduler_repeats_and_streams(causal, dtype):
    """The dynamic tile scheduler's counter resets itself: back-to-back launches on one stream and
    launches on two streams at once (each with its own counter) all cover every tile. In fp8 the
    V transposers follow the same tiles through the producer's ring."""
    import torch

    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.reference import compare
    from tuner.kernel_templates.sm90_tile_counter import tile_counter

    fam, gpu, rng = get_family("flash_fwd_sm90"), detect(), random.Random()
    # more work tiles than SMs, so most of them come from the counter
    n = rng.randint(1500, 2500)
    d = rng.choice([64, 128])
    problem = Problem(rng.randint(2, 4), 8, n, n, d, dtype, causal)
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    persistent = [p for p in fam.valid_points(gpu, problem) if p["persistent"]]
    params = rng.choice(persistent)
    q, k, v, ref, _ = _inputs_and_reference(rng, problem)

    def check(o, what):
        err = compare(o, None, ref, None)
        assert err.finite and err.rel <= problem.rel_budget, f"{what}: {problem.key} {params}: {err}"

    for i in range(3):
        check(_run_inputs(fam, params, problem, q, k, v), f"launch {i} on one stream")
    assert tile_counter(q.device).tolist() == [0, 0], "the counter did not reset after the launches"

    side = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for s in side:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(_run_inputs(fam, params, problem, q, k, v, sync=False))
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        check(o, f"stream {i} of 2 at once")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_tma_store_epilogue(dtype, causal):
    """O staged per warp in shared memory and stored by TMA: rows past N are clipped by the map
    (ragged N), the map follows O's own strides (a (B, N, H, D) O too), over several work tiles
    per CTA, and every element is written (O poisoned with NaN)."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import poisoned_outputs
    from tuner.reference import compare

    fam, gpu, rng = get_family("flash_fwd_sm90"), detect(), random.Random()
    problem = _random_problem(rng, dtype, causal, rng.choice([64, 128]))
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    valid = [p for p in fam.valid_points(gpu, problem) if p["tma_store"]]
    q, k, v, ref_o, ref_lse = _inputs_and_reference(rng, problem)
    for params in rng.sample(valid, 2):
        for o_layout in ("bhnd", "bnhd"):
            o, lse = poisoned_outputs(problem, q)
            if o_layout == "bnhd":   # O's rows H * D apart
                o = o.transpose(1, 2).contiguous().transpose(1, 2)
            o, lse = _run_inputs(fam, params, problem, q, k, v, with_lse=True, out=(o, lse))
            _assert_within_budget(compare(o, lse, ref_o, ref_lse), problem, f"{problem.key} {params} O {o_layout}")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_idle_consumers_in_ragged_192_row_blocks(dtype, causal):
    """Three consumers (192 query rows) where N leaves 1-64 rows in the last block: the consumers
    with no rows there skip their products but keep every barrier and ping-pong turn, on the grid
    and persistent (the warp-wide producer of split=32)."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.reference import compare

    fam, gpu, rng = get_family("flash_fwd_sm90"), detect(), random.Random()
    n = 192 * rng.randint(1, 8) + rng.randint(1, 64)
    problem = Problem(rng.randint(1, 3), 4, n, n, 64, dtype, causal, rng.choice([1, 2, 4]))
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    q, k, v, ref_o, ref_lse = _inputs_and_reference(rng, problem)
    three = [p for p in fam.valid_points(gpu, problem) if p["cwg"] == 3]
    for persistent in (0, 1):
        for params in rng.sample([p for p in three if p["persistent"] == persistent], 2):
            o, lse = _run_inputs(fam, params, problem, q, k, v, with_lse=True)
            _assert_within_budget(compare(o, lse, ref_o, ref_lse), problem, f"{problem.key} {params}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp8"])
def test_sm90_causal_blocks_from_the_end_and_consumers_at_their_own_diagonal(dtype):
    """Causal query blocks aligned to the end of the sequence, so a ragged N leaves its partial
    block at the first rows, starting before row 0 (Q filled with zeros by the TMA, no O or LSE
    written there); and each consumer running only the K/V tiles up to its own rows' diagonal,
    passing the rest (three consumers, or two with K/V tiles narrower than their 128 rows). N is
    not a multiple of 64, so some consumers have no rows at all and some only part of theirs; half
    the time there are fewer or more keys than queries. O is NaN-poisoned, stored from registers
    and by TMA (whose kernels keep causal blocks aligned to the start: a TMA store box cannot begin
    before row 0), on the grid and persistent."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.reference import compare

    fam, gpu, rng = get_family("flash_fwd_sm90"), detect(), random.Random()
    n = 64 * rng.randint(8, 20) + rng.randint(1, 63)
    nk = n if rng.random() < 0.5 else rng.randint(n // 2, 2 * n)   # top-left diagonal, as SDPA
    kvh = rng.choice([1, 2])
    problem = Problem(rng.randint(1, 3), kvh * rng.choice([2, 4]), n, nk, rng.choice([64, 128]), dtype, True, kvh)
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    several = [p for p in fam.valid_points(gpu, problem) if p["cwg"] >= 2]
    picks = []
    # each consumer count with and without the intra-warpgroup overlap (the two ways of passing
    # tiles), each of those on the grid and persistent
    for cwg, overlap, persistent in ((2, 0, 0), (2, 1, 1), (3, 0, 1), (3, 1, 0)):
        group = {"cwg": cwg, "overlap": overlap, "persistent": persistent}
        points = [p for p in several if group.items() <= p.items()]
        trimmed = [p for p in points if not p["chain"] and 64 * p["cwg"] > p["Bc"]]   # rows past a K/V tile
        if points:
            picks.append(rng.choice(trimmed or points))   # e4m3 (Bc=128 only) at d=128: none trimmed
    picks += rng.sample([p for p in several if p["tma_store"] and not p["chain"]], 1)
    assert len(picks) >= 3, picks
    q, k, v, ref_o, ref_lse = _inputs_and_reference(rng, problem)
    for params in picks:
        o, lse = _run_inputs(fam, params, problem, q, k, v, with_lse=True)
        _assert_within_budget(compare(o, lse, ref_o, ref_lse), problem, f"{problem.key} {params}")


@pytest.mark.parametrize("mask", ["causal", "causal_br"])
def test_sm90_causal_work_in_sections_of_heads(mask):
    """Causal work tiles by sections of heads (tile_scheduler.cuh's causal_tile): at d=256 with
    5.5k-8k keys two K/V heads' K/V fill a section, so 6 query heads on 3 K/V heads make sections
    of 4 heads across the batches' boundaries with B=3 or 4; with B=3 the 2 heads left over join
    the last section (last_section: 4, 4, 4, 6). Every block runs once (O NaN-poisoned), on the
    grid and persistent, and a persistent CTA's later tiles come in the sections' order."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.reference import compare

    fam, gpu, rng = get_family("flash_fwd_sm90"), detect(), random.Random()
    n = rng.randint(5500, 8192)
    problem = Problem(rng.choice([3, 4]), 6, n, n, 256, "bf16", mask, 3)
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    points = fam.valid_points(gpu, problem)
    picks = [rng.choice(group) for group in ([p for p in points if not p["persistent"]], [p for p in points if p["persistent"]])
             if group]
    assert picks
    q, k, v, ref_o, ref_lse = _inputs_and_reference(rng, problem)
    for params in picks:
        o, lse = _run_inputs(fam, params, problem, q, k, v, with_lse=True)
        _assert_within_budget(compare(o, lse, ref_o, ref_lse), problem, f"{problem.key} {params}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_chained_work_tiles(dtype, causal):
    """chain=1: each consumer issues the next work tile's first S with this tile's last P V, from a
    second Q buffer, and writes O after. Over many work tiles per CTA (the causal ones 1-16 K/V
    tiles long), ragged N, GQA, every element written (O poisoned with NaN), the LSE too, and the
    tile counter reset for a second launch."""
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.reference import compare
    from tuner.kernel_templates.sm90_tile_counter import tile_counter

    fam, gpu, rng = get_family("flash_fwd_sm90"), detect(), random.Random()
    kvh = rng.choice([2, 4])
    n = rng.randint(1100, 2100)   # 9-17 query blocks per head, the last one ragged
    problem = Problem(rng.randint(2, 3), kvh * rng.choice([2, 4]), n, n, rng.choice([64, 128]), dtype, causal, kvh)
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    chained = [p for p in fam.valid_points(gpu, problem) if p["chain"]]
    q, k, v, ref_o, ref_lse = _inputs_and_reference(rng, problem)
    for params in rng.sample(chained, 2):
        for launch in range(2):
            o, lse = _run_inputs(fam, params, problem, q, k, v, with_lse=True)
            _assert_within_budget(compare(o, lse, ref_o, ref_lse), problem, f"{problem.key} {params} launch {launch}")
        assert tile_counter(q.device).tolist() == [0, 0], "the counter did not reset after the launches"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_rows_whose_max_keeps_rising(d, mask, dtype):
    """flash_fwd_sm90 keeps a row's softmax max until a tile's rises past it by 2^8 (softmax.cuh,
    FT_RESCALE_LOG2): scores that climb along the keys, by steps below and above that, up and down
    the rows (some rows' max comes first, some last), against float64: the default, a serial and an
    overlapped config, and three persistent consumers where they fit (lazy at d <= 64 only). Random
    inputs alone rarely move a max after the first tiles."""
    import torch

    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.reference import attention_fp64, compare

    gpu = detect()
    fam = get_family("flash_fwd_sm90")
    rng = random.Random()
    nq, nk = rng.choice([(333, 1031), (1031, 1031), (200, 2000)])
    problem = Problem(2, 4, nq, nk, d, dtype, mask, 2)
    if reason := fam.supports(gpu, problem):
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    dt = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype])
    e = torch.randn(d, device="cuda", generator=g, dtype=torch.float64)
    e /= e.norm()
    # a score of about rise * (j / nk) along e (in softmax-scaled natural units), 0 to 60 over the
    # keys: 1-8 log2 units a 128-key tile, so some tiles keep the max and some move it; half the
    # sequences' keys run backwards (the max first), and a quarter of the rows lean the other way
    rise = rng.uniform(20.0, 60.0)
    ramp = torch.linspace(0.0, 1.0, nk, device="cuda", dtype=torch.float64)
    ramps = torch.stack([ramp, ramp.flip(0)])[:, None, :, None]                      # (B, 1, Nk, 1)
    lean = torch.where(torch.rand(1, 4, nq, 1, device="cuda", generator=g) < 0.25, -1.0, 1.0).double()
    scale = 1.0 / math.sqrt(d)
    q = (torch.randn(2, 4, nq, d, device="cuda", generator=g) + 4.0 * lean * e)
    k = (torch.randn(2, 2, nk, d, device="cuda", generator=g) * 0.5 + (rise / (4.0 * scale)) * ramps * e)
    v = torch.randn(2, 2, nk, d, device="cuda", generator=g)
    q, k, v = (t.to(dt).contiguous() for t in (q, k, v))
    ref_o, ref_lse = attention_fp64(q, k, v, problem.mask, scale)
    valid = fam.valid_points(gpu, problem)
    picks = [fam.default(gpu, problem)] + [rng.choice([p for p in valid if p["overlap"] == o] or valid) for o in (0, 1)]
    if three := [p for p in valid if p["cwg"] == 3 and p["persistent"]]:   # lazy at d <= 64
        picks.append(rng.choice(three))
    for params in picks:
        o, lse = _run_inputs(fam, params, problem, q, k, v, with_lse=True)
        err = compare(o, lse, ref_o, ref_lse)
        _assert_within_budget(err, problem, f"{problem.key} rise {rise:.1f} {params}")
