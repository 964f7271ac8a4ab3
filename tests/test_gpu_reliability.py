"""On the GPU: faulty candidates are recorded and the search goes on; the dispatcher under threads
and streams. The faulty kernels are the test-only families of tests/faulty_families.py, plugged
into the worker process through TUNER_EXTRA_FAMILIES."""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

TESTS = str(Path(__file__).parent)


@pytest.fixture
def faulty_env(monkeypatch):
    monkeypatch.setenv("TUNER_EXTRA_FAMILIES", "faulty_families")
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_crash_timeout_wrong_then_a_good_kernel(tmp_path, faulty_env):
    from faulty_families import FAMILIES

    from tuner.db import queries
    from tuner.db.engine import make_engine, session_factory
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.problem import Problem
    from tuner.runner import GpuRunner
    from tuner.search import Search

    fam = {f.name: f for f in FAMILIES}
    gpu = detect()
    p = Problem(1, 2, 256, 256, 64, "fp32", True)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    sessions = session_factory(make_engine(url))
    runner = GpuRunner(gpu, candidate_timeout=10)
    s = Search(runner, sessions, url, sampler="grid", seed=0)
    t0 = time.monotonic()
    try:
        oob = s.tune(fam["test_oob"], p, trials=2)
        spin = s.tune(fam["test_spin"], p, trials=1)
        wrong = s.tune(fam["test_wrong"], p, trials=2)
        simt = get_family("flash_fwd_simt")
        good = s.tune(simt, p, trials=1)
    finally:
        runner.close()
    print(f"faulty search took {time.monotonic() - t0:.1f} s")
    assert set(oob.counts) == {"crash"} and oob.best is None
    assert set(spin.counts) == {"timeout"} and spin.best is None
    assert set(wrong.counts) == {"wrong_result"} and wrong.best is None
    assert good.counts == {"ok": 1} and good.best is not None and good.best.tflops > 0

    with sessions() as ses:
        rows = queries.measurements(ses)
        best = queries.best_rows(ses)
    got = {}
    for r in rows:
        got.setdefault(r["family"], []).append(r)
        print(r["family"], r["params_key"], r["status"], r["message"][:160])
    assert sorted(r["status"] for r in got["test_oob"]) == ["crash", "crash"]
    assert all("illegal" in r["message"].lower() for r in got["test_oob"]), [r["message"] for r in got["test_oob"]]
    assert [r["status"] for r in got["test_spin"]] == ["timeout"]
    assert sorted(r["status"] for r in got["test_wrong"]) == ["wrong_result", "wrong_result"]
    nan_row = next(r for r in got["test_wrong"] if r["params"] == {"x": 1})
    assert "NaN/Inf" in nan_row["message"]
    far_row = next(r for r in got["test_wrong"] if r["params"] == {"x": 2})
    assert "over budget" in far_row["message"] and far_row["rel_err"] > 1
    assert [r["status"] for r in got["flash_fwd_simt"]] == ["ok"]
    assert [b.family for b in best] == ["flash_fwd_simt"]


def test_dispatcher_threads_and_streams(tmp_path):
    import torch

    from tuner.db.queries import BestEntry
    from tuner.dispatch import Dispatcher
    from tuner.export import build_lookup, write_lookup
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.problem import Problem
    from tuner.reference import attention_fp64, compare

    gpu = detect()
    simt = get_family("flash_fwd_simt")
    shapes = [Problem(2, 4, 256, 256, 64, "fp32", True), Problem(2, 4, 200, 200, 64, "fp32", True),
              Problem(1, 8, 512, 512, 64, "fp32", False), Problem(2, 4, 256, 256, 128, "fp32", True)]
    entries = [BestEntry(gpu.key, simt.name, p, p.bucket().key, simt.default(gpu, p), 1.0, 1.0, i)
               for i, p in enumerate(shapes)]
    path = tmp_path / "best.json"
    write_lookup(build_lookup(entries), path)
    disp = Dispatcher(path)

    n_threads, n_streams, rounds = 8, 2, 3
    barrier = threading.Barrier(n_threads)
    errors: list[str] = []
    checked = [0]
    lock = threading.Lock()

    def work(t: int) -> None:
        try:
            torch.cuda.set_device(gpu.index)
            streams = [torch.cuda.Stream() for _ in range(n_streams)]
            g = torch.Generator(device="cuda").manual_seed(t)
            barrier.wait()
            for r in range(rounds):
                pending = []
                for i, s in enumerate(streams):
                    p = shapes[(t + i + r) % len(shapes)]
                    with torch.cuda.stream(s):
                        q, k, v = (torch.randn(p.batch, p.heads, p.seqlen_q, p.head_dim, device="cuda", generator=g)
                                   for _ in range(3))
                        o = disp(q, k, v, causal=p.mask)
                    pending.append((s, p, q, k, v, o))
                for s, p, q, k, v, o in pending:
                    s.synchronize()
                    ref, _ = attention_fp64(q, k, v, p.mask, p.head_dim ** -0.5)
                    err = compare(o, None, ref, None)
                    if not err.within(p.rel_budget):
                        with lock:
                            errors.append(f"thread {t} {p.key}: rel {err.rel:.3g}")
                    with lock:
                        checked[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            with lock:
                errors.append(f"thread {t}: {type(exc).__name__}: {exc}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
    assert not errors, errors
    assert checked[0] == n_threads * n_streams * rounds
    assert not [w for w in caught if "flashtune" in str(w.message)], "a thread fell back to SDPA"
    assert all(plan.launcher is not None for plan in disp._plans.values())
