"""Plans chosen from the process's dispatcher, kept by the entry points beside `attention`
(kvcache_attention's, attention_varlen's): made once per key and dispatcher, so that after
`tuner.dispatch.reset` (a new search, another lookup) they are chosen again from the new lookup."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

P = TypeVar("P")


class DispatcherPlans(dict):
    """key -> plan, dropped whenever the process's dispatcher is another than the one they were
    chosen from. A dict otherwise (tests and benchmarks look plans up and clear them)."""

    def __init__(self) -> None:
        super().__init__()
        self._owner: object = None
        self._lock = threading.Lock()

    def plan(self, key, make: Callable[[], P]) -> P:
        """The plan for `key`, made by `make()` on a miss (once: threads racing on it share one)."""
        from .dispatch import default

        dispatcher = default()
        if self._owner is not dispatcher:
            with self._lock:
                if self._owner is not dispatcher:
                    self.clear()
                    self._owner = dispatcher
        found = self.get(key)
        if found is None:
            with self._lock:
                found = self.get(key)
                if found is None:
                    found = self[key] = make()
        return found
