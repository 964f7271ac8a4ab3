"""flash_fwd_simt's spec: every kind of invalid point is named, defaults are valid, launch geometry; and every
family's parameter kinds against what its cubin declares."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tuner.family import Launch, ceil_div
from tuner.gpu import A100_SXM, H100_SXM
from tuner.kernel_templates import FAMILIES, get_family
from tuner.problem import GPT2_FP32, Problem

FAM = get_family("flash_fwd_simt")
P64 = Problem(2, 4, 512, 512, 64, "fp32", True)
P128 = Problem(2, 4, 512, 512, 128, "fp32", False)
BASE = dict(Br=64, Bc=64, TM=4, TN=4, stages=1, min_blocks=1)


def pt(**kw) -> dict:
    return {**BASE, **kw}


def test_base_point_is_valid():
    assert FAM.check(BASE, H100_SXM, P64) is None
    assert FAM.check(BASE, A100_SXM, P128) is None


@pytest.mark.parametrize(
    "params,words",
    [
        (pt(Bc=128, TN=2), ["Bc/TN=64", "one warp"]),  # 64 threads per row: more than a warp
        (pt(Br=32, Bc=32, TM=8, TN=8), ["not a whole number of warps"]),  # 4 x 4 = 16 threads
        (pt(Br=128, Bc=64, TM=2, TN=2), ["over the limit of 1024"]),  # 32 x 64 = 2048 threads
        (pt(Br=128, Bc=32, TM=8, TN=8, min_blocks=1), ["registers"]),
    ],
    ids=["row-wider-than-warp", "partial-warp", "over-1024-threads", "registers"],
)
def test_structural_reasons(params, words):
    reason = FAM.check(params, H100_SXM, P128 if "registers" in words else P64)
    assert isinstance(reason, str), params
    for w in words:
        assert w in reason, reason


def test_register_estimate_too_high_is_named():
    # TM=8 rows per thread, each owning head_dim/(Bc/TN) = 128/4 = 32 output columns: >255 live values
    p = pt(Br=128, Bc=32, TM=8, TN=8)
    assert FAM.register_estimate(p, P128) > 255
    reason = FAM.check(p, H100_SXM, P128)
    assert reason is not None and "registers" in reason and "spill" in reason


@pytest.mark.parametrize("d,dtype,budget,past,border", [
    # 32 query rows a warp (Br 128 over 4 warps): 16-bit past Bc + d = 160, tf32 past 96
    (64, "bf16", 0.0, dict(Br=128, Bc=128, warps=4), dict(Br=128, Bc=96, warps=4)),
    (32, "fp32", 2e-3, dict(Br=128, Bc=96, warps=4), dict(Br=128, Bc=64, warps=4)),
    # 16 rows a warp: tf32 from 224, 16-bit from 256 up to d=128, past 320 at d=256
    (128, "fp32", 2e-3, dict(Br=128, Bc=96, warps=8), dict(Br=128, Bc=64, warps=8)),
    (128, "fp16", 0.0, dict(Br=128, Bc=128, warps=8), dict(Br=128, Bc=96, warps=8)),
    (256, "bf16", 0.0, dict(Br=64, Bc=96, warps=4), dict(Br=64, Bc=64, warps=4)),
])
def test_mma_points_past_where_all_spilled_are_refused_and_the_border_kept(d, dtype, budget, past, border):
    mma = get_family("flash_fwd_mma")
    problem = Problem(2, 4, 512, 512, d, dtype, False, max_error=budget)
    compute = "tf32" if dtype == "fp32" else "in"
    base = dict(stages=2, q_regs=0, compute=compute)
    reason = mma.check({**base, **past}, H100_SXM, problem)
    assert reason is not None and "spill" in reason and f"Bc + d = {past['Bc'] + d}" in reason
    assert mma.check({**base, **border}, H100_SXM, problem) is None
    assert not any(mma.spill_reach(s, problem) for gpu in (A100_SXM, H100_SXM) for s in mma.seeds(gpu, problem))


def test_registers_per_sm_limit_is_named():
    p = pt(Br=128, Bc=64, TM=4, TN=2)  # 32 x 32 = 1024 threads x ~70 registers > 64K
    assert FAM.register_estimate(p, P64) <= 255
    reason = FAM.check(p, H100_SXM, P64)
    assert reason is not None and "registers of an SM" in reason and "1024 threads" in reason
    small_rf = replace(H100_SXM, regs_per_sm=8192)
    assert FAM.check(BASE, H100_SXM, P64) is None
    assert "registers of an SM" in (FAM.check(BASE, small_rf, P64) or "")


def test_min_blocks_register_budget_is_named():
    p = pt(Br=64, Bc=64, TM=2, TN=2, min_blocks=2)  # 2 x 1024 threads
    assert FAM.check({**p, "min_blocks": 1}, H100_SXM, P64) is None
    reason = FAM.check(p, H100_SXM, P64)
    assert reason is not None and "registers" in reason and "cannot share an SM" in reason


def test_shared_memory_over_the_gpu_limit():
    tiny = replace(H100_SXM, smem_per_block_optin=40000)
    p = pt(Br=64, Bc=64)
    need = FAM.smem_bytes(p, P64)
    assert need > 40000
    reason = FAM.check(p, tiny, P64)
    assert reason is not None and "shared memory" in reason and str(need) in reason and "40000" in reason
    assert FAM.check(p, H100_SXM, P64) is None


def test_min_blocks_shared_memory_per_sm_is_named():
    p = pt(Br=128, Bc=128, TM=8, TN=4, min_blocks=2)
    need = FAM.smem_bytes(p, P64)
    g = replace(H100_SXM, smem_per_sm=need + 1, regs_per_sm=10**6)
    reason = FAM.check(p, g, P64)
    assert reason is not None and "shared memory of one SM" in reason


def test_stages2_needs_sm80():
    turing = replace(H100_SXM, name="Tesla T4", major=7, minor=5)
    assert FAM.check(pt(stages=1), turing, P64) is None
    reason = FAM.check(pt(stages=2), turing, P64)
    assert reason is not None and "cp.async" in reason and "sm_80" in reason
    assert FAM.check(pt(stages=2), A100_SXM, P64) is None


def test_stages2_staging_costs_shared_memory_by_dtype():
    p = pt(stages=2)
    fp32 = FAM.smem_bytes(p, P64)
    fp16 = FAM.smem_bytes(p, replace(P64, dtype="fp16"))
    plain = FAM.smem_bytes(pt(stages=1), P64)
    assert plain < fp16 < fp32


@pytest.mark.parametrize(
    "gpu,problem,word",
    [
        (replace(H100_SXM, name="Tesla V100", major=7, minor=0), P64, "compute capability 7.5+"),
        (H100_SXM, Problem(1, 1, 128, 128, 80, "fp32"), "head dim"),
        (H100_SXM, Problem(1, 1, 128, 128, 96, "fp16"), "head dim"),
    ],
    ids=["cc-7.0", "d80", "d96"],
)
def test_supports_rejects(gpu, problem, word):
    reason = FAM.supports(gpu, problem)
    assert reason is not None and word in reason
    assert FAM.check(BASE, gpu, problem) == reason  # check reports the same reason for any point
    with pytest.raises(ValueError):
        FAM.default(gpu, problem)


def test_supports_rejects_dtype(monkeypatch):
    monkeypatch.setattr(FAM, "dtypes", ("fp32",))
    reason = FAM.supports(H100_SXM, replace(P64, dtype="bf16"))
    assert reason is not None and "bf16" in reason and "fp32" in reason
    assert FAM.supports(H100_SXM, P64) is None


def test_value_not_in_space():
    reason = FAM.check(pt(Br=48), H100_SXM, P64)
    assert reason is not None and "Br=48" in reason
    reason = FAM.check(pt(stages=3), H100_SXM, P64)
    assert reason is not None and "stages=3" in reason


@pytest.mark.parametrize("params", [pt(Br=64.0), pt(stages=True), pt(TM="4"), pt(min_blocks=None)],
                         ids=["float", "bool", "str", "none"])
def test_value_of_another_type_is_not_in_space(params):
    """1 == True and 64 == 64.0 in Python, but `#define` would render them as text: check compares
    by type, and render refuses anything check would."""
    reason = FAM.check(params, H100_SXM, P64)
    assert reason is not None and "is not one of" in reason
    with pytest.raises(ValueError, match="refusing to render"):
        FAM.render(params, P64)


@pytest.mark.parametrize("params", [{k: v for k, v in BASE.items() if k != "TN"}, {**BASE, "warps": 4}, {}],
                         ids=["missing", "extra", "empty"])
def test_missing_or_extra_params(params):
    reason = FAM.check(params, H100_SXM, P64)
    assert reason is not None and "parameters must be exactly" in reason


def test_valid_points_agree_with_check_and_shrink_with_head_dim():
    for gpu in (A100_SXM, H100_SXM):
        v64, v128 = FAM.valid_points(gpu, P64), FAM.valid_points(gpu, P128)
        assert v64 and v128 and len(v128) < len(v64) < len(FAM.points())
        assert all(FAM.check(p, gpu, P64) is None for p in v64)
        assert len(FAM.points()) == len({tuple(p.items()) for p in FAM.points()})
    # cp.async makes stages=2 points valid on Ampere+ only
    turing = replace(A100_SXM, major=7, minor=5)
    assert not any(p["stages"] == 2 for p in FAM.valid_points(turing, P64))
    assert any(p["stages"] == 2 for p in FAM.valid_points(A100_SXM, P64))


@pytest.mark.parametrize("gpu", [H100_SXM, A100_SXM], ids=lambda g: g.arch)
@pytest.mark.parametrize("problem", list(GPT2_FP32) + [P128, replace(P128, dtype="bf16", mask="causal")],
                         ids=lambda p: p.key)
def test_default_is_valid(gpu, problem):
    d = FAM.default(gpu, problem)
    assert FAM.check(d, gpu, problem) is None
    assert set(d) == set(FAM.space)
    seeds = [s for s in FAM.seeds(gpu, problem) if FAM.check(s, gpu, problem) is None]
    assert seeds and d == seeds[0]


def test_default_falls_back_to_a_valid_point_when_no_seed_fits(monkeypatch):
    monkeypatch.setattr(FAM, "seeds", lambda gpu, problem: [pt(Br=48), pt(Bc=128, TN=2)])
    d = FAM.default(H100_SXM, P64)
    assert d == FAM.valid_points(H100_SXM, P64)[0] and FAM.check(d, H100_SXM, P64) is None


def test_default_raises_when_nothing_fits():
    tiny = replace(H100_SXM, smem_per_block_optin=20000)
    assert FAM.valid_points(tiny, P64) == []
    with pytest.raises(ValueError, match="no valid config"):
        FAM.default(tiny, P64)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 1024])
@pytest.mark.parametrize("params", [BASE, pt(Br=128, Bc=64, TM=8, TN=4), pt(Br=32, Bc=32, TM=2, TN=2)],
                         ids=lambda p: f"Br{p['Br']}")
def test_launch_geometry(params, n):
    problem = Problem(3, 5, n, n + 7, 64, "fp16", True)
    launch = FAM.launch(params, problem, H100_SXM)
    assert isinstance(launch, Launch)
    gx, gy, gz = launch.grid
    assert gx == ceil_div(n, params["Br"]) and gx * params["Br"] >= n > (gx - 1) * params["Br"]
    assert (gy, gz) == (3 * 5, 1)
    threads = (params["Bc"] // params["TN"]) * (params["Br"] // params["TM"])
    assert launch.block == (threads, 1, 1) and threads % 32 == 0
    assert launch.smem_bytes == FAM.smem_bytes(params, problem) > 0


def test_render_carries_every_define():
    src = FAM.render(BASE, Problem(1, 1, 128, 128, 128, "bf16", True))
    for name, value in {"BR": 64, "BC": 64, "TM": 4, "TN": 4, "STAGES": 1, "MIN_BLOCKS": 1,
                        "HEAD_DIM": 128, "IN_DTYPE": 2, "IS_CAUSAL": 1}.items():
        assert f"#define {name} {value}\n" in src
    assert '#include "' not in src  # our headers are inlined
    assert f"void {FAM.kernel_name}" in src or FAM.kernel_name in src


def test_family_registry():
    assert FAMILIES["flash_fwd_simt"] is FAM
    with pytest.raises(ValueError, match="unknown kernel family 'nope'"):
        get_family("nope")


# ---- the masks: every family's check, and the kernels' contract (IS_CAUSAL, MASK_BR) ----

MASK_CASES = [Problem(2, 8, nq, nk, 128, "bf16", mask, kv_heads=2)
              for mask in ("none", "causal", "causal_br") for nq, nk in ((300, 1000), (1000, 300), (512, 512))]


@pytest.mark.parametrize("problem", MASK_CASES, ids=lambda p: p.key)
@pytest.mark.parametrize("fam", FAMILIES.values(), ids=lambda f: f.name)
def test_every_family_checks_every_mask(fam, problem):
    """A family runs the masks it claims (its default passes check there) and refuses the rest by name."""
    gpu = H100_SXM
    if fam.max_queries:   # a decode family: as few queries as it serves, the keys as they are
        problem = replace(problem, seqlen_q=min(problem.seqlen_q, fam.max_queries))
    if problem.mask in fam.masks:
        assert fam.supports(gpu, problem) is None
        assert fam.check(fam.default(gpu, problem), gpu, problem) is None
    else:
        why = fam.supports(gpu, problem)
        assert why and problem.mask in why and fam.name in why
        some = fam.default(gpu, replace(problem, mask=fam.masks[0]))   # a config it runs, on a mask it does not
        assert fam.check(some, gpu, problem) == why


def test_every_family_runs_every_mask():
    for name in ("flash_fwd_simt", "flash_fwd_mma", "flash_fwd_sm90"):
        assert get_family(name).masks == ("none", "causal", "causal_br"), name


@pytest.mark.parametrize("fam", [f for f in FAMILIES.values() if "causal" in f.masks], ids=lambda f: f.name)
def test_mask_defines_and_what_they_change_in_the_source(fam):
    """IS_CAUSAL is set for either diagonal, MASK_BR for the bottom-right one only, and the two
    renderings of a point differ in that one define line (the diagonal's shift is computed in the
    kernel from its runtime nq and nk). An unmasked-only family (flash_fwd_sm90_tail, _pairs) builds none."""
    tl = Problem(1, 4, min(128, fam.max_queries or 128), 512, 64, "bf16", "causal", 2)   # GQA: flash_fwd_sm90_gqa's calls too
    params = fam.default(H100_SXM, tl)
    full, br = replace(tl, mask="none"), replace(tl, mask="causal_br")
    want = {"none": (0, 0), "causal": (1, 0), "causal_br": (1, 1)}
    for p in (full, tl, br):
        d = fam.defines(params, p)
        assert (d["IS_CAUSAL"], d["MASK_BR"]) == want[p.mask]
    a, b = fam.render(params, tl).splitlines(), fam.render(params, br).splitlines()
    assert [x for x, y in zip(a, b) if x != y] == ["#define MASK_BR 0"] and len(a) == len(b)


def test_an_unmasked_only_family_builds_no_diagonal():
    only = [f for f in FAMILIES.values() if "causal" not in f.masks]
    assert [f.name for f in only] == ["flash_fwd_sm90_tail", "flash_fwd_sm90_pairs"]
    for fam in only:
        full = Problem(1, 4, 128, 512, 64, "bf16")
        d = fam.defines(fam.default(H100_SXM, full), full)
        assert (d["IS_CAUSAL"], d["MASK_BR"]) == (0, 0)


def _declaring_case(fam, head_dim: int | None = None):
    """(gpu, params, problem) of `fam`'s default on a small problem it takes (MHA, else four query heads
    a K/V head): the Hopper GPU where the family runs there, else the A100."""
    dtype = "bf16" if "bf16" in fam.dtypes else fam.dtypes[0]
    d = head_dim or (64 if 64 in fam.head_dims else fam.head_dims[0])
    mha = Problem(2, 4, min(256, fam.max_queries or 256), 256, d, dtype, "none")
    for problem, gpu in ((p, g) for p in (mha, replace(mha, kv_heads=1)) for g in (H100_SXM, A100_SXM)):
        if fam.supports(gpu, problem) is None:   # (a packed GQA family: four query heads on one K/V head)
            break
    assert fam.supports(gpu, problem) is None, fam.name
    return gpu, fam.default(gpu, problem), problem


def _all_families() -> dict:
    """The searched families, their varlen variants, and flash_decode's two paged forms."""
    from tuner.kernel_templates import VARIANTS_BY_NAME
    from tuner.kernel_templates.flash_decode import PAGED, PAGED_BOXES

    return {**FAMILIES, **VARIANTS_BY_NAME, PAGED.name: PAGED, PAGED_BOXES.name: PAGED_BOXES}


