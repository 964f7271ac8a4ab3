"""Attention on packed batches: sequences of their own lengths laid end to end (FlashAttention's
varlen API, and what training on packed samples feeds), with no padding to pay for.

q is (total_q, H, D), k and v (total_k, Hk, D); sequence b is rows [cu_seqlens_q[b],
cu_seqlens_q[b + 1]) of q and O and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v; the masks
are the dense ones, per sequence. O is (total_q, H, D), the natural-log LSE (H, total_q) in float32.

Served by a family's varlen variant (kernel_templates: flash_decode_varlen where no sequence has
more than 64 queries, else flash_fwd_sm90_varlen on Hopper, flash_fwd_mma_varlen from sm_80) at
the config the lookup holds for the padded problem's bucket (the batch, the longest lengths): the
variant's own where it was tuned (`tuner search --family <variant>`, on that bucket's
representative length mix, tuner/length_mix.py), else built from its family's, or from the
family's default. Elsewhere torch answers,
with one warning: FlashAttention-2's varlen kernel where it takes the case, else each sequence in
float32 (exact, slow: it reads the lengths on the host). Gradients: FlashAttention-2's varlen
backward on our O and LSE where it takes the case, else each sequence through float32 autograd.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from .dispatch import dtype_name
from .dispatch import default as default_dispatcher
from .launch import Launch, Launcher, LoadedKernel, kernel_scale, launch_on
from .plan_cache import DispatcherPlans
from .backward import like
from .problem import Problem, mask_of
from .records import one_line
from .torch_attention import MATH

HALF = (torch.float16, torch.bfloat16)
_GRIDS = 256   # launch geometries a plan keeps (VarlenVariant.packed_launch)


@dataclass
class _Plan:
    family: object = None   # a kernel_templates VarlenVariant, or None for torch
    params: dict | None = None
    kernel: LoadedKernel | None = None
    make_args: object = None
    reason: str = ""
    launchers: dict = field(default_factory=dict)   # grid -> Launcher


_plans = DispatcherPlans()   # (bucket, device) -> _Plan, chosen from the dispatcher's lookup
_warned: set[str] = set()


def check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k, *, cuda: bool = True) -> str:
    """Validate packed inputs (each mistake a one-line ValueError) and return the dtype's name.
    The offsets are not read (that would wait on the GPU): like FlashAttention's, they must rise
    from 0 to each tensor's length, and max_seqlen_* be at least every sequence's length."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D (total, heads, head_dim) tensor with cu_seqlens, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if cuda and t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; attention runs on CUDA tensors")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (*HALF, torch.float32):
        raise ValueError(f"q, k, v must share one of float16, bfloat16, float32: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[2] != q.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}: the head dim must match and k/v's heads divide q's")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.device != q.device:
            raise ValueError(f"{name} must be a 1-D int32 tensor on {q.device}")
        if t.numel() < 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, with one offset per sequence and the total (at least 2)")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_q.numel() - 1} sequences, cu_seqlens_k {cu_k.numel() - 1}")
    for name, n in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return dtype_name(q)


def longest(cu: torch.Tensor) -> int:
    """The longest sequence of offsets `cu` (reads them: a host sync)."""
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def padded_problem(q, k, cu_q, max_q: int, max_k: int, mask: str, dtype: str) -> Problem:
    """The dense problem these sequences are padded to: the batch at its longest lengths. Its
    bucket is the one whose tuned configs a varlen call runs."""
    return Problem(cu_q.numel() - 1, q.shape[1], max(max_q, 1), max(max_k, 1), q.shape[2], dtype, mask, k.shape[1])


def varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, mask: str = "none", scale: float | None = None,
                   need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """O (total_q, H, D) and the LSE (H, total_q) of packed sequences, after check_varlen_inputs."""
    mask = mask_of(mask)
    dtype = check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
    q, scale = kernel_scale(q, scale)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    if q.shape[0] == 0:
        return o, lse
    if k.shape[0] == 0:   # no sequence holds a key (and no map can describe an empty K): every row sees none
        return o.zero_(), lse.fill_(float("-inf"))
    problem = padded_problem(q, k, cu_q, max_q, max_k, mask, dtype)
    plan = _plan_for(problem, q)
    if plan.family is None:
        _warn(plan.reason)
        return torch_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, scale, o, lse)
    index = q.device.index or 0
    gpu = default_dispatcher()._gpu(index)
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, o)]   # (1, H, total, D)
    launch = plan.family.packed_launch(plan.params, problem, gpu, q.shape[0], k.shape[0])
    values = lambda: plan.family.varlen_values(plan.make_args, plan.params, problem, launch.grid, views, lse, scale,
                                               cu_q, cu_k, max_q, max_k)
    args = values()
    if args is None:   # misaligned rows or a strided last dim: copies the kernel reads
        views[:3] = [t.contiguous().unsqueeze(0).transpose(1, 2) for t in (q, k, v)]
        args = values()
    launch_on(_launcher(plan, launch), index, *args)
    return o, lse


def _plan_for(problem: Problem, q) -> _Plan:
    """The plan of the padded problem's bucket, made once per dispatcher (tuner.dispatch.reset,
    a new lookup, makes them again)."""
    return _plans.plan((problem.bucket().key, q.device.index or 0), lambda: _plan(problem, q.device.index or 0))


def _plan(problem: Problem, device_index: int) -> _Plan:
    """A varlen variant's own tuned config (a search of it on a length mix: the padded problem's
    bucket or the nearest tuned one), else the varlen variant of the fastest tuned config that has
    one, else of the first family's default that serves the GPU."""
    from .compile import compile_kernel
    from .dispatch import default
    from .kernel_templates import FAMILIES, VARLEN_VARIANTS

    dispatcher = default()
    gpu = dispatcher._gpu(device_index)
    chosen = next(((variant, e["params"]) for _, variant, e in dispatcher.packed_candidates(problem, gpu)), None)
    if chosen is None:
        for _, e in dispatcher.candidates(problem, gpu):
            variant = VARLEN_VARIANTS.get(e["family"])
            if variant is not None and variant.check(params := variant.from_tuned(e["params"], problem), gpu, problem) is None:
                chosen = variant, params
                break
    if chosen is None:
        for name, variant in VARLEN_VARIANTS.items():
            if variant.supports(gpu, problem) is None:
                fits = (variant.from_tuned(p, problem) for p in FAMILIES[name].seeds(gpu, problem))
                params = next((p for p in fits if variant.check(p, gpu, problem) is None), None)
                if params is not None:
                    chosen = variant, params
                    break
    if chosen is None:
        whys = "; ".join(v.supports(gpu, problem) or f"{v.name}: no config" for v in VARLEN_VARIANTS.values())
        return _Plan(reason=f"no varlen kernel for {problem.bucket().key} on {gpu.key} ({whys})")
    variant, params = chosen
    try:
        ck = compile_kernel(variant, params, problem, gpu.arch)
        kernel = LoadedKernel.load(ck, variant.smem_bytes(params, problem), device_index)
    except Exception as exc:
        return _Plan(reason=f"{variant.name} {params} cannot be used ({one_line(exc)})")
    return _Plan(variant, params, kernel, variant.arg_maker(params))


def _launcher(plan: _Plan, launch: Launch) -> Launcher:
    """The plan's launcher of this call's launch (VarlenVariant.packed_launch), one per grid."""
    launcher = plan.launchers.get(launch.grid)
    if launcher is None:
        if len(plan.launchers) >= _GRIDS:
            plan.launchers.clear()
        launcher = plan.launchers[launch.grid] = plan.kernel.launcher(launch, plan.family.param_kinds(plan.params))
    return launcher


def _warn(message: str) -> None:
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(f"flashtune: {message}; using torch's attention per packed batch", stacklevel=3)


# ---- torch: FlashAttention-2's varlen kernels where they take the case, else per sequence ----

def _fa2_takes(q, cu_q, cu_k, mask: str) -> bool:
    """Whether torch's FlashAttention-2 varlen kernels run this case: fp16/bf16, sm80+, d <= 256 in
    multiples of 8, and a mask it has (its causal is bottom-right: top-left only where every
    sequence's query and key lengths agree, which equal offsets guarantee)."""
    if q.device.type != "cuda" or q.dtype not in HALF or q.shape[2] % 8 or q.shape[2] > 256:
        return False
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return False
    return mask != "causal" or cu_q is cu_k or torch.equal(cu_q, cu_k)


