"""Problem: parsing, validation, FLOP count, keys and shape buckets."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from tuner.problem import DTYPES, GPT2_FP32, MASKS, Bucket, Problem, standard_grid


@pytest.mark.parametrize(
    "text,dtype,want",
    [
        ("2,4,512,64", "fp32", Problem(2, 4, 512, 512, 64, "fp32", False)),
        ("2, 4, 512, 64, causal", "fp16", Problem(2, 4, 512, 512, 64, "fp16", True)),
        ("8,12,1024,64,1", "bf16", Problem(8, 12, 1024, 1024, 64, "bf16", True)),
        ("8,12,1024,64,0", "fp32", Problem(8, 12, 1024, 1024, 64, "fp32", False)),
        ("1,1,7,128,FALSE", "fp32", Problem(1, 1, 7, 7, 128, "fp32", False)),
        ("1,1,7,128,C", "fp32", Problem(1, 1, 7, 7, 128, "fp32", True)),
        ("1,32:8,8192,128,causal", "bf16", Problem(1, 32, 8192, 8192, 128, "bf16", "causal", kv_heads=8)),
        ("2,8,512:4096,64,causal_br", "fp16", Problem(2, 8, 512, 4096, 64, "fp16", "causal_br")),
        ("2,8:1,4096:512,64,Bottom_Right", "fp16", Problem(2, 8, 4096, 512, 64, "fp16", "causal_br", 1)),
        ("2,8,1:300,64,br", "bf16", Problem(2, 8, 1, 300, 64, "bf16", "causal_br")),
        ("2,8,7:9,64,top_left", "bf16", Problem(2, 8, 7, 9, 64, "bf16", "causal")),
        ("2,8,7:9,64,none", "bf16", Problem(2, 8, 7, 9, 64, "bf16")),
    ],
)
def test_parse_good(text, dtype, want):
    assert Problem.parse(text, dtype) == want


@pytest.mark.parametrize(
    "text,match",
    [
        ("2,4,512", r"must be B,H\[:KVH\],NQ\[:NK\],D\[,MASK\]"),
        ("2,4,512,64,causal,x", "must be B,H"),
        ("", "must be B,H"),
        ("2,4,,64", "must be B,H"),
        ("2,4,x,64", "must be integers"),
        ("2,4,512.5,64", "must be integers"),
        ("2,4:,512,64", "must be integers"),
        ("2:1,4,512,64", "must be integers"),
        ("2,4:2:1,512,64", "at most one ':'"),
        ("2,4,512:64:3,64", "at most one ':'"),
        ("2,4,512,64,sideways", "the mask field must be one of none, full"),
        ("2,4:3,512,64", r"kv_heads \(3\) must divide heads \(4\)"),
        ("2,4,512:0,64", "seqlen_k must be a positive integer"),
        ("0,4,512,64", "batch must be a positive integer"),
        ("2,-4,512,64", "heads must be a positive integer"),
        ("2,4,512,0", "head_dim must be a positive integer"),
    ],
)
def test_parse_bad(text, match):
    with pytest.raises(ValueError, match=match) as info:
        Problem.parse(text)
    assert "\n" not in str(info.value)


def test_parse_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of fp32, fp16, bf16, fp8, got 'int8'"):
        Problem.parse("1,1,128,64", "int8")


@pytest.mark.parametrize("field", ["batch", "heads", "seqlen_q", "seqlen_k", "head_dim", "kv_heads"])
@pytest.mark.parametrize("value", [-1, 2.0, "4", None])
def test_fields_must_be_positive_ints(field, value):
    kw = dict(batch=1, heads=4, seqlen_q=128, seqlen_k=128, head_dim=64, kv_heads=2)
    kw[field] = value
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        Problem(**kw)


def test_zero_is_rejected_except_kv_heads():
    for field in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim"):
        kw = dict(batch=1, heads=4, seqlen_q=128, seqlen_k=128, head_dim=64)
        kw[field] = 0
        with pytest.raises(ValueError, match=field):
            Problem(**kw)
    assert Problem(1, 4, 128, 128, 64, kv_heads=0).kv_heads == 4  # 0 means "same as heads"


def test_gqa_validation_and_default_kv_heads():
    assert Problem(1, 8, 128, 128, 64).kv_heads == 8
    assert Problem(1, 8, 128, 128, 64, kv_heads=2).kv_heads == 2
    with pytest.raises(ValueError, match=r"kv_heads \(3\) must divide heads \(8\)"):
        Problem(1, 8, 128, 128, 64, kv_heads=3)
    with pytest.raises(ValueError, match="kv_heads must be a positive integer"):
        Problem(1, 8, 128, 128, 64, kv_heads=-2)


def test_flops_count_the_visible_pairs():
    p = Problem(2, 3, 5, 7, 64, "fp32", False)
    assert p.flops() == 4 * 2 * 3 * 5 * 7 * 64
    per_pair = 4 * 2 * 3 * 64
    # 5 queries, 7 keys: top-left rows see 1..5 keys; bottom-right (shift 2) rows see 3..7
    assert replace(p, mask="causal").flops() == per_pair * (1 + 2 + 3 + 4 + 5)
    assert replace(p, mask="causal_br").flops() == per_pair * (3 + 4 + 5 + 6 + 7)
    # 7 queries, 5 keys: bottom-right rows 0 and 1 see no key at all
    q = Problem(2, 3, 7, 5, 64, "fp32", "causal_br")
    assert q.flops() == per_pair * (0 + 0 + 1 + 2 + 3 + 4 + 5)
    assert replace(q, mask="causal").flops() == per_pair * (1 + 2 + 3 + 4 + 5 + 5 + 5)
    # TFLOP/s from milliseconds; square causal is N(N+1)/2 pairs, both diagonals alike
    assert p.tflops(2.0) == pytest.approx(p.flops() / 2e-3 / 1e12)
    big = GPT2_FP32[0]
    assert big.tflops(1.0) == pytest.approx(4 * 8 * 12 * 1024 * 1025 / 2 * 64 / 1e-3 / 1e12)
    assert replace(big, mask="causal_br").flops() == big.flops()


@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_visible_pairs_against_counting(mask):
    from tuner.problem import visible_pairs

    for nq, nk in itertools.product(range(1, 12), range(1, 12)):
        shift = nk - nq if mask == "causal_br" else 0
        want = sum(sum(mask == "none" or j <= i + shift for j in range(nk)) for i in range(nq))
        assert visible_pairs(nq, nk, mask) == want, (nq, nk)


@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_visible_keys_are_the_rows_share_of_the_visible_pairs(mask):
    from tuner.problem import visible_keys, visible_pairs

    for nq, nk in itertools.product(range(1, 12), range(1, 12)):
        shift = nk - nq if mask == "causal_br" else 0
        for i in range(nq):   # the first keys, up to the row's diagonal
            assert visible_keys(i, nq, nk, mask) == sum(mask == "none" or j <= i + shift for j in range(nk)), (i, nq, nk)
        assert sum(visible_keys(i, nq, nk, mask) for i in range(nq)) == visible_pairs(nq, nk, mask)


def test_bytes_moved_counts_gqa():
    p = Problem(1, 8, 100, 200, 64, "fp16", kv_heads=2)
    assert p.bytes_moved() == 2 * (2 * 8 * 100 * 64 + 2 * 2 * 200 * 64)
    assert replace(p, dtype="fp32").bytes_moved() == 2 * p.bytes_moved()


def test_keys():
    assert Problem(8, 12, 1024, 1024, 64, "fp32", True).key == "B8-H12-N1024-D64-fp32-causal"
    assert Problem(2, 16, 512, 2048, 128, "bf16", False, 4).key == "B2-H16/kv4-N512x2048-D128-bf16-full"
    assert Problem(2, 16, 512, 2048, 128, "bf16", "causal_br", 4).key == "B2-H16/kv4-N512x2048-D128-bf16-causal_br"
    keys = {Problem(b, h, n, n, d, t, c).key for b, h, n, d, t, c in
            itertools.product((1, 2), (4, 8), (128, 256), (64, 128), DTYPES, MASKS)}
    assert len(keys) == 2 * 2 * 2 * 2 * len(DTYPES) * 3  # distinct problems never share a key


@pytest.mark.parametrize("p", [
    Problem(8, 12, 1024, 1024, 64, "fp32", True), Problem(2, 16, 512, 2048, 128, "bf16", "causal_br", 4),
    Problem(1, 32, 8192, 100, 256, "fp16", "causal", 1, max_error=3e-3),
    Problem(1, 1, 7, 7, 64, "fp32", max_error=2e-2), Problem(3, 6, 1, 9000, 128, "fp8", "causal_br", 2)])
def test_problem_key_round_trip(p):
    assert Problem.from_key(p.key) == p
    assert Problem.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("key", ["", "B1-H1-N7-D64-fp32", "B1-H1-N7-D64-fp32-masked", "B1-H1-N7x-D64-fp32-full",
                                 "B1-H1-N7-D64-fp32-full-err", "b1-H1-N7-D64-fp32-full"])
def test_problem_from_bad_key(key):
    with pytest.raises(ValueError, match="not a problem key"):
        Problem.from_key(key)


def test_older_records_say_causal():
    """Version-1 lookups and databases wrote a `causal` bool: it reads as the top-left mask."""
    old = {"batch": 1, "heads": 2, "seqlen_q": 3, "seqlen_k": 5, "head_dim": 64, "dtype": "fp16",
           "causal": True, "kv_heads": 1, "max_error": 0.0}
    assert Problem.from_dict(old) == Problem(1, 2, 3, 5, 64, "fp16", "causal", 1)
    assert Problem.from_dict({**old, "causal": False}).mask == "none"
    with pytest.raises(ValueError, match="not both"):
        Problem.from_dict({**old, "mask": "none"})


def test_causal_property_and_bool_masks():
    assert Problem(1, 1, 4, 4, 64, "fp32", True).mask == "causal"
    assert Problem(1, 1, 4, 4, 64, "fp32", False).mask == "none"
    br = Problem(1, 1, 4, 8, 64, "fp32", "causal_br")
    assert br.causal and br.bottom_right and not Problem(1, 1, 4, 8, 64, "fp32", "causal").bottom_right
    assert not Problem(1, 1, 4, 8, 64).causal


def test_bucket_rounds_seqlen_and_work():
    b = Problem(8, 12, 1000, 1000, 64, "fp32", True).bucket()
    assert b == Bucket("fp32", 64, True, 1024, "medium")
    assert b.key == "fp32/d64/causal/n1024/medium"
    assert Problem(1, 1, 5, 5, 64).bucket().seqlen == 128  # minimum 128
    kv_cache = Problem(1, 1, 100, 3000, 64, "bf16", "causal_br").bucket()
    assert (kv_cache.queries, kv_cache.seqlen) == (128, 4096)  # Nq and Nk rounded apart
    assert kv_cache.key == "bf16/d64/causal_br/n128x4096/small"
    assert Problem(1, 1, 3000, 3000, 64).bucket().key == "fp32/d64/full/n4096/small"
    assert Problem(1, 1, 3000, 2100, 64).bucket().key == "fp32/d64/full/n4096/small"  # one bucket: one length
    assert Problem(1, 31, 128, 128, 64).bucket().work == "small"
    assert Problem(1, 32, 128, 128, 64).bucket().work == "medium"
    assert Problem(2, 128, 128, 128, 64).bucket().work == "large"
    assert Problem(63, 32, 1, 1024, 128, "bf16", kv_heads=8).bucket().work == "large"
    assert Problem(64, 32, 1, 1024, 128, "bf16", kv_heads=8).bucket().key == "bf16/d128/full/n1x1024/huge"
    assert Bucket.from_key("bf16/d128/full/n1x1024/huge") == Problem(128, 32, 1, 1024, 128, "bf16", kv_heads=8).bucket()


@pytest.mark.parametrize("a,b", [(1000, 1024), (513, 1024), (129, 256), (65, 128), (4097, 8192)])
def test_same_bucket(a, b):
    pa, pb = Problem(4, 12, a, a, 64, "fp16", True), Problem(4, 12, b, b, 64, "fp16", True)
    assert pa.bucket() == pb.bucket() and pa.bucket().key == pb.bucket().key


def test_decode_buckets_its_queries_from_one():
    """Up to DECODE_QUERIES queries, Nq rounds to a power of two from 1: one token against a cache
    is not bucketed with a prefill of 128 queries, which other configs serve."""
    key = lambda nq: Problem(32, 32, nq, 8192, 128, "bf16", "causal_br", 8).bucket().key
    assert key(1) == "bf16/d128/full/n1x8192/large"   # one query on the bottom-right diagonal sees every key
    assert key(3) == key(4) == "bf16/d128/causal_br/n4x8192/large"
    assert key(16) != key(17) and key(64) == "bf16/d128/causal_br/n64x8192/large"
    assert key(65) == key(128) == "bf16/d128/causal_br/n128x8192/large"
    for nq in (1, 2, 5, 16, 64):
        b = Problem(32, 32, nq, 8192, 128, "bf16", "causal_br", 8).bucket()
        assert Bucket.from_key(b.key) == b


def test_a_decode_step_is_one_bucket_whatever_mask_says_every_key():
    """One query: the bottom-right diagonal and no mask are the same attention, so a KV-cache
    step and SDPA's unmasked call share their tuned configs; top-left causal (key 0 alone) does not."""
    p = Problem(8, 32, 1, 8192, 128, "bf16", "causal_br", 8)
    assert p.bucket() == replace(p, mask="none").bucket() != replace(p, mask="causal").bucket()
    assert replace(p, seqlen_q=2).bucket() != replace(p, seqlen_q=2, mask="none").bucket()
    assert p.mask == "causal_br"   # the problem keeps its mask: the kernel is compiled for it
    from tuner.torch_attention import Case, sdpa_mask_kwargs

    assert sdpa_mask_kwargs("causal_br", 1, 8192) == {"is_causal": False}   # SDPA runs it unmasked
    assert "attn_mask" in sdpa_mask_kwargs("causal_br", 2, 8192)
    case = Case.of_problem(p, (9, 0))
    assert not case.causal and not case.bottom_right and case == Case.of_problem(replace(p, mask="none"), (9, 0))


