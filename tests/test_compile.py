"""NVRTC without a GPU: every valid point of every kernel family compiles for sm_80 and sm_90a
(points that differ only in a launch parameter, KernelFamily.launch_params, are one cubin: once).

Each (point, arch) compiles once, as a quick build (tuner.compile.QUICK: -Ofast-compile, 2-2.8x
faster on a CI core, so the 2100-point sweep fits CI's time); the problem variant (head dim, dtype,
mask) rotates over the points so that every variant is compiled by many points. The defaults and
seeds below, whose registers, spills and SASS are asserted, are production builds. The cubin cache
is shared by the xdist workers (conftest).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from benchmark_scripts import script
from tuner.compile import CompileError, compile_kernel, parse_ptxas, resources_from_cubin, sass_listing
from tuner.gpu import A100_SXM, H100_SXM
from tuner.kernel_templates import FAMILIES, get_family
from tuner.problem import GPT2_FP32, MASK_KEYS, MASKS, Problem
from tuner.records import params_key

FAM = get_family("flash_fwd_simt")
GPUS = (A100_SXM, H100_SXM)
# fp32 with a budget wide enough for tensor-core compute, so flash_fwd_mma's tf32/bf16 paths are swept
WIDE = {"fp32": 2e-2, "fp16": 0.0, "bf16": 0.0, "fp8": 0.0}
VARIANTS = [
    Problem(2, 4, 256, 256, d, dtype, mask, max_error=WIDE[dtype])
    for d, dtype, mask in itertools.product((32, 64, 96, 128, 256), ("fp32", "fp16", "bf16", "fp8"), MASKS)
]


def _variants(fam) -> list[Problem]:
    """VARIANTS the family takes; a decode family (flash_decode: a few queries) gets them with as few
    queries as it serves."""
    out = [v for v in VARIANTS if v.dtype in fam.dtypes and v.head_dim in fam.head_dims and v.mask in fam.masks]
    return [replace(v, seqlen_q=min(v.seqlen_q, fam.max_queries)) for v in out] if fam.max_queries else out


# The problems whose defaults and seeds the tests below compile (spills, SASS, the seeds' record).
DEFAULT_PROBLEMS = list(GPT2_FP32) + [Problem(4, 16, 2048, 2048, 128, "fp32", True),
                                      Problem(4, 16, 2048, 2048, 128, "bf16", False)]
MMA = get_family("flash_fwd_mma")
MMA_PROBLEMS = [Problem(4, 16, 2048, 2048, d, dt, c) for d in (64, 128) for dt in ("fp16", "bf16") for c in (False, True)]
MMA_PROBLEMS += [Problem(4, 16, 2048, 2048, d, "fp32", c, max_error=e) for d in (64, 128) for c in (False, True)
                 for e in (2e-3, 2e-2)]  # tf32 seeds only, then tf32 and bf16
SM90 = get_family("flash_fwd_sm90")
SEED_RESOURCES = script("seed_resources")   # the one home of the sm90 seed problems and of their resource record
SM90_PROBLEMS = SEED_RESOURCES.problems()


def _share(valid_count: int) -> int:
    """How many sweep points a variant compiles at least: twice, or once where few points fit it."""
    return min(2, max(1, valid_count // 8))


def _sweep(fam) -> list:
    """One (gpu, params, problem) per point that is valid for some variant on that gpu."""
    cases = []
    variants = _variants(fam)
    for gpu in GPUS:
        if fam.supports(gpu, variants[0]):
            continue  # e.g. the Hopper family on an A100
        valid = {v: {params_key(p) for p in fam.valid_points(gpu, v)} for v in variants}
        used = dict.fromkeys(variants, 0)
        for i, point in enumerate(fam.points()):
            if any(point[name] != fam.space[name][0] for name in fam.launch_params):
                continue   # the same cubin as the point with the first value there
            key = params_key(point)
            ok = [v for v in variants if key in valid[v]]
            if not ok:
                continue
            # round robin, balanced: the least-used variant this point is valid for (rarer d=128
            # points thus go to the d=128 variants), then the one fewest points fit (fp8 at d=256
            # takes 4 of the points bf16 takes), ties broken by rotating the start
            rot = variants[i % len(variants):] + variants[: i % len(variants)]
            problem = min((v for v in rot if v in ok), key=lambda v: (used[v], len(valid[v])))
            used[problem] += 1
            pid = "-".join(f"{k}{v}" for k, v in point.items())
            vid = f"d{problem.head_dim}-{problem.dtype}-{MASK_KEYS[problem.mask]}"
            cases.append(pytest.param(fam, gpu, point, problem, id=f"{fam.name}-{gpu.arch}-{pid}-{vid}"))
    return cases


SWEEP = [case for fam in FAMILIES.values() for case in _sweep(fam)]


@pytest.mark.parametrize("fam", FAMILIES.values(), ids=lambda f: f.name)
def test_sweep_covers_the_space(fam):
    """Every point valid for some variant is in the sweep, each variant compiled several times."""
    for gpu in GPUS:
        cases = [c for c in SWEEP if c.values[0] is fam and c.values[1] == gpu]
        if fam.supports(gpu, _variants(fam)[0]):
            assert not cases
            continue
        swept = {params_key(c.values[2]) for c in cases}
        for d in fam.head_dims:
            for dtype in fam.dtypes:
                nq = min(128, fam.max_queries or 128)
                want = {params_key(p) for p in fam.valid_points(gpu, Problem(1, 1, nq, 128, d, dtype, max_error=WIDE[dtype]))
                        if all(p[name] == fam.space[name][0] for name in fam.launch_params)}
                assert want and want <= swept, (fam.name, gpu.arch, d, dtype)
        used = [c.values[3] for c in cases]
        if fam.launch_params:   # few cubins (flash_decode: ~50 over 30 variants): every head dim, dtype and mask
            for what in ("head_dim", "dtype", "mask"):
                assert {getattr(v, what) for v in used} == {getattr(v, what) for v in _variants(fam)}, (fam.name, what)
        else:
            for v in _variants(fam):  # twice each (six times per head dim and dtype), or a fair share (d=256)
                assert used.count(v) >= _share(len(fam.valid_points(gpu, v))), (fam.name, gpu.arch, v.key, used.count(v))
        assert len(used) == len(swept)  # each point once per arch


def _is_elf(b: bytes) -> bool:
    return len(b) > 64 and b[:4] == b"\x7fELF"


@pytest.mark.parametrize("fam,gpu,params,problem", SWEEP)
def test_every_valid_point_compiles(fam, gpu, params, problem):
    assert fam.check(params, gpu, problem) is None
    ck = compile_kernel(fam, params, problem, gpu.arch, quick=True)
    assert _is_elf(ck.cubin)
    assert ck.arch == gpu.arch and ck.family == fam.name and ck.kernel_name == fam.kernel_name
    r = ck.resources
    assert 0 < r.registers <= 255, ck.log
    assert r.dynamic_smem == fam.smem_bytes(params, problem) == fam.launch(params, problem, gpu).smem_bytes
    # the resources agree with the cubin itself (cuobjdump), and with ptxas's report where NVRTC gave one
    from_cubin = resources_from_cubin(ck.cubin, gpu.arch)
    assert from_cubin is not None and from_cubin.registers == r.registers
    if "Compiling entry function" in ck.log:
        assert f"Compiling entry function '{fam.kernel_name}' for '{gpu.arch}'" in ck.log
        assert parse_ptxas(ck.log).registers == r.registers
        assert parse_ptxas(ck.log).static_smem == from_cubin.static_smem


@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: g.arch)
@pytest.mark.parametrize("problem", DEFAULT_PROBLEMS, ids=lambda p: p.key)
def test_default_config_does_not_spill(gpu, problem):
    params = FAM.default(gpu, problem)
    assert FAM.check(params, gpu, problem) is None
    ck = compile_kernel(FAM, params, problem, gpu.arch)
    assert ck.resources.spill_bytes == 0, ck.log
    assert ck.resources.stack_bytes == 0, ck.log
    assert ck.resources.registers > 0
    if "Compiling entry function" in ck.log:  # ptxas's report, where NVRTC returned one
        assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", ck.log), ck.log
    from_cubin = resources_from_cubin(ck.cubin)  # and the cubin's own record: no local memory
    assert from_cubin is not None
    assert (from_cubin.spill_bytes, from_cubin.stack_bytes) == (0, 0)
    assert from_cubin.registers == ck.resources.registers


@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: g.arch)
@pytest.mark.parametrize("problem", MMA_PROBLEMS, ids=lambda p: p.key)
def test_mma_seeds_do_not_spill(gpu, problem):
    seeds = [s for s in MMA.seeds(gpu, problem) if MMA.check(s, gpu, problem) is None]
    assert seeds and seeds[0] == MMA.default(gpu, problem)
    for params in seeds:
        ck = compile_kernel(MMA, params, problem, gpu.arch)
        assert (ck.resources.spill_bytes, ck.resources.stack_bytes) == (0, 0), (params, ck.resources)


def test_default_sm90a_sass_is_ffma_without_local_memory():
    problem = GPT2_FP32[0]
    ck = compile_kernel(FAM, FAM.default(H100_SXM, problem), problem, H100_SXM.arch)
    sass = sass_listing(ck.cubin)
    assert FAM.kernel_name in sass
    assert len(re.findall(r"\bFFMA\b", sass)) > 100  # the inner loops are fp32 FMAs
    assert not re.search(r"\b(LDL|STL)(\.\w+)*\b", sass), "local memory (spills) in SASS"
    assert re.search(r"\bLDS(\.\w+)*\b", sass)  # tiles are read from shared memory


def test_mma_fp32_inputs_need_a_budget_for_tensor_cores():
    default = Problem(4, 16, 2048, 2048, 64, "fp32", False)
    assert "--max-error" in MMA.supports(H100_SXM, default)
    tf32_only = Problem(4, 16, 2048, 2048, 64, "fp32", False, max_error=2e-3)
    computes = {p["compute"] for p in MMA.valid_points(H100_SXM, tf32_only)}
    assert computes == {"tf32"}
    wide = Problem(4, 16, 2048, 2048, 64, "fp32", False, max_error=2e-2)
    assert {p["compute"] for p in MMA.valid_points(H100_SXM, wide)} == {"tf32", "bf16"}
    assert MMA.default(H100_SXM, wide)["compute"] == "tf32"
    half = Problem(4, 16, 2048, 2048, 64, "bf16", False)
    assert {p["compute"] for p in MMA.valid_points(H100_SXM, half)} == {"in"}


@pytest.mark.parametrize("compute", ["tf32", "bf16"])
def test_mma_fp32_sass_uses_the_chosen_tensor_core_precision(compute):
    problem = Problem(4, 16, 2048, 2048, 64, "fp32", True, max_error=2e-2)
    params = next(p for p in MMA.seeds(H100_SXM, problem) if p["compute"] == compute)
    ck = compile_kernel(MMA, params, problem, H100_SXM.arch)
    sass = sass_listing(ck.cubin)
    if compute == "tf32":
        assert len(re.findall(r"\bHMMA\.1688\.F32\.TF32", sass)) >= 16
        assert re.search(r"\bLDGSTS(\.\w+)*\b", sass)  # fp32 tiles by cp.async
    else:
        assert len(re.findall(r"\bHMMA\.16816\.F32\.BF16", sass)) >= 16
        assert re.search(r"\bF2FP\.BF16", sass)  # converted while stored
    assert not re.search(r"\b(LDL|STL)(\.\w+)*\b", sass), "local memory (spills) in SASS"


def test_mma_sm90a_sass_uses_tensor_cores():
    problem = MMA_PROBLEMS[1]
    ck = compile_kernel(MMA, MMA.default(H100_SXM, problem), problem, H100_SXM.arch)
    sass = sass_listing(ck.cubin)
    assert len(re.findall(r"\bHMMA\.16816\.F32", sass)) >= 16  # both products on tensor cores
    assert re.search(r"\bLDSM(\.\w+)*\b", sass)  # ldmatrix
    assert re.search(r"\bLDGSTS(\.\w+)*\b", sass)  # cp.async
    assert re.search(r"\bSTG\.E\.128\b", sass)  # O in 16-byte stores (store_slab's quad transpose)
    assert not re.search(r"\b(LDL|STL)(\.\w+)*\b", sass), "local memory (spills) in SASS"


SM90_RECORD = Path(__file__).parent / "fixtures" / "sm90_seed_resources.json"


@pytest.mark.parametrize("problem", SM90_PROBLEMS, ids=lambda p: p.key)
def test_sm90_seeds_are_hgmma_without_local_memory(problem):
    """The seeded Hopper configs: both products on wgmma (HGMMA, QGMMA for e4m3), tiles by TMA (UTMALDG), the
    register split honoured (no C7508 warning), no spills, no local memory in the SASS, the
    tile scheduler's atomic exactly in the persistent ones, and O stored by TMA exactly where asked."""
    seeds = SEED_RESOURCES.seeds(problem)
    assert seeds and seeds[0] == SM90.default(H100_SXM, problem)
    assert SM90.supports(A100_SXM, problem) is not None  # Hopper only
    for params in seeds:
        ck = compile_kernel(SM90, params, problem, H100_SXM.arch)
        assert (ck.resources.spill_bytes, ck.resources.stack_bytes) == (0, 0), (params, ck.resources)
        assert "C7508" not in ck.log and "warning" not in ck.log.lower(), ck.log
        # C7510/C7511/C7519: ptxas serialized the wgmma pipeline (a branch between wgmma instructions
        # did that to the tried diagonal-half tile, h13: 25-45% slower; too few registers, C7511, h15)
        assert not re.search(r"C751[019]", ck.log), ck.log
        sass = sass_listing(ck.cubin)
        op, k = ("QGMMA", 32) if problem.dtype == "fp8" else ("HGMMA", 16)
        assert len(re.findall(rf"\b{op}\.64x\d+x{k}\.F32", sass)) >= (problem.head_dim + params["Bc"]) // k, params
        assert re.search(r"\bUTMALDG(\.\w+)*\b", sass), params
        assert not re.search(r"\b(LDL|STL)(\.\w+)*\b", sass), f"local memory (spills) in SASS: {params}"
        if params["split"]:
            assert len(re.findall(r"\bUSETMAXREG(\.\w+)*\b", sass)) == 2, params
        # the dynamic tile scheduler: one global atomic for the next tile, in persistent kernels only
        assert bool(re.search(r"\bATOMG(\.\w+)*\b", sass)) == bool(params["persistent"]), params
        # O: TMA-stored from stmatrix-staged slabs, or 16-byte stores from registers
        if params["tma_store"]:
            assert re.search(r"\bUTMASTG(\.\w+)*\b", sass) and re.search(r"\bSTSM(\.\w+)*\b", sass), params
        else:
            assert not re.search(r"\bUTMASTG", sass) and re.search(r"\bSTG\.E\.128\b", sass), params


