"""Shared test setup: the `gpu` marker's skip hook (GPU tests skip with a reason where no CUDA GPU
is visible) and one cubin cache for the whole session."""

from __future__ import annotations

import os
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
