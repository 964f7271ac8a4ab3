"""flash_decode: the splits' partial results and arrival counters, one workspace per device and stream.

The kernel writes each split's O and LSE here and the last split to arrive merges them, resetting
its counter as it does (kernel_templates/flash_decode.cu), so a workspace is ready for the next
launch on its stream with no memset in between. Launches on one stream run in order; on different
streams they may overlap, so each stream has its own. A workspace only grows, and a grown-out one is
kept: a captured CUDA graph still points at it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tuner.launch import raw_stream

_lock = threading.Lock()


@dataclass
class _Workspace:
    floats: object = None      # torch float32: the splits' O, then their LSE
    counters: object = None    # torch int32, zeroed once, reset by the kernel
    retired: list = field(default_factory=list)


_spaces: dict[tuple[int, int], _Workspace] = {}


def workspace(index: int, o_floats: int, lse_floats: int, counters: int) -> tuple[int, int, int]:
    """Device pointers (the splits' O, their LSE, the arrival counters) for torch's current stream
    on device `index`, each at least as large as asked."""
    o_floats = -(-o_floats // 4) * 4   # the LSE block after O's, 16-byte aligned (O's rows are float4 stores)
    need = o_floats + lse_floats
    key = (index, raw_stream(index))
    ws = _spaces.get(key)
    if ws is None or ws.floats.numel() < need or ws.counters.numel() < counters:
        import torch

        with _lock:
            ws = _spaces.setdefault(key, _Workspace())
            dev = torch.device("cuda", index)
            if ws.floats is None or ws.floats.numel() < need:
                if ws.floats is not None:
                    ws.retired.append(ws.floats)
                ws.floats = torch.empty(max(need, 1 << 16), dtype=torch.float32, device=dev)
            if ws.counters is None or ws.counters.numel() < counters:
                if ws.counters is not None:
                    ws.retired.append(ws.counters)
                ws.counters = torch.zeros(max(counters, 1024), dtype=torch.int32, device=dev)
    base = ws.floats.data_ptr()
    return base, base + 4 * o_floats, ws.counters.data_ptr()
