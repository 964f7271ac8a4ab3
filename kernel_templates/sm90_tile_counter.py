"""flash_fwd_sm90: work counters for the persistent kernels' dynamic tile scheduler, one per device and stream.

Launches on one stream run in order, so a counter that the kernel resets as it finishes
(kernel_templates/tile_scheduler.cuh) is ready for the next launch with no memset in between;
launches on different streams may overlap, so each stream has its own.
"""

from __future__ import annotations

import threading

from tuner.launch import raw_stream

_counters: dict[tuple[int, int], object] = {}
_pointers: dict[tuple[int, int], int] = {}
_lock = threading.Lock()


def tile_counter(device):
    """Two zeroed int32 words on `device` for torch's current stream there (made on first use)."""
    import torch

    key = (device.index, raw_stream(device.index))
    buf = _counters.get(key)
    if buf is None:
        with _lock:
            buf = _counters.get(key)
            if buf is None:
                buf = _counters[key] = torch.zeros(2, dtype=torch.int32, device=device)
                _pointers[key] = buf.data_ptr()
    return buf


def tile_counter_ptr(device_index: int) -> int:
    """tile_counter's device address on device `device_index` (the launch's hot path: one
    dictionary lookup once made)."""
    ptr = _pointers.get((device_index, raw_stream(device_index)))
    if ptr is None:
        import torch

        ptr = tile_counter(torch.device("cuda", device_index)).data_ptr()
    return ptr
