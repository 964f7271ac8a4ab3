"""Tensor maps without a GPU: what TMA cannot describe is refused before the driver is asked."""

from __future__ import annotations

import pytest
import torch

from tuner.kernel_templates.sm90_tma import TmaError, _encode


def test_last_dim_must_be_contiguous():
    t = torch.randn(1, 2, 64, 8, dtype=torch.bfloat16).transpose(2, 3)  # (1, 2, 8, 64), last stride 8
    with pytest.raises(TmaError, match="last dimension must be contiguous"):
        _encode(t, 64, 64)


def test_strides_must_be_16_byte_multiples():
    odd = torch.randn(1, 2, 16, 68, dtype=torch.float16)[..., :64]  # rows 136 B apart: not a multiple of 16
    with pytest.raises(TmaError, match="16-byte aligned"):
        _encode(odd, 64, 64)


@pytest.mark.parametrize("d,esize,tile,panel,swizzle", [
    (64, 2, 64, 64, "128B"), (128, 2, 128, 64, "128B"), (192, 2, 192, 64, "128B"), (256, 2, 256, 64, "128B"),
    (248, 2, 256, 64, "128B"), (56, 2, 64, 64, "128B"), (96, 2, 96, 32, "64B"), (160, 2, 160, 32, "64B"),
    (32, 2, 32, 32, "64B"), (80, 2, 96, 32, "64B"), (72, 2, 96, 32, "64B"), (112, 2, 128, 64, "128B"),
    (40, 2, 64, 64, "128B"), (8, 2, 32, 32, "64B"), (64, 1, 64, 64, "64B"), (128, 1, 128, 128, "128B"),
    (256, 1, 256, 128, "128B")])
def test_tiles_panels_and_swizzles_by_head_dim(d, esize, tile, panel, swizzle):
    """A tile is the head dim rounded up to 64 bytes, in panels of the widest swizzle that divides
    its row (128 or 64 bytes: 32-byte panels measured slower than the padding, PERF_NOTES "w2"); a
    map's box is one panel, swizzled as wide, and ends at the head dim (the tile's further columns
    read as zeros)."""
    from cuda.bindings import driver

    from tuner.kernel_templates.sm90_tma import _geometry, box_cols, panel_cols, tile_cols

    assert (tile_cols(d, esize), panel_cols(d, esize)) == (tile, panel)
    dtype = torch.bfloat16 if esize == 2 else torch.float8_e4m3fn
    t = torch.empty(2, 3, 100, d, dtype=dtype)
    assert box_cols(t) == panel
    _, dims, strides, box, swz, promotion = _geometry(t, 64, box_cols(t))
    assert dims == (d, 100, 3, 2) and strides[0] == d * esize and box == (panel, 64)
    assert swz == getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}")
    assert promotion == 0   # none: 256 B cost the packed GQA step 10% of its bandwidth (PERF_NOTES "i1")


def test_a_promotion_setting_makes_maps_of_its_own(monkeypatch):
    """The L2 promotion is part of a map's geometry and of the template cache's key: a map made at
    another setting (as benchmarks/l2_promotion_ab.py makes them) is not the cached map of the first."""
    from tuner.kernel_templates import sm90_tma as tma

    encoded = []
    monkeypatch.setattr(tma, "_templates", type(tma._templates)())
    monkeypatch.setattr(tma, "_cache", type(tma._cache)())
    monkeypatch.setattr(tma, "_encode_at", lambda geometry, address: encoded.append(geometry) or bytes(128))
    monkeypatch.setattr(tma.AddressField, "learn", classmethod(lambda cls, *a: None))
    t = torch.empty(1, 2, 64, 128, dtype=torch.bfloat16)
    for value in (0, 3, 0):
        monkeypatch.setattr(tma, "L2_PROMOTION", value)
        tma.tensor_map(t, 128)
    # each new setting: its template and the address's map (no address field here); 0 again: cached
    assert [g[-1] for g in encoded] == [0, 0, 3, 3]


def test_a_box_row_must_be_a_swizzle_width():
    with pytest.raises(TmaError, match="128, 64 or 32 bytes"):
        _encode(torch.randn(1, 2, 16, 64, dtype=torch.float16), 64, 8)


@pytest.mark.gpu
def test_ctypes_encoder_gives_the_bindings_map():
    """The driver's cuTensorMapEncodeTiled through ctypes (the fast path) and through cuda.bindings
    encode the same 128 bytes, on random views, dtypes and boxes."""
    import random

    from tuner.kernel_templates import sm90_tma as tma

    assert tma._fast_encoder() is not None
    rng = random.Random()
    for _ in range(30):
        dt = rng.choice([torch.bfloat16, torch.float16, torch.float8_e4m3fn])
        b, h, n, d = rng.randint(1, 3), rng.randint(1, 8), rng.randint(1, 3000), rng.choice([64, 128, 256] if dt == torch.float8_e4m3fn else [40, 64, 80, 96, 128, 192, 248, 256])
        t = torch.empty(b, n, h, d, device="cuda", dtype=dt)
        t = t.transpose(1, 2) if rng.random() < 0.5 else t.view(b, h, n, d)
        rows, cols = rng.choice([16, 64, 128, 192]), tma.box_cols(t)
        fast = tma._encode(t, rows, cols)
        saved, tma._fast[:] = tma._fast[:], [None]
        try:
            slow = tma._encode(t, rows, cols)
        finally:
            tma._fast[:] = saved
        assert fast == slow and len(fast) == tma.TMAP_BYTES, (tuple(t.shape), t.stride(), dt, rows)