@pytest.mark.parametrize("a,b", [(1024, 1025), (2048, 1024), (128, 129)])
def test_different_seqlen_bucket(a, b):
    assert Problem(4, 12, a, a, 64).bucket() != Problem(4, 12, b, b, 64).bucket()


def test_head_dim_dtype_causal_never_share():
    base = Problem(4, 12, 1024, 2048, 64, "fp32", False)   # Nq != Nk: the two diagonals differ
    variants = [replace(base, head_dim=d, dtype=t, mask=c)
                for d, t, c in itertools.product((64, 128), DTYPES, MASKS)]
    keys = [v.bucket().key for v in variants]
    assert len(set(keys)) == len(variants)


@pytest.mark.parametrize("nq,nk,shares", [(1000, 1000, True), (1000, 1001, False), (1001, 1000, False), (1, 1, False)])
def test_square_bottom_right_is_the_causal_bucket(nq, nk, shares):
    """With as many queries as keys the bottom-right diagonal is the top-left one: a prompt's
    prefill into an empty KV cache is served by the causal buckets the grid and the models tuned."""
    br, tl = (Problem(1, 8, nq, nk, 128, "bf16", m, 2).bucket() for m in ("causal_br", "causal"))
    assert (br == tl) is shares
    if nq == 1:   # one query on the bottom-right diagonal sees every key
        assert br.mask == "none"


