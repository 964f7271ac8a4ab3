"""The C++ hot path of `attention` (tuner/csrc/fast_call.cpp), built on first use and kept.

A tuned call's work on the host is a plan lookup, an allocation or two, a few integers written
into the kernel's packed parameters and a launch: in Python that is 15-35 us, about what SDPA's
whole C++ call costs. The extension does the same in C++ from the plans the Python dispatcher
makes, and hands back anything it has not seen to the Python path (tuner/dispatch.py), which
stays the one home of the rules.

It is compiled against the running torch by the host's C++ compiler, in a background thread the
first time a tuned kernel runs (about 10-30 s; calls take the Python path meanwhile), into the
cache directory (`tuner precompile` builds it ahead), and loaded from there by later processes
at once. Nothing blocks on it and nothing fails without it: with no compiler (or
FLASHTUNE_NATIVE=0) every call takes the Python path, after one warning that says why.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

from .files import one_maker

SOURCE = Path(__file__).parent / "csrc" / "fast_call.cpp"
ENV = "FLASHTUNE_NATIVE"   # "0": never build or load it

_lock = threading.Lock()
_module = None
_thread: threading.Thread | None = None
_failure: str | None = None


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def module(wait: bool = False):
    """The extension module, or None while it builds (starting the build on the first call) or
    where it cannot be had. `wait`: build in this thread if need be and return it (or None)."""
    if _module is not None or _failure is not None or not enabled():
        return _module
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_build_and_load, name="flashtune-native-build", daemon=True)
            _thread.start()
        thread = _thread
    if wait:
        thread.join()
    return _module


def failure() -> str | None:
    """Why the extension is not there (None: it is, or it is still being built)."""
    if not enabled():
        return f"{ENV}=0"
    return _failure


def _build_and_load() -> None:
    global _module, _failure
    try:
        path = built()
        _module = _load(path)
        _module.set_launch_error(_raise_launch_error)
    except Exception as exc:   # any failure: the Python path, after one warning
        from .records import one_line

        _failure = one_line(exc)
        warnings.warn(f"flashtune: the C++ call path is not available ({_failure}); calls take the Python path",
                      RuntimeWarning, stacklevel=1)


def _raise_launch_error(code: int) -> None:
    from cuda.bindings import driver

    from .launch import LaunchError

    try:
        name = driver.CUresult(code).name
    except ValueError:
        name = str(code)
    raise LaunchError(f"cuLaunchKernel: {name}")


def _flags() -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    incs = [*include_paths(), sysconfig.get_paths()["include"]]
    libs = library_paths()
    return (["-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
            + [f"-I{p}" for p in incs] + [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs]
            + ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"])


def _name() -> str:
    """The module's name: what it is built from (source, torch, Python, flags) in a digest, so a
    changed torch or source builds anew beside the old."""
    import torch

    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{torch.__version__} {sys.version} {_compiler()} {_flags()}".encode())
    return f"flashtune_fast_{h.hexdigest()[:16]}"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def built() -> Path:
    """The extension's shared library in the cache, compiled first where it is not there yet."""
    from .compile import cache_dir

    name = _name()
    out = cache_dir() / "native" / f"{name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with one_maker(out.with_suffix(".lock")):   # one compiler run for every process starting at once
        if not out.exists():
            _compile_to(out, name)
    return out


def _compile_to(out: Path, name: str) -> None:
    # built beside its final name and moved there whole: a reader never loads half a library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [_compiler(), str(SOURCE), "-o", tmp, f"-DTORCH_EXTENSION_NAME={name}", *_flags()]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            lines = [ln for ln in res.stderr.splitlines() if "error" in ln] or res.stderr.splitlines() or ["no output"]
            raise RuntimeError(f"{_compiler()} failed: {lines[0][:300]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path):
    name = path.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