def torch_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, scale, o=None, lse=None):
    """torch's answer: O (total_q, H, D) and LSE (H, total_q), rows that see no key O = 0 and
    LSE = -inf."""
    if _fa2_takes(q, cu_q, cu_k, mask):
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, mask != "none", False,
                                                      scale=scale)
        o_, lse_ = out[0], out[1]
        lse_ = lse_.masked_fill(lse_ == float("inf"), float("-inf"))   # FA2's rows with no key
        if o is None:
            return o_, lse_
        return o.copy_(o_), lse.copy_(lse_)
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device) if lse is None else lse
    for (a, b), (c, d) in _spans(cu_q, cu_k):
        if b == a:
            continue
        oi, li = MATH.forward(*(_dense(t) for t in (q[a:b], k[c:d], v[c:d])), mask, scale)
        o[a:b], lse[:, a:b] = _packed(oi), li[0]
    return o, lse


def _spans(cu_q, cu_k):
    qs, ks = cu_q.tolist(), cu_k.tolist()
    return [((qs[i], qs[i + 1]), (ks[i], ks[i + 1])) for i in range(len(qs) - 1)]


def _dense(t):
    """One sequence's (n, H, D) rows as the (1, H, n, D) view torch's math attention takes."""
    return t.transpose(0, 1)[None]


def _packed(t):
    """A (1, H, n, D) result back as (n, H, D) rows."""
    return t[0].transpose(0, 1)


def varlen_backward(grad, q, k, v, o, lse, cu_q, cu_k, max_q: int, max_k: int, mask: str, scale):
    """dq, dk, dv of packed attention whose forward gave O and the LSE (H, total_q): torch's
    FlashAttention-2 varlen backward where it takes the case (rows with no key reach it with LSE
    +inf, its convention), else each sequence through float32 autograd."""
    if q.dtype == torch.float8_e4m3fn:
        from .backward import NoBackwardError

        raise NoBackwardError("no attention backward for float8_e4m3fn inputs")
    if q.shape[0] == 0 or k.shape[0] == 0:   # nothing attended: nothing flows
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if _fa2_takes(q, cu_q, cu_k, mask):
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, o, lse, cu_q, cu_k, max_q, max_k, 0.0, mask != "none", empty, empty,
            scale=scale)[:3]
        return like(q, dq), like(k, dk), like(v, dv)   # the layouts the operator's fake promises
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (a, b), (c, d) in _spans(cu_q, cu_k):
        if b == a or d == c:
            continue
        grads = MATH.backward(_dense(grad[a:b]), *(_dense(t) for t in (q[a:b], k[c:d], v[c:d])), None, None, mask, scale)
        dq[a:b], dk[c:d], dv[c:d] = (_packed(g) for g in grads)
    return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    """Packed attention with gradients (eager; torch.compile runs the flashtune::attention_varlen op)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, mask, scale):
        o, lse = varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, scale)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, mask, scale)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, _grad_lse):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, mask, scale = ctx.args
        dq, dk, dv = varlen_backward(grad_o, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, mask, scale)
        return dq, dk, dv, None, None, None, None, None, None


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, *, mask: str | bool = "none", scale: float | None = None,
                     return_lse: bool = False):
    """Attention of packed sequences: q (total_q, H, D), k and v (total_k, Hk, D), int32 offsets
    cu_seqlens_q and cu_seqlens_k (B + 1, from 0 to each total; the same tensor for self-attention),
    the longest lengths max_seqlen_q and max_seqlen_k (None: read from the offsets, which waits on
    the GPU). `mask` per sequence: "none", "causal" (top-left, as SDPA's is_causal) or "causal_br"
    (bottom-right: a sequence's queries are its last keys' positions). O is (total_q, H, D) in q's
    dtype, and with `return_lse` the natural-log LSE (H, total_q). Gradients flow to q, k and v."""
    mask = mask_of(mask)
    if max_seqlen_q is None:
        max_seqlen_q = longest(cu_seqlens_q)
    if max_seqlen_k is None:
        max_seqlen_k = longest(cu_seqlens_k)
    if torch.compiler.is_compiling():
        o, lse = torch.ops.flashtune.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                      mask, scale)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, scale)
    else:
        o, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, scale)
    return (o, lse) if return_lse else o
