"""Tensor maps without a GPU: what TMA cannot describe is refused before the driver is asked."""

from __future__ import annotations

import pytest
import torch

from tuner.tma import TmaError, _encode


def test_last_dim_must_be_contiguous():
    t = torch.randn(1, 2, 64, 8, dtype=torch.bfloat16).transpose(2, 3)  # (1, 2, 8, 64), last stride 8
    with pytest.raises(TmaError, match="last dimension must be contiguous"):
        _encode(t, 64, 64)


def test_strides_must_be_16_byte_multiples():
    odd = torch.randn(1, 2, 16, 68, dtype=torch.float16)[..., :64]  # rows 136 B apart: not a multiple of 16
    with pytest.raises(TmaError, match="16-byte aligned"):
        _encode(odd, 64, 64)