@pytest.mark.parametrize("problem", SM90_PROBLEMS, ids=lambda p: p.key)
def test_sm90_seed_resources_match_the_record(problem):
    """ptxas's registers, spills, stack and shared memory of every seed, and its SASS instruction
    stream (length, and a fingerprint with registers, labels and immediates renamed away), are the
    recorded ones: a change to the kernel's structure must not move them unnoticed. Equal resources
    alone are not equal speed: issue 20's first split kept them all and ran 4-10% slower on two
    configs. benchmarks/seed_resources.py -o regenerates the record after a change that is meant to
    (its diff then shows what moved), and benchmarks/sass_compare.py shows where the streams differ."""
    record = json.loads(SM90_RECORD.read_text())
    expected = {key: r for key, r in record.items() if key.split(" ", 1)[0] == problem.key}
    got = dict(SEED_RESOURCES.resources(problem, params) for params in SEED_RESOURCES.seeds(problem))
    assert got.keys() == expected.keys(), "the seeds are not the recorded ones"
    differ = {key: {"recorded": expected[key], "now": r} for key, r in got.items() if r != expected[key]}
    assert not differ, f"ptxas's resources moved: {json.dumps(differ, indent=1)}"


# Head dims off flash_fwd_sm90's 64-column panels: its tile padded to 64 bytes, in 64- or 128-byte
# panels (sm90_tma.panel_cols); each mask and 16-bit dtype somewhere.
ANY_DIM_PROBLEMS = [Problem(2, 8, 1000, 1000, d, dt, m, kv_heads=2) for d, dt, m in (
    (8, "bf16", "none"), (40, "fp16", "causal"), (56, "bf16", "causal_br"), (72, "fp16", "none"),
    (80, "bf16", "causal"), (96, "bf16", "none"), (96, "fp16", "causal_br"), (112, "bf16", "causal"),
    (144, "bf16", "causal_br"), (160, "fp16", "none"), (192, "bf16", "causal"), (248, "bf16", "causal_br"))]