def test_bucket_key_round_trip():
    for p in standard_grid("bf16") + list(GPT2_FP32) + [Problem(1, 1, 3, 9000, 128, "fp16", True),
                                                        Problem(1, 1, 9000, 3, 128, "fp16", "causal_br", max_error=0.1)]:
        b = p.bucket()
        assert Bucket.from_key(b.key) == b


@pytest.mark.parametrize("key", ["", "fp32/d64/causal/n1024", "fp32/64/causal/n1024/small",
                                 "fp32/d64/masked/n1024/small", "fp32/dx/causal/n1024/small",
                                 "fp32/d64/causal/1024/small", "a/b/c/d/e/f", "fp32/d64/causal/nx1024/small",
                                 "fp32/d64/causal_tl/n1024/small", "fp32/d64/full/n1024/small/err"])
def test_bucket_from_bad_key(key):
    with pytest.raises(ValueError, match="not a shape-bucket key"):
        Bucket.from_key(key)


def test_standard_grid():
    grid = standard_grid("bf16")
    assert len(grid) == 18 and all(p.dtype == "bf16" for p in grid) and {p.head_dim for p in grid} == {64, 128, 256}
    assert {p.batch * p.seqlen_q for p in grid} == {16384}
    assert {p.heads * p.head_dim for p in grid} == {2048}
    assert len({p.key for p in grid}) == 18


