"""Bad input: each a one-line error and a non-zero exit (no traceback), or in the dispatcher a
fallback with one warning; never a partly written database or lookup file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import tuner.gpu
from tuner.dispatch import Dispatcher
from tuner.export import build_lookup, read_lookup, write_lookup
from tuner.db.queries import BestEntry
from tuner.gpu import A100_SXM, H100_SXM
from tuner.problem import Problem

FIXTURE = Path(__file__).parent / "fixtures" / "h100_simt.db"
P = Problem(2, 4, 512, 512, 64, "fp32", True)
PARAMS = dict(Br=64, Bc=64, TM=4, TN=4, stages=1, min_blocks=1)


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1", COLUMNS="200",
               TUNER_DB=f"sqlite:///{tmp_path / 'env.db'}", TUNER_LOOKUP=str(tmp_path / "env.json"))
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def one_line(out: subprocess.CompletedProcess, *words: str) -> str:
    assert out.returncode != 0, out
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def nothing_written(tmp_path: Path, *names: str) -> None:
    for n in ("env.db", "env.json", *names):
        assert not (tmp_path / n).exists(), n


@pytest.fixture
def replay(tmp_path) -> str:
    shutil.copy(FIXTURE, tmp_path / "replay.db")
    (tmp_path / "replay.db").chmod(0o644)
    return f"sqlite:///{tmp_path / 'replay.db'}"


@pytest.mark.parametrize("shape", ["2,4,512", "2,4,x,64", "0,4,512,64", "2,4,512,64,sideways", "",
                                   "1,1,99999999999999999999,64", "1,1,2147483648,64", "1,64,33554432,64"])
def test_malformed_shape_writes_nothing(tmp_path, replay, shape):
    out = run(tmp_path, "search", "--replay", replay, "--shape", shape, "--no-peers", "--db",
              f"sqlite:///{tmp_path / 'r.db'}", "--lookup", str(tmp_path / "b.json"))
    one_line(out)
    assert out.returncode == 2
    nothing_written(tmp_path, "r.db", "b.json")


def test_unknown_gpu_index_without_gpu(tmp_path):
    out = run(tmp_path, "search", "--gpu", "7", "--db", f"sqlite:///{tmp_path / 'r.db'}")
    one_line(out, "no CUDA GPU")
    assert out.returncode == 1
    nothing_written(tmp_path, "r.db")


def test_gpu_index_checked(monkeypatch):
    monkeypatch.setattr(tuner.gpu, "visible", lambda: [H100_SXM])
    assert tuner.gpu.detect("0") == H100_SXM
    with pytest.raises(ValueError, match=r"--gpu 7: only 1 GPU\(s\) visible \(indices 0..0\)"):
        tuner.gpu.detect("7")
    with pytest.raises(ValueError, match="--gpu -1: only 1"):
        tuner.gpu.detect("-1")
    with pytest.raises(ValueError, match="'auto' or a GPU index, got 'first'"):
        tuner.gpu.detect("first")


@pytest.mark.parametrize("args,words", [
    (("--shape", "1,2,128,80"), ("head dim", "80")),
    (("--shape", "1,2,128,64", "--dtype", "fp64"), ("--dtype", "fp64")),
    (("--shape", "1,2,128,64", "--family", "nope"), ("--family", "'nope' is not one of")),
])
def test_unsupported_problem_writes_nothing(tmp_path, replay, args, words):
    out = run(tmp_path, "search", "--replay", replay, *args, "--no-peers", "--db", f"sqlite:///{tmp_path / 'r.db'}",
              "--lookup", str(tmp_path / "b.json"))
    one_line(out, *words)
    nothing_written(tmp_path, "r.db", "b.json")


def test_db_that_is_not_a_database(tmp_path, replay):
    junk = tmp_path / "junk.db"
    junk.write_bytes(os.urandom(4096))
    before = junk.read_bytes()
    out = run(tmp_path, "search", "--replay", replay, "--shape", "2,4,512,64,causal", "--trials", "2", "--no-peers",
              "--db", f"sqlite:///{junk}", "--lookup", str(tmp_path / "b.json"))
    one_line(out, str(junk), "not a database")
    assert junk.read_bytes() == before
    nothing_written(tmp_path, "b.json")


def test_db_path_is_a_directory(tmp_path):
    (tmp_path / "dir.db").mkdir()
    out = run(tmp_path, "export", "-o", str(tmp_path / "x.json"), "--db", f"sqlite:///{tmp_path / 'dir.db'}")
    one_line(out, "cannot open the database", "dir.db")
    nothing_written(tmp_path, "x.json")


def test_replay_db_that_is_not_a_database(tmp_path):
    (tmp_path / "junk.db").write_bytes(b"\x00garbage" * 100)
    out = run(tmp_path, "search", "--replay", f"sqlite:///{tmp_path / 'junk.db'}", "--shape", "2,4,512,64",
              "--no-peers", "--db", f"sqlite:///{tmp_path / 'r.db'}")
    one_line(out, "not a database")
    nothing_written(tmp_path, "r.db")


def test_export_into_a_path_under_a_file(tmp_path, replay):
    (tmp_path / "afile").write_text("x")
    out = run(tmp_path, "export", "-o", str(tmp_path / "afile" / "sub" / "x.json"), "--db", replay)
    one_line(out, "Not a directory")
    assert (tmp_path / "afile").read_text() == "x"


def _lookup_doc(gpu_key: str = H100_SXM.key) -> dict:
    return build_lookup([BestEntry(gpu_key, "flash_fwd_simt", P, P.bucket().key, PARAMS, 5.0, 1.0, 1)])


@pytest.mark.parametrize("content", [
    b'{"schema": "flashtune.best-configs", "version": 1, "entries": [',  # truncated
    b"\xff\xfe\x00garbage",  # not text
    b'{"openapi": "3.0.0", "paths": {}}',  # someone else's JSON
    b'{"schema": "flashtune.best-configs", "version": 99, "entries": []}',  # newer
    b'{"schema": "flashtune.best-configs", "version": 1, "entries": [{"gpu_key": 3}]}',  # bad entry
])
def test_dispatcher_ignores_a_bad_lookup_with_one_warning(tmp_path, content):
    path = tmp_path / "best.json"
    path.write_bytes(content)
    d = Dispatcher(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert d.select(P, H100_SXM) is None
        assert d.select(P, H100_SXM) is None  # read once, warned once
    msgs = [str(w.message) for w in caught if "flashtune" in str(w.message)]
    assert len(msgs) == 1 and "ignoring the best-config lookup" in msgs[0] and str(path) in msgs[0]


def _entry_params(**changes) -> bytes:
    import json

    doc = _lookup_doc()
    doc["entries"][0]["params"].update(changes)
    return json.dumps(doc).encode()


def _entry_without(field: str) -> bytes:
    import json

    doc = _lookup_doc()
    del doc["entries"][0][field]
    return json.dumps(doc).encode()


@pytest.fixture
def fake_cuda():
    """Tensors that say cuda:0 on a CPU-only build (shape, dtype, device, no storage): enough for
    attention's whole CPU-side path, the SDPA fallback included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        yield


