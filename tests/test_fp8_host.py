"""fp8 (e4m3 inputs, bf16 O) through the host side, without a GPU: the problem, inputs, reference
and budget, families, tensor maps, dispatcher and CLI tables."""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tuner.dispatch import TORCH_TO_DTYPE, Dispatcher, Plan, problem_of
from tuner.launch import attention_args
from tuner.family import ELEM_CODE, template_text
from tuner.gpu import A100_SXM, H100_SXM
from tuner.kernel_templates import get_family
from tuner.measure import poisoned_outputs, random_inputs
from tuner.peers import peer_dtype
from tuner.problem import TORCH_DTYPES, torch_dtype
from tuner.problem import DTYPES, REL_BUDGET, Bucket, Problem, standard_grid
from tuner.reference import attention_fp64, compare

FP8 = Problem(2, 4, 96, 160, 64, "fp8", True, kv_heads=2)  # ragged, causal, GQA


# ---- the problem ----

def test_fp8_problem_budget_and_out_dtype():
    assert "fp8" in DTYPES and FP8.dtype == "fp8"
    assert FP8.rel_budget == REL_BUDGET["fp8"] == 5e-2
    # e4m3 wgmma sums Q K^T with fewer bits than fp32: the LSE gets a wider floor than 16-bit inputs
    assert FP8.lse_budget == 5e-3 > replace(FP8, dtype="bf16").lse_budget == 1e-3
    assert FP8.out_dtype == "bf16"
    assert {d: replace(FP8, dtype=d).out_dtype for d in ("fp32", "fp16", "bf16")} == {
        "fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
    assert replace(FP8, max_error=5e-2) == FP8  # the default, spelled out, is one key
    assert Problem.parse("2,4,512,64,causal", "fp8") == Problem(2, 4, 512, 512, 64, "fp8", True)


def test_fp8_bytes_moved_counts_o_in_bf16():
    p = Problem(1, 8, 100, 200, 64, "fp8", kv_heads=2)
    q = o = 8 * 100 * 64
    kv = 2 * 2 * 200 * 64
    assert p.bytes_moved() == 1 * (q + kv) + 2 * o
    assert replace(p, dtype="bf16").bytes_moved() - p.bytes_moved() == q + kv  # only the inputs shrink


def test_fp8_grid_and_buckets():
    grid = standard_grid("fp8")
    assert [replace(p, dtype="bf16") for p in grid] == standard_grid("bf16")
    assert len({p.key for p in grid} | {p.key for p in standard_grid("bf16")}) == 2 * len(grid)
    for p in grid + [FP8]:
        b = p.bucket()
        assert b.key.startswith("fp8/") and Bucket.from_key(b.key) == b
        assert b != replace(p, dtype="bf16").bucket()


# ---- inputs, outputs, reference, budget ----

def test_random_inputs_are_fp8_and_nonzero():
    q, k, v = random_inputs(FP8, 7, device="cpu")
    assert (q.shape, k.shape, v.shape) == ((2, 4, 96, 64), (2, 2, 160, 64), (2, 2, 160, 64))
    for t in (q, k, v):
        assert t.dtype == torch.float8_e4m3fn
        f = t.float()
        assert torch.isfinite(f).all() and f.count_nonzero() > 0.99 * f.numel()  # |x| < 2^-10 rounds to 0
        assert 0.8 < f.std() < 1.2
    again = random_inputs(FP8, 7, device="cpu")[0]
    assert torch.equal(q.view(torch.uint8), again.view(torch.uint8))
    assert not torch.equal(q.view(torch.uint8), random_inputs(FP8, 8, device="cpu")[0].view(torch.uint8))


def test_other_dtypes_draw_as_before():
    """fp8 draws in float32 and rounds; the 16-bit dtypes still draw in their own type."""
    p = replace(FP8, dtype="bf16")
    g = torch.Generator(device="cpu").manual_seed(3)
    want = torch.randn(2, 4, 96, 64, generator=g, dtype=torch.bfloat16)
    assert torch.equal(random_inputs(p, 3, device="cpu")[0], want)


def test_poisoned_outputs_are_bf16_for_fp8():
    q, _, _ = random_inputs(FP8, 0, device="cpu")
    o, lse = poisoned_outputs(FP8, q)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and o.isnan().all()
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and lse.isnan().all()
    assert poisoned_outputs(replace(FP8, dtype="fp16"), q)[0].dtype == torch.float16


@pytest.fixture(scope="module")
def fp8_case():
    q, k, v = random_inputs(FP8, 11, device="cpu")
    scale = 1.0 / math.sqrt(FP8.head_dim)
    return q, k, v, scale, attention_fp64(q, k, v, FP8.causal, scale)


def test_reference_takes_fp8_and_equals_its_bf16_copies(fp8_case):
    """e4m3 values are exact in bf16: the bf16 peers and the fallback see the very same inputs."""
    q, k, v, scale, (ref_o, ref_lse) = fp8_case
    assert ref_o.dtype == torch.float64 and ref_o.shape == q.shape and torch.isfinite(ref_o).all()
    o16, lse16 = attention_fp64(*(t.to(torch.bfloat16) for t in (q, k, v)), FP8.causal, scale)
    assert torch.equal(o16, ref_o) and torch.equal(lse16, ref_lse)


def test_exact_result_in_bf16_is_within_budget(fp8_case):
    _, _, _, _, (ref_o, ref_lse) = fp8_case
    err = compare(ref_o.to(torch.bfloat16), ref_lse.float(), ref_o, ref_lse)
    assert err.finite and err.rel < 2**-8 and err.lse < 1e-5  # bf16 rounding of O, nothing else
    assert err.within(FP8.rel_budget, FP8.lse_budget)


def test_budget_admits_p_quantized_to_e4m3(fp8_case):
    """What the kernel does: S and the softmax in fp32, P = exp(S - max) rounded to e4m3 for the
    P V product, the row sum from fp32 P. That error must sit well inside the budget."""
    q, k, v, scale, (ref_o, ref_lse) = fp8_case
    g = FP8.heads // FP8.kv_heads
    kf, vf = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    s = q.float() @ kf.transpose(-1, -2) * scale
    s.masked_fill_(torch.ones(FP8.seqlen_q, FP8.seqlen_k, dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = (p.to(torch.float8_e4m3fn).float() @ vf / l).to(torch.bfloat16)
    err = compare(o, (m + l.log()).squeeze(-1), ref_o, ref_lse)
    assert 5e-3 < err.rel < FP8.rel_budget / 1.5, err  # a real error, with room under the budget
    assert err.within(FP8.rel_budget, FP8.lse_budget)


def test_perturbed_or_unwritten_output_is_rejected(fp8_case):
    _, _, _, _, (ref_o, ref_lse) = fp8_case
    noise = torch.randn(ref_o.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bad = (ref_o + 0.1 * noise * ref_o.std()).to(torch.bfloat16)
    err = compare(bad, ref_lse.float(), ref_o, ref_lse)
    assert err.rel > FP8.rel_budget and not err.within(FP8.rel_budget, FP8.lse_budget)
    hole = ref_o.to(torch.bfloat16)
    hole[0, 0, 5] = float("nan")
    assert not compare(hole, ref_lse.float(), ref_o, ref_lse).within(FP8.rel_budget, FP8.lse_budget)


# ---- families and the element-type codes ----

@pytest.mark.parametrize("family", ["flash_fwd_simt", "flash_fwd_mma"])
def test_cuda_core_and_mma_families_refuse_fp8(family):
    fam = get_family(family)
    for gpu in (H100_SXM, A100_SXM):
        reason = fam.supports(gpu, FP8)
        assert reason is not None and "not fp8" in reason and family in reason
        assert fam.valid_points(gpu, FP8) == []


def test_elem_codes_match_common_cuh():
    names = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "TF32": "tf32", "E4M3": "fp8"}
    header = dict(re.findall(r"^#define FT_(F32|F16|BF16|TF32|E4M3) (\d+)", template_text("common.cuh"), re.M))
    assert {names[k]: int(v) for k, v in header.items()} == ELEM_CODE
    assert "struct Elem<FT_E4M3> { using type = unsigned char; }" in template_text("common.cuh")


# ---- tensor maps ----

def test_tensor_map_data_types():
    from cuda.bindings import driver

    from tuner.kernel_templates.sm90_tma import TmaError, _data_type, _encode

    kinds = driver.CUtensorMapDataType
    assert _data_type(torch.float8_e4m3fn) == kinds.CU_TENSOR_MAP_DATA_TYPE_UINT8  # the map only moves bytes
    assert _data_type(torch.bfloat16) == kinds.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    assert _data_type(torch.float16) == kinds.CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    for dt in (torch.float32, torch.float8_e5m2):
        with pytest.raises(TmaError, match=f"no tensor map for {dt}"):
            _data_type(dt)
    with pytest.raises(TmaError, match="no tensor map for torch.float32"):  # before the driver is asked
        _encode(torch.zeros(1, 1, 64, 64), 64, 64)
    rows_72_bytes = torch.zeros(1, 2, 16, 72, dtype=torch.float8_e4m3fn)[..., :64]
    with pytest.raises(TmaError, match="16-byte aligned"):  # strides are checked in bytes
        _encode(rows_72_bytes, 64, 128)


# ---- dispatcher ----

def test_dtype_tables_know_fp8():
    assert TORCH_DTYPES["fp8"] == "float8_e4m3fn" and TORCH_TO_DTYPE["float8_e4m3fn"] == "fp8"
    assert set(TORCH_DTYPES) == set(DTYPES) and torch_dtype("fp8") is torch.float8_e4m3fn


@pytest.fixture(scope="module")
def fake():
    mode = FakeTensorMode()

    def make(*shape, dtype=torch.float8_e4m3fn):
        with mode:
            return torch.empty(*shape, dtype=dtype, device="cuda")

    return make


def test_problem_of_fp8(fake):
    q, kv = fake(2, 8, 100, 128), fake(2, 2, 300, 128)
    assert problem_of(q, kv, kv, causal=True) == Problem(2, 8, 100, 300, 128, "fp8", True, kv_heads=2)
    with pytest.raises(ValueError, match="different dtypes: torch.float8_e4m3fn, torch.bfloat16"):
        problem_of(q, fake(2, 2, 300, 128, dtype=torch.bfloat16), kv, False)
    e5m2 = fake(1, 2, 16, 64, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="unsupported dtype torch.float8_e5m2; use one of .*float8_e4m3fn"):
        problem_of(e5m2, e5m2, e5m2, False)


def test_kernel_ready_counts_fp8_elements_as_bytes():
    """Rows 72 elements apart are 16-byte aligned in bf16 (144 B), not in e4m3 (72 B): the kernel's
    arguments are made only for inputs laid out as it reads them."""
    def ready(t):
        o, lse = torch.empty(t.shape, dtype=torch.bfloat16), torch.empty(t.shape[:3])
        return attention_args(t, t, t, o, lse, None) is not None

    for dt, expected in ((torch.float8_e4m3fn, False), (torch.bfloat16, True)):
        assert ready(torch.zeros(1, 2, 16, 72, dtype=dt)[..., :64]) is expected
    assert ready(torch.zeros(1, 2, 16, 64, dtype=torch.float8_e4m3fn))
    assert not ready(torch.zeros(1, 2, 64, 16, dtype=torch.bfloat16).transpose(2, 3))   # last dim strided


def test_fallback_upcasts_fp8_and_returns_bf16(tmp_path, fp8_case, monkeypatch):
    """No kernel of ours for it (fp8 on an A100; on Hopper flash_fwd_sm90's default would serve):
    torch's attention on bf16 copies (it takes no fp8), O in bf16, one warning; with an LSE where
    the backward would need one. Planned and run on the CPU here (the dispatcher's own entry
    refuses CPU tensors before this point)."""
    q, k, v, scale, (ref_o, ref_lse) = fp8_case
    d = Dispatcher(tmp_path / "absent.json")
    d._gpus[0] = A100_SXM
    plan = d._plan(FP8, 0)
    assert plan.launcher is None and plan.out is torch.bfloat16 and "fp8/d64/causal" in plan.reason
    monkeypatch.setenv("TUNER_BACKWARD", "math")   # the one of torch's kernels that runs on the CPU
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, lse = d._fallback(q, k, v, True, scale, plan, False)
        o2, lse2 = d._fallback(q, k, v, True, scale, plan, True)
    for out in (o, o2):
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        assert compare(out, None, ref_o, None).rel < REL_BUDGET["bf16"]
    assert torch.isnan(lse).all()   # not asked for: marked unwritten
    assert compare(o2, lse2, ref_o, ref_lse).lse < 1e-3
    assert len(caught) == 1 and "no tuned config" in str(caught[0].message)
    assert Plan(None, None).out is None  # plans made elsewhere still construct


# ---- peers and the CLI's tables ----

def test_peers_for_fp8_are_the_bf16_backends():
    from tuner.peers import PEERS_BY_DTYPE

    assert PEERS_BY_DTYPE["fp8"] == PEERS_BY_DTYPE["bf16"] and "sdpa_flash" in PEERS_BY_DTYPE["fp8"]
    assert peer_dtype(FP8) == "bf16"
    assert {d: peer_dtype(replace(FP8, dtype=d)) for d in ("fp32", "fp16", "bf16")} == {
        "fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}


def test_summary_table_says_fp8_peers_ran_in_bf16():
    from rich.console import Console

    from tuner.cli import _summary_table
    from tuner.records import Measurement
    from tuner.search import ProblemResult

    def row(p: Problem) -> ProblemResult:
        r = ProblemResult(p, "flash_fwd_sm90", "", {"Bc": 128}, Measurement("ok", median_ms=1.0, tflops=600.0))
        r.peers = {"sdpa_flash": Measurement("ok", tflops=400.0), "sdpa_cudnn": Measurement("ok", tflops=500.0)}
        return r

    console = Console(width=400, record=True)
    console.print(_summary_table([row(FP8), row(replace(FP8, dtype="bf16"))], "t"))
    lines = {ln for ln in console.export_text().splitlines() if "B2-H4" in ln}
    fp8_line = next(ln for ln in lines if "-fp8-" in ln)
    bf16_line = next(ln for ln in lines if "-bf16-" in ln)
    assert "cudnn 500.0, flash 400.0 (bf16 inputs)" in fp8_line and "1.20x" in fp8_line
    assert "(bf16 inputs)" not in bf16_line


def test_cli_problems_take_fp8():
    from tuner.cli import UserError, _problems

    defaults = _problems([], "fp8")   # the standard grid first, then the model table's shapes
    grid = standard_grid("fp8")
    assert defaults[:len(grid)] == grid and len(defaults) > len(grid) and {p.dtype for p in defaults} == {"fp8"}
    assert _problems(["1,2,128,64,causal"], "fp8") == [Problem(1, 2, 128, 128, 64, "fp8", True)]
    with pytest.raises(UserError, match="--dtype must be one of fp32, fp16, bf16, fp8, got 'e4m3'"):
        _problems([], "e4m3")
