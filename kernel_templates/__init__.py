"""Kernel families: one CUDA source and one Python spec per family."""

from __future__ import annotations

from tuner.family import KernelFamily

from .flash_fwd_simt import FAMILY as _SIMT

FAMILIES: dict[str, KernelFamily] = {f.name: f for f in (_SIMT,)}


def get_family(name: str) -> KernelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown kernel family {name!r}; known: {', '.join(FAMILIES)}") from None
