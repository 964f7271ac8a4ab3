"""Stored params (a results database, a lookup file) reach CUDA source only as exact points of
their family's space: `#define {name} {value}` never carries text. A crafted database or lookup
is refused on every path (search, bench, dispatch, compile): nothing of it is compiled, no
injected symbol reaches a cubin, no host file reaches a compile log."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from faulty_families import FAMILIES as FAULTY
from tuner import cli
from tuner.db import queries
from tuner.db.engine import make_engine, session_factory
from tuner.dispatch import Dispatcher
from tuner.export import build_lookup, write_lookup
from tuner.db.queries import BestEntry
from tuner.family import in_space
from tuner.gpu import H100_SXM
from tuner.kernel_templates import FAMILIES, get_family
from tuner.problem import Problem
from tuner.records import Measurement, SideBySide

SIMT = get_family("flash_fwd_simt")
MMA = get_family("flash_fwd_mma")
P = Problem(2, 4, 512, 512, 64, "fp32", True)
BASE = dict(Br=64, Bc=64, TM=4, TN=4, stages=1, min_blocks=1)
SYMBOL = "ft_injected_symbol"
SECRET = "FT-HOST-SECRET-5e2a9"  # the content of a "host file" an #include would copy into a log


def injected(host_file: Path) -> str:
    return f'64\n#include "{host_file}"\nextern "C" __global__ void {SYMBOL}() {{}}\n'


@pytest.fixture
def host_file(tmp_path) -> Path:
    p = tmp_path / "secret.txt"
    p.write_text(f"{SECRET}\n")
    return p


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TUNER_CACHE_DIR", str(tmp_path / "cubin"))
    return tmp_path / "cubin"


def test_membership_is_type_exact():
    assert in_space(1, (0, 1)) and in_space("tf32", ("in", "tf32"))
    assert not in_space(True, (0, 1)) and not in_space(False, (0, 1))
    assert not in_space(128.0, (64, 128)) and not in_space("128", (64, 128))
    assert not in_space(1, ("in", "tf32")) and not in_space("tf32\n", ("in", "tf32"))


@pytest.mark.parametrize("value", [True, 64.0, "64", None, [64], "INJECT"], ids=lambda v: type(v).__name__)
def test_check_and_render_refuse_what_is_not_in_the_space(value, host_file):
    params = {**BASE, "Br": injected(host_file) if value == "INJECT" else value}
    why = SIMT.check(params, H100_SXM, P)
    assert why is not None and why.startswith("Br=") and "is not one of (32, 64, 128)" in why
    with pytest.raises(ValueError, match="refusing to render flash_fwd_simt: Br="):
        SIMT.render(params, P)
    assert SIMT.check(BASE, H100_SXM, P) is None and "#define BR 64\n" in SIMT.render(BASE, P)


def test_strings_pass_only_where_the_space_lists_them(host_file):
    wide = Problem(2, 4, 512, 512, 64, "fp32", True, max_error=2e-2)
    good = MMA.default(H100_SXM, wide)
    assert isinstance(good["compute"], str) and MMA.check(good, H100_SXM, wide) is None
    for bad in (good["compute"] + "\n", 1, injected(host_file)):
        assert "compute=" in (MMA.check({**good, "compute": bad}, H100_SXM, wide) or "")
        with pytest.raises(ValueError, match="refusing to render"):
            MMA.render({**good, "compute": bad}, wide)


def test_compile_refuses_before_nvrtc_and_caches_nothing(host_file, cache):
    from tuner.compile import compile_kernel

    with pytest.raises(ValueError, match="refusing to render"):
        compile_kernel(SIMT, {**BASE, "Br": injected(host_file)}, P, H100_SXM.arch)
    assert not cache.exists() or not any(cache.rglob("*"))


class FakeRunner:
    """A GpuRunner stand-in that compiles for real (NVRTC needs no GPU) and times nothing."""

    def __init__(self, gpu, candidate_timeout: float = 60.0) -> None:
        self.gpu = gpu
        self.compiled: list[dict] = []
        self.logs: list[str] = []

    def versions(self) -> dict:
        return {"fake": "1"}

    def _compile(self, family, params, problem):
        from tuner.compile import compile_kernel

        ck = compile_kernel(family, params, problem, self.gpu.arch)
        self.compiled.append(params)
        self.logs.append(ck.log)
        return ck

    def prefetch(self, family, points, problem) -> None:
        pass

    def measure(self, family, params, problem) -> Measurement:
        self._compile(family, params, problem)
        return Measurement("ok", median_ms=1.0, tflops=1.0, versions=self.versions())

    def bench(self, family, params, problem, backends) -> SideBySide:
        self._compile(family, params, problem)
        return SideBySide(Measurement("ok", median_ms=1.0, tflops=problem.tflops(1.0), versions=self.versions()))

    def peer(self, backend, problem):
        return None

    def close(self) -> None:
        pass


def _crafted_db(url: str, rows: list[tuple[str, dict, float]]) -> None:
    with session_factory(make_engine(url)).begin() as s:
        for family, params, tflops in rows:
            queries.record_measurement(s, H100_SXM, P, family, params, Measurement("ok", median_ms=1.0, tflops=tflops))
            queries.update_best(s, H100_SXM.key, P.key, family)


def test_bench_skips_a_crafted_best_and_compiles_the_next(tmp_path, host_file, cache, monkeypatch):
    """`tuner bench` checks every stored best before it renders: the crafted (fastest) row of a
    database is skipped with one warning and the next valid family's best is benched instead."""
    wrong = next(f for f in FAULTY if f.name == "test_wrong")  # compiles in a fraction of a second
    monkeypatch.setitem(FAMILIES, wrong.name, wrong)
    url = f"sqlite:///{tmp_path / 'crafted.db'}"
    _crafted_db(url, [(SIMT.name, {**BASE, "Br": injected(host_file)}, 999.0), (wrong.name, {"x": 1}, 1.0)])
    made: list[FakeRunner] = []
    monkeypatch.setattr("tuner.gpu.detect", lambda which="auto": H100_SXM)
    monkeypatch.setattr("tuner.runner.GpuRunner", lambda gpu, *a: made.append(FakeRunner(gpu)) or made[-1])
    out = CliRunner().invoke(cli.app, ["bench", "--db", url, "--shape", "2,4,512,64,causal"])
    assert out.exit_code == 0, (out.output, out.exception)
    assert "warning: skipping the stored best of B2-H4-N512-D64-fp32-causal (flash_fwd_simt): Br=" in out.output
    assert made[0].compiled == [{"x": 1}]
    cubins = [p.read_bytes() for p in cache.rglob("*.cubin")]
    assert cubins and not any(SYMBOL.encode() in c for c in cubins)
    assert not any(SECRET in log for log in made[0].logs)
    with session_factory(make_engine(url))() as s:
        assert not any(SECRET in (r["message"] or "") for r in queries.measurements(s))


