"""torch's own fused attention kernels as building blocks: a forward that also returns the
softmax's log-sum-exp, and a backward that starts from an O and its LSE.

Our kernels write O and the natural-log LSE per query row (B, H, Nq) in float32, exactly what
FlashAttention-2's, cuDNN's and the memory-efficient backward kernels read. So a training step can
run our tuned forward and torch's fastest backward on it, and a call with no tuned kernel can run
torch's forward with the same LSE, for the same backward. Each backend says which cases it takes
(`why_not`): dtype, head dim, the causal diagonal where Nq != Nk (SDPA's `is_causal` is the top-left
one, FlashAttention-2's the bottom-right one; a `causal` argument here is a problem mask, a bool
meaning SDPA's), and GQA (K/V heads shared by several query heads:
expanded for the kernels that need equal heads, their gradients summed back).

These call private aten ops (`torch.ops.aten._scaled_dot_product_*`, `_efficient_attention_*`),
which are stable across the torch versions this project supports but not public API; the GPU
tests check every backend against float64 autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .problem import mask_of, seen_mask, torch_dtype
from .reference import hidden_keys

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Case:
    """What decides which backend can take a call."""

    dtype: torch.dtype
    head_dim: int
    nq: int
    nk: int
    causal: bool
    gqa: bool
    cc: tuple[int, int]
    bottom_right: bool = False   # the causal diagonal is the bottom-right one, and it differs (Nq != Nk)

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool | str) -> "Case":
        cc = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else (0, 0)
        nq, nk = q.shape[2], k.shape[2]
        mask = seen_mask(mask_of(causal), nq, nk)
        return cls(q.dtype, q.shape[-1], nq, nk, mask != "none", k.shape[1] != q.shape[1], cc,
                   mask == "causal_br")

    @classmethod
    def of_problem(cls, problem, cc: tuple[int, int]) -> "Case":
        """The case a Problem poses, run in its output dtype (fp8 inputs go up to bf16) on a GPU of
        compute capability `cc`."""
        nq, nk = problem.seqlen_q, problem.seqlen_k
        mask = seen_mask(problem.mask, nq, nk)
        return cls(torch_dtype(problem.out_dtype), problem.head_dim, nq, nk, mask != "none",
                   problem.kv_heads != problem.heads, cc, mask == "causal_br")


def sdpa_mask_kwargs(causal: bool | str, nq: int, nk: int) -> dict:
    """scaled_dot_product_attention's arguments for a mask: is_causal for the top-left diagonal,
    torch's causal_lower_right bias for the bottom-right one (where it differs)."""
    mask = seen_mask(mask_of(causal), nq, nk)
    if mask == "causal_br":
        from torch.nn.attention.bias import causal_lower_right

        return {"attn_mask": causal_lower_right(nq, nk)}
    return {"is_causal": mask != "none"}


def expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """K or V with its heads repeated to q's (GQA), as a view where that is possible."""
    h, hk = q.shape[1], t.shape[1]
    if h == hk:
        return t
    b, _, n, d = t.shape
    return t[:, :, None].expand(b, hk, h // hk, n, d).reshape(b, h, n, d)


def reduce_kv(grad: torch.Tensor, hk: int) -> torch.Tensor:
    """The gradient of expanded K or V summed back over the query heads that share each K/V head."""
    b, h, n, d = grad.shape
    if h == hk:
        return grad
    return grad.view(b, hk, h // hk, n, d).sum(2)


def _half_dim(c: Case, limit: int) -> str | None:
    if c.dtype not in HALF:
        return f"takes fp16/bf16, not {c.dtype}"
    if c.head_dim % 8 or c.head_dim > limit:
        return f"takes head dims that are multiples of 8 up to {limit}, not {c.head_dim}"
    return None


@dataclass(frozen=True)
class Backend:
    """One of torch's attention kernels: its forward with an LSE and its backward from one."""

    name: str
    why_not: Callable[[Case], str | None]
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]   # (q, k, v, causal, scale) -> (O, LSE)
    backward: Callable[..., Grads]   # (grad_out, q, k, v, o, lse, causal, scale) -> (dq, dk, dv)
    backward_why_not: Callable[[Case], str | None] | None = None   # what its backward refuses besides

    def why_not_backward(self, c: Case) -> str | None:
        """Why the backward cannot take `c`: what the forward refuses, and what only the backward does."""
        return self.why_not(c) or (self.backward_why_not(c) if self.backward_why_not else None)


# ---- cuDNN (sm80+; on Hopper its fastest) ----

def _cudnn_why_not(c: Case) -> str | None:
    if c.cc < (8, 0):
        return "needs compute capability 8.0+"
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available"
    if c.causal and c.nq != c.nk:
        return "its causal mask with Nq != Nk is not verified here (NaN gradients were seen on the H100)"
    if c.nk < 2:
        # cuDNN refuses s_q = s_kv = 1, and after a refused graph torch's cache of them crashed
        # the process on the next call (H100, torch 2.11): never ask it for what it may refuse.
        # One query against 2 or more keys (a decode step) it runs: the searches measured it there
        # against float64, fastest at large batches on the H200 (PERF_NOTES d10).
        return "takes 2 or more keys"
    return _half_dim(c, 128)


def _cudnn_backward_why_not(c: Case) -> str | None:
    # its forward runs one query against 2 or more keys (d10), its backward there does not: dq, dk
    # and dv 0.92-0.94 off (relative) at B4-H32/kv8 x 1 x 7 keys, d=64, fp16, from a correct O and
    # LSE (H100, torch 2.11; FlashAttention-2's and the efficient backward within 4e-4 on the same)
    return "its backward takes 2 or more query rows" if c.nq < 2 else None


def _cudnn_forward(q, k, v, causal, scale):
    k, v = expand_kv(q, k), expand_kv(q, v)
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, mask_of(causal) != "none",
                                                            False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3])


def _cudnn_backward(grad, q, k, v, o, lse, causal, scale):
    # torch keeps one cuDNN graph per (shapes, q/k/v strides): O's, dO's and the LSE's layouts are
    # not in that key, so they must be the ones cuDNN's own forward gives, or a graph built for
    # another layout is reused and reads them wrongly (seen on the H100: wrong gradients, or a
    # crash). O has q's layout (dispatch.out_layout, as cuDNN's forward), dO is made O's, and the
    # LSE is (B, H, Nq, 1) as cuDNN writes it.
    hk = k.shape[1]
    ke, ve = expand_kv(q, k), expand_kv(q, v)
    if grad.stride() != o.stride():
        grad = torch.empty_strided(o.shape, o.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
    lse = lse.reshape(*q.shape[:3], 1)
    if not lse.is_contiguous():
        lse = lse.contiguous()
    empty = torch.empty(0, dtype=torch.int64, device=q.device)   # dropout's seed and offset: unused at p=0
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, ke, ve, o, lse, empty, empty, None, None, None, q.shape[2], k.shape[2], 0.0, mask_of(causal) != "none",
        scale=scale)
    return dq, reduce_kv(dk, hk), reduce_kv(dv, hk)


# ---- FlashAttention-2 (sm80+; causal only where both diagonals agree) ----

def _flash_why_not(c: Case) -> str | None:
    if c.cc < (8, 0):
        return "needs compute capability 8.0+"
    if c.causal and c.nq != c.nk and not c.bottom_right:
        return "its causal mask is the bottom-right diagonal, SDPA's the top-left: they differ where Nq != Nk"
    return _half_dim(c, 256)


def _flash_forward(q, k, v, causal, scale):
    k, v = expand_kv(q, k), expand_kv(q, v)   # its causal is the bottom-right diagonal (why_not sees to it)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, mask_of(causal) != "none", False,
                                                             scale=scale)
    return out[0], out[1]


def _flash_backward(grad, q, k, v, o, lse, causal, scale):
    hk = k.shape[1]
    ke, ve = expand_kv(q, k), expand_kv(q, v)
    empty = torch.empty(0, dtype=torch.int64, device=q.device)   # dropout's RNG state: unused at p=0
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, ke, ve, o, lse, None, None, q.shape[2], k.shape[2], 0.0, mask_of(causal) != "none", empty, empty,
        scale=scale)
    return dq, reduce_kv(dk, hk), reduce_kv(dv, hk)


# ---- memory-efficient (CUTLASS; fp32 too, either causal diagonal) ----

_TOP_LEFT, _BOTTOM_RIGHT = 1, 2   # sdp::CustomMaskType::CausalFromTopLeft, CausalFromBottomRight
_LSE_ALIGN = 32


