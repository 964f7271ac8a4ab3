"""Runners answer "how fast is this point?": on the GPU through a worker, or replayed from a DB.

The search only sees this interface, so strategies can be tried offline against real recorded
measurements (a replay database) exactly as they would run on the GPU.
"""

from __future__ import annotations

import time
from typing import Protocol

from .compile import CompileError, compile_kernel
from .family import KernelFamily
from .gpu import GpuSpec
from .problem import Problem
from .records import CompiledKernel, Measurement, SideBySide


PREFETCH_JOBS = 4   # compiler processes beside the search (NVRTC runs a point in seconds, the GPU in less)


class Runner(Protocol):
    gpu: GpuSpec

    def versions(self) -> dict: ...

    def measure(self, family: KernelFamily, params: dict, problem: Problem) -> Measurement | None:
        """None means "this runner cannot answer" (a replay miss); nothing is recorded then."""

    def peer(self, backend: str, problem: Problem) -> Measurement | None: ...

    def prefetch(self, family: KernelFamily, points: list[dict], problem: Problem) -> None:
        """Points that will be measured soon: a runner may start on them (compile) meanwhile."""

    def bench(self, family: KernelFamily, params: dict, problem: Problem,
              backends: tuple[str, ...]) -> SideBySide | None:
        """The point and the peers timed in turns on the same inputs (None: a replay miss)."""

    def close(self) -> None: ...


class GpuRunner:
    """Compile here (NVRTC needs no GPU), measure in the worker process."""

    compiles = True   # prefetch compiles: worth asking a search's next point ahead

    def __init__(self, gpu: GpuSpec, candidate_timeout: float = 60.0) -> None:
        from .versions import run_versions
        from .worker import Worker

        self.gpu = gpu
        self._versions = run_versions()
        self._worker = Worker(gpu.index, gpu.l2_bytes, candidate_timeout)
        self._compilers = None   # a process pool, made on the first prefetch

    def versions(self) -> dict:
        return self._versions

    def prefetch(self, family: KernelFamily, points: list[dict], problem: Problem) -> None:
        """Compile `points` in background processes into the on-disk cache while the GPU measures
        what comes first: `measure` then finds them there (the cache writes are atomic, so one
        compiled twice at once is only wasted work)."""
        import multiprocessing as mp
        import os
        from concurrent.futures import ProcessPoolExecutor

        from .compile import compile_job

        if not points:
            return
        if self._compilers is None:
            jobs = max(1, min(PREFETCH_JOBS, (os.cpu_count() or 2) - 1))
            self._compilers = ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"))
        for params in points:
            runs, ps = family.served_form(params, self.gpu, problem)
            self._compilers.submit(compile_job, (runs.name, ps, problem, self.gpu.arch))

    def _seed(self) -> int:
        return time.time_ns() % (2**31)  # fresh inputs for every candidate

    def _compile(self, family: KernelFamily, params: dict, problem: Problem) -> CompiledKernel | Measurement:
        try:
            return compile_kernel(family, params, problem, self.gpu.arch)
        except CompileError as exc:
            return Measurement("compile_error", message=f"{exc}\n{exc.log[-2000:]}", versions=self._versions)

    def _stamp(self, m: Measurement, ck: CompiledKernel) -> Measurement:
        m.resources, m.compile_seconds = ck.resources, ck.compile_seconds
        m.versions = self._versions
        return m

    def measure(self, family: KernelFamily, params: dict, problem: Problem) -> Measurement:
        """The point as a call of `problem` runs it (KernelFamily.served_form), filed under the point."""
        from .worker import Job

        family, params = family.served_form(params, self.gpu, problem)
        ck = self._compile(family, params, problem)
        if isinstance(ck, Measurement):
            return ck
        return self._stamp(self._worker.run(Job("kernel", problem, self._seed(), family.name, params, ck, gpu=self.gpu)), ck)

    def peer(self, backend: str, problem: Problem) -> Measurement:
        from .worker import Job

        m = self._worker.run(Job("peer", problem, self._seed(), backend=backend))
        m.versions = self._versions
        return m

    def bench(self, family: KernelFamily, params: dict, problem: Problem,
              backends: tuple[str, ...]) -> SideBySide:
        """The point (as served, like `measure`) and the peers in one worker job, timed in turns on
        the same inputs."""
        from .worker import Job

        family, params = family.served_form(params, self.gpu, problem)
        ck = self._compile(family, params, problem)
        if isinstance(ck, Measurement):
            return SideBySide(ck)
        r = self._worker.run(Job("bench", problem, self._seed(), family.name, params, ck, backends=backends,
                                 gpu=self.gpu),
                             timeout=self._worker.timeout * (1 + len(backends)))
        if isinstance(r, Measurement):  # the worker was lost: nothing was timed beside the kernel
            r = SideBySide(r)
        self._stamp(r.kernel, ck)
        for m in r.peers.values():
            m.versions = self._versions
        return r

    def close(self) -> None:
        self._worker.close()
        if self._compilers is not None:
            self._compilers.shutdown(wait=False, cancel_futures=True)


