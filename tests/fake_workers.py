"""Fake worker entries for tuner.worker.Worker(serve=...): the crash and hang paths without a GPU.

They speak the real protocol ("ready", then one Measurement per Job, a SideBySide per bench Job)
and act on the job's family:
test_oob dies without a word (os._exit, as a segfault would), test_oob_reported reports `crash`
with a driver-like message and exits as the real worker does, test_spin never answers, test_wrong
answers wrong_result (with a huge tflops that must not win), anything else answers ok; a bench Job
whose peers include test_oob dies like test_oob. Every
message carries the child's pid, so a test can see that a fresh process took the next job.
"""

from __future__ import annotations

import os
import time

from tuner.records import Measurement, SideBySide


def serve(conn, device_index: int, l2_bytes: int) -> None:
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        pid = f"pid {os.getpid()}"
        if job.family == "test_oob" or "test_oob" in job.backends:
            os._exit(7)
        if job.family == "test_oob_reported":
            conn.send(Measurement("crash", message=f"CUDA fault: CUDA error: an illegal memory access was encountered ({pid})"))
            conn.close()
            os._exit(3)
        if job.family == "test_spin":
            while True:
                time.sleep(3600)
        if job.family == "test_wrong":
            conn.send(Measurement("wrong_result", tflops=1e6, rel_err=float("nan"), message=f"NaN/Inf in the output ({pid})"))
            continue
        if job.kind == "bench":
            conn.send(SideBySide(Measurement("ok", median_ms=1.0, tflops=2.0, reps=10, message=pid),
                                 {b: Measurement("ok", median_ms=2.0, tflops=1.0, reps=10, message=pid) for b in job.backends}))
            continue
        x = sum(job.params.values()) if job.params else 1
        conn.send(Measurement("ok", median_ms=1.0 / x, min_ms=0.9 / x, max_ms=1.1 / x, tflops=float(x),
                              rel_err=1e-7, reps=10, message=pid))


def never_ready(conn, device_index: int, l2_bytes: int) -> None:
    os._exit(5)
