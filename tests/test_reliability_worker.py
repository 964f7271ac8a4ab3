"""The worker's crash and timeout paths on the CPU: a fake child entry (tests/fake_workers.py)
dies, hangs or answers, and the parent records `crash` / `timeout` and takes the next job in a
fresh process. Then the same through Search: a faulty family never stops the search, and no
failure (wrong_result included) ever becomes the best config."""

from __future__ import annotations

import re
import time

import pytest

import fake_workers
from faulty_families import FAMILIES as FAULTY
from tuner.db import queries
from tuner.db.engine import make_engine, session_factory
from tuner.gpu import H100_SXM
from tuner.kernel_templates import get_family
from tuner.problem import Problem
from tuner.records import STATUSES
from tuner.search import Search
from tuner.worker import Job, Worker

P = Problem(1, 2, 128, 128, 64, "fp32", False)
BY_NAME = {f.name: f for f in FAULTY}


def job(family: str, **params) -> Job:
    return Job("kernel", P, 0, family, params or {"x": 1}, None)


def pid_of(message: str) -> int:
    return int(re.search(r"pid (\d+)", message).group(1))


def test_crash_timeout_and_fresh_process():
    w = Worker(timeout=2.0, serve=fake_workers.serve)
    try:
        m0 = w.run(job("simt", a=1))
        assert m0.status == "ok"
        first = pid_of(m0.message)
        assert w.run(job("simt", a=2)).status == "ok" and pid_of(w.run(job("simt", a=3)).message) == first  # reused

        crash = w.run(job("test_oob"))
        assert crash.status == "crash" and "exit code 7" in crash.message, crash.message
        m1 = w.run(job("simt", a=1))
        assert m1.status == "ok" and pid_of(m1.message) != first

        reported = w.run(job("test_oob_reported"))
        assert reported.status == "crash" and "illegal memory access" in reported.message
        m2 = w.run(job("simt", a=1))
        assert m2.status == "ok" and pid_of(m2.message) not in (first, pid_of(m1.message))

        t0 = time.monotonic()
        hang = w.run(job("test_spin"))
        assert hang.status == "timeout" and "worker killed" in hang.message
        assert 1.9 < time.monotonic() - t0 < 10
        short = w.run(job("test_spin"), timeout=1.0)  # a per-job limit overrides the default
        assert short.status == "timeout" and "1 s" in short.message
        m3 = w.run(job("simt", a=1))
        assert m3.status == "ok" and pid_of(m3.message) not in (first, pid_of(m1.message), pid_of(m2.message))
    finally:
        w.close()
    assert w._proc is None


def test_worker_that_never_starts_is_an_error_not_a_hang():
    w = Worker(timeout=2.0, serve=fake_workers.never_ready)
    with pytest.raises(RuntimeError, match="did not start"):
        w.run(job("simt"))
    w.close()


def test_bench_compiles_then_times_in_one_job_and_survives_a_lost_worker(monkeypatch):
    """GpuRunner.bench compiles the point for real (NVRTC needs no GPU) and sends one bench job;
    the kernel and every peer come back from the same process. A worker lost mid-bench still
    leaves a kernel row (crash, with the compile's resources) and no peer figure."""
    from tuner.runner import GpuRunner

    monkeypatch.setattr("tuner.versions.run_versions", lambda: {"driver": "none here"})  # it asks the driver
    fam = get_family("flash_fwd_simt")
    params = next(iter(fam.valid_points(H100_SXM, P)))
    runner = GpuRunner(H100_SXM)
    runner._worker = Worker(timeout=5.0, serve=fake_workers.serve)
    try:
        r = runner.bench(fam, params, P, ("sdpa_efficient", "sdpa_math"))
        assert r.kernel.status == "ok" and set(r.peers) == {"sdpa_efficient", "sdpa_math"}
        assert {pid_of(m.message) for m in (r.kernel, *r.peers.values())} == {pid_of(r.kernel.message)}
        assert r.kernel.resources.registers > 0 and r.kernel.versions == runner.versions()
        assert all(m.versions == runner.versions() for m in r.peers.values())
        lost = runner.bench(fam, params, P, ("sdpa_efficient", "test_oob"))
        assert lost.kernel.status == "crash" and lost.peers == {}
        assert lost.kernel.resources.registers == r.kernel.resources.registers
        again = runner.bench(fam, params, P, ("sdpa_math",))
        assert again.kernel.ok and pid_of(again.kernel.message) != pid_of(r.kernel.message)
    finally:
        runner.close()


