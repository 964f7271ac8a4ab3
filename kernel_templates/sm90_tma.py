"""flash_fwd_sm90: tensor maps (TMA descriptors), built on the host.

The kernel takes each map by value, as a `__grid_constant__` parameter (as FlashAttention-3
passes them), so a map travels in the launch's own parameter buffer: no device memory, no
host-to-device copy, nothing to keep alive after the launch, and a CUDA graph captures the map
with the launch.

A map depends on a tensor's address, shape, strides and the box. A model's activations come at
new addresses every step, and one cuTensorMapEncodeTiled costs 3-10 us, so a geometry (all but
the address) is encoded once and a new address is patched into its map: the driver's encoding of
the address is learnt from encodings at other addresses and must reproduce further encodings
exactly before any patched map is used (`AddressField`); where it does not (an unknown driver's
layout) every new address is encoded, through a cache keyed on it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from tuner.family import padded_head_dim

TMAP_BYTES = 128
O_BOX_ROWS = 16   # a TMA-stored O box: one consumer warp's rows
NO_MAP = bytes(TMAP_BYTES)   # for a map parameter the kernel does not read
# Maps by address: 128-byte strings, 4096 of them half a megabyte.
_CACHE_SIZE = 4096
_cache: OrderedDict[tuple, bytes] = OrderedDict()
_lock = threading.Lock()
# What an L2 miss of a box row fetches beyond it (cuTensorMapEncodeTiled's l2Promotion: 0 none, 1 64 B,
# 2 128 B, 3 256 B). Read into each geometry, so that maps encoded at another setting
# (benchmarks/l2_promotion_ab.py) are maps of their own. 256 B cost HBM bandwidth where a tile's rows
# lie apart (token-major K/V: a K/V head's 256-byte row every 2 KB at 8 K/V heads): the packed GQA
# step streamed 4.07 TB/s with it and 4.50 without, and read 521 TFLOP/s at 256 B, 548 at 128 B (CUTLASS's
# default), 563 at none; prefill level within 1% (H200, benchmarks/PERF_NOTES.md "i1").
L2_PROMOTION = 0


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


def _geometry(t, box_rows: int, box_cols: int, group: int = 1) -> tuple:
    """What a map of a (B, H, N, D) view depends on besides its address, checked: dims (D, N, H, B)
    innermost first, byte strides, the box of [box_rows x box_cols] elements, swizzled as wide as a
    box row (128, 64 or 32 bytes: `panel_cols`), and the L2 promotion (L2_PROMOTION); rows past N and
    columns past D read as zeros.
    `group` > 1 (flash_fwd_sm90's packed GQA Q): dims (D, group, N, H / group, B), the `group` heads
    that share a K/V head inside each query, so that a box of (box_cols, group, box_rows // group)
    lands row r as query r / group of head r % group (whole groups: the box's last rows may stay
    unfilled)."""
    from cuda.bindings import driver

    kind = _data_type(t.dtype)
    b, h, n, d = t.shape
    esize = t.element_size()
    swizzle = {128: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
               64: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
               32: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B}.get(box_cols * esize)
    if swizzle is None:
        raise TmaError(f"a box row must be 128, 64 or 32 bytes, not {box_cols} x {esize}")
    if t.stride(3) != 1:
        raise TmaError("the last dimension must be contiguous")
    strides = (t.stride(2) * esize, t.stride(1) * esize, t.stride(0) * esize)
    if any(s % 16 for s in strides):
        raise TmaError(f"TMA needs 16-byte aligned data and strides, got strides {strides}")
    if group > 1:
        if h % group or box_rows < group:
            raise TmaError(f"packed rows: {group} heads a group must divide the {h} heads and fit a box's {box_rows} rows")
        sn, sh, sb = strides
        return (kind, (d, group, n, h // group, b), (sh, sn, sh * group, sb), (box_cols, group, box_rows // group), swizzle,
                L2_PROMOTION)
    return kind, (d, n, h, b), strides, (box_cols, box_rows), swizzle, L2_PROMOTION


def _check_address(address: int) -> None:
    if address % 16:
        raise TmaError(f"TMA needs 16-byte aligned data and strides, got an address {address % 16} bytes off")


def _encode_at(geometry: tuple, address: int) -> bytes:
    """cuTensorMapEncodeTiled of `geometry` at `address` (through ctypes where it can)."""
    from cuda.bindings import driver

    kind, dims, strides, box, swizzle, promotion = geometry
    fast = _fast_encoder()
    if fast is not None:
        return fast(int(kind), address, dims, strides, box, int(swizzle), promotion)
    u64, u32, rank = driver.cuuint64_t, driver.cuuint32_t, len(dims)
    err, tmap = driver.cuTensorMapEncodeTiled(
        kind, rank, address, [u64(x) for x in dims], [u64(x) for x in strides],
        [u32(x) for x in _box(box, rank)], [u32(1)] * rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzle,
        driver.CUtensorMapL2promotion(promotion),
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise TmaError(f"cuTensorMapEncodeTiled failed: {err.name} (dims {dims}, strides {strides})")
    return b"".join(int(w).to_bytes(8, "little") for w in tmap.opaque)


def _box(box: tuple, rank: int) -> tuple:
    """A map's box over all `rank` dims: the outer dims' one element each."""
    return (*box, *(1,) * (rank - len(box)))


def _encode(t, box_rows: int, box_cols: int) -> bytes:
    """The map of tensor `t` with boxes of [box_rows x box_cols], encoded by the driver."""
    geometry = _geometry(t, box_rows, box_cols)
    _check_address(t.data_ptr())
    return _encode_at(geometry, t.data_ptr())


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

    def _buffers(self, rank: int):
        import ctypes

        buffers = getattr(self._local, "b", None)
        if buffers is None:
            buffers = self._local.b = {}
        b = buffers.get(rank)
        if b is None:   # per rank: 4 for (B, H, N, D) views, 5 for packed GQA rows
            b = buffers[rank] = (ctypes.create_string_buffer(TMAP_BYTES + 64), (ctypes.c_uint64 * rank)(),
                                 (ctypes.c_uint64 * (rank - 1))(), (ctypes.c_uint32 * rank)(),
                                 (ctypes.c_uint32 * rank)(*(1,) * rank))
        return b

    def __call__(self, kind: int, address: int, dims, strides, box, swizzle: int, promotion: int) -> bytes:
        import ctypes

        rank = len(dims)
        out, gdim, gstride, boxdim, estride = self._buffers(rank)
        gdim[:] = dims
        gstride[:] = strides
        boxdim[:] = _box(box, rank)
        start = ctypes.addressof(out) + (-ctypes.addressof(out) % 64)   # a CUtensorMap is 64-byte aligned
        err = self._fn(start, kind, rank, address, gdim, gstride, boxdim, estride, 0, swizzle, promotion, 0)
        if err:
            raise TmaError(f"cuTensorMapEncodeTiled failed: CUresult {err} (dims {dims}, strides {strides})")
        return ctypes.string_at(start, TMAP_BYTES)


_fast: list = []


def _fast_encoder() -> _CtypesEncoder | None:
    """The ctypes encoder where the driver library loads by name (Linux), else None."""
    if not _fast:
        from tuner.launch import driver_library

        lib = driver_library()
        _fast.append(_CtypesEncoder(lib) if lib is not None else None)
    return _fast[0]


def tile_cols(d: int, esize: int) -> int:
    """The width of a kernel's Q, K and V tiles for head dim `d`: d rounded up to 64 bytes (32
    columns of fp16/bf16), so that a tile is whole 64- or 128-byte panels (tile_width widens d = 72
    and 80 to 128 columns). The columns past d come
    in as zeros. Rounding only to a wgmma k step (32 bytes) needs 32-byte panels at d = 80 or 112,
    which ran 0.77-0.96x the same configs in wider ones, padding included (PERF_NOTES "w2")."""
    return padded_head_dim(d, 64 // esize)


def tile_width(d: int, esize: int) -> int:
    """The width of flash_fwd_sm90's and flash_decode's Q, K and V tiles at head dim `d`: d rounded
    up to 64 bytes (tile_cols), or to 128 where that is 96 columns of which the products use fewer
    (d = 72, 80: prod_cols 80). There one 128-byte-panel tile of 128 columns ran flash_fwd_sm90's
    configs 1.03-1.06x (Phi-2's d=80 causal at 8k and 2k), 1.06-1.20x at d=72, though it carries more
    zero columns; at d=96 and 160, whose products fill their 64-byte-panel tiles, 0.97-0.99x
    (PERF_NOTES "w5")."""
    narrow = tile_cols(d, esize)
    if narrow * esize == 192 and padded_head_dim(d, 32 // esize) < narrow:
        return padded_head_dim(d, 128 // esize)
    return narrow


def tail_cols(d: int, esize: int) -> int:
    """Columns of a K/V ring's tail panel at head dim `d` (0: none), for flash_decode and
    flash_fwd_sm90: where d, rounded up to a k step (32 bytes), ends 32 or 64 bytes into the
    tile's last panel (tile_width, tile_panel), that panel comes as a box of those columns
    (32- or 64-byte rows, swizzled as wide) rather than as one of a whole panel row mostly past
    the tensor's columns. The copy engine asks L2 for the sectors past them all the same: at d=80
    (a 128-byte panel, then 32 bytes of the next) it asked for 1.33x the sectors of a stream of 64
    + 16-column boxes, which streamed 1.05x faster, and flash_decode read 11% more from memory
    than the K/V (H200, benchmarks/PERF_NOTES.md "y2"). d = 72-80, 136-144 and 200-208 in 16 bits;
    a tail of 48 columns (d = 112) would take two boxes: none."""
    cols, tile = padded_head_dim(d, 32 // esize), tile_width(d, esize)
    p = tile_panel(tile, esize)
    tail = cols % p
    return tail if tail * esize in (32, 64) and p < cols < tile else 0


def panel_cols(d: int, esize: int) -> int:
    """Columns of one panel of a tile (a TMA box's row and a wgmma swizzle atom's): 128 bytes
    wherever the tile's width is a multiple of them (d = 64, 128, 192, 256 in 16 bits; 40 and 120
    padded to 64 and 128), else 64 (d = 96 and 160, 72 and 80 padded to 96)."""
    return tile_panel(tile_cols(d, esize), esize)


def tile_panel(cols: int, esize: int) -> int:
    """Columns of one panel of a tile `cols` wide: 128 bytes where the row is a multiple of them, else 64."""
    return (128 if cols * esize % 128 == 0 else 64) // esize


def box_cols(t) -> int:
    """Columns of a box row of tensor `t`'s maps: one panel (`panel_cols` of its head dim)."""
    return panel_cols(t.shape[-1], t.element_size())


@dataclass(frozen=True)
class AddressField:
    """Where a map holds its global address: the little-endian 64-bit word at byte `offset`, which
    holds (address >> shift) << position plus bits that do not depend on the address. Learnt from
    two encodings, trusted only once it reproduces encodings at other addresses byte for byte."""

    offset: int
    shift: int
    position: int

    def moved(self, word: int, base_address: int, address: int) -> int:
        """The field's word `word` (of the map at `base_address`) for a map at `address`."""
        return (word + (((address >> self.shift) - (base_address >> self.shift)) << self.position)) & _U64

    def patch(self, base: bytes, base_address: int, address: int) -> bytes:
        o = self.offset
        word = self.moved(int.from_bytes(base[o:o + 8], "little"), base_address, address)
        return base[:o] + word.to_bytes(8, "little") + base[o + 8:]

    @classmethod
    def learn(cls, geometry: tuple, address: int, base: bytes) -> AddressField | None:
        """The field of maps of `geometry` (`base`: the driver's map at `address`), or None where no
        such field reproduces the driver."""
        probes = [address ^ (1 << bit) for bit in (4, 21, 39)] + [_random_address(i) for i in range(3)]
        try:
            return cls._fit(geometry, address, base, probes)
        except TmaError:   # a driver that refuses addresses it has not allocated: encode each one
            return None

    @classmethod
    def _fit(cls, geometry: tuple, address: int, base: bytes, probes: list[int]) -> AddressField | None:
        other = _encode_at(geometry, probes[0])
        words = [o for o in range(0, TMAP_BYTES, 8) if base[o:o + 8] != other[o:o + 8]]
        if len(words) != 1:
            return None
        o = words[0]
        delta = int.from_bytes(other[o:o + 8], "little") - int.from_bytes(base[o:o + 8], "little")
        # address ^ (1 << 4) moved the field by +-1 << (position + 4 - shift)
        step = abs(delta)
        if step == 0 or step & (step - 1):
            return None
        for shift in (0, 4):
            position = step.bit_length() - 1 - (4 - shift)
            if position >= 0:
                field = cls(o, shift, position)
                if all(field.patch(base, address, p) == _encode_at(geometry, p) for p in probes):
                    return field
        return None


_U64 = (1 << 64) - 1


def _random_address(i: int) -> int:
    """A 16-byte aligned address in the 47-bit virtual range, fixed per i (the encoder reads no memory)."""
    return (0x7F3A_5C2E_9B10 * (i + 3) + 0x1000 * i) & ((1 << 47) - 16)


class _Template(NamedTuple):
    geometry: tuple
    base: bytes
    address: int
    field: AddressField | None


# Geometries: a model has a handful (per shape and layout); 1024 of them bound memory all the same.
_templates: OrderedDict[tuple, _Template] = OrderedDict()
_TEMPLATES = 1024


def _template(t, rows: int, cols: int, group: int = 1) -> _Template:
    key = (t.shape, t.stride(), t.dtype, rows, cols, group, L2_PROMOTION)   # one tensor, several kernels' boxes (prefill's, decode's)
    tpl = _templates.get(key)
    if tpl is None:
        geometry = _geometry(t, rows, cols, group)
        address = t.data_ptr()
        _check_address(address)
        base = _encode_at(geometry, address)
        tpl = _Template(geometry, base, address, AddressField.learn(geometry, address, base))
        with _lock:
            _templates[key] = tpl
            while len(_templates) > _TEMPLATES:
                _templates.popitem(last=False)
    return tpl


class MapSlot:
    """The maps of one tensor geometry at whatever address a call brings: a plan's q, k, v or O.
    With the driver's address field known, a map is the geometry's map with the address written
    into that field (integer arithmetic and one bytes join, the same cost for a new address as for
    a seen one); without, the driver's encoding of each new address, cached on it. Boxes of `rows`
    x `cols` (default box_cols: one panel of the head dim's tile_cols; a kernel with a tile of its
    own passes its panel); `group` > 1: packed GQA rows (_geometry)."""

    __slots__ = ("_geometry", "_patched", "_head", "_word", "_tail", "_origin", "_shift", "_position")

    def __init__(self, t, rows: int, cols: int | None = None, group: int = 1) -> None:
        tpl = _template(t, rows, box_cols(t) if cols is None else cols, group)
        self._geometry, f = tpl.geometry, tpl.field
        self._patched = f is not None
        if f is not None:   # AddressField.moved, with what it needs of the template kept at hand
            o = f.offset
            self._head, self._tail = tpl.base[:o], tpl.base[o + 8:]
            self._word = int.from_bytes(tpl.base[o:o + 8], "little")
            self._origin, self._shift, self._position = tpl.address >> f.shift, f.shift, f.position

    def field(self) -> tuple[int, int, int] | None:
        """(byte offset, shift, position) of the map's address field (AddressField), or None
        where maps are the driver's encodings."""
        if not self._patched:
            return None
        return len(self._head), self._shift, self._position

    def at(self, address: int) -> bytes:
        if address & 15:
            _check_address(address)
        if not self._patched:
            return _encoded(self._geometry, address)
        word = (self._word + (((address >> self._shift) - self._origin) << self._position)) & _U64
        return self._head + word.to_bytes(8, "little") + self._tail


def map_fields(slots, first: int, sources) -> list[tuple[int, int, int, int, int]] | None:
    """AttentionArgs.address_fields' entries for maps passed as parameters first, first + 1, ...:
    slot i the map of source sources[i] (0-4: q, k, v, o, lse), None where no map is passed there.
    None where a map is the driver's encoding (no address field known)."""
    fields = []
    for i, (slot, source) in enumerate(zip(slots, sources)):
        if slot is None:
            continue
        where = slot.field()
        if where is None:
            return None
        fields.append((first + i, source, *where))
    return fields


def maps_at(slots, pointers, sources) -> tuple[bytes, ...]:
    """The map parameters map_fields describes: slot i's map at pointers[sources[i]] (the call's
    q, k, v, o, lse), an empty map (NO_MAP) where slot i is None."""
    return tuple(NO_MAP if slot is None else slot.at(pointers[i]) for slot, i in zip(slots, sources))


def _encoded(geometry: tuple, address: int) -> bytes:
    """The driver's map of `geometry` at `address`, through a cache (a model's activations come
    back at the same addresses from torch's caching allocator)."""
    key = (geometry, address)
    m = _cache.get(key)
    if m is None:
        m = _encode_at(geometry, address)
        with _lock:
            _cache[key] = m
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return m


def tensor_map(t, rows: int) -> bytes:
    """The 128-byte tensor map of a (B, H, N, D) view with boxes of `rows` x box_cols(t): its
    geometry's map with t's address patched in, or, where the driver's address field is not known,
    the driver's encoding (MapSlot; a plan keeps its slots, this makes one per call)."""
    return MapSlot(t, rows).at(t.data_ptr())
