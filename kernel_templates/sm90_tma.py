"""flash_fwd_sm90: tensor maps (TMA descriptors), built on the host.

The kernel takes each map by value, as a `__grid_constant__` parameter (as FlashAttention-3
passes them), so a map travels in the launch's own parameter buffer: no device memory, no
host-to-device copy, nothing to keep alive after the launch, and a CUDA graph captures the map
with the launch. Maps depend only on a tensor's address, shape, strides and the box, so they are
cached on exactly that: a hit costs one dict lookup, a miss one cuTensorMapEncodeTiled.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

TMAP_BYTES = 128
O_BOX_ROWS = 16   # a TMA-stored O box: one consumer warp's rows
NO_MAP = bytes(TMAP_BYTES)   # for a map parameter the kernel does not read
# Entries are 128-byte strings: a model's activations cycle through a bounded set of addresses
# (torch's caching allocator), and 4096 of them cost half a megabyte.
_CACHE_SIZE = 4096
_cache: OrderedDict[tuple, bytes] = OrderedDict()
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
    fast = _fast_encoder()
    if fast is not None:
        return fast(int(kind), t.data_ptr(), (d, n, h, b), strides, (box_cols, box_rows), int(swizzle))
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(        kind, 4, t.data_ptr(), [u64(x) for x in (d, n, h, b)], [u64(x) for x in strides],
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


class _CtypesEncoder:
    """cuTensorMapEncodeTiled called in the driver library through ctypes: the same function as
    cuda.bindings' wrapper, without its conversion of every argument to a Python object (about 3 us
    instead of 10 on the H100's host: a model's fresh activations each need new maps)."""

    def __init__(self, lib) -> None:
        import ctypes

        c = ctypes
        self._fn = lib.cuTensorMapEncodeTiled
        self._fn.restype = c.c_int
        self._fn.argtypes = [c.c_void_p, c.c_int, c.c_uint32, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p,
                             c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int]
        self._local = threading.local()

    def _buffers(self):
        import ctypes

        b = getattr(self._local, "b", None)
        if b is None:
            b = self._local.b = (ctypes.create_string_buffer(TMAP_BYTES + 64), (ctypes.c_uint64 * 4)(),
                                 (ctypes.c_uint64 * 3)(), (ctypes.c_uint32 * 4)(), (ctypes.c_uint32 * 4)(1, 1, 1, 1))
        return b

    def __call__(self, kind: int, address: int, dims, strides, box, swizzle: int) -> bytes:
        import ctypes

        out, gdim, gstride, boxdim, estride = self._buffers()
        gdim[:] = dims
        gstride[:] = strides
        boxdim[:] = (box[0], box[1], 1, 1)
        start = ctypes.addressof(out) + (-ctypes.addressof(out) % 64)   # a CUtensorMap is 64-byte aligned
        err = self._fn(start, kind, 4, address, gdim, gstride, boxdim, estride, 0, swizzle, _L2_256B, 0)
        if err:
            raise TmaError(f"cuTensorMapEncodeTiled failed: CUresult {err} (dims {dims}, strides {strides})")
        return ctypes.string_at(start, TMAP_BYTES)


_L2_256B = 3   # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_fast: list = []


def _fast_encoder() -> _CtypesEncoder | None:
    """The ctypes encoder where the driver library loads by name (Linux), else None."""
    if not _fast:
        from tuner.launch import driver_library

        lib = driver_library()
        _fast.append(_CtypesEncoder(lib) if lib is not None else None)
    return _fast[0]


def box_cols(t) -> int:
    """Columns of a box row: one swizzle width (128 bytes), or the whole row where it is narrower
    (64 bytes: e4m3 at d=64)."""
    return min(128 // t.element_size(), t.shape[-1])


def tensor_map(t, rows: int) -> bytes:
    """The 128-byte tensor map of a (B, H, N, D) view with boxes of `rows` x box_cols(t), cached
    on what it depends on (address, shape, strides, dtype, box): a hit is one dict lookup."""
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, rows)
    m = _cache.get(key)
    if m is None:
        m = _encode(t, rows, box_cols(t))
        with _lock:
            _cache[key] = m
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return m