@pytest.mark.parametrize("problem", ANY_DIM_PROBLEMS, ids=lambda p: p.key)
def test_sm90_any_head_dim_seeds_compile_without_spills(problem):
    """Every valid seed of flash_fwd_sm90 and of its split at such a head dim compiles for sm_90a:
    P V a wgmma as wide as the head dim rounded up to a k step (not the padded tile: d=80's 80 of
    96), S in that many k steps, Q, K and V by TMA, no spills or local memory, O by ordinary stores
    or, where the panels are 128 bytes and a seed asks, by TMA (over the whole tile then). K has a
    tail panel at d = 72-80 and 144 (k_tail: its last k step on a descriptor of its own)."""
    from tuner.kernel_templates.flash_fwd_sm90 import k_tail, prod_cols, tile_dim
    from tuner.kernel_templates.sm90_tma import tile_panel

    split = get_family("flash_fwd_sm90_split")
    assert SM90.supports(H100_SXM, problem) is None and split.supports(H100_SXM, problem) is None
    width, panel = tile_dim(problem), tile_panel(tile_dim(problem), 2)
    assert width % 32 == 0 and 0 <= width - problem.head_dim < panel and width % panel == 0   # whole panels
    if panel < 64:
        assert not any(p["tma_store"] for p in SM90.valid_points(H100_SXM, problem))
    cases = [(fam, p) for fam in (SM90, split) for p in fam.seeds(H100_SXM, problem) if fam.check(p, H100_SXM, problem) is None]
    assert len(cases) >= 3
    for fam, params in cases:
        prod = prod_cols(params, problem)
        assert prod == width if params["tma_store"] else (prod % 16 == 0 and 0 <= prod - problem.head_dim < 16)
        ck = compile_kernel(fam, params, problem, H100_SXM.arch)
        assert (ck.resources.spill_bytes, ck.resources.stack_bytes) == (0, 0), (fam.name, params, ck.resources)
        assert not re.search(r"C751[019]", ck.log), ck.log
        sass = sass_listing(ck.cubin)
        assert bool(k_tail(params, problem)) == (problem.head_dim in (72, 80, 144) and not params["tma_store"]), params
        assert re.search(rf"\bHGMMA\.64x{prod}x16\.F32", sass) and re.search(rf"\bHGMMA\.64x{params['Bc']}x16\.F32", sass)
        if width not in (prod, params["Bc"]):
            assert not re.search(rf"\bHGMMA\.64x{width}x16", sass), "P V over the tile's zero columns"
        if params["Bc"] != prod:   # S's k steps, in whatever copies of the loop: a multiple of prod's
            s_steps = len(re.findall(rf"\bHGMMA\.64x{params['Bc']}x16\.F32", sass))
            assert s_steps % (prod // 16) == 0, (s_steps, prod, width)
        assert re.search(r"\bUTMALDG(\.\w+)*\b", sass), (fam.name, params)
        assert bool(re.search(r"\bUTMASTG", sass)) == bool(params["tma_store"]), (fam.name, params)
        assert not re.search(r"\b(LDL|STL)(\.\w+)*\b", sass), f"local memory (spills) in SASS: {fam.name} {params}"


# Head dims flash_fwd_mma pads to (32 columns): each input dtype (fp32 through tf32 or bf16) and mask
# somewhere, up to 184 (past 192 it takes 256 alone).
MMA_ANY_DIM_PROBLEMS = [Problem(2, 8, 1000, 1000, d, dt, m, kv_heads=2, max_error=WIDE[dt]) for d, dt, m in (
    (8, "bf16", "none"), (40, "fp32", "causal"), (80, "fp16", "causal_br"), (112, "bf16", "causal"),
    (160, "fp32", "none"), (184, "bf16", "causal_br"))]


@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: g.arch)
@pytest.mark.parametrize("problem", MMA_ANY_DIM_PROBLEMS, ids=lambda p: p.key)
def test_mma_any_head_dim_seeds_compile_without_spills(problem, gpu):
    """flash_fwd_mma and its varlen variant at head dims off their list: the tile is d rounded up to
    32 columns (HEAD_DIM), loads and stores at d's width (D_VALID); every valid seed compiles for
    sm_80 and sm_90a with no spills. d=248 (a 256-column tile) is refused by name: it spilled."""
    from tuner.family import padded_head_dim
    from tuner.kernel_templates import VARLEN_VARIANTS

    mma = FAMILIES["flash_fwd_mma"]
    assert mma.supports(gpu, problem) is None and problem.head_dim not in mma.head_dims
    assert "8 to 192 in steps of 8, 256" in mma.supports(gpu, replace(problem, head_dim=248))
    fams = [mma] + ([VARLEN_VARIANTS["flash_fwd_mma"]] if problem.dtype != "fp32" else [])
    cases = [(f, p) for f in fams for p in mma.seeds(gpu, problem) if f.check(p, gpu, problem) is None]
    assert len(cases) >= 2
    for fam, params in cases:
        defines = fam.defines(params, problem)
        assert (defines["HEAD_DIM"], defines["D_VALID"]) == (padded_head_dim(problem.head_dim), problem.head_dim)
        ck = compile_kernel(fam, params, problem, gpu.arch)
        assert (ck.resources.spill_bytes, ck.resources.stack_bytes) == (0, 0), (fam.name, params, ck.resources)


