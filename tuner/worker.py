"""A GPU worker process with a time limit per job.

A candidate that faults poisons its CUDA context, and one that hangs never returns: either way
only the worker is lost. The parent records `crash` or `timeout` and starts a fresh worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass

from .gpu import GpuSpec
from .problem import Problem
from .records import CompiledKernel, Measurement, SideBySide

START_TIMEOUT = 180.0  # torch import + CUDA context creation on a cold machine


@dataclass
class Job:
    kind: str  # "kernel", "peer" or "bench" (the kernel and `backends` in turns)
    problem: Problem
    seed: int
    family: str = ""
    params: dict | None = None
    compiled: CompiledKernel | None = None
    backend: str = ""
    backends: tuple[str, ...] = ()
    gpu: GpuSpec | None = None   # where a kernel runs: its launch geometry is sized for it


def _serve(conn, device_index: int, l2_bytes: int) -> None:
    import torch

    from .kernel_templates import get_family
    from .measure import DeviceFault, measure_kernel, measure_peer, measure_side_by_side
    from .timing import Timer

    torch.cuda.set_device(device_index)
    timer = Timer(l2_bytes)
    conn.send("ready")
    while True:
        try:
            job: Job | None = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            if job.kind == "kernel":
                m = measure_kernel(get_family(job.family), job.params, job.problem, job.compiled, timer,
                                   job.seed, job.gpu)
            elif job.kind == "bench":
                m = measure_side_by_side(get_family(job.family), job.params, job.problem, job.compiled,
                                         job.backends, timer, job.seed, job.gpu)
            else:
                m = measure_peer(job.backend, job.problem, timer, job.seed)
        except DeviceFault as exc:
            conn.send(Measurement("crash", message=f"CUDA fault: {exc}"))
            conn.close()
            os._exit(3)  # the context is unusable; the parent starts a new worker
        except Exception as exc:  # a bug in measuring is still a recorded row, never a lost trial
            import torch

            torch.cuda.empty_cache()
            conn.send(Measurement("launch_error", message=f"{type(exc).__name__}: {exc}"[:500]))
            continue
        conn.send(m)
        torch.cuda.empty_cache()


class Worker:
    """Runs jobs one at a time in a child process; restarts it after a crash or a timeout."""

    def __init__(self, device_index: int = 0, l2_bytes: int = 50 << 20, timeout: float = 60.0,
                 serve=None) -> None:
        """`serve(conn, device_index, l2_bytes)` is the child's entry (default `_serve`): a
        module-level function (spawn pickles it by name). Tests inject fakes that crash or hang."""
        self.device_index, self.l2_bytes, self.timeout = device_index, l2_bytes, timeout
        self._serve = serve or _serve
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=self._serve, args=(child, self.device_index, self.l2_bytes), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            ready = parent.poll(START_TIMEOUT) and parent.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            code = self._proc.exitcode
            self.close(kill=True)
            raise RuntimeError(f"the GPU worker did not start (exit code {code})")

    def run(self, job: Job, timeout: float | None = None) -> Measurement | SideBySide:
        """The job's result; a Measurement with status crash or timeout whenever the worker was lost."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        self._conn.send(job)
        if not self._conn.poll(limit):
            self.close(kill=True)
            return Measurement("timeout", message=f"no result within {limit:.0f} s; worker killed")
        try:
            m = self._conn.recv()
        except (EOFError, OSError):
            if self._proc is not None:
                self._proc.join(5)  # reap it, so its exit code is known
            code = self._proc.exitcode if self._proc else None
            self.close(kill=True)
            return Measurement("crash", message=f"worker died (exit code {code}) after {time.monotonic() - start:.1f} s")
        if isinstance(m, Measurement) and m.status == "crash":
            self.close(kill=True)
        return m

    def close(self, kill: bool = False) -> None:
        if self._proc is not None and self._proc.pid is not None:
            if kill or not self._conn:
                self._proc.kill()
            else:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
                self._proc.join(5)
                if self._proc.is_alive():
                    self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
