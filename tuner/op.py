"""`attention` as a PyTorch operator: `torch.ops.flashtune.attention`, with a fake implementation
(so torch.compile traces through it without a graph break) and autograd (the backward seam,
tuner/backward.py), usable under CUDA-graph capture; and `sdpa_override`, which routes a model's
own `F.scaled_dot_product_attention` calls here.

Eager calls skip the operator dispatcher: without gradients `attention` calls the dispatcher
directly, with them an autograd.Function around the same forward and backward. Going through
`torch.ops` costs 10-50 us of host time per call (measured on the CPU: a Python kernel behind the
dispatcher, more with its autograd), as much as a short kernel's whole GPU time. Under
torch.compile the call is the registered operator, which the compiler traces by its fake.
"""

from __future__ import annotations

import threading
import warnings

import torch

from .backward import attention_backward
from .dispatch import default as _dispatcher
from .dispatch import out_layout
from .torch_attention import sdpa_mask_kwargs
from .kvcache import check_cache_inputs, kvcache_forward
from .varlen import check_varlen_inputs, varlen_attention, varlen_backward, varlen_forward

LIB = "flashtune"
_lib = torch.library.Library(LIB, "DEF")
# bottom_right: with is_causal, the diagonal is the bottom-right one (a KV cache: query i sees keys
# j <= i + Nk - Nq) instead of SDPA's top-left; without is_causal it means nothing.
_lib.define("attention(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None, "
            "float? max_error=None, bool need_lse=True, bool bottom_right=False) -> (Tensor, Tensor)")
_lib.define("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "bool is_causal, float? scale, bool bottom_right=False) -> (Tensor, Tensor, Tensor)")
# packed sequences (tuner/varlen.py): q (total_q, H, D), O the same, the LSE (H, total_q)
_lib.define("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
            "int max_seqlen_q, int max_seqlen_k, str mask='none', float? scale=None) -> (Tensor, Tensor)")
# decode against a KV cache (tuner/kvcache.py), inference only: O as q's layout, the LSE (B, H, Nq)
_lib.define("kvcache_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cache_seqlens, Tensor? block_table, "
            "str mask='causal_br', float? scale=None) -> (Tensor, Tensor)")
_lib.define("attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, str mask, float? scale) "
            "-> (Tensor, Tensor, Tensor)")


def op_mask(is_causal: bool, bottom_right: bool = False) -> str:
    """The problem mask the op's two flags spell."""
    return ("causal_br" if bottom_right else "causal") if is_causal else "none"


def _forward(q, k, v, is_causal=False, scale=None, max_error=None, need_lse=True, bottom_right=False):
    return _dispatcher().forward(q, k, v, op_mask(is_causal, bottom_right), scale, max_error, need_lse)


def _backward(grad_out, q, k, v, out, lse, is_causal, scale, bottom_right=False):
    return attention_backward(grad_out, q, k, v, out, lse, op_mask(is_causal, bottom_right), scale)


_lib.impl("attention", _forward, "CUDA")
_lib.impl("attention_backward", _backward, "CUDA")
_lib.impl("attention_varlen", varlen_forward, "CUDA")
_lib.impl("kvcache_attention", kvcache_forward, "CUDA")
_lib.impl("attention_varlen_backward", varlen_backward, "CUDA")


@torch.library.register_fake(f"{LIB}::attention")
def _attention_fake(q, k, v, is_causal=False, scale=None, max_error=None, need_lse=True, bottom_right=False):
    from .dispatch import check_inputs
    from .problem import OUT_DTYPE, torch_dtype

    # bad input fails at trace time, as it would at run time; the device is the dispatcher's to refuse
    dtype = check_inputs(q, k, v, max_error, cuda=False)
    size, stride = out_layout(q)
    return (torch.empty_strided(size, stride, dtype=torch_dtype(OUT_DTYPE.get(dtype, dtype)), device=q.device),
            q.new_empty(size[:3], dtype=torch.float32))


@torch.library.register_fake(f"{LIB}::attention_backward")
def _attention_backward_fake(grad_out, q, k, v, out, lse, is_causal, scale, bottom_right=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, _max_error, need_lse, bottom_right = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal, ctx.scale, ctx.need_lse, ctx.bottom_right = is_causal, scale, need_lse, bottom_right
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, grad_o, _grad_lse):
    if not ctx.need_lse:
        raise RuntimeError("flashtune::attention was called with need_lse=False, so it kept no LSE for the backward")
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashtune.attention_backward(grad_o, q, k, v, o, lse, ctx.is_causal, ctx.scale,
                                                        ctx.bottom_right)
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd(f"{LIB}::attention", _autograd_backward, setup_context=_setup_context)