def _attention_warnings(path: Path) -> list[str]:
    import torch

    d = Dispatcher(path)
    d._gpus[0] = H100_SXM  # what the call would find on an H100
    q = torch.empty(2, 4, 512, 64, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            o = d(q, q, q, causal=True)
            assert o.shape == q.shape and o.device == q.device
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("content", [
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError inside json.loads
    _entry_params(stages=True), _entry_params(min_blocks=1.0), _entry_params(Br="64"),
    _entry_without("params"), _entry_without("problem"), b"null", b"",
], ids=["nested", "true", "float", "string", "no-params", "no-problem", "null", "empty"])
def test_attention_falls_back_with_one_warning_for_any_lookup(tmp_path, fake_cuda, content):
    path = tmp_path / "best.json"
    path.write_bytes(content)
    msgs = _attention_warnings(path)
    assert len(msgs) == 1, msgs
    assert "scaled_dot_product_attention" in msgs[0] and "\n" not in msgs[0]


def test_attention_falls_back_when_a_looked_up_config_cannot_compile(tmp_path, fake_cuda, monkeypatch):
    from tuner import compile as tc

    def fail(*args, **kwargs):
        raise tc.CompileError("NVRTC failed for flash_fwd_simt: error: something", "long log\n" * 50)

    monkeypatch.setattr(tc, "compile_kernel", fail)
    write_lookup(_lookup_doc(), tmp_path / "best.json")
    msgs = _attention_warnings(tmp_path / "best.json")
    assert len(msgs) == 1 and "cannot be used (NVRTC failed for flash_fwd_simt" in msgs[0], msgs


def test_dispatcher_good_lookup_and_foreign_gpu(tmp_path):
    path = tmp_path / "best.json"
    write_lookup(_lookup_doc(), path)
    assert Dispatcher(path).select(P, H100_SXM)["params"] == PARAMS
    assert Dispatcher(path).select(P, A100_SXM) is None  # another GPU model never silently shares


def test_lookup_write_interrupted_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "best.json"
    write_lookup(_lookup_doc(), path)
    old = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", boom)
    new = _lookup_doc()
    new["entries"][0]["tflops"] = 99.0
    with pytest.raises(OSError, match="simulated"):
        write_lookup(new, path)
    assert path.read_bytes() == old and read_lookup(path)["entries"][0]["tflops"] == 5.0
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]  # no temp file left

    monkeypatch.undo()
    with pytest.raises(ValueError, match="lacks field"):  # an invalid document is never written
        write_lookup({**new, "entries": [{"gpu_key": "x"}]}, path)
    assert path.read_bytes() == old


def test_lookup_write_killed_mid_write_keeps_the_old_file(tmp_path):
    """A process killed while writing (after the temp file got bytes, before the rename)."""
    path = tmp_path / "best.json"
    write_lookup(_lookup_doc(), path)
    old = path.read_bytes()
    code = (
        "import os\n"
        "import tuner.export as e\n"
        "import tuner.files as files\n"
        "files.os.replace = lambda src, dst: os._exit(9)\n"   # the temp file is written, the rename not done
        f"e.write_lookup(e.read_lookup({str(path)!r}), {str(path)!r})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 9
    assert path.read_bytes() == old
    assert read_lookup(path)["entries"]