class ReplayRunner:
    """Answers from measurements recorded earlier on a real GPU (any versions, latest first).

    TUNER_REPLAY_DELAY (seconds, default 0) makes each answer take that long, like a GPU
    measurement: the reliability tests use it to land signals in the middle of a search.
    """

    def __init__(self, url: str, gpu_key: str | None = None) -> None:
        import os

        self.delay = float(os.environ.get("TUNER_REPLAY_DELAY") or 0)
        from .db import queries
        from .db.engine import masked, open_readonly, session_factory

        self.sessions = session_factory(open_readonly(url))  # never writes to the recording
        self.source = masked(url)
        with self.sessions() as s:
            gpus = queries.list_gpus(s)
        if not gpus:
            raise ValueError(f"the replay database {self.source} holds no measurements")
        info = next((g for g in gpus if gpu_key in (None, g.key)), None)
        if info is None:
            raise ValueError(f"the replay database has no GPU {gpu_key!r}; it has {', '.join(g.key for g in gpus)}")
        self.gpu = GpuSpec(**info.spec)
        self._versions = {"replay": self.source}  # stored with each row: never a password

    def recorded(self, problem: Problem) -> set[str]:
        """The families (and SDPA peers) the recording can answer for `problem`: a search of any
        other would only miss, so the CLI refuses it up front."""
        from .db import queries

        with self.sessions() as s:
            return queries.measured_families(s, self.gpu.key, problem.key)

    def recorded_problems(self) -> list[str]:
        from .db import queries

        with self.sessions() as s:
            return [p.key for p in queries.list_problems(s, self.gpu.key)]

    def versions(self) -> dict:
        return self._versions

    def _latest(self, family: str, params: dict, problem: Problem) -> Measurement | None:
        from .db import queries

        with self.sessions() as s:
            m = queries.find_measurement(s, self.gpu.key, problem.key, family, params, None)
        if m is not None:
            m.versions = self._versions
        return m

    def prefetch(self, family: KernelFamily, points: list[dict], problem: Problem) -> None:
        pass   # nothing to compile: the recording answers

    def measure(self, family: KernelFamily, params: dict, problem: Problem) -> Measurement | None:
        if self.delay > 0:
            time.sleep(self.delay)
        return self._latest(family.name, params, problem)

    def peer(self, backend: str, problem: Problem) -> Measurement | None:
        return self._latest(backend, {}, problem)

    def bench(self, family: KernelFamily, params: dict, problem: Problem,
              backends: tuple[str, ...]) -> SideBySide | None:
        """What was recorded for the point and each peer (none of them timed beside the others
        here, unless the recording was a bench)."""
        kernel = self.measure(family, params, problem)
        if kernel is None:
            return None
        peers = {b: m for b in backends if (m := self.peer(b, problem)) is not None}
        return SideBySide(kernel, peers)

    def close(self) -> None:
        pass
