"""The versions a measurement ran under: a result is reused only under the same ones."""

from __future__ import annotations

from functools import cache
from importlib import metadata


def _dist(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


@cache
def software_versions() -> dict:
    from .compile import nvrtc_version

    return {
        "tuner": _dist("flashtune"),
        "torch": _dist("torch"),
        "cuda_core": _dist("cuda-core"),
        "nvrtc": nvrtc_version(),
    }


@cache
def driver_version() -> str:
    from cuda.bindings import driver

    err, v = driver.cuDriverGetVersion()
    return f"{v // 1000}.{(v % 1000) // 10}" if err == driver.CUresult.CUDA_SUCCESS else "unknown"


def run_versions(with_driver: bool = True) -> dict:
    v = dict(software_versions())
    if with_driver:
        v["driver"] = driver_version()
    return v