# ---- the compile cache ----

@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of this test only: the shared one is never corrupted."""
    d = tmp_path / "cubin"
    monkeypatch.setenv("TUNER_CACHE_DIR", str(d))
    return d


SMALL = Problem(1, 2, 128, 128, 64, "fp16", True)
SMALL_PARAMS = dict(Br=32, Bc=32, TM=2, TN=2, stages=1, min_blocks=2)


def test_cache_hit_then_truncated_entry_is_rebuilt(private_cache):
    first = compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80")
    assert not first.cached and _is_elf(first.cubin)
    files = sorted(private_cache.rglob("*.cubin"))
    assert [f.stem for f in files] == [first.key]

    second = compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80")
    assert second.cached and second.key == first.key and second.cubin == first.cubin
    assert second.resources.registers == first.resources.registers

    other_arch = compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_90a")
    assert not other_arch.cached and other_arch.key != first.key

    files[0].write_bytes(first.cubin[: len(first.cubin) // 2])  # a torn write
    rebuilt = compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80")
    assert not rebuilt.cached and rebuilt.key == first.key
    assert _is_elf(rebuilt.cubin) and len(rebuilt.cubin) == len(first.cubin)
    assert files[0].read_bytes() == rebuilt.cubin  # the entry on disk is whole again
    again = compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80")
    assert again.cached and again.cubin == rebuilt.cubin


def test_cache_missing_metadata_is_rebuilt(private_cache):
    first = compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80")
    (meta,) = private_cache.rglob("*.json")
    meta.write_text("{not json")
    rebuilt = compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80")
    assert not rebuilt.cached and rebuilt.cubin == first.cubin
    assert compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80").cached


def test_key_depends_on_params_and_problem(private_cache):
    a = compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80")
    b = compile_kernel(FAM, {**SMALL_PARAMS, "min_blocks": 1}, SMALL, "sm_80")
    c = compile_kernel(FAM, SMALL_PARAMS, Problem(1, 2, 128, 128, 64, "fp16", False), "sm_80")
    assert len({a.key, b.key, c.key}) == 3
    assert not b.cached and not c.cached


def test_sass_listing_is_kept_by_cubin_and_nvdisasm_version(private_cache, monkeypatch):
    import tuner.compile as compile_mod

    ck = compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80")
    first = sass_listing(ck.cubin)
    assert FAM.kernel_name in first and re.search(r"\bFFMA\b", first)
    assert len(list((private_cache / "sass").iterdir())) == 1

    def no_nvdisasm(*args, **kwargs):
        raise AssertionError("nvdisasm ran again for a listing in the cache")

    monkeypatch.setattr(compile_mod, "_run_on_cubin", no_nvdisasm)
    assert sass_listing(ck.cubin) == first
    with pytest.raises(AssertionError, match="ran again"):   # another cubin is another entry
        sass_listing(compile_kernel(FAM, {**SMALL_PARAMS, "min_blocks": 1}, SMALL, "sm_80").cubin)
    tool, version = compile_mod._nvdisasm()
    monkeypatch.setattr(compile_mod, "_nvdisasm", lambda: (tool, version + " (another)"))
    with pytest.raises(AssertionError, match="ran again"):   # so is another nvdisasm's listing
        sass_listing(ck.cubin)


def test_compile_error_raises_with_nvrtc_message(private_cache, monkeypatch):
    def broken(params, problem):
        return "extern \"C\" __global__ void flash_fwd_simt() { this_is_not_declared = 1; }\n"

    monkeypatch.setattr(FAM, "render", broken)
    with pytest.raises(CompileError) as info:
        compile_kernel(FAM, SMALL_PARAMS, SMALL, "sm_80")
    err = info.value
    assert "NVRTC failed for flash_fwd_simt" in str(err)
    assert "this_is_not_declared" in err.log and "error" in err.log
    assert "undefined" in str(err) or "this_is_not_declared" in str(err)
    assert not list(private_cache.rglob("*.cubin"))  # nothing cached for a failure


def _with_and_without_report(fam, params, problem, cache, monkeypatch):
    """One point compiled twice into fresh caches: with ptxas's report, then as if NVRTC gave none."""
    import tuner.compile as compile_mod
    from tuner.records import Resources

    with_log = compile_kernel(fam, params, problem, "sm_90a")
    monkeypatch.setenv("TUNER_CACHE_DIR", str(cache / "again"))
    monkeypatch.setattr(compile_mod, "parse_ptxas", lambda log: Resources())  # as if the log were empty
    without = compile_kernel(fam, params, problem, "sm_90a")
    assert not without.cached
    return with_log, without