def test_to_dict_round_trip():
    p = Problem(2, 16, 512, 2048, 128, "bf16", "causal_br", 4)
    assert Problem(**p.to_dict()) == p and p.to_dict()["mask"] == "causal_br"


def test_error_budget_is_part_of_the_problem_and_its_bucket():
    from tuner.problem import REL_BUDGET, Bucket

    default = Problem(2, 4, 512, 512, 64, "fp32", True)
    spelled = Problem(2, 4, 512, 512, 64, "fp32", True, max_error=REL_BUDGET["fp32"])
    assert spelled == default and spelled.key == default.key and default.rel_budget == REL_BUDGET["fp32"]
    wide = Problem(2, 4, 512, 512, 64, "fp32", True, max_error=2e-2)
    assert wide.key == default.key + "-err0.02" and wide.rel_budget == 2e-2
    assert default.lse_budget == 1e-3 and wide.lse_budget == 0.1
    assert wide.bucket().key == default.bucket().key + "/err0.02"
    assert Bucket.from_key(wide.bucket().key) == wide.bucket()
    assert Bucket.from_key(default.bucket().key) == default.bucket()
    for bad in (-1e-3, 1.0, "0.1"):
        with pytest.raises(ValueError, match="max_error"):
            Problem(2, 4, 512, 512, 64, "fp32", True, max_error=bad)