@torch.library.register_fake(f"{LIB}::attention_varlen")
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask="none", scale=None):
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cuda=False)
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((q.shape[1], q.shape[0]),
                                                                                    dtype=torch.float32)


@torch.library.register_fake(f"{LIB}::attention_varlen_backward")
def _attention_varlen_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, mask, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake(f"{LIB}::kvcache_attention")
def _kvcache_attention_fake(q, k_cache, v_cache, cache_seqlens=None, block_table=None, mask="causal_br", scale=None):
    check_cache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, cuda=False)
    size, stride = out_layout(q)
    return torch.empty_strided(size, stride, dtype=q.dtype, device=q.device), q.new_empty(size[:3], dtype=torch.float32)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, mask, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.args = (max_q, max_k, mask, scale)
    ctx.mark_non_differentiable(output[1])


def _varlen_autograd_backward(ctx, grad_o, _grad_lse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashtune.attention_varlen_backward(grad_o, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd(f"{LIB}::attention_varlen", _varlen_autograd_backward,
                                setup_context=_varlen_setup_context)


class _Attention(torch.autograd.Function):
    """The eager path with gradients: the op's forward and backward without the dispatcher's cost."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, max_error):
        o, lse = _forward(q, k, v, mask != "none", scale, max_error, True, mask == "causal_br")
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask, ctx.scale = mask, scale
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(grad_o, q, k, v, o, lse, ctx.mask, ctx.scale)
        return dq, dk, dv, None, None, None


_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(message: str) -> None:
    if torch.compiler.is_compiling():   # dynamo cannot trace warnings.warn; the eager call has said it
        return
    with _warn_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(f"flashtune: {message}", stacklevel=3)


def attention(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, causal: bool | None = None, mask: str | None = None,
              max_error: float | None = None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None):
    """Attention on CUDA tensors of shape (B, H, N, D), as torch.nn.functional.scaled_dot_product_attention.

    Computed by the best tuned kernel for this GPU and shape bucket, or by torch's attention (with
    one warning; on bf16 copies of fp8 inputs) where nothing tuned fits or no kernel takes the head
    dim. K/V may have fewer heads (GQA; `enable_gqa` is accepted and not required). `is_causal` is
    SDPA's: the top-left diagonal, key j visible to query i where j <= i (`causal=` is the older
    spelling). `mask="causal_br"` (or "bottom_right") is the bottom-right diagonal, key j visible
    to query i where j <= i + Nk - Nq, as a KV cache or a chunked prefill needs (torch's
    causal_lower_right; the two differ only where Nq != Nk); query rows that see no key (Nq > Nk)
    are 0. `mask` also takes "none" and "causal" (problem.MASK_TOKENS: what `--shape` takes). `attn_mask` and `dropout_p` go to SDPA
    itself, with one warning. Gradients flow to q, k and v (fp8 has none).
    `max_error` picks configs tuned under that error budget (`tuner search --max-error`): for fp32
    inputs, the tf32 or bf16 tensor-core kernels. O has q's dtype (bf16 for float8_e4m3fn inputs)
    and, like SDPA's, q's layout: (B, N, H, D) storage where q is such a view.
    With `cu_seqlens_q` and `cu_seqlens_k` (int32, B + 1 offsets), q, k, v are packed sequences,
    (total, H, D) as FlashAttention's varlen API takes them, each masked on its own
    (tuner.varlen_attention, which says more); O is (total_q, H, D).
    """
    if isinstance(attn_mask, str):   # SDPA's fourth argument; the dispatcher's call takes a mask name there
        raise ValueError(f"attn_mask takes a tensor; a mask name goes in mask= (mask={attn_mask!r})")
    if causal is not None:
        if is_causal and not causal:
            raise ValueError("is_causal=True and causal=False disagree: pass one of them")
        is_causal = bool(causal)
    chosen = _mask(is_causal, mask)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("packed sequences take both cu_seqlens_q and cu_seqlens_k (the same tensor for self-attention)")
        if attn_mask is not None or dropout_p or max_error is not None:
            raise ValueError("packed sequences (cu_seqlens) take no attn_mask, dropout_p or max_error")
        return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask=chosen, scale=scale)
    if attn_mask is not None or dropout_p:
        what = "an attn_mask" if attn_mask is not None else "dropout"
        if attn_mask is not None and chosen == "causal_br":
            raise ValueError("attn_mask and mask='causal_br' exclude each other: pass one of them")
        _warn_once(f"{what} is not served by flashtune's kernels; using torch scaled_dot_product_attention")
        kw = sdpa_mask_kwargs(chosen, q.shape[-2], k.shape[-2]) if attn_mask is None else \
            {"attn_mask": attn_mask, "is_causal": is_causal}
        return _sdpa(q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa or _gqa(q, k), **kw)
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if torch.compiler.is_compiling():
        return torch.ops.flashtune.attention(q, k, v, chosen != "none", scale, max_error, grads,
                                             chosen == "causal_br")[0]
    if grads:
        if q.dtype == torch.float8_e4m3fn:
            raise ValueError("no backward for float8_e4m3fn inputs: call attention under torch.no_grad()")
        return _Attention.apply(q, k, v, chosen, scale, max_error)
    return _dispatcher().output(q, k, v, chosen, scale, max_error)


def _mask(is_causal: bool, mask: str | None) -> str:
    """The problem mask of attention's arguments: `mask` (a MASK_TOKENS word) where given, else
    SDPA's is_causal; both given must agree."""
    if mask is None:
        return "causal" if is_causal else "none"
    from .problem import MASK_TOKENS

    chosen = MASK_TOKENS.get(mask.lower()) if isinstance(mask, str) else None
    if chosen is None:
        raise ValueError(f"mask must be one of none, causal, causal_br (or bottom_right, top_left), got {mask!r}")
    if is_causal and chosen != "causal":
        raise ValueError(f"is_causal=True (the top-left diagonal) and mask={mask!r} disagree: pass one of them")
    return chosen


