"""Tensor maps (TMA descriptors) for the Hopper family, built on the host and kept in device memory.

A kernel reads its maps through a pointer rather than as `__grid_constant__` parameters, so any
cuda.core that can launch the other families can launch this one. Maps depend only on a tensor's
address, shape, strides and the box, so they are cached on exactly that: a hit costs one dict
lookup, a miss one 128-byte host-to-device copy per tensor.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

TMAP_BYTES = 128
O_BOX_ROWS = 16   # a TMA-stored O box: one consumer warp's rows
# Eviction frees a buffer through torch's allocator, which is ordered on the stream it was made
# on: a kernel on another stream still reading an evicted map is not protected. 256 entries keep
# that to workloads cycling through more live shapes and tensors than that.
_CACHE_SIZE = 256
_cache: OrderedDict[tuple, object] = OrderedDict()
_lock = threading.Lock()


class TmaError(ValueError):
    """The tensor cannot be described by a tensor map (dtype, alignment, strides)."""


def _data_type(dtype):
    """The tensor map's element type for a torch dtype. e4m3 goes as UINT8: the map only moves
    bytes (and fills out-of-bounds rows with zeros, which is 0.0 in e4m3 too)."""
    import torch
    from cuda.bindings import driver

    kinds = {torch.bfloat16: "BFLOAT16", torch.float16: "FLOAT16", torch.float8_e4m3fn: "UINT8"}
    if dtype not in kinds:
        raise TmaError(f"no tensor map for {dtype} inputs; TMA families take {', '.join(map(str, kinds))}")
    return getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{kinds[dtype]}")


def _encode(t, box_rows: int, box_cols: int) -> bytes:
    """One map over a (B, H, N, D) view: dims (D, N, H, B) innermost first, a box of
    [box_rows x box_cols] elements, swizzled as wide as a box row (128 bytes: 64 16-bit or 128 e4m3
    columns; 64 bytes: e4m3 at d=64), rows past N read as zeros."""
    from cuda.bindings import driver

    kind = _data_type(t.dtype)
    b, h, n, d = t.shape
    esize = t.element_size()
    swizzle = {128: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
               64: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B}.get(box_cols * esize)
    if swizzle is None:
        raise TmaError(f"a box row must be 64 or 128 bytes, not {box_cols} x {esize}")
    if t.stride(3) != 1:
        raise TmaError("the last dimension must be contiguous")
    strides = [t.stride(2) * esize, t.stride(1) * esize, t.stride(0) * esize]
    if t.data_ptr() % 16 or any(s % 16 for s in strides):
        raise TmaError(f"TMA needs 16-byte aligned data and strides, got {t.data_ptr() % 16} / {strides}")
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        kind, 4, t.data_ptr(), [u64(x) for x in (d, n, h, b)], [u64(x) for x in strides],
        [u32(x) for x in (box_cols, box_rows, 1, 1)], [u32(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzle,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise TmaError(f"cuTensorMapEncodeTiled failed: {err.name} (shape {tuple(t.shape)}, strides {strides})")
    words = tmap.opaque
    return b"".join(int(w).to_bytes(8, "little") for w in words)


def _key(t, rows: int) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, rows)


def box_cols(t) -> int:
    """Columns of a box row: one swizzle width (128 bytes), or the whole row where it is narrower
    (64 bytes: e4m3 at d=64)."""
    return min(128 // t.element_size(), t.shape[-1])


def attention_maps(q, k, v, q_rows: int, kv_rows: int, o=None):
    """A device buffer holding the maps of q, k and v back to back (3 x 128 bytes), then O's where
    given: boxes of 16 rows x 64 columns (one consumer warp's slab of a 16-bit O, TMA-stored)."""
    key = (_key(q, q_rows), _key(k, kv_rows), _key(v, kv_rows), q.device.index,
           None if o is None else _key(o, O_BOX_ROWS))
    with _lock:
        buf = _cache.get(key)
        if buf is not None:
            _cache.move_to_end(key)
            return buf
    import torch

    cols = box_cols(q)
    raw = _encode(q, q_rows, cols) + _encode(k, kv_rows, cols) + _encode(v, kv_rows, cols)
    if o is not None:
        raw += _encode(o, O_BOX_ROWS, box_cols(o))
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(q.device)
    with _lock:
        _cache[key] = buf
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return buf