def test_resources_from_cubin_when_nvrtc_gives_no_report(private_cache, monkeypatch):
    with_log, without = _with_and_without_report(FAM, SMALL_PARAMS, SMALL, private_cache, monkeypatch)
    assert without.resources.registers == with_log.resources.registers > 0
    assert without.resources.spill_bytes == without.resources.stack_bytes == 0
    assert without.resources.dynamic_smem == FAM.smem_bytes(SMALL_PARAMS, SMALL)


def test_static_shared_memory_from_cubin_when_nvrtc_gives_no_report(private_cache, monkeypatch):
    """A varlen kernel's static shared memory (its block's sequence lookup) is read back from the
    cubin too, as ptxas reports it: beside 48 KB of dynamic (this point) the total is past 48 KB,
    where the driver refuses a launch that did not opt in."""
    from tuner.kernel_templates import VARLEN_VARIANTS

    fam = VARLEN_VARIANTS["flash_fwd_mma"]
    problem = Problem(2, 4, 256, 256, 128, "bf16", "none")
    params = dict(Br=64, Bc=32, warps=4, stages=2, q_regs=0, compute="in")
    assert fam.check(params, H100_SXM, problem) is None and fam.smem_bytes(params, problem) == 48 * 1024
    with_log, without = _with_and_without_report(fam, params, problem, private_cache, monkeypatch)
    assert without.resources.static_smem == with_log.resources.static_smem > 0


