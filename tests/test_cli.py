"""The CLI without a GPU: every user mistake is one line on stderr and a non-zero exit, no traceback.

Run as `python -m tuner.cli` in a subprocess, with CUDA_VISIBLE_DEVICES="" so no GPU is seen on
any machine, and TUNER_DB / TUNER_LOOKUP pointing into tmp_path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tuner.db import queries
from tuner.db.engine import make_engine, session_factory
from tuner.gpu import H100_SXM
from tuner.problem import Problem
from tuner.records import Measurement


@dataclass
class Out:
    code: int
    stdout: str
    stderr: str

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


@pytest.fixture
def cli(tmp_path):
    env = dict(os.environ, TUNER_DB=f"sqlite:///{tmp_path / 'env.db'}", TUNER_LOOKUP=str(tmp_path / "best.json"),
               CUDA_VISIBLE_DEVICES="", NO_COLOR="1", COLUMNS="200")

    def run(*args: str) -> Out:
        p = subprocess.run([sys.executable, "-m", "tuner.cli", *args], env=env, capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
        return Out(p.returncode, p.stdout, p.stderr)

    return run


@pytest.fixture(scope="module")
def replay_url(tmp_path_factory) -> str:
    """A tiny recorded DB so `search --replay` gets past the GPU step."""
    url = f"sqlite:///{tmp_path_factory.mktemp('cli') / 'replay.db'}"
    p = Problem(2, 4, 512, 512, 64, "fp32", True)
    with session_factory(make_engine(url)).begin() as s:
        queries.record_measurement(s, H100_SXM, p, "flash_fwd_simt",
                                   dict(Br=64, Bc=64, TM=4, TN=4, stages=1, min_blocks=1),
                                   Measurement("ok", median_ms=1.0, tflops=p.tflops(1.0), versions={"x": "1"}))
    return url


def one_line_error(out: Out, *words: str) -> str:
    assert out.code != 0, out
    assert "Traceback" not in out.text, out.text
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_main_guard_and_help(cli):
    out = cli("--help")
    assert out.code == 0 and "search" in out.stdout and "gpus" in out.stdout and "export" in out.stdout


def test_search_without_gpu(cli, tmp_path):
    out = cli("search", "--gpu", "auto", "--trials", "2")
    line = one_line_error(out, "no CUDA GPU")
    assert out.code == 1 and line.startswith("error:")
    assert not (tmp_path / "best.json").exists()


def test_search_default_gpu_without_gpu(cli):
    out = cli("search", "--shape", "1,2,128,64")
    one_line_error(out, "no CUDA GPU")
    assert out.code == 1


def test_gpus_without_gpu(cli):
    out = cli("gpus")
    assert out.code == 1 and "Traceback" not in out.text
    assert "no CUDA GPU is visible" in out.stdout


def test_bench_without_gpu(cli):
    out = cli("bench", "--shape", "1,2,128,64")
    one_line_error(out, "no CUDA GPU")
    assert out.code == 1


def test_max_error_out_of_range_is_one_line(cli):
    out = cli("search", "--shape", "1,2,128,64", "--max-error", "2")
    one_line_error(out, "--max-error must be in (0, 1)")
    assert out.code != 0


def test_bench_unknown_peer_is_refused_before_anything_runs(cli):
    out = cli("bench", "--shape", "1,2,128,64", "--peer", "sdpa_flash", "--peer", "flash3")
    assert out.code != 0
    assert "unknown peer 'flash3'" in out.text and "sdpa_cudnn" in out.text
    assert "Traceback" not in out.text


@pytest.mark.parametrize(
    "shape,words",
    [("2,4,512", ["'2,4,512'", "must be B,H,N,D"]), ("2,4,x,64", ["'2,4,x,64'", "must be integers"]),
     ("2,4,512,64,sideways", ["fifth field"]), ("0,4,512,64", ["batch must be a positive integer"])],
    ids=["three-fields", "not-int", "bad-flag", "zero-batch"],
)
def test_malformed_shape(cli, shape, words):
    out = cli("search", "--shape", shape, "--trials", "2")
    one_line_error(out, "error:", *words)
    assert out.code == 2


def test_bad_dtype(cli):
    out = cli("search", "--dtype", "int8", "--shape", "1,2,128,64")
    one_line_error(out, "--dtype must be one of fp32, fp16, bf16, fp8", "'int8'")
    assert out.code == 2


def test_fp8_search_without_gpu(cli, tmp_path):
    out = cli("search", "--gpu", "auto", "--dtype", "fp8", "--trials", "2")
    line = one_line_error(out, "no CUDA GPU")
    assert out.code == 1 and line.startswith("error:")
    assert not (tmp_path / "best.json").exists()


def test_fp8_help_and_a_family_that_takes_no_fp8(cli, replay_url):
    assert "fp8 = e4m3 inputs, bf16 output" in cli("search", "--help").stdout
    out = cli("search", "--replay", replay_url, "--shape", "1,2,128,64", "--dtype", "fp8", "--family", "flash_fwd_mma",
              "--no-peers")
    one_line_error(out, "B1-H2-N128-D64-fp8-full", "flash_fwd_mma takes fp32/fp16/bf16 inputs, not fp8")
    assert out.code == 2


def test_unknown_family(cli):
    out = cli("search", "--family", "flash_fwd_tma", "--shape", "1,2,128,64")
    one_line_error(out, "unknown kernel family 'flash_fwd_tma'", "flash_fwd_simt")
    assert out.code == 2


def test_unsupported_head_dim_with_replay(cli, replay_url):
    out = cli("search", "--replay", replay_url, "--shape", "1,2,128,80", "--no-peers")
    one_line_error(out, "head dim", "80")
    assert out.code == 2


def test_unwritable_db_search(cli, replay_url, tmp_path):
    out = cli("search", "--replay", replay_url, "--db", "sqlite:////proc/nope/x.db", "--shape", "2,4,512,64,causal",
              "--trials", "1", "--no-peers", "--lookup", str(tmp_path / "l.json"))
    one_line_error(out, "/proc/nope")
    assert out.code == 2


def test_unwritable_db_export(cli, tmp_path):
    out = cli("export", "-o", str(tmp_path / "x.json"), "--db", "sqlite:////proc/nope/x.db")
    one_line_error(out, "cannot create the database directory /proc/nope")
    assert out.code == 2


def test_unwritable_db_from_env(cli, tmp_path, monkeypatch):
    env = dict(os.environ, TUNER_DB="sqlite:////proc/nope/y.db", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "tuner.cli", "export", "-o", str(tmp_path / "x.json")], env=env,
                       capture_output=True, text=True, timeout=120)
    one_line_error(Out(p.returncode, p.stdout, p.stderr), "/proc/nope")


def test_malformed_db_url(cli, tmp_path):
    out = cli("export", "-o", str(tmp_path / "x.json"), "--db", "not a url")
    one_line_error(out, "malformed database URL")
    assert out.code == 2


def test_replay_db_missing_or_without_measurements(cli, tmp_path):
    out = cli("search", "--replay", f"sqlite:///{tmp_path / 'missing.db'}", "--shape", "1,2,128,64", "--no-peers")
    one_line_error(out, "no database at")
    assert out.code == 2
    from tuner.db.engine import make_engine

    make_engine(f"sqlite:///{tmp_path / 'empty.db'}").dispose()
    out = cli("search", "--replay", f"sqlite:///{tmp_path / 'empty.db'}", "--shape", "1,2,128,64", "--no-peers")
    one_line_error(out, "holds no measurements")
    assert out.code == 2


def test_export_empty_db_warns(cli, tmp_path):
    out = cli("export", "-o", str(tmp_path / "x.json"), "--db", f"sqlite:///{tmp_path / 'fresh.db'}")
    assert out.code == 0 and "no tuned configs yet" in out.stderr and "0 entries" in out.stdout


def test_usage_error_is_not_a_traceback(cli):
    out = cli("search", "--trials", "0")
    assert out.code == 2 and "Traceback" not in out.text and "--trials" in out.stderr
