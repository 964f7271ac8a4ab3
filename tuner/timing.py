"""One way to time GPU work: CUDA events, warm-up, L2 flushed before every repetition, median."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    rounds: tuple[float, ...] = ()   # the median of each timed turn, in order (Timer.interleaved)


FLUSHES = ("write", "read")


class Timer:
    """Times a callable on the current stream. The flush buffer (twice L2, 256 MiB at least) goes
    through L2 before each repetition so no input is served from there, and it keeps the GPU busy
    while the host enqueues the events and the launch, so host overhead stays outside the events.

    `flush`: "write" (the default, as Triton's do_bench) zeroes the buffer, which leaves L2 full of
    dirty lines that the timed call then writes back to memory: ~9 us of an H100's DRAM time, the
    same for every kernel, which a memory-bound call of ~100 us pays as 9% of its bandwidth
    (PERF_NOTES "q2"). "read" reads the buffer instead: L2 holds clean lines of it and nothing of
    the inputs, and what the previous repetition wrote is written back during the flush."""

    def __init__(self, l2_bytes: int = 50 << 20, target_seconds: float = 0.5,
                 min_reps: int = 10, max_reps: int = 200, settle_seconds: float = 0.05,
                 flush: str = "write") -> None:
        import torch

        if flush not in FLUSHES:
            raise ValueError(f"flush must be one of {', '.join(FLUSHES)}, got {flush!r}")
        self._flush = torch.zeros(max(2 * l2_bytes, 256 << 20) // 4, dtype=torch.int32, device="cuda")
        self._flush_op = self._flush.zero_ if flush == "write" else (lambda: torch.sum(self._flush, dtype=torch.int32))
        self.target_seconds, self.min_reps, self.max_reps = target_seconds, min_reps, max_reps
        self.settle_seconds = settle_seconds

    def flush(self) -> None:
        """Puts the flush buffer through L2 once, as before each timed repetition."""
        self._flush_op()

    def __call__(self, fn: Callable[[], None], warmup: int = 3) -> Timing:
        return self.interleaved({"": fn}, warmup=warmup)[""]

    def interleaved(self, fns: dict[str, Callable[[], None]], rounds: int = 8,
                    warmup: int = 3) -> dict[str, Timing]:
        """Times each callable for about `target_seconds`, in `rounds` turns (one for a single
        callable), the order rotating each round. On an H100 one kernel's median moved by 5%
        between two timings minutes apart (0.488 and 0.511 ms); taken in turns, every callable sees
        the same clock and power states, so the ratios between them hold where separate timings
        would not. Each turn first runs its callable untimed for `settle_seconds`: at the power cap
        the SM clock follows the recent draw with a lag, so a short turn was timed at the clock its
        predecessor left. On an H100 at d=128 N=4096, with settle 0 / 20 / 50 ms, cuDNN's median
        read 0.833 / 0.878 / 0.912 ms and ours 0.823 / 0.823 / 0.784 beside it (benchmarks/PERF_NOTES.md):
        without it each kernel was partly timed in the other's power state."""
        import torch

        for fn in fns.values():
            for _ in range(warmup):
                fn()
        torch.cuda.synchronize()
        rounds, settle_ms = (1, 0.0) if len(fns) == 1 else (rounds, self.settle_seconds * 1e3)
        times = {name: self._run(fn, 3) for name, fn in fns.items()}
        estimate = {name: max(statistics.median(t), 1e-3) for name, t in times.items()}
        per_round = {name: math.ceil(self._reps(ms) / rounds) for name, ms in estimate.items()}
        settle = {name: math.ceil(settle_ms / ms) for name, ms in estimate.items()}
        names = list(fns)
        turns: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if settle[name]:
                    self._run(fns[name], settle[name])
                turn = self._run(fns[name], per_round[name])
                times[name] += turn
                turns[name].append(statistics.median(turn))
        return {name: Timing(statistics.median(t), min(t), max(t), len(t), tuple(turns[name])) for name, t in times.items()}

    def _reps(self, estimate_ms: float) -> int:
        return int(min(self.max_reps, max(self.min_reps, self.target_seconds * 1e3 / estimate_ms)))

    def _run(self, fn: Callable[[], None], reps: int) -> list[float]:
        import torch

        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            self.flush()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]