@pytest.mark.parametrize(
    "text,match",
    [
        ("1,1,99999999999999999999,64", r"seqlen_q must be below 2\^31"),
        ("1,1,2147483648,64", r"seqlen_q must be below 2\^31.*got 2147483648"),
        ("2147483648,1,128,64", r"batch must be below 2\^31"),
        ("1,64,33554432,64", r"batch x heads x seqlen_q = 2147483648 rows must be below 2\^31"),
        ("1024,1024,2048,64", "batch x heads x seqlen_q"),
    ],
    ids=["20-digits", "n-2^31", "b-2^31", "rows-2^31", "rows-product"],
)
def test_sizes_the_kernels_cannot_index_are_refused(text, match):
    """Lengths, heads and row counts are 32-bit ints in every kernel: larger ones would wrap."""
    with pytest.raises(ValueError, match=match):
        Problem.parse(text)
    assert Problem.parse("1,1,2147483647,64").seqlen_q == 2**31 - 1  # the largest that fits
    assert Problem.parse("1,32,67108863,64").seqlen_q == 67108863


@pytest.mark.parametrize("field", ["batch", "heads", "head_dim"])
def test_bools_are_not_sizes(field):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got True"):
        Problem(**{**dict(batch=1, heads=1, seqlen_q=128, seqlen_k=128, head_dim=64), field: True})
    with pytest.raises(ValueError, match="mask must be one of none, causal, causal_br"):
        Problem(1, 1, 128, 128, 64, "fp32", 1)
    with pytest.raises(ValueError, match="max_error"):
        Problem(1, 1, 128, 128, 64, "fp32", False, max_error=True)
