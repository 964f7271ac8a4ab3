"""The reference every candidate is validated against: attention in float64 through torch."""

from __future__ import annotations

from dataclasses import dataclass

from .problem import LSE_BUDGET
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


def attention_fp64(q, k, v, causal: bool, scale: float):
    """O and LSE in float64 for (B, H, N, D) tensors; K/V heads broadcast for GQA."""
    import torch

    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    q2, k2, v2 = (t.reshape(b * h, -1, d) for t in (q, k, v))
    o = torch.empty(b * h, nq, d, dtype=torch.float64, device=q.device)
    lse = torch.empty(b * h, nq, dtype=torch.float64, device=q.device)
    step = max(1, _CHUNK_BYTES // (8 * nq * nk))
    mask = None
    if causal:
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(1)  # top-left, as SDPA
    for s in range(0, b * h, step):
        sl = slice(s, s + step)
        scores = torch.matmul(q2[sl].double(), k2[sl].double().transpose(1, 2)) * scale
        if mask is not None:
            scores.masked_fill_(mask, float("-inf"))
        lse[sl] = torch.logsumexp(scores, dim=-1)
        o[sl] = torch.matmul(torch.exp(scores - lse[sl, :, None]), v2[sl].double())
    return o.reshape(b, h, nq, d), lse.reshape(b, h, nq)


def compare(out, lse_out, ref_o, ref_lse) -> Errors:
    import torch

    out64 = out.double()
    finite = bool(torch.isfinite(out64).all())
    diff = out64 - ref_o
    rel = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref_o).clamp_min(1e-300))
    max_abs = float(diff.abs().max())
    lse_err = None
    if lse_out is not None:
        finite = finite and bool(torch.isfinite(lse_out).all())
        lse_err = float((lse_out.double() - ref_lse).abs().max())
    if not finite:
        rel = max_abs = float("inf")
    return Errors(rel=rel, max_abs=max_abs, lse=lse_err, finite=finite)
