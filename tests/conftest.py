"""Shared test setup: the `gpu` marker's skip hook (GPU tests skip with a reason where no CUDA GPU
is visible), one cubin cache for the whole session, the long tests first and the compile sweep's
cubins filled in the background while they wait."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest


@cache
def _no_gpu_reason() -> str | None:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover
        return f"torch is not importable: {exc}"
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU with CUDA (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # xdist hands tests out in this order: the long ones first, so that no worker ends on one while
    # the other idles, and so that their waits come while the compile sweep still has work for
    # the background compile below
    items.sort(key=lambda it: it.get_closest_marker("long") is None)
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _no_gpu_reason()
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for it in gpu_items:
            it.add_marker(skip)


# ---- the cubin cache: one folder for every xdist worker ----
# .pytest_cache/d/cubin under the rootdir (kept between local runs; the cache key covers source,
# arch, NVRTC version and flags, so a stale entry is never reused). Set at configure time, before
# collection and before any test compiles, in the controller and in each worker; subprocesses the
# tests start (the CLI) inherit it.

def _shared_cache_dir(config: pytest.Config) -> Path:
    cache_ = getattr(config, "cache", None)
    if cache_ is not None:
        return Path(cache_.mkdir("cubin"))
    return Path(config.rootpath) / ".pytest_cache" / "cubin"


def pytest_configure(config: pytest.Config) -> None:
    os.environ["TUNER_CACHE_DIR"] = str(_shared_cache_dir(config))
    # Every test sees only the lookups it writes: not the ones flashtune ships (a test of those
    # turns them on), and no first-call autotuning unless the test asks for it.
    os.environ["FLASHTUNE_SHIPPED_LOOKUPS"] = "0"
    os.environ.pop("FLASHTUNE_AUTOTUNE", None)


@pytest.fixture(scope="session", autouse=True)
def shared_cubin_cache() -> Path:
    """The session's cubin cache folder (TUNER_CACHE_DIR), shared by all xdist workers."""
    path = Path(os.environ["TUNER_CACHE_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def native_call_path(shared_cubin_cache):
    """Where a GPU is visible, the C++ call path (tuner/native.py) built before any test runs, so
    the GPU tests run tuned calls through it as a user's process does once it is built (else they
    would race its background build and test whichever path was ready)."""
    if _no_gpu_reason() is None:
        from tuner import native

        native.module(wait=True)


# ---- a real PostgreSQL server for the fleet tests ----
# One throwaway cluster per test session (per xdist worker), on a free loopback port, stopped at the
# end; each test gets a fresh database in it. Skipped, saying why, only where no server binaries or
# no driver can be had (.ci/run installs Debian's postgresql package).

@pytest.fixture(scope="session")
def pg_cluster():
    from tuner import pgcluster

    why = pgcluster.unavailable()
    if why:
        pytest.skip(why)
    with pgcluster.running() as cluster:
        yield cluster


@pytest.fixture
def pg_url(pg_cluster) -> str:
    return pg_cluster.create_database()


# ---- the compile sweep's cubins, filled while the long tests wait ----
# Several long tests mostly wait on the processes they start and kill, leaving a core idle. One
# process (the first xdist worker's) starts tests/cubin_warmer.py at the lowest CPU priority, which
# compiles the sweep's points from its end into the shared cache; the sweep's tests, which run from
# its start, then find those cubins there (each still checks its own). Under busy workers it gets
# next to no CPU. Only for a run of many sweep points: a smaller run compiles its own.

WARM_MIN_POINTS = 200


@dataclasses.dataclass
class _Warmer:
    process: subprocess.Popen
    points: Path


_warmer: _Warmer | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    global _warmer
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    points = [it.callspec.params for it in session.items
              if getattr(it, "originalname", "") == "test_every_valid_point_compiles"]
    if len(points) < WARM_MIN_POINTS:
        return
    rows = [[p["fam"].name, p["gpu"].arch, p["params"], dataclasses.asdict(p["problem"])] for p in reversed(points)]
    fd, path = tempfile.mkstemp(prefix="flashtune-sweep-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(rows, f)
    script = Path(__file__).with_name("cubin_warmer.py")
    process = subprocess.Popen([sys.executable, str(script), path, str(os.getpid())],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _warmer = _Warmer(process, Path(path))


def pytest_sessionfinish(session: pytest.Session) -> None:
    global _warmer
    if _warmer is not None:
        _warmer.process.kill()   # mid-compile at worst: the cache writes each entry whole or not at all
        _warmer.process.wait()
        _warmer.points.unlink(missing_ok=True)
        _warmer = None