class WorkerRunner:
    """GpuRunner without the compile step: every job goes through a real Worker process."""

    def __init__(self, timeout: float) -> None:
        self.gpu = H100_SXM
        self._worker = Worker(timeout=timeout, serve=fake_workers.serve)

    def versions(self) -> dict:
        return {"fake": "1"}

    def prefetch(self, family, points, problem) -> None:
        pass

    def measure(self, family, params, problem):
        m = self._worker.run(Job("kernel", problem, 0, family.name, params, None))
        m.versions = self.versions()
        return m

    def peer(self, backend, problem):
        return None

    def close(self) -> None:
        self._worker.close()


def test_search_survives_faulty_families(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    sessions = session_factory(make_engine(url))
    runner = WorkerRunner(timeout=1.5)
    s = Search(runner, sessions, url, sampler="grid", seed=0)
    try:
        oob = s.tune(BY_NAME["test_oob"], P, trials=2)
        spin = s.tune(BY_NAME["test_spin"], P, trials=1)
        wrong = s.tune(BY_NAME["test_wrong"], P, trials=2)
        simt = get_family("flash_fwd_simt")
        good = s.tune(simt, P, trials=3)
    finally:
        runner.close()
    # counts are per answer (a re-proposed point answered from the DB counts again): statuses only
    assert set(oob.counts) == {"crash"} and oob.best is None
    assert set(spin.counts) == {"timeout"} and spin.best is None
    assert set(wrong.counts) == {"wrong_result"} and wrong.best is None  # tflops 1e6, never the best
    assert good.counts.get("ok", 0) >= 1 and good.best is not None and good.best.tflops < 1e6

    with sessions() as ses:
        rows = queries.measurements(ses)
        best = queries.best_rows(ses)
    assert all(r["status"] in STATUSES for r in rows)
    by_family = {}
    for r in rows:
        by_family.setdefault(r["family"], []).append(r["status"])
    assert sorted(by_family["test_oob"]) == ["crash", "crash"]
    assert all("exit code 7" in r["message"] for r in rows if r["family"] == "test_oob")
    assert by_family["test_spin"] == ["timeout"]
    assert by_family["test_wrong"] == ["wrong_result", "wrong_result"]
    assert [b.family for b in best] == ["flash_fwd_simt"]
    # every row once: no point stored twice
    keys = [(r["family"], r["params_key"], r["problem_key"], r["versions_key"]) for r in rows]
    assert len(keys) == len(set(keys))


def test_extra_families_env(tmp_path):
    """TUNER_EXTRA_FAMILIES plugs the faulty families in, in a fresh interpreter (as the worker is)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    env = dict(os.environ, TUNER_EXTRA_FAMILIES="faulty_families", PYTHONPATH=tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "from tuner.kernel_templates import get_family; print(sorted(get_family(n).name for n in ('test_oob','test_spin','test_wrong','flash_fwd_simt')))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "test_oob" in out.stdout and "flash_fwd_simt" in out.stdout
    env["TUNER_EXTRA_FAMILIES"] = "no_such_module_here"
    out = subprocess.run([sys.executable, "-m", "tuner.cli", "search", "--replay", "sqlite:///x.db", "--no-peers"],
                         env=dict(env, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [ln for ln in out.stderr.splitlines() if ln.strip()] == [
        ln for ln in out.stderr.splitlines() if "no_such_module_here" in ln]
    assert not (tmp_path / "x.db").exists()
