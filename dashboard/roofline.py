"""Measured ceilings per GPU model and the roofline they draw.

Datasheet peaks are not reachable; these are what docs/benchmarks.md records as measured on the card, so a point
near a ceiling really is near the limit. Keyed by a substring of the GPU's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Ceilings:
    tflops: dict[str, float] = field(hash=False)  # dtype -> dense matrix-product TFLOP/s
    memory_tbps: float
    source: str


# H100 SXM, measured 2026-11-22 (docs/benchmarks.md): fp32 without TF32, dense bf16, device copy.
CEILINGS: dict[str, Ceilings] = {
    "H100": Ceilings({"fp32": 52.0, "bf16": 684.0}, 3.0, "docs/benchmarks.md, measured on H100 SXM 2026-11-22"),
}


def ceilings_for(gpu_name: str) -> Ceilings | None:
    for sub, c in CEILINGS.items():
        if sub.lower() in gpu_name.lower():
            return c
    return None


def roof(c: Ceilings, dtype: str, intensity: np.ndarray) -> np.ndarray | None:
    """Attainable TFLOP/s at each arithmetic intensity (FLOP/byte): min(compute, bandwidth x AI)."""
    peak = c.tflops.get(dtype)
    if peak is None:
        return None
    return np.minimum(peak, c.memory_tbps * intensity)