@pytest.mark.parametrize("name,head_dim", [(name, None) for name in _all_families()]
                         + [("flash_decode", 80), ("flash_decode_varlen", 80), ("flash_decode_paged_boxes", 80)],
                         ids=lambda x: str(x))
def test_every_family_passes_the_parameters_its_kernel_declares(name, head_dim):
    """Each family's param_kinds against its cubin's declared parameters (cuobjdump's
    EIATTR_KPARAM_INFO, in order): count and byte sizes. Without a GPU the driver's own check at
    load (tuner.launch.Launcher) never runs, so a kernel parameter added without its kind (flash_decode's
    tail maps at d=80, say) would otherwise pass CI."""
    from tuner.compile import compile_kernel, param_sizes_from_cubin
    from tuner.launch import PARAM_KINDS

    fam = _all_families()[name]
    gpu, params, problem = _declaring_case(fam, head_dim)
    ck = compile_kernel(fam, params, problem, gpu.arch, quick=True)
    declared = param_sizes_from_cubin(ck.cubin, fam.kernel_name)
    assert declared, f"{name}: no parameters read from the cubin (cuobjdump missing or the kernel renamed)"
    assert declared == [PARAM_KINDS[k][1] for k in fam.param_kinds(params)], (name, gpu.arch, params)
