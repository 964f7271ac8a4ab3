"""Timing the tuned best beside its SDPA peers: through any Runner (the GPU, or a replay of a
recorded database), every row stored under one run id. `tuner bench` and the search's peers."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import interrupts
from .db import queries
from .db.queries import BestEntry
from .peers import PEER_FAMILIES, peers_for
from .problem import Problem
from .records import Measurement, ProblemResult, new_run_id
from .runner import Runner


@dataclass
class Bench:
    runner: Runner
    sessions: object   # a sqlalchemy sessionmaker
    run_id: str = field(default_factory=new_run_id)

    def peers(self, problem: Problem, backends: tuple[str, ...] | None = None) -> dict[str, Measurement]:
        """Each SDPA backend alone on fresh inputs, stored. SIGINT/SIGTERM reach this only while a
        backend is being measured (tuner.interrupts)."""
        with interrupts.deferred():
            out = {}
            for backend in backends or self._peers(problem):
                interrupts.checkpoint()
                with interrupts.allowed():
                    m = self.runner.peer(backend, problem)
                if m is not None:
                    out[backend] = m
            self._store(problem, peers=out)
            return out

    def best(self, problem: Problem, best: BestEntry | None, backends: tuple[str, ...] | None = None) -> ProblemResult:
        """The stored best of `problem` (its params passed `check` already) and the peers, timed in
        turns on the same inputs; without a best, the peers alone; a best that is a peer (what a
        lookup serves where SDPA measured fastest) is that peer's timing among the others."""
        backends = backends or self._peers(problem)
        r = ProblemResult(problem, best.family if best else "-", "")
        if best is None:
            r.peers = self.peers(problem, backends)
            return r
        if best.family in PEER_FAMILIES:   # what the dispatcher serves is an SDPA backend: timed as a peer
            r.peers = self.peers(problem, tuple(dict.fromkeys((*backends, best.family))))
            r.best_params = {}
            r.best = r.peers.get(best.family, Measurement("launch_error", message=f"{best.family} did not run"))
            return r
        from .kernel_templates import get_family

        with interrupts.allowed():
            side = self.runner.bench(get_family(best.family), best.params, problem, backends)
        r.best_params = best.params
        if side is None:   # a replay that lacks the point: what the database says, nothing new
            r.best = Measurement("ok", median_ms=best.median_ms, tflops=best.tflops)
            return r
        self._store(problem, best.family, best.params, side.kernel, side.peers)
        r.peers = side.peers
        r.best = side.kernel if side.kernel.ok else Measurement("ok", median_ms=best.median_ms, tflops=None)
        return r

    def _peers(self, problem: Problem) -> tuple[str, ...]:
        gpu = self.runner.gpu
        return peers_for(problem, (gpu.major, gpu.minor))

    def _store(self, problem: Problem, family: str | None = None, params: dict | None = None,
               kernel: Measurement | None = None, peers: dict[str, Measurement] | None = None) -> None:
        gpu = self.runner.gpu
        with interrupts.deferred(), self.sessions.begin() as s:
            if kernel is not None:
                queries.record_measurement(s, gpu, problem, family, params, kernel, run_id=self.run_id)
            queries.record_peers(s, gpu, problem, peers or {}, self.run_id)
