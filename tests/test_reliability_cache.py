"""The compile cache: a truncated or corrupted entry is detected (hash) and rebuilt, and several
processes filling one cache at once leave only whole entries (each file is written to a temp file
and renamed; NVRTC output is deterministic, so racing writers of one key write the same bytes).
Uses the tiny test families of tests/faulty_families.py: they compile in a fraction of a second."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import pytest

from faulty_families import FAMILIES
from tuner import compile as tc
from tuner.problem import Problem
from tuner.records import short_hash

P = Problem(1, 2, 128, 128, 64, "fp32", False)
ARCH = "sm_90a"
BY_NAME = {f.name: f for f in FAMILIES}

try:
    tc.nvrtc_version()
except Exception as exc:  # pragma: no cover
    pytest.skip(f"NVRTC not usable here: {exc}", allow_module_level=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNER_CACHE_DIR", str(tmp_path / "cubin"))
    return tmp_path / "cubin"


def _compile(name: str, x: int):
    return tc.compile_kernel(BY_NAME[name], {"x": x}, P, ARCH)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "meta-garbage", "meta-missing", "cubin-missing"])
def test_damaged_entry_is_rebuilt(cache, damage):
    first = _compile("test_wrong", 1)
    assert not first.cached
    assert _compile("test_wrong", 1).cached
    cubin, meta = tc._paths(first.key)
    if damage == "truncate":
        cubin.write_bytes(cubin.read_bytes()[: len(first.cubin) // 2])
    elif damage == "flip":
        data = bytearray(cubin.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cubin.write_bytes(bytes(data))
    elif damage == "empty":
        cubin.write_bytes(b"")
    elif damage == "meta-garbage":
        meta.write_text('{"key": "trunc')
    elif damage == "meta-missing":
        meta.unlink()
    else:
        cubin.unlink()
    rebuilt = _compile("test_wrong", 1)
    assert not rebuilt.cached and rebuilt.cubin == first.cubin
    again = _compile("test_wrong", 1)  # and the rebuilt entry is whole again
    assert again.cached and again.cubin == first.cubin


@pytest.mark.parametrize("meta", [
    [], "a string", None, {}, {"cubin_sha": "x"},
    "drop:kernel_name", "key:1", "resources:[]", "resources:{}", "compile_seconds:true", "resources.registers:1.5",
], ids=lambda m: m if isinstance(m, str) else json.dumps(m))
def test_metadata_of_the_wrong_shape_is_a_miss(cache, meta):
    """Valid JSON that is not what _write_cache writes: a miss and a rebuild, never a traceback."""
    first = _compile("test_wrong", 1)
    cubin, meta_path = tc._paths(first.key)
    good = json.loads(meta_path.read_text())
    if isinstance(meta, str) and ":" in meta:
        field, value = meta.split(":", 1)
        if field == "drop":
            del good[value]
        elif "." in field:
            outer, inner = field.split(".")
            good[outer][inner] = json.loads(value)
        else:
            good[field] = json.loads(value)
        meta = good
    meta_path.write_text(json.dumps(meta))
    rebuilt = _compile("test_wrong", 1)
    assert not rebuilt.cached and rebuilt.cubin == first.cubin
    assert _compile("test_wrong", 1).cached


def test_an_entry_filed_under_another_key_is_not_served(cache):
    """A whole, self-consistent entry (cubin and metadata with its hash) copied or planted under
    another key is a miss: the metadata names its key, family and arch, and all are checked."""
    mine, other = _compile("test_wrong", 1), _compile("test_wrong", 2)
    assert mine.cubin != other.cubin
    for src, dst in zip(tc._paths(other.key), tc._paths(mine.key)):
        dst.write_bytes(src.read_bytes())
    served = _compile("test_wrong", 1)
    assert not served.cached and served.cubin == mine.cubin and served.key == mine.key
    planted = json.loads(tc._paths(other.key)[1].read_text())
    planted["key"] = mine.key  # names the right key, but another family's kernel
    planted["family"] = planted["kernel_name"] = "test_oob"
    tc._paths(mine.key)[1].write_text(json.dumps(planted))
    tc._paths(mine.key)[0].write_bytes(other.cubin)
    served = _compile("test_wrong", 1)
    assert not served.cached and served.cubin == mine.cubin


POINTS = [(n, x) for n in ("test_oob", "test_spin", "test_wrong") for x in (1, 2)]


def _fill(seed: int) -> list[str]:
    import random

    order = POINTS * 2
    random.Random(seed).shuffle(order)
    return [tc.compile_kernel(BY_NAME[n], {"x": x}, P, ARCH).key for n, x in order]


def test_processes_filling_one_cache(cache):
    with mp.get_context("spawn").Pool(4) as pool:
        keys = pool.map(_fill, range(8))
    assert len({k for ks in keys for k in ks}) == len(POINTS)
    for n, x in POINTS:
        ck = _compile(n, x)
        assert ck.cached, (n, x)
        cubin, meta = tc._paths(ck.key)
        assert json.loads(meta.read_text())["cubin_sha"] == short_hash(cubin.read_bytes().hex(), 32)
    assert not list(cache.rglob("*.tmp"))  # no temp file left behind
    assert len(list(cache.rglob("*.cubin"))) == len(POINTS) and len(list(cache.rglob("*.json"))) == len(POINTS)


def _compile_after_a_miss(name: str, x: int, missed) -> bool:
    """In another process: see the cache miss, say so, then compile; whether it read the build."""
    fam = BY_NAME[name]
    assert tc._read_cache(tc.cache_key(fam.render({"x": x}, P), ARCH, False), fam, ARCH) is None
    missed.set()
    return tc.compile_kernel(fam, {"x": x}, P, ARCH).cached


def test_a_process_reads_the_build_another_process_is_making(cache):
    """Two processes set out to build one kernel (each rank of a job on its first call): the one
    that comes second waits for the first's build and reads it rather than running NVRTC again
    (files.one_maker). Unlocked, it would build its own in the half second it is given here."""
    from tuner.files import one_maker

    fam, params = BY_NAME["test_wrong"], {"x": 1}
    source = fam.render(params, P)
    key = tc.cache_key(source, ARCH, False)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(1) as pool:
        missed = manager.Event()
        with one_maker(tc._paths(key)[0].with_suffix(".lock")):   # this process is building it
            later = pool.apply_async(_compile_after_a_miss, ("test_wrong", 1, missed))
            assert missed.wait(120)
            time.sleep(0.5)
            mine = tc._build(fam, params, P, ARCH, source, key, fam.smem_bytes(params, P), False)
        assert later.get(120) is True
    assert not mine.cached and _compile("test_wrong", 1).cubin == mine.cubin
    assert len(list(cache.rglob("*.cubin"))) == 1