def test_a_quick_build_is_filed_apart_from_the_production_build(tmp_path, monkeypatch):
    """The sweep's quick builds (-Ofast-compile) are never what a launch gets: the production build
    of the same point is a cache miss after them, and compiles with NVRTC's full optimization."""
    monkeypatch.setenv("TUNER_CACHE_DIR", str(tmp_path))
    problem = GPT2_FP32[0]
    params = FAM.default(A100_SXM, problem)
    quick = compile_kernel(FAM, params, problem, A100_SXM.arch, quick=True)
    prod = compile_kernel(FAM, params, problem, A100_SXM.arch)
    assert not quick.cached and not prod.cached and quick.key != prod.key
    assert compile_kernel(FAM, params, problem, A100_SXM.arch).key == prod.key   # each then a hit for its own kind
    assert compile_kernel(FAM, params, problem, A100_SXM.arch, quick=True).cached
    assert _is_elf(quick.cubin) and quick.cubin != prod.cubin


def test_a_quick_build_goes_to_the_caller_s_cache_after_it_moves(tmp_path, monkeypatch):
    """The quick-build process keeps the environment it was spawned with: a quick build after the
    caller's TUNER_CACHE_DIR changed reads and fills the new cache, not the first (a build filed
    in the first answered as cached, and one made was written where the caller never looks)."""
    problem = GPT2_FP32[0]
    params = FAM.default(A100_SXM, problem)
    monkeypatch.setenv("TUNER_CACHE_DIR", str(tmp_path / "first"))
    assert not compile_kernel(FAM, params, problem, A100_SXM.arch, quick=True).cached
    monkeypatch.setenv("TUNER_CACHE_DIR", str(tmp_path / "moved"))
    moved = compile_kernel(FAM, params, problem, A100_SXM.arch, quick=True)
    assert not moved.cached and list((tmp_path / "moved").rglob(f"{moved.key}*"))
    assert compile_kernel(FAM, params, problem, A100_SXM.arch, quick=True).cached


