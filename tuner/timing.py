"""One way to time GPU work: CUDA events, warm-up, L2 flushed before every repetition, median."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int


class Timer:
    """Times a callable on the current stream. The flush buffer (twice L2, 256 MiB at least) is
    written before each repetition so no input is served from L2, and it keeps the GPU busy while
    the host enqueues the events and the launch, so host overhead stays outside the events."""

    def __init__(self, l2_bytes: int = 50 << 20, target_seconds: float = 0.5,
                 min_reps: int = 10, max_reps: int = 200) -> None:
        import torch

        self._flush = torch.empty(max(2 * l2_bytes, 256 << 20) // 4, dtype=torch.int32, device="cuda")
        self.target_seconds, self.min_reps, self.max_reps = target_seconds, min_reps, max_reps

    def __call__(self, fn: Callable[[], None], warmup: int = 3) -> Timing:
        import torch

        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        first = self._run(fn, 3)
        estimate = statistics.median(first)
        reps = int(min(self.max_reps, max(self.min_reps, self.target_seconds * 1e3 / max(estimate, 1e-3))))
        times = first + self._run(fn, reps)
        return Timing(statistics.median(times), min(times), max(times), len(times))

    def _run(self, fn: Callable[[], None], reps: int) -> list[float]:
        import torch

        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            self._flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]