def _gqa(q, k) -> bool:
    return q.dim() == k.dim() >= 3 and q.shape[-3] != k.shape[-3]


# ---- routing a model's own SDPA calls ----

_sdpa = torch.nn.functional.scaled_dot_product_attention   # torch's, whatever the switch says
_override_depth = 0
_override_lock = threading.Lock()


def _served(q, k, v) -> str | None:
    """Why a call to SDPA stays with SDPA (None: flashtune takes it)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "inputs are not tensors"
    if q.is_nested or k.is_nested or v.is_nested:   # (attention takes packed sequences as cu_seqlens)
        return "nested (jagged) tensors"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"inputs are {q.dim()}-D; flashtune takes (B, H, N, D)"
    if q.device.type != "cuda":
        return f"inputs on {q.device}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}"
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        return "shapes flashtune does not take (a value head dim unlike the key's, say)"
    from .dispatch import takes_head_dim

    if not takes_head_dim(q.shape[3]):
        return f"head dim {q.shape[3]}"
    if 0 in (*q.shape, *k.shape):   # an empty microbatch: what SDPA gives (None on torch 2.11's CUDA)
        return "empty inputs"
    return None


def routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention while `sdpa_override` is on: flashtune for what it serves."""
    why = _served(query, key, value)
    if why is None and attn_mask is None and not dropout_p:
        return attention(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if why is not None:
        _warn_once(f"an SDPA call stays with torch ({why})")
        kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return _sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def set_sdpa_override(enabled: bool) -> None:
    """Route torch.nn.functional.scaled_dot_product_attention through flashtune (True) or not."""
    global _override_depth
    with _override_lock:
        _override_depth = 1 if enabled else 0
        torch.nn.functional.scaled_dot_product_attention = routed_sdpa if enabled else _sdpa


class sdpa_override:
    """`with tuner.sdpa_override(): model(x)`: the model's own SDPA calls run flashtune's kernels
    where they can (tuned or not, as `attention` does) and torch's SDPA elsewhere; nests, and puts
    SDPA back on leaving the outermost block."""

    def __enter__(self) -> "sdpa_override":
        global _override_depth
        with _override_lock:
            _override_depth += 1
            torch.nn.functional.scaled_dot_product_attention = routed_sdpa
        return self

    def __exit__(self, *exc) -> None:
        global _override_depth
        with _override_lock:
            _override_depth = max(0, _override_depth - 1)
            if _override_depth == 0:
                torch.nn.functional.scaled_dot_product_attention = _sdpa