def test_a_production_build_after_quick_builds_is_the_one_a_fresh_process_makes(tmp_path, monkeypatch):
    """NVRTC 13.0 carries -Ofast-compile into later builds of its process (another cubin for the
    same source): quick builds run in a process of their own, so this one's production builds are
    the ones a process that never made a quick build makes (the seeds' SASS record depends on it)."""
    import subprocess
    import sys

    from tuner import compile as comp

    problem = SM90_PROBLEMS[0]
    seeds = SM90.seeds(H100_SXM, problem)
    monkeypatch.setenv("TUNER_CACHE_DIR", str(tmp_path / "quick"))
    for params in seeds[:2]:
        compile_kernel(SM90, params, problem, H100_SXM.arch, quick=True)
    monkeypatch.setenv("TUNER_CACHE_DIR", str(tmp_path / "after"))
    after = compile_kernel(SM90, seeds[0], problem, H100_SXM.arch).cubin
    fresh = subprocess.run(
        [sys.executable, "-c", "import sys; from tuner.compile import compile_kernel; from tuner.gpu import H100_SXM; "
         "from tuner.kernel_templates import get_family; from tuner.problem import Problem; import json; "
         "p = Problem(**json.loads(sys.argv[1])); f = get_family('flash_fwd_sm90'); "
         "sys.stdout.buffer.write(compile_kernel(f, json.loads(sys.argv[2]), p, H100_SXM.arch).cubin)",
         json.dumps(problem.to_dict()), json.dumps(seeds[0])],
        capture_output=True, check=True, env={**os.environ, "TUNER_CACHE_DIR": str(tmp_path / "fresh")}).stdout
    assert after == fresh
    assert comp._quick_process is False   # this process made none itself
    with pytest.raises(CompileError, match="no production build"):
        comp._quick_builder().submit(_production_in_quick_process, problem, seeds[0]).result()


def _production_in_quick_process(problem, params):
    """In the quick-build process: a production build is refused."""
    from tuner import compile as comp

    comp._quick_process = True
    return compile_kernel(SM90, params, problem, H100_SXM.arch)
