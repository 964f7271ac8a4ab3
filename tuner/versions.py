"""The versions a measurement ran under: a result is reused only under the same ones."""

from __future__ import annotations

from functools import cache
from importlib import metadata
from pathlib import Path


def _dist(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


# What a timing depends on besides the tools: the kernels (sources and launch rules) and the code
# that times and counts them (a varlen variant's length mixes among it).
_MEASURED = ("measure.py", "timing.py", "length_mix.py")


def sources_hash(templates: Path, tuner_dir: Path) -> str:
    """A hash of the kernel templates in `templates` and the measuring code in `tuner_dir`."""
    from .records import short_hash

    files = sorted(f for f in templates.iterdir() if f.suffix in (".cu", ".cuh", ".py")) + [tuner_dir / n for n in _MEASURED]
    return short_hash("\n".join(f"{f.name}\n{f.read_text()}" for f in files), 16)


@cache
def sources_version() -> str:
    """This install's sources_hash: the package's version does not move with each change to the
    kernels or the measuring code, and a timing of an older kernel, or one counted another way,
    must not answer for this one (a search measures such a point again)."""
    from . import kernel_templates

    return sources_hash(Path(kernel_templates.__file__).parent, Path(__file__).parent)


@cache
def software_versions() -> dict:
    from .compile import nvrtc_version

    return {
        "tuner": _dist("flashtune"),
        "sources": sources_version(),
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