def test_search_records_crafted_params_as_invalid(tmp_path, host_file, cache):
    """The search's one door to the runner is `check`: a crafted point (from a crafted study's
    queue, say) is recorded `invalid` and never compiled."""
    from tuner.search import Search

    url = f"sqlite:///{tmp_path / 'search.db'}"
    runner = FakeRunner(H100_SXM)
    s = Search(runner, session_factory(make_engine(url)), url)
    for params in ({**BASE, "Br": injected(host_file)}, {**BASE, "Br": True}, {**BASE, "Br": 64.0}):
        m, source = s._evaluate(SIMT, P, params, "v", "study", 0)
        assert (m.status, source) == ("invalid", "invalid") and "Br=" in m.message
    assert runner.compiled == [] and not cache.exists()


@pytest.mark.parametrize("value", [True, 64.0, "INJECT"], ids=["true", "float", "text"])
def test_dispatcher_never_compiles_a_crafted_lookup(tmp_path, host_file, cache, value):
    path = tmp_path / "best.json"
    write_lookup(build_lookup([BestEntry(H100_SXM.key, SIMT.name, P, P.bucket().key, BASE, 5.0, 1.0, 1)]), path)
    doc = json.loads(path.read_text())
    doc["entries"][0]["params"]["Br"] = injected(host_file) if value == "INJECT" else value
    path.write_text(json.dumps(doc))
    d = Dispatcher(path)
    d._gpus[0] = H100_SXM  # the GPU a real call would find
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing raises: select skips what fails check
        plan = d._plan(P, 0)
    assert plan.launcher is None and "no tuned config" in plan.reason
    assert not cache.exists()
