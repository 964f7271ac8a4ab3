"""tuner.dispatch without a GPU: input validation, and choosing the lookup entry for a shape.

The validators after the device check need CUDA tensors; torch's FakeTensorMode makes tensors
that say device cuda:N (shape, dtype, device, no storage) on a CPU-only build, which is all
problem_of looks at.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tuner.db.queries import BestEntry
from tuner.dispatch import Dispatcher, problem_of, takes_head_dim
from tuner.export import build_lookup, read_lookup, write_lookup
from tuner.gpu import A100_SXM, H100_SXM
from tuner.kernel_templates import FAMILIES, get_family
from tuner.problem import Problem

FAM = get_family("flash_fwd_simt")
FAST = dict(Br=128, Bc=64, TM=8, TN=4, stages=1, min_blocks=1)
SLOW = dict(Br=64, Bc=64, TM=4, TN=4, stages=1, min_blocks=2)
STAGED = dict(Br=64, Bc=64, TM=4, TN=4, stages=2, min_blocks=1)


@pytest.fixture(scope="module")
def fake():
    mode = FakeTensorMode()

    def make(*shape, dtype=torch.float32, device="cuda"):
        with mode:
            return torch.empty(*shape, dtype=dtype, device=device)

    return make


# ---- problem_of ----

def test_cpu_tensors_are_refused_first():
    q = torch.randn(1, 2, 16, 64)
    with pytest.raises(ValueError, match=r"q is on cpu; attention runs on CUDA tensors"):
        problem_of(q, q, q, causal=False)


def test_dispatcher_refuses_cpu_tensors_without_touching_cuda(tmp_path):
    q = torch.randn(1, 2, 16, 64)
    with pytest.raises(ValueError, match="CUDA tensors"):
        Dispatcher(tmp_path / "none.json")(q, q, q, causal=True)


def test_non_tensor_and_non_4d(fake):
    q = fake(1, 2, 16, 64)
    with pytest.raises(ValueError, match="k must be a torch.Tensor, got list"):
        problem_of(q, [1, 2], q, False)
    with pytest.raises(ValueError, match="q must be a torch.Tensor, got ndarray"):
        problem_of(torch.randn(1, 2, 16, 64).numpy(), q, q, False)
    with pytest.raises(ValueError, match=r"v must be 4-D \(B, H, N, D\), got shape \(2, 16, 64\)"):
        problem_of(q, q, torch.randn(2, 16, 64), False)


def test_valid_cuda_inputs_describe_the_problem(fake):
    q = fake(2, 8, 100, 64, dtype=torch.bfloat16)
    kv = fake(2, 2, 300, 64, dtype=torch.bfloat16)
    p = problem_of(q, kv, kv, causal=True)
    assert p == Problem(2, 8, 100, 300, 64, "bf16", True, kv_heads=2)
    assert problem_of(fake(1, 1, 5, 128), fake(1, 1, 5, 128), fake(1, 1, 5, 128), False).dtype == "fp32"


def test_fake_cpu_tensor_is_refused_too(fake):
    q = fake(1, 2, 16, 64, device="cpu")
    with pytest.raises(ValueError, match="is on cpu"):
        problem_of(q, q, q, False)


@pytest.mark.parametrize(
    "shapes,dtypes,match",
    [
        (((1, 2, 16, 64),) * 3, (torch.float32, torch.float16, torch.float32), "different dtypes"),
        (((1, 2, 16, 64),) * 3, (torch.float64,) * 3, "unsupported dtype torch.float64"),
        (((1, 2, 16, 64), (1, 2, 16, 64), (1, 2, 17, 64)), None, "k and v shapes differ"),
        (((2, 2, 16, 64), (1, 2, 16, 64), (1, 2, 16, 64)), None, r"does not match q \(.*\) in batch or head dim"),
        (((1, 2, 16, 64), (1, 2, 16, 128), (1, 2, 16, 128)), None, r"does not match q \(.*\) in batch or head dim"),
        (((1, 6, 16, 64), (1, 4, 16, 64), (1, 4, 16, 64)), None, r"k/v heads \(4\) must divide q heads \(6\)"),
        (((1, 2, 0, 64),) * 3, None, "empty input"),
    ],
    ids=["mixed-dtypes", "float64", "kv-mismatch", "batch-mismatch", "d-mismatch", "gqa-heads", "empty"],
)
def test_validators(fake, shapes, dtypes, match):
    dtypes = dtypes or (torch.float16,) * 3
    q, k, v = (fake(*s, dtype=t) for s, t in zip(shapes, dtypes))
    with pytest.raises(ValueError, match=match) as info:
        problem_of(q, k, v, False)
    assert "\n" not in str(info.value)


def test_different_devices(fake):
    q = fake(1, 2, 16, 64, device="cuda:0")
    k = fake(1, 2, 16, 64, device="cuda:1")
    with pytest.raises(ValueError, match="different devices"):
        problem_of(q, k, q, False)


def test_head_dims_taken_come_from_the_families():
    from tuner.kernel_templates import FAMILIES

    listed = set().union(*(f.head_dims for f in FAMILIES.values()))
    assert listed == {32, 64, 96, 128, 256} and all(takes_head_dim(d) for d in listed)
    # the Hopper kernel pads its tile to the head dim: any multiple of 8 up to 256
    assert FAMILIES["flash_fwd_sm90"].takes_head_dim(80) and FAMILIES["flash_fwd_sm90"].takes_head_dim(8)
    assert all(takes_head_dim(d) for d in (8, 40, 72, 80, 112, 160, 192, 248))
    assert not any(takes_head_dim(d) for d in (4, 20, 84, 264, 512))


# ---- Dispatcher.select ----

TUNED = Problem(8, 12, 1024, 1024, 64, "fp32", True)


def entry(params: dict, tflops: float, *, problem: Problem = TUNED, gpu=H100_SXM, family: str = FAM.name,
          mid: int = 1) -> BestEntry:
    return BestEntry(gpu.key, family, problem, problem.bucket().key, params, tflops, problem.flops() / tflops / 1e9, mid)


@pytest.fixture
def two_families(monkeypatch):
    """A second family name in the registry (the same spec) so one bucket holds two entries."""
    monkeypatch.setitem(FAMILIES, "simt_twin", FAM)
    return "simt_twin"


def lookup_file(tmp_path, entries) -> str:
    path = tmp_path / "best.json"
    write_lookup(build_lookup(entries), path)
    assert read_lookup(path)["entries"]
    return str(path)


def test_select_matching_bucket_and_gpu(tmp_path):
    a100_only = entry(SLOW, 9.0, gpu=A100_SXM, mid=2)
    other_bucket = entry(SLOW, 30.0, problem=replace(TUNED, mask="none"), mid=3)
    path = lookup_file(tmp_path, [entry(FAST, 20.0), a100_only, other_bucket])
    d = Dispatcher(path)
    e = d.select(replace(TUNED, seqlen_q=1000, seqlen_k=1000), H100_SXM)
    assert e is not None and e["params"] == FAST and e["tflops"] == 20.0 and e["gpu_key"] == H100_SXM.key
    e = d.select(TUNED, A100_SXM)
    assert e is not None and e["params"] == SLOW and e["gpu_key"] == A100_SXM.key
    assert d.select(replace(TUNED, mask="none"), H100_SXM)["tflops"] == 30.0


def test_the_mask_picks_the_bucket(tmp_path, fake):
    """is_causal (True) is the top-left bucket; "causal_br" the bottom-right one: with Nq != Nk they
    are different problems, and neither serves the other."""
    cache = Problem(2, 8, 256, 4096, 64, "fp32", "causal", kv_heads=2)
    tl, br = entry(FAST, 20.0, problem=cache), entry(SLOW, 10.0, problem=replace(cache, mask="causal_br"), mid=2)
    d = Dispatcher(lookup_file(tmp_path, [tl]))
    q, kv = fake(2, 8, 256, 64), fake(2, 2, 4096, 64)
    assert problem_of(q, kv, kv, True) == cache and problem_of(q, kv, kv, "causal_br").mask == "causal_br"
    assert d.select(problem_of(q, kv, kv, True), H100_SXM)["params"] == FAST
    assert d.select(problem_of(q, kv, kv, "causal_br"), H100_SXM) is None
    d = Dispatcher(lookup_file(tmp_path, [tl, br]))
    assert d.select(problem_of(q, kv, kv, "causal_br"), H100_SXM)["params"] == SLOW


@pytest.mark.parametrize(
    "problem",
    [
        replace(TUNED, seqlen_q=2048, seqlen_k=2048),  # next seqlen bucket
        replace(TUNED, batch=64),  # more work: another bucket
        replace(TUNED, head_dim=128),
        replace(TUNED, dtype="fp16"),
    ],
    ids=["n2048", "large-work", "d128", "fp16"],
)
def test_select_an_untuned_bucket_from_the_nearest_comparable_one(tmp_path, problem):
    """Another length or amount of work borrows the nearest tuned bucket's config; another head
    dim or dtype (another kernel) never does."""
    d = Dispatcher(lookup_file(tmp_path, [entry(FAST, 20.0)]))
    assert problem.bucket() != TUNED.bucket()
    comparable = (problem.head_dim, problem.dtype) == (TUNED.head_dim, TUNED.dtype)
    e = d.select(problem, H100_SXM)
    assert (e is not None and e["params"] == FAST) if comparable else e is None


def test_nearest_bucket_order_limit_and_mask(tmp_path):
    near = replace(TUNED, seqlen_q=2048, seqlen_k=2048)
    far = replace(TUNED, seqlen_q=256, seqlen_k=256)
    d = Dispatcher(lookup_file(tmp_path, [entry(FAST, 20.0, problem=near), entry(SLOW, 90.0, problem=far, mid=2)]))
    assert d.select(replace(TUNED, seqlen_q=512, seqlen_k=512), H100_SXM)["params"] == SLOW   # n256: 2 away, n2048: 4
    assert d.select(replace(TUNED, seqlen_q=4000, seqlen_k=4000), H100_SXM)["params"] == FAST  # n4096: next to n2048
    far = replace(TUNED, seqlen_q=16384, seqlen_k=16384)
    assert next(d.candidates(far, H100_SXM), None) is None                                  # 6 octaves: too far,
    assert d.select(far, H100_SXM)["params"] == FAST                                        # but it fills the GPU
    assert d.select(replace(far, batch=1, heads=1, kv_heads=1), H100_SXM) is None          # 128 blocks: SDPA
    assert d.select(replace(TUNED, mask="causal_br", seqlen_q=512, seqlen_k=4096), H100_SXM) is None  # another mask
    assert d.select(replace(TUNED, seqlen_q=1024, seqlen_k=1024), A100_SXM) is None           # another GPU


def test_a_huge_batch_takes_its_own_bucket_else_borrows_the_large_one(tmp_path):
    """B128 x 32 heads is the "huge" work class: with no entry there it is served by the "large"
    bucket's (an octave of work away), as before that class existed; an entry tuned at B128 serves
    it and nothing at B32."""
    b32 = replace(TUNED, batch=32, heads=32, kv_heads=32)
    b128 = replace(b32, batch=128)
    assert (b32.bucket().work, b128.bucket().work) == ("large", "huge")
    d = Dispatcher(lookup_file(tmp_path, [entry(FAST, 20.0, problem=b32)]))
    assert d.select(b128, H100_SXM)["params"] == FAST
    d = Dispatcher(lookup_file(tmp_path, [entry(FAST, 20.0, problem=b32), entry(SLOW, 25.0, problem=b128, mid=2)]))
    assert d.select(b128, H100_SXM)["params"] == SLOW and d.select(replace(b32, batch=64), H100_SXM)["params"] == SLOW
    assert d.select(b32, H100_SXM)["params"] == FAST and d.select(replace(b32, batch=63), H100_SXM)["params"] == FAST


def test_a_huge_call_prefers_its_own_gpu_s_large_neighbour_to_another_gpu_s_huge_entry(tmp_path):
    """A B64 call at a key length nobody tuned: its own GPU's large bucket an octave of keys away serves
    it, not the huge entry another GPU of the architecture has at that length (kin borrow only where
    a GPU's own entries are not that near)."""
    h200 = replace(H100_SXM, name="NVIDIA H200")
    own = replace(TUNED, batch=32, heads=32, kv_heads=32, seqlen_q=1024, seqlen_k=8192)
    kin = entry(SLOW, 25.0, problem=replace(own, batch=128), gpu=h200, mid=2)
    d = Dispatcher(lookup_file(tmp_path, [entry(FAST, 20.0, problem=own), kin]))
    call = replace(own, batch=64, seqlen_k=3000)
    e = d.select(call, H100_SXM)
    assert e["params"] == FAST and e["gpu_key"] == H100_SXM.key


def test_a_call_that_fills_the_gpu_passes_over_configs_tuned_on_few_heads(tmp_path):
    """A config of the smallest work class (B1 x 12 heads: persistent, keys split) was chosen where
    query blocks leave SMs idle; a call of a larger class over DEFAULT_KEYS keys runs the nearest
    entry of a larger class instead, else flash_fwd_sm90's default (the served form of it), while
    the small class itself, short rows of keys, and entries borrowed from the medium class keep the
    lookup's."""
    from tuner.borrowing import DEFAULT_KEYS

    sm90 = FAMILIES["flash_fwd_sm90"]
    few = Problem(1, 12, 1024, 32768, 64, "bf16", "causal_br")
    tuned = dict(sm90.default(H100_SXM, few), persistent=1, split=40, stages=3, cwg=2)
    assert tuned != sm90.default(H100_SXM, few) and few.bucket().work == "small"
    d = Dispatcher(lookup_file(tmp_path, [entry(tuned, 380.0, problem=few, family=sm90.name)]))
    served = lambda p: d.serving_entry(p, H100_SXM)
    wide = replace(few, batch=2, heads=25, kv_heads=25, seqlen_q=3665, seqlen_k=23192)
    assert wide.bucket().work == "medium" and wide.seqlen_k >= DEFAULT_KEYS
    default = sm90.served_form(sm90.default(H100_SXM, wide), H100_SXM, wide)
    assert (served(wide)["family"], served(wide)["params"]) == (default[0].name, default[1])
    assert served(few)["params"] == tuned                                        # its own bucket
    short = replace(wide, seqlen_q=900, seqlen_k=DEFAULT_KEYS - 1)   # short rows of keys
    near = d.select(short, H100_SXM)
    assert near is not None and near["bucket"] == few.bucket().key
    # tuned one class up, on two waves of blocks or more (_tuned_on_few_blocks): borrowed as before
    medium = replace(few, batch=2, heads=16, kv_heads=16, seqlen_q=2048)
    d = Dispatcher(lookup_file(tmp_path, [entry(tuned, 380.0, problem=medium, family=sm90.name)]))
    assert d.select(replace(medium, batch=16), H100_SXM)["bucket"] == medium.bucket().key
    # with both near: the small class's entry is nearer, the medium one's serves
    near_few = replace(wide, batch=1, heads=12, kv_heads=12)
    farther = replace(wide, seqlen_q=1024)
    other = dict(tuned, stages=2)
    d = Dispatcher(lookup_file(tmp_path, [entry(tuned, 380.0, problem=near_few, family=sm90.name),
                                          entry(other, 300.0, problem=farther, family=sm90.name, mid=2)]))
    order = [(dist, e["bucket"]) for dist, e in d.candidates(wide, H100_SXM)]
    assert [b for _, b in order] == [near_few.bucket().key, farther.bucket().key] and order[0][0] < order[1][0]
    assert served(wide) is not None and d.serving_entry(wide, H100_SXM)["params"] == other


def test_an_unmasked_call_passes_over_configs_tuned_under_one_wave(tmp_path):
    """A config tuned where its query blocks made under one wave (B2-H8 x 1024 at d=80: 128 blocks of
    128 rows on 132 SMs, a grid schedule) never weighed a last wave: an unmasked call of another
    bucket that fills the GPU runs flash_fwd_sm90's default however few times its blocks are (1.25x
    here; on rows of any length, 1.15x on 33 random short-row calls, "x9"), while a masked call within
    MISFIT_BLOCKS and the entry's own bucket keep borrowing it."""
    from tuner.borrowing import DEFAULT_KEYS, FILL_ROWS, MISFIT_BLOCKS, fills_gpu

    sm90 = FAMILIES["flash_fwd_sm90"]
    few = Problem(2, 8, 1024, 1024, 80, "bf16", "none")
    blocks = few.query_blocks(FILL_ROWS)
    assert blocks < H100_SXM.sm_count
    tuned = dict(sm90.default(H100_SXM, few), persistent=0, split=24, cwg=2, pingpong=1)
    call = replace(few, batch=1, seqlen_q=2505, seqlen_k=3773)   # 160 blocks: 1.25x
    assert tuned != sm90.default(H100_SXM, call) and sm90.check(tuned, H100_SXM, call) is None
    assert fills_gpu(call, H100_SXM) and call.bucket() != few.bucket() and call.query_blocks(FILL_ROWS) < 2 * blocks
    d = Dispatcher(lookup_file(tmp_path, [entry(tuned, 300.0, problem=few, family=sm90.name)]))
    default = sm90.served_form(sm90.default(H100_SXM, call), H100_SXM, call)
    e = d.serving_entry(call, H100_SXM)
    assert (e["family"], e["params"]) == (default[0].name, default[1]) and "bucket" not in e
    assert d.select(replace(few, heads=12, kv_heads=12), H100_SXM)["params"] == tuned   # its own bucket
    # short rows too: flash_fwd_sm90's default (two consumers where 192-row tiles make as many waves,
    # two of 136 blocks against 200 of 128 rows; three where they make one, at 2505 queries)
    short = replace(call, seqlen_q=3136, seqlen_k=DEFAULT_KEYS - 1)
    for q, cwg in ((3136, 2), (2505, 3)):
        served = d.select(replace(short, seqlen_q=q), H100_SXM)
        assert "bucket" not in served and served["params"]["cwg"] == cwg, served
    # masked: tiles of unequal work; within MISFIT_BLOCKS the borrowed config serves
    few_c, call_c = replace(few, mask="causal"), replace(call, seqlen_k=call.seqlen_q, mask="causal")
    assert call_c.query_blocks(FILL_ROWS) < MISFIT_BLOCKS * blocks
    d = Dispatcher(lookup_file(tmp_path, [entry(tuned, 300.0, problem=few_c, family=sm90.name)]))
    assert d.select(call_c, H100_SXM)["bucket"] == few_c.bucket().key


def test_a_call_of_many_waves_passes_over_configs_tuned_on_few_blocks(tmp_path):
    """A borrowed config tuned where its query blocks made under FEW_WAVES waves (240 blocks of 128
    rows on 132 SMs: a persistent schedule with a TMA store) gives way to the next entry tuned on more
    blocks, where the call has MISFIT_BLOCKS times as many, else to flash_fwd_sm90's default; within
    that factor, under DEFAULT_KEYS keys, and in its own bucket the entry serves."""
    from tuner.borrowing import DEFAULT_KEYS, FEW_WAVES, FILL_ROWS, MISFIT_BLOCKS

    sm90 = FAMILIES["flash_fwd_sm90"]
    few = Problem(1, 20, 1500, 1500, 64, "bf16", "none")
    blocks = few.query_blocks(FILL_ROWS)
    assert blocks < FEW_WAVES * H100_SXM.sm_count
    tuned = dict(sm90.default(H100_SXM, few), persistent=1, tma_store=1, split=40, cwg=2)
    assert tuned != sm90.default(H100_SXM, few)
    d = Dispatcher(lookup_file(tmp_path, [entry(tuned, 300.0, problem=few, family=sm90.name)]))
    many = replace(few, heads=25, kv_heads=25, seqlen_q=6805, seqlen_k=1639)   # 1350 blocks: 5.6x
    assert many.query_blocks(FILL_ROWS) >= MISFIT_BLOCKS * blocks and many.bucket() != few.bucket()
    assert many.bucket().work == few.bucket().work   # not _tuned_on_few_heads' case
    default = sm90.served_form(sm90.default(H100_SXM, many), H100_SXM, many)
    e = d.serving_entry(many, H100_SXM)
    assert (e["family"], e["params"]) == (default[0].name, default[1]) and "bucket" not in e
    within = replace(few, heads=25, kv_heads=25, seqlen_q=2007, seqlen_k=5137)   # 400 blocks: 1.7x
    assert d.select(within, H100_SXM)["bucket"] == few.bucket().key
    short = replace(many, seqlen_k=DEFAULT_KEYS - 1)
    assert d.select(short, H100_SXM)["bucket"] == few.bucket().key
    same = replace(few, heads=31, kv_heads=31, seqlen_q=2048, seqlen_k=2048)   # its own bucket
    assert same.bucket() == few.bucket() and d.select(same, H100_SXM)["params"] == tuned
    # an entry tuned on more blocks, farther away, serves before the default
    wide = replace(few, heads=16, kv_heads=16, seqlen_q=4096, seqlen_k=4096)   # 512 blocks
    other = dict(tuned, persistent=0, tma_store=0)
    d = Dispatcher(lookup_file(tmp_path, [entry(tuned, 300.0, problem=few, family=sm90.name),
                                          entry(other, 430.0, problem=wide, family=sm90.name, mid=2)]))
    order = [e["bucket"] for _, e in d.candidates(many, H100_SXM)]
    assert order[0] == few.bucket().key and wide.bucket().key in order
    assert d.select(many, H100_SXM)["bucket"] == wide.bucket().key


def test_select_keeps_error_budgets_apart(tmp_path):
    """A config tuned under a widened budget (fp32 at tf32/bf16 precision) serves only calls that
    allow that error; the default-budget config serves the rest; the lookup file round-trips it."""
    mma = FAMILIES["flash_fwd_mma"]
    wide = replace(TUNED, max_error=2e-2)
    fast = mma.default(H100_SXM, wide)
    d = Dispatcher(lookup_file(tmp_path, [entry(FAST, 20.0), entry(fast, 120.0, problem=wide, family=mma.name, mid=2)]))
    assert d.select(TUNED, H100_SXM)["params"] == FAST
    e = d.select(replace(wide, seqlen_q=1000, seqlen_k=1000), H100_SXM)
    assert e is not None and e["family"] == mma.name and e["params"]["compute"] in ("tf32", "bf16")
    assert d.select(replace(TUNED, max_error=2e-3), H100_SXM) is None  # tuned under no such budget


def test_bucketing_of_lengths(tmp_path):
    d = Dispatcher(lookup_file(tmp_path, [entry(FAST, 20.0, problem=replace(TUNED, seqlen_q=1000, seqlen_k=1000))]))
    for n in (513, 1000, 1024):
        assert d.select(replace(TUNED, seqlen_q=n, seqlen_k=n), H100_SXM) is not None, n
    assert d.select(replace(TUNED, seqlen_q=2048, seqlen_k=2048), H100_SXM)["bucket"] == TUNED.bucket().key  # nearest
    far = replace(TUNED, seqlen_q=8192, seqlen_k=8192)
    assert next(d.candidates(far, H100_SXM), None) is None   # 3 octaves in each length: too far for the nearest rule
    assert d.select(far, H100_SXM)["bucket"] == TUNED.bucket().key   # ... not for a call that fills the GPU


def test_select_none_for_other_gpu_key(tmp_path):
    d = Dispatcher(lookup_file(tmp_path, [entry(FAST, 20.0)]))
    l40 = replace(H100_SXM, name="NVIDIA L40S", major=8, minor=9)
    assert d.select(TUNED, A100_SXM) is None
    assert d.select(TUNED, l40) is None
    same_model = replace(H100_SXM, index=3)  # another card of the same model shares results
    assert d.select(TUNED, same_model) is not None


def test_select_fastest_first_and_skips_what_fails_check(tmp_path, two_families):
    path = lookup_file(tmp_path, [entry(SLOW, 10.0, mid=1), entry(STAGED, 25.0, family=two_families, mid=2)])
    doc = read_lookup(path)
    assert [e["tflops"] for e in doc["entries"]] == [25.0, 10.0]
    d = Dispatcher(path)
    assert d.select(TUNED, H100_SXM)["family"] == two_families  # fastest first
    # a Turing card of the same key cannot run cp.async (stages=2): the next entry serves
    turing_like = replace(H100_SXM, major=7, minor=5)
    turing_d = Dispatcher(lookup_file(tmp_path / "t", [replace(entry(SLOW, 10.0), gpu_key=turing_like.key),
                                                      replace(entry(STAGED, 25.0, family=two_families),
                                                              gpu_key=turing_like.key)]))
    e = turing_d.select(TUNED, turing_like)
    assert e is not None and e["params"] == SLOW and e["family"] == FAM.name
    # shared memory too small for the fast entry on this card: the slow one serves
    small = replace(H100_SXM, smem_per_block_optin=FAM.smem_bytes(SLOW, TUNED))
    assert FAM.check(STAGED, small, TUNED) is not None and FAM.check(SLOW, small, TUNED) is None
    assert Dispatcher(path).select(TUNED, small)["params"] == SLOW
    # nothing runnable: None
    tiny = replace(H100_SXM, smem_per_block_optin=1024)
    assert Dispatcher(path).select(TUNED, tiny) is None


def test_unknown_family_in_lookup_is_skipped(tmp_path, two_families):
    path = lookup_file(tmp_path, [entry(SLOW, 10.0), entry(FAST, 40.0, family=two_families)])
    FAMILIES.pop(two_families)  # a lookup written by a flashtune with more families
    e = Dispatcher(path).select(TUNED, H100_SXM)
    assert e is not None and e["family"] == FAM.name and e["params"] == SLOW


@pytest.mark.parametrize(
    "content",
    ["{not json", "", json.dumps({"schema": "other", "version": 1, "entries": []}),
     json.dumps({"schema": "flashtune.best-configs", "version": 99, "entries": []}),
     json.dumps({"schema": "flashtune.best-configs", "version": 1, "entries": [{"gpu_key": 1}]})],
    ids=["truncated", "empty", "other-schema", "newer-version", "bad-entry"],
)
def test_corrupt_lookup_warns_once_and_selects_nothing(tmp_path, content):
    path = tmp_path / "best.json"
    path.write_text(content)
    d = Dispatcher(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert d.select(TUNED, H100_SXM) is None
        assert d.select(TUNED, A100_SXM) is None
        assert d.select(replace(TUNED, head_dim=128), H100_SXM) is None
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1, msgs
    assert "ignoring the best-config lookup" in msgs[0] and str(path) in msgs[0]
    assert "scaled_dot_product_attention" in msgs[0]


def test_missing_lookup_selects_nothing_silently(tmp_path):
    d = Dispatcher(tmp_path / "absent.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d.select(TUNED, H100_SXM) is None


def test_lookup_is_read_once(tmp_path):
    path = lookup_file(tmp_path, [entry(FAST, 20.0)])
    d = Dispatcher(path)
    assert d.select(TUNED, H100_SXM)["params"] == FAST
    write_lookup(build_lookup([entry(SLOW, 50.0)]), path)  # a later export is not picked up...
    assert d.select(TUNED, H100_SXM)["params"] == FAST
    assert Dispatcher(path).select(TUNED, H100_SXM)["params"] == SLOW  # ...until a new dispatcher


def test_a_call_of_long_key_rows_passes_over_configs_tuned_on_short_ones(tmp_path):
    """A borrowed config tuned on rows of DEFAULT_KEYS keys or fewer (a persistent schedule with a
    TMA store, chosen where a short main loop leaves them exposed) gives way to flash_fwd_sm90's
    default where the call has MISFIT_KEYS times as many keys; under that factor, and in its own
    bucket, the entry serves."""
    from tuner.borrowing import DEFAULT_KEYS, MISFIT_KEYS

    sm90 = FAMILIES["flash_fwd_sm90"]
    short = Problem(16, 16, 1024, 1024, 128, "bf16", "none")
    tuned = dict(sm90.default(H100_SXM, short), persistent=1, tma_store=1, split=40, Bc=128)
    assert tuned != sm90.default(H100_SXM, short) and short.seqlen_k <= DEFAULT_KEYS
    d = Dispatcher(lookup_file(tmp_path, [entry(tuned, 640.0, problem=short, family=sm90.name)]))
    long_rows = Problem(16, 32, 315, 4896, 128, "bf16", "none", 8)   # 4.8x the keys
    assert long_rows.seqlen_k >= MISFIT_KEYS * short.seqlen_k and long_rows.bucket() != short.bucket()
    default = sm90.served_form(sm90.default(H100_SXM, long_rows), H100_SXM, long_rows)
    e = d.select(long_rows, H100_SXM)   # (served packed: 8 query heads of 315 rows fill their blocks better)
    assert (e["family"], e["params"]) == (default[0].name, default[1]) and "bucket" not in e
    within = replace(long_rows, seqlen_k=MISFIT_KEYS * short.seqlen_k - 1)
    assert d.select(within, H100_SXM)["bucket"] == short.bucket().key
    own = replace(short, seqlen_k=DEFAULT_KEYS)   # its own bucket
    assert own.bucket() == short.bucket() and d.select(own, H100_SXM)["params"] == tuned
    # under DEFAULT_KEYS the call's rows are short too: an entry tuned on 200 keys serves 5x them
    few_keys = replace(short, seqlen_k=200)
    d = Dispatcher(lookup_file(tmp_path, [entry(tuned, 640.0, problem=few_keys, family=sm90.name)]))
    call = replace(long_rows, seqlen_k=DEFAULT_KEYS - 1)
    assert call.seqlen_k >= MISFIT_KEYS * few_keys.seqlen_k
    assert d.select(call, H100_SXM)["bucket"] == few_keys.bucket().key
