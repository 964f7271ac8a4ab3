"""The float64 reference on the CPU: every mask, Nq != Nk both ways, GQA, and rows that see no
key (bottom-right with Nq > Nk: O = 0, LSE = -inf), against a row-by-row softmax and SDPA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tuner.reference import attention_fp64, compare, hidden_keys

SHAPES = [(5, 9), (9, 5), (7, 7), (1, 6), (6, 1)]   # (Nq, Nk): fewer queries, more queries, square, decode


def _inputs(nq, nk, h=4, hk=2, d=16):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)   # fresh inputs every run
    q = torch.randn(2, h, nq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, hk, nk, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _row_by_row(q, k, v, mask, scale):
    """Attention one query row at a time, from the definition: row i sees keys j <= i + shift."""
    b, h, nq, d = q.shape
    nk, group = k.shape[2], h // k.shape[1]
    shift = {"none": None, "causal": 0, "causal_br": nk - nq}[mask]
    o, lse = torch.zeros(b, h, nq, d, dtype=torch.float64), torch.full((b, h, nq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(nq):
                seen = nk if shift is None else max(0, min(nk, i + shift + 1))
                if seen == 0:
                    continue
                s = k[bi, hi // group, :seen] @ q[bi, hi, i] * scale
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                o[bi, hi, i] = torch.softmax(s, 0) @ v[bi, hi // group, :seen]
    return o, lse


@pytest.mark.parametrize("nq,nk", SHAPES)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
def test_reference_is_the_definition(mask, nq, nk):
    q, k, v = _inputs(nq, nk)
    o, lse = attention_fp64(q, k, v, mask, 0.3)
    want_o, want_lse = _row_by_row(q, k, v, mask, 0.3)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    empty = torch.isneginf(lse)
    assert bool(empty.any()) == (mask == "causal_br" and nq > nk)   # only there does a row see nothing
    assert torch.isfinite(o).all() and (o[empty.unsqueeze(-1).expand_as(o)] == 0).all()


@pytest.mark.parametrize("chunk_rows", [1, 3, 5])
def test_chunks_and_gqa_groups_need_not_line_up(monkeypatch, chunk_rows):
    """The reference runs a few (batch, head) rows at a time, each reading its own K/V head: chunks
    of 1, 3 or 5 of the 2 x 8 query heads (4 per K/V head, 2 K/V heads) cut across groups and
    batches, and still give the definition."""
    import tuner.reference as reference

    nq, nk, d = 3, 11, 16
    monkeypatch.setattr(reference, "_CHUNK_BYTES", chunk_rows * 8 * (2 * nq * nk + 2 * nk * d + 2 * nq * d))
    q, k, v = _inputs(nq, nk, h=8, hk=2, d=d)
    o, lse = attention_fp64(q, k, v, "causal_br", 0.3)
    want_o, want_lse = _row_by_row(q, k, v, "causal_br", 0.3)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_a_long_decode_batch_stays_within_the_chunk_budget(monkeypatch):
    """A decode step as a search measures it (32 query heads on 8 K/V heads, one query against many
    keys) is checked a chunk at a time: no float64 copy of all the K/V heads, nor of K/V repeated per
    query head (B32 x 32768 keys: 34 GB, where tuning such a problem on the H100 ran out of memory).
    Here at 1/8 of the real budget, on two sequences of 8192 keys."""
    import tuner.reference as reference

    budget = reference._CHUNK_BYTES // 8
    monkeypatch.setattr(reference, "_CHUNK_BYTES", budget)
    b, h, hk, nk, d = 2, 32, 8, 8192, 128
    q = torch.randn(b, h, 1, d, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hk, nk, d, dtype=torch.bfloat16) for _ in range(2))
    seen, real_matmul = [], torch.matmul

    def matmul(x, y):
        seen.append(x.numel() * x.element_size() + y.numel() * y.element_size())
        return real_matmul(x, y)

    monkeypatch.setattr(torch, "matmul", matmul)
    o, lse = attention_fp64(q, k, v, "causal_br", d ** -0.5)
    monkeypatch.setattr(torch, "matmul", real_matmul)
    assert len(seen) > 2 and max(seen) <= budget   # several chunks, each within the budget
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", ["none", "causal", "causal_br"])
@pytest.mark.parametrize("nq,nk", [(13, 40), (40, 13), (29, 29)])
def test_a_head_too_large_for_the_budget_runs_a_block_of_rows_at_a_time(monkeypatch, mask, nq, nk):
    """One head's float64 scores over the budget (a 64k-token prompt's are 69 GB with their exp,
    where checking a search's candidate ran the GPU out of memory): blocks of its query rows, each
    with the mask built for its rows, give the definition, rows that see no key included; every
    score block stays within the budget."""
    import tuner.reference as reference

    d = 16
    budget = 16 * nk * d + 8 * (2 * nk + 2 * d) * 4   # K and V, and 4 query rows' scores
    monkeypatch.setattr(reference, "_CHUNK_BYTES", budget)
    q, k, v = _inputs(nq, nk, h=4, hk=2, d=d)
    seen, real_matmul = [], torch.matmul

    def matmul(x, y):
        seen.append(x.shape[-2] if y.shape[-1] == nk else None)   # the rows of a score block
        return real_matmul(x, y)

    monkeypatch.setattr(torch, "matmul", matmul)
    o, lse = attention_fp64(q, k, v, mask, 0.3)
    monkeypatch.setattr(torch, "matmul", real_matmul)
    blocks = [r for r in seen if r is not None]
    assert max(blocks) == 4 and len(blocks) == 8 * -(-nq // 4)   # 4 rows at a time, each of the 8 heads
    want_o, want_lse = _row_by_row(q, k, v, mask, 0.3)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nq,nk", [(5, 9), (7, 7), (9, 5)])
@pytest.mark.filterwarnings("ignore:Lower right causal bias")
def test_masks_agree_with_sdpa(nq, nk):
    """Top-left is SDPA's is_causal; bottom-right is torch's causal_lower_right (on the rows that see
    a key; SDPA leaves the others to the backend)."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _inputs(nq, nk, h=2, hk=2)
    tl, _ = attention_fp64(q, k, v, True, q.shape[-1] ** -0.5)
    torch.testing.assert_close(tl, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    br, lse = attention_fp64(q, k, v, "causal_br", q.shape[-1] ** -0.5)
    rows = ~torch.isneginf(lse[0, 0])
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(nq, nk))
    torch.testing.assert_close(br[:, :, rows], sdpa[:, :, rows])
    assert bool(torch.equal(hidden_keys(nq, nk, "causal_br"), ~causal_lower_right(nq, nk)._materialize()))


def test_compare_takes_minus_inf_only_where_the_reference_has_it():
    q, k, v = _inputs(9, 5)
    ref_o, ref_lse = attention_fp64(q, k, v, "causal_br", 0.25)
    assert torch.isneginf(ref_lse).any()
    good = compare(ref_o.float(), ref_lse.float(), ref_o, ref_lse)
    assert good.finite and good.lse < 1e-6 and good.within(1e-4)
    for damage in ("finite-in-empty", "inf-in-seen", "nan", "plus-inf"):
        lse = ref_lse.clone().float()
        empty = torch.isneginf(ref_lse)
        if damage == "finite-in-empty":
            lse[empty] = 0.0
        elif damage == "inf-in-seen":
            lse[~empty] = -math.inf
        elif damage == "nan":
            lse[~empty] = math.nan
        else:
            lse[empty] = math.inf
        assert not compare(ref_o.float(), lse, ref_o, ref_lse).within(1e-4, 1e9), damage
    o = ref_o.clone()
    o[0, 0, 0] = math.nan   # an unwritten (poisoned) empty row
    assert not compare(o, ref_lse, ref_o, ref_lse).finite
