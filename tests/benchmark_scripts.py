"""benchmarks/<name>.py as a module, for the CPU tests of the scripts' offline parts: the scripts
are files run by path, not a package, so a test loads them by theirs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str) -> ModuleType:
    """A fresh module of benchmarks/`name`.py."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # as an import would: a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module
