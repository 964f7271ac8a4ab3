"""The timer's arguments, checked before it touches a GPU (its timings: tests/test_gpu_timing.py)."""

from __future__ import annotations

import pytest


def test_an_unknown_flush_is_refused_in_one_line():
    from tuner.timing import Timer

    with pytest.raises(ValueError, match="^flush must be one of write, read, got 'none'$"):
        Timer(flush="none")
