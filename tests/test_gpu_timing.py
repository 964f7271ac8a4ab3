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


def _read_ms(buf, timer=None) -> float:
    """ms of a sum over `buf`: timed by `timer`, or the mean of 50 back to back with nothing between
    (what L2 holds of it stays there), queued behind a spin so the host's launches are not timed."""
    import torch

    run = lambda: torch.sum(buf, dtype=torch.float32)
    if timer is not None:
        return timer(run).median_ms
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)
    start.record()
    for _ in range(50):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


@pytest.mark.parametrize("flush", ["write", "read"])
def test_either_flush_keeps_the_inputs_out_of_l2(flush):
    import torch

    from tuner.timing import Timer

    small = torch.randn(4 << 20, device="cuda")   # 16 MB: held by an H100's or H200's 50 MB L2
    # the warm read's best of five: the GPU session runs eight test processes side by side, whose
    # kernels once made one warm mean of 50 slower than the flushed median (0.0178 against 0.0150 ms)
    warm = min(_read_ms(small) for _ in range(5))
    flushed = _read_ms(small, Timer(target_seconds=0.05, flush=flush))
    # (a sum this small is partly launch and reduction latency: 1.45x on the H100 with the read flush)
    assert flushed > 1.25 * warm, (flush, warm, flushed)


def test_the_read_flush_leaves_no_write_back_to_the_timed_call():
    """A write flush leaves L2's lines dirty and the next call writes them back (q2 in PERF_NOTES:
    ~9 us of a 100 us decode step on the H100); after a read flush it has nothing to write."""
    import torch

    from tuner.timing import Timer

    big = torch.randn(64 << 20, device="cuda")   # 256 MB
    after_write = _read_ms(big, Timer(target_seconds=0.1, flush="write"))
    after_read = _read_ms(big, Timer(target_seconds=0.1, flush="read"))
    assert after_write - after_read > 0.003, (after_write, after_read)   # ms