# ---- a new address patched into its geometry's map ----

def _fake_driver(layout):
    """An encoder standing in for the driver (no GPU here): geometry words, and the address as
    `layout` places it."""
    def encode_at(geometry, address):
        _, dims, strides, box, swizzle, promotion = geometry
        words = [layout(address), *dims, *strides, *box, int(swizzle), promotion]
        words += [0] * (16 - len(words))
        return b"".join((w & (2**64 - 1)).to_bytes(8, "little") for w in words)
    return encode_at


@pytest.mark.parametrize("layout", [lambda a: a, lambda a: (a >> 4) << 8 | 0x5, lambda a: (7 << 60) | a >> 4])
def test_patched_maps_are_the_driver_maps(layout, monkeypatch):
    """Where the address is one linear field, it is learnt, and a map at a fresh address is its
    geometry's map patched: byte for byte what the driver would encode, with no encode per address."""
    from tuner.kernel_templates import sm90_tma as tma

    encode = _fake_driver(layout)
    calls = []
    monkeypatch.setattr(tma, "_encode_at", lambda g, a: calls.append(a) or encode(g, a))
    monkeypatch.setattr(tma, "_templates", type(tma._templates)())
    monkeypatch.setattr(tma, "_cache", type(tma._cache)())
    base = torch.empty(2, 512, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    first = tma.tensor_map(base, 128)
    learnt = len(calls)
    for _ in range(20):
        t = torch.empty(2, 512, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
        assert tma.tensor_map(t, 128) == encode(tma._geometry(t, 128, 64), t.data_ptr())
    assert len(calls) == learnt  # no encode for the new addresses
    assert first == encode(tma._geometry(base, 128, 64), base.data_ptr())


def test_an_address_field_that_is_not_linear_is_never_patched(monkeypatch):
    """A driver whose address encoding the model cannot reproduce: every new address is encoded."""
    from tuner.kernel_templates import sm90_tma as tma

    encode = _fake_driver(lambda a: (a * 2654435761) ^ (a >> 7))
    calls = []
    monkeypatch.setattr(tma, "_encode_at", lambda g, a: calls.append(a) or encode(g, a))
    monkeypatch.setattr(tma, "_templates", type(tma._templates)())
    monkeypatch.setattr(tma, "_cache", type(tma._cache)())
    tensors = [torch.empty(1, 4, 256, 128, dtype=torch.float16) for _ in range(5)]
    maps = [tma.tensor_map(t, 64) for t in tensors]
    assert maps == [encode(tma._geometry(t, 64, 64), t.data_ptr()) for t in tensors]
    assert {t.data_ptr() for t in tensors} <= set(calls)


def test_one_tensors_maps_keep_each_kernels_box(monkeypatch):
    """flash_fwd_sm90 rounds d = 72 and 80 to a 128-column tile of 128-byte panels (its products stop
    short of the 96-column one), flash_decode keeps d=80's 96 columns in 64-byte panels: the same K
    then gets a map of each box width from the two kernels, never the other's cached one."""
    from tuner.kernel_templates import sm90_tma as tma
    from tuner.kernel_templates.flash_fwd_sm90 import map_panel, tile_width

    assert [tile_width(d, 2) for d in (40, 64, 72, 80, 88, 96, 112, 160)] == [64, 64, 128, 128, 96, 96, 128, 160]
    assert [tile_width(d, 1) for d in (64, 128, 256)] == [64, 128, 256]   # e4m3 tiles as before
    encode = _fake_driver(lambda a: a)
    monkeypatch.setattr(tma, "_encode_at", encode)
    monkeypatch.setattr(tma, "_templates", type(tma._templates)())
    monkeypatch.setattr(tma, "_cache", type(tma._cache)())
    k = torch.empty(2, 512, 4, 80, dtype=torch.bfloat16).transpose(1, 2)
    assert (map_panel(k), tma.box_cols(k)) == (64, 32)
    prefill, decode = tma.MapSlot(k, 128, map_panel(k)), tma.MapSlot(k, 128)
    assert prefill.at(k.data_ptr()) == encode(tma._geometry(k, 128, 64), k.data_ptr())
    assert decode.at(k.data_ptr()) == encode(tma._geometry(k, 128, 32), k.data_ptr())


def test_a_misaligned_address_is_refused_on_the_patched_path(monkeypatch):
    from tuner.kernel_templates import sm90_tma as tma

    monkeypatch.setattr(tma, "_encode_at", _fake_driver(lambda a: a))
    monkeypatch.setattr(tma, "_templates", type(tma._templates)())
    monkeypatch.setattr(tma, "_cache", type(tma._cache)())
    flat = torch.empty(4 * 256 * 64 + 8, dtype=torch.float16)
    tma.tensor_map(flat[:4 * 256 * 64].view(1, 4, 256, 64), 64)
    with pytest.raises(TmaError, match="address"):
        tma.tensor_map(flat[1:4 * 256 * 64 + 1].view(1, 4, 256, 64), 64)


@pytest.mark.gpu
def test_patched_maps_match_the_driver_on_fresh_tensors():
    """On the real driver: the address field is learnt, and maps of tensors at fresh addresses, of
    random geometries, equal the driver's own encoding byte for byte."""
    import random

    from tuner.kernel_templates import sm90_tma as tma

    rng = random.Random()
    learnt = 0
    for _ in range(40):
        dt = rng.choice([torch.bfloat16, torch.float16, torch.float8_e4m3fn])
        b, h, n, d = rng.randint(1, 3), rng.randint(1, 8), rng.randint(1, 3000), rng.choice([64, 128, 256] if dt == torch.float8_e4m3fn else [40, 64, 80, 96, 128, 192, 248, 256])
        t = torch.empty(b, n, h, d, device="cuda", dtype=dt)
        t = t.transpose(1, 2) if rng.random() < 0.5 else t.view(b, h, n, d)
        rows = rng.choice([16, 64, 128, 192])
        assert tma.tensor_map(t, rows) == tma._encode(t, rows, tma.box_cols(t))
        learnt += tma._template(t, rows, tma.box_cols(t)).field is not None
    assert learnt == 40, "the driver's address field was not learnt: every new address is encoded"


def test_a_plans_arguments_follow_each_calls_tensors(monkeypatch):
    """flash_fwd_sm90's argument maker keeps what a layout fixes and patches each call's addresses:
    its values at fresh tensors are attention_args' and the driver's own maps of those tensors,
    with no encode after the first call of a layout; a misaligned q is refused (None). K's tail
    panel's map (d = 72-80: boxes of 16 columns) follows O's, empty where there is no tail."""
    from tuner.kernel_templates import sm90_tma as tma
    from tuner.kernel_templates.flash_fwd_sm90 import FAMILY
    from tuner.launch import attention_args

    encode = _fake_driver(lambda a: (a >> 4) << 8 | 0x5)
    calls = []
    monkeypatch.setattr(tma, "_encode_at", lambda g, a: calls.append(a) or encode(g, a))
    monkeypatch.setattr(tma, "_templates", type(tma._templates)())
    make = FAMILY.arg_maker({"cwg": 2, "Bc": 128, "tma_store": 1, "persistent": 1})
    monkeypatch.setattr("tuner.kernel_templates.flash_fwd_sm90.tile_counter_ptr", lambda index: 0xC0FFEE)
    learnt = None
    for i in range(12):
        b, h, n, d = 2, 4, 300, 128
        q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        o = torch.empty(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)
        lse = torch.empty(b, h, n)
        scale = 0.1 if i % 3 == 0 else None
        args = make(q, k, v, o, lse, scale)
        assert args[:22] == attention_args(q, k, v, o, lse, scale)
        want = (encode(tma._geometry(q, 128, 64), q.data_ptr()), encode(tma._geometry(k, 128, 64), k.data_ptr()),
                encode(tma._geometry(v, 128, 64), v.data_ptr()), encode(tma._geometry(o, 16, 64), o.data_ptr()))
        assert args[22:26] == want
        assert args[26:] == (tma.NO_MAP, b, 0xC0FFEE)
        if learnt is None:
            learnt = len(calls)
        assert len(calls) == learnt, "a new address was encoded, not patched"
    tail = FAMILY.arg_maker({"cwg": 2, "Bc": 128, "tma_store": 0, "persistent": 1})
    q, k, v = (torch.randn(1, 100, 2, 80, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    o, lse = torch.empty(1, 100, 2, 80, dtype=torch.bfloat16).transpose(1, 2), torch.empty(1, 2, 100)
    args = tail(q, k, v, o, lse, None)
    assert args[22:27] == (encode(tma._geometry(q, 128, 64), q.data_ptr()), encode(tma._geometry(k, 128, 64), k.data_ptr()),
                           encode(tma._geometry(v, 128, 64), v.data_ptr()), tma.NO_MAP,
                           encode(tma._geometry(k, 128, 16), k.data_ptr()))
    flat = torch.empty(2 * 4 * 300 * 128 + 8, dtype=torch.bfloat16)
    shifted = flat[1:1 + 2 * 4 * 300 * 128].view(2, 300, 4, 128).transpose(1, 2)
    assert make(shifted, k, v, o, lse, None) is None
