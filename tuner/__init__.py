"""flashtune: search, validate, store and dispatch CUDA FlashAttention forward kernels."""

from __future__ import annotations

__all__ = ["attention", "kvcache_attention", "sdpa_override", "set_sdpa_override", "set_autotune", "varlen_attention"]


def __getattr__(name: str):
    # `from tuner import attention` without importing torch/cuda for the CLI's light commands.
    if name == "set_autotune":
        from .autotune import set_autotune

        value = globals()[name] = set_autotune
        return value
    if name == "kvcache_attention":
        from .kvcache import kvcache_attention

        value = globals()[name] = kvcache_attention
        return value
    if name in __all__:
        from . import op

        value = globals()[name] = getattr(op, name)   # later lookups skip this function
        return value
    raise AttributeError(f"module 'tuner' has no attribute {name!r}")