def _mask_type(causal: bool | str) -> int:
    return {"none": 0, "causal": _TOP_LEFT, "causal_br": _BOTTOM_RIGHT}[mask_of(causal)]


def _efficient_why_not(c: Case) -> str | None:
    if c.dtype not in (torch.float32, *HALF):
        return f"takes fp32/fp16/bf16, not {c.dtype}"
    if c.head_dim % 8:
        return f"takes head dims that are multiples of 8, not {c.head_dim}"
    return None


def _efficient_forward(q, k, v, causal, scale):
    k, v = expand_kv(q, k), expand_kv(q, v)
    o, lse = torch.ops.aten._efficient_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, None, None, 0.0,
        _mask_type(causal), True, scale=scale)[:2]
    return o.transpose(1, 2), lse[:, :, : q.shape[2]]


def _efficient_backward(grad, q, k, v, o, lse, causal, scale):
    hk = k.shape[1]
    ke, ve = expand_kv(q, k), expand_kv(q, v)
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    t = lambda x: x.transpose(1, 2)   # (B, N, H, D) views
    nq = q.shape[2]
    if lse.stride(1) % _LSE_ALIGN:
        # its kernel reads the LSE in rows padded to 32, the padding too: +inf there (as its own
        # forward writes) makes those rows' probabilities 0
        padded = torch.full((*lse.shape[:2], -(-nq // _LSE_ALIGN) * _LSE_ALIGN), float("inf"), dtype=lse.dtype,
                            device=lse.device)
        lse = padded[:, :, :nq].copy_(lse)
    # its kernel reads O as (B, N, H, D) storage whatever O's strides say
    out = t(o) if t(o).is_contiguous() else t(o).contiguous()
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        t(grad), t(q), t(ke), t(ve), None, out, None, None, nq, k.shape[2], lse, 0.0, empty, empty,
        _mask_type(causal), False, scale=scale)
    return t(dq), reduce_kv(t(dk), hk), reduce_kv(t(dv), hk)


# ---- math: float32 autograd of the formula, for anything the fused kernels refuse ----

def _math_why_not(c: Case) -> str | None:
    if c.dtype not in (torch.float32, *HALF):
        return f"takes fp32/fp16/bf16, not {c.dtype}"
    return None


def _scores(q, k, causal, scale):
    s = (q.float() @ expand_kv(q, k).float().transpose(-1, -2)) * scale
    hidden = hidden_keys(q.shape[2], k.shape[2], causal, q.device)
    return s if hidden is None else s.masked_fill(hidden, float("-inf"))


def _math_forward(q, k, v, causal, scale):
    s = _scores(q, k, causal, _scale(q, scale))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse[..., None]).nan_to_num(0.0) @ expand_kv(q, v).float()
    return o.to(q.dtype), lse


def _math_backward(grad, q, k, v, o, lse, causal, scale):
    with torch.enable_grad():
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        s = _scores(qf, kf, causal, _scale(q, scale))
        out = torch.softmax(s, dim=-1).nan_to_num(0.0) @ expand_kv(qf, vf)
        dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), grad.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


CUDNN = Backend("cudnn", _cudnn_why_not, _cudnn_forward, _cudnn_backward, _cudnn_backward_why_not)
FLASH = Backend("flash", _flash_why_not, _flash_forward, _flash_backward)
EFFICIENT = Backend("efficient", _efficient_why_not, _efficient_forward, _efficient_backward)
MATH = Backend("math", _math_why_not, _math_forward, _math_backward)
def takes_problem(name: str, problem, cc: tuple[int, int]) -> bool:
    """Whether backend `name` (BACKENDS) runs `problem` on a GPU of compute capability `cc`."""
    return BACKENDS[name].why_not(Case.of_problem(problem, cc)) is None


def no_key_rows(q, k, causal: bool | str) -> int:
    """How many leading query rows see no key at all: Nq - Nk under the bottom-right mask."""
    return max(0, q.shape[2] - k.shape[2]) if mask_of(causal) == "causal_br" else 0


# Fastest first, as measured on the H100 (benchmarks/PERF_NOTES.md, "backward").
BACKENDS: dict[str, Backend] = {b.name: b for b in (CUDNN, FLASH, EFFICIENT, MATH)}
