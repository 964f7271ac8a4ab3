"""The timer's turns on a real GPU: settle runs happen before each turn and stay out of the figures."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _counted(cycles: int):
    """A callable of fixed GPU duration (a spin of `cycles` clocks) that counts its launches."""
    import torch

    calls = [0]

    def run() -> None:
        calls[0] += 1
        torch.cuda._sleep(cycles)

    return run, calls


def test_each_turn_settles_untimed_before_it_is_timed():
    from tuner.timing import Timer

    settle_s, rounds, warmup = 0.01, 4, 3
    timer = Timer(target_seconds=0.05, settle_seconds=settle_s)
    (a, a_calls), (b, b_calls) = _counted(200_000), _counted(600_000)
    times = timer.interleaved({"a": a, "b": b}, rounds=rounds, warmup=warmup)
    for name, calls in (("a", a_calls), ("b", b_calls)):
        t = times[name]
        assert t.min_ms <= t.median_ms <= t.max_ms
        untimed = calls[0] - warmup - t.reps
        # every turn ran the kernel untimed for at least settle_s (give 10% for the median's spread)
        assert untimed * t.median_ms >= 0.9 * rounds * settle_s * 1e3, (name, untimed, t.median_ms)
        # and for no more than the rounding up of one more launch per turn
        assert untimed * t.median_ms <= 1.1 * rounds * (settle_s * 1e3 + t.max_ms), (name, untimed, t)
    # a spin three times as long reads about three times as long: the settle runs did not leak in
    assert 2.0 < times["b"].median_ms / times["a"].median_ms < 4.0


def test_a_single_callable_is_timed_without_settling():
    """The search times one kernel at a time: its figures are made exactly as before the turns."""
    from tuner.timing import Timer

    run, calls = _counted(200_000)
    t = Timer(target_seconds=0.05, settle_seconds=0.05)(run, warmup=2)
    assert calls[0] == 2 + t.reps
