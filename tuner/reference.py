"""The reference every candidate is validated against: attention in float64 through torch."""

from __future__ import annotations

from dataclasses import dataclass

from .problem import LSE_BUDGET, mask_of

_CHUNK_BYTES = 2 << 30  # bound the float64 score matrix a chunk may hold


@dataclass
class Errors:
    rel: float
    max_abs: float
    lse: float | None
    finite: bool

    def within(self, rel_budget: float, lse_budget: float = LSE_BUDGET) -> bool:
        return (
            self.finite
            and self.rel <= rel_budget
            and (self.lse is None or self.lse <= lse_budget)
        )


def hidden_keys(nq: int, nk: int, mask: bool | str, device=None):
    """The (Nq, Nk) bool matrix of the keys each query row must not see (None: none hidden).
    Row i sees keys j <= i + shift: shift 0 top-left (SDPA's is_causal), Nk - Nq bottom-right."""
    return _hidden_rows(0, nq, nq, nk, mask, device)


def _hidden_rows(r0: int, r1: int, nq: int, nk: int, mask: bool | str, device):
    """Rows r0..r1 of hidden_keys(nq, nk, mask), built for those rows alone (None: none hidden)."""
    import torch

    mask = mask_of(mask)
    if mask == "none":
        return None
    shift = nk - nq if mask == "causal_br" else 0
    rows = torch.arange(r0, r1, device=device)[:, None]
    return torch.arange(nk, device=device)[None, :] > rows + shift


def attention_fp64(q, k, v, mask: bool | str, scale: float):
    """O and LSE in float64 for (B, H, N, D) tensors; K/V heads broadcast for GQA. `mask` is a
    problem's mask (a bool: SDPA's is_causal). A row that sees no key at all (bottom-right with
    Nq > Nk) has O = 0 and LSE = -inf (the log of an empty sum), what every kernel must write.
    Computed a few (batch, head) pairs at a time, so that the float64 scores and the float64 copies of
    their K and V stay within _CHUNK_BYTES; each query head reads its K/V head in place (a decode
    batch of 32 x 32 heads against 32768 keys would otherwise copy 34 GB of float64 K at once).
    Where one head's scores alone exceed that (a 64k-token prompt's are 69 GB with their exp), a
    block of its query rows at a time, the mask built for those rows."""
    import torch

    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    q2, k2, v2 = q.reshape(b * h, nq, d), k.reshape(b * hk, nk, d), v.reshape(b * hk, nk, d)
    kv_row = torch.arange(b * h, device=q.device)
    kv_row = kv_row // h * hk + kv_row % h // (h // hk)   # query (batch, head) -> its K/V (batch, head)
    o = torch.empty(b * h, nq, d, dtype=torch.float64, device=q.device)
    lse = torch.empty(b * h, nq, dtype=torch.float64, device=q.device)
    head_bytes = 8 * (2 * nq * nk + 2 * nk * d + 2 * nq * d)   # scores and their exp, K, V, Q, O
    step = max(1, _CHUNK_BYTES // head_bytes)
    rows = nq if head_bytes <= _CHUNK_BYTES else max(1, (_CHUNK_BYTES - 16 * nk * d) // (8 * (2 * nk + 2 * d)))
    for s in range(0, b * h, step):
        sl = slice(s, s + step)
        kk, vv = k2[kv_row[sl]].double(), v2[kv_row[sl]].double()
        for r0 in range(0, nq, rows):
            r1 = min(nq, r0 + rows)
            scores = torch.matmul(q2[sl, r0:r1].double(), kk.transpose(1, 2)) * scale
            hidden = _hidden_rows(r0, r1, nq, nk, mask, q.device)
            if hidden is not None:
                scores.masked_fill_(hidden, float("-inf"))
            block_lse = torch.logsumexp(scores, dim=-1)
            lse[sl, r0:r1] = block_lse
            shift = torch.where(torch.isneginf(block_lse), 0.0, block_lse)   # empty rows: exp(-inf) = 0, not NaN
            o[sl, r0:r1] = torch.matmul(torch.exp(scores - shift[:, :, None]), vv)
    return o.reshape(b, h, nq, d), lse.reshape(b, h, nq)


def compare(out, lse_out, ref_o, ref_lse) -> Errors:
    import torch

    out64 = out.double()
    finite = bool(torch.isfinite(out64).all())
    diff = out64 - ref_o
    rel = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref_o).clamp_min(1e-300))
    max_abs = float(diff.abs().max())
    lse_err = None
    if lse_out is not None:   # -inf exactly where the reference has it (rows that see no key)
        lse64, empty = lse_out.double(), torch.isneginf(ref_lse)
        seen = ~empty
        finite = finite and torch.equal(torch.isneginf(lse64), empty) and bool(torch.isfinite(lse64[seen]).all())
        lse_err = float((lse64[seen] - ref_lse[seen]).abs().max()) if bool(seen.any()) else 0.0
    if not finite:
        rel = max_abs = float("inf")
    return Errors(rel=rel, max_abs=max_abs, lse=lse_err, finite=finite)
