"""The attention backward: gradients of q, k, v from the forward's O and LSE.

One seam, so that a tuned backward kernel of our own can take over later: today every call goes
to the fastest of torch's backward kernels that takes the case (tuner/torch_attention.py), in the
order of BACKENDS, or to the one TUNER_BACKWARD names. A case no backend takes raises: a gradient
is never dropped.
"""

from __future__ import annotations

import os

import torch

from .torch_attention import BACKENDS, Backend, Case, Grads, no_key_rows

ENV = "TUNER_BACKWARD"


class NoBackwardError(RuntimeError):
    """No backward kernel takes this case (fp8 inputs, say)."""


def choose(case: Case, order: tuple[str, ...] | None = None) -> Backend:
    """The first backend (in `order`, default TUNER_BACKWARD or BACKENDS' order) that takes `case`."""
    names = order or _order()
    reasons = []
    for name in names:
        backend = BACKENDS[name]
        why = backend.why_not_backward(case)
        if why is None:
            return backend
        reasons.append(f"{name} {why}")
    raise NoBackwardError(f"no attention backward for {case.dtype}, d={case.head_dim}: " + "; ".join(reasons))


def _order() -> tuple[str, ...]:
    forced = os.environ.get(ENV)
    if not forced:
        return tuple(BACKENDS)
    if forced not in BACKENDS:
        raise ValueError(f"{ENV}={forced!r}: must be one of {', '.join(BACKENDS)}")
    return (forced,)


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor, causal: bool | str, scale: float | None) -> Grads:
    """dq, dk, dv (each with its input's shape, dtype and strides) of attention whose forward gave
    O and the natural-log LSE (B, H, Nq) on q, k, v; `causal` is a mask (a bool: SDPA's is_causal).
    Rows that saw no key (bottom-right, Nq > Nk) have dq = 0 and give nothing to dk and dv; the
    others are a square causal problem, on which every backend's diagonal agrees, so that alone
    runs (copied to fresh tensors: cuDNN's graphs assume the layouts its own forward gives)."""
    if empty := no_key_rows(q, k, causal):
        seen = [t[:, :, empty:].contiguous() for t in (grad_out, q, o, lse)]
        dq_seen, dk, dv = attention_backward(seen[0], seen[1], k, v, seen[2], seen[3], "causal", scale)
        dq = torch.zeros_like(q)
        dq[:, :, empty:] = dq_seen
        return dq, like(k, dk), like(v, dv)
    backend = choose(Case.of(q, k, causal))
    dq, dk, dv = backend.backward(grad_out, q, k, v, o, lse, causal, scale)
    return like(q, dq), like(k, dk), like(v, dv)


def like(ref: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`grad` laid out as torch.empty_like(ref) is, which is what the op's fake implementation
    promises the compiler (a copy only where the backend chose another layout)."""
    out = torch.empty_like(ref)
    if grad.stride() == out.stride() and grad.dtype == out.dtype:
        return grad
    return out.copy_(grad)
