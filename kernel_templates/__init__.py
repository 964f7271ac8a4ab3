"""Kernel families: one CUDA source and one Python spec per family, and the host-side helpers only
one family uses beside it (sm90_tma.py, sm90_tile_counter.py: flash_fwd_sm90's).

Extra families (test-only faulty kernels, out-of-tree experiments) are plugged in through the
environment: TUNER_EXTRA_FAMILIES names importable modules, comma-separated, each exposing FAMILY
(one KernelFamily) or FAMILIES (a list or dict of them). A worker process is spawned with the same
environment, so `get_family` finds them there too.
"""

from __future__ import annotations

import importlib
import os

from tuner.family import KernelFamily

from .flash_decode import CLUSTER_FAMILY as _DECODE_CLUSTER
from .flash_decode import FAMILY as _DECODE
from .flash_decode import VARLEN_FAMILY as _DECODE_VARLEN
from .flash_fwd_mma import FAMILY as _MMA
from .flash_fwd_mma import VARLEN_FAMILY as _MMA_VARLEN
from .flash_fwd_sm90 import FAMILY as _SM90
from .flash_fwd_sm90 import VARLEN_FAMILY as _SM90_VARLEN
from .flash_fwd_sm90_gqa import FAMILY as _SM90_GQA
from .flash_fwd_sm90_pairs import FAMILY as _SM90_PAIRS
from .flash_fwd_sm90_split import FAMILY as _SM90_SPLIT
from .flash_fwd_sm90_tail import FAMILY as _SM90_TAIL
from .flash_fwd_simt import FAMILY as _SIMT

FAMILIES: dict[str, KernelFamily] = {f.name: f for f in (_SIMT, _MMA, _SM90, _SM90_SPLIT, _SM90_TAIL, _SM90_PAIRS,
                                                         _SM90_GQA, _DECODE, _DECODE_CLUSTER)}
# Each family's variant on packed sequences (tuner/varlen.py), made from its tuned configs unless a
# search tuned it by name (never under `auto`). In order of preference for a default: decode for
# short queries, then prefill.
VARLEN_VARIANTS: dict[str, KernelFamily] = {_DECODE.name: _DECODE_VARLEN, _SM90.name: _SM90_VARLEN, _MMA.name: _MMA_VARLEN}
# The same by their own names: a search may tune one by name (packed, on a representative length mix)
# and its entries name it.
VARIANTS_BY_NAME: dict[str, KernelFamily] = {v.name: v for v in VARLEN_VARIANTS.values()}
EXTRA_ENV = "TUNER_EXTRA_FAMILIES"


def times_a_length_mix(name: str) -> bool:
    """Whether `name`'s stored timings are of packed batches: a varlen variant tuned by name, whose
    TFLOP/s count its padded problem's length mix's useful work, so that no dense run of the padded
    problem (a dense family's, a peer's) ranks beside them."""
    return name in VARIANTS_BY_NAME


def _load_extra(spec: str) -> None:
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"{EXTRA_ENV}: cannot import {name!r}: {exc}") from None
        found = getattr(mod, "FAMILIES", None)
        if found is None and hasattr(mod, "FAMILY"):
            found = [mod.FAMILY]
        if isinstance(found, dict):
            found = list(found.values())
        if not found or not all(isinstance(f, KernelFamily) for f in found):
            raise ValueError(f"{EXTRA_ENV}: module {name!r} exposes no FAMILY or FAMILIES of KernelFamily")
        for f in found:
            FAMILIES.setdefault(f.name, f)


_load_extra(os.environ.get(EXTRA_ENV, ""))


def configs_family(name: str) -> str:
    """The family whose configs `name` runs: itself, or the one it serves in another form
    (KernelFamily.configs_of); a name no family has (an SDPA backend's) as it is."""
    found = FAMILIES.get(name)
    return (found.configs_of or name) if found else name


def get_family(name: str) -> KernelFamily:
    """A family, or a varlen variant, by name."""
    found = FAMILIES.get(name) or VARIANTS_BY_NAME.get(name)
    if found is None:
        raise ValueError(f"unknown kernel family {name!r}; known: {', '.join([*FAMILIES, *VARIANTS_BY_NAME])}")
    return found
