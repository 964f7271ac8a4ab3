"""Which GPU we are tuning for: detection and the spec every result is keyed by."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict, dataclass


class NoGpuError(RuntimeError):
    """Raised where a GPU is needed and none is visible; the CLI prints it as one line."""


@dataclass(frozen=True)
class GpuSpec:
    name: str
    major: int
    minor: int
    sm_count: int
    smem_per_block_optin: int  # bytes a block may have once its dynamic limit is raised
    smem_per_sm: int
    regs_per_sm: int
    l2_bytes: int
    memory_bytes: int
    index: int = 0

    @property
    def cc(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def arch(self) -> str:
        """The NVRTC target: sm_90a on Hopper so that wgmma/setmaxnreg are available."""
        a = f"sm_{self.major}{self.minor}"
        return a + "a" if (self.major, self.minor) == (9, 0) else a

    @property
    def key(self) -> str:
        """Same model shares results, another model never silently does."""
        return f"{re.sub(r'[^A-Za-z0-9.]+', '-', self.name).strip('-')}/sm_{self.major}{self.minor}"

    def to_dict(self) -> dict:
        return asdict(self)


# Reference specs for tests and for compiling without a GPU (public datasheet figures).
H100_SXM = GpuSpec("NVIDIA H100 80GB HBM3", 9, 0, 132, 232448, 233472, 65536, 50 * 2**20, 80 * 2**30)
A100_SXM = GpuSpec("NVIDIA A100-SXM4-80GB", 8, 0, 108, 166912, 167936, 65536, 40 * 2**20, 80 * 2**30)


def visible() -> list[GpuSpec]:
    if why_none() is not None:
        return []
    import torch

    return [_from_torch(i) for i in range(torch.cuda.device_count())]


def why_none() -> str | None:
    """Why no CUDA GPU is visible, in a few words; None where one is. The driver and
    CUDA_VISIBLE_DEVICES are asked first: a machine without a GPU then says so without importing
    torch (seconds)."""
    import ctypes

    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return "CUDA_VISIBLE_DEVICES hides every device"
    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return "no NVIDIA driver: libcuda does not load"
    import torch

    return None if torch.cuda.is_available() else "torch.cuda.is_available() is False"


def _from_torch(index: int) -> GpuSpec:
    import torch

    p = torch.cuda.get_device_properties(index)
    return GpuSpec(
        name=p.name,
        major=p.major,
        minor=p.minor,
        sm_count=p.multi_processor_count,
        smem_per_block_optin=int(getattr(p, "shared_memory_per_block_optin", 49152)),
        smem_per_sm=int(getattr(p, "shared_memory_per_multiprocessor", 0)),
        regs_per_sm=int(getattr(p, "regs_per_multiprocessor", 65536)),
        l2_bytes=int(getattr(p, "L2_cache_size", 0)),
        memory_bytes=int(p.total_memory),
        index=index,
    )


def detect(which: str = "auto") -> GpuSpec:
    """`auto` is the current CUDA device; an integer picks a visible index."""
    gpus = visible()
    if not gpus:
        raise NoGpuError(
            f"no CUDA GPU is visible ({why_none()}): "
            "tuning needs an NVIDIA GPU; `tuner gpus` lists what is seen"
        )
    if which == "auto":
        import torch

        return gpus[torch.cuda.current_device()]
    try:
        index = int(which)
    except ValueError:
        raise ValueError(f"--gpu must be 'auto' or a GPU index, got {which!r}") from None
    if not 0 <= index < len(gpus):
        raise ValueError(f"--gpu {index}: only {len(gpus)} GPU(s) visible (indices 0..{len(gpus) - 1})")
    return gpus[index]
