"""flashtune: search, validate, store and dispatch CUDA FlashAttention forward kernels."""

from __future__ import annotations

__all__ = ["attention"]


def __getattr__(name: str):
    # `from tuner import attention` without importing torch/cuda for the CLI's light commands.
    if name == "attention":
        from .dispatch import attention

        return attention
    raise AttributeError(f"module 'tuner' has no attribute {name!r}")
