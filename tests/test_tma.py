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
        b, h, n, d = rng.randint(1, 3), rng.randint(1, 8), rng.randint(1, 3000), rng.choice([64, 128, 256])
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
