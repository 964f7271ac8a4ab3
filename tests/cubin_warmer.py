"""Compiles the compile sweep's points into the shared cubin cache (TUNER_CACHE_DIR) ahead of the
tests that check them, at the lowest CPU priority: started and stopped by tests/conftest.py.

`python tests/cubin_warmer.py POINTS.json PARENT_PID`: POINTS.json lists [family, arch, params,
problem fields], in the order to compile them. It stops when its pytest process is gone. A point
that fails is left to its test, which compiles it again and says why."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(points_file: str, parent: int) -> None:
    os.nice(19)   # only what the tests leave idle: under a busy worker this gets ~1.5% of a core
    from tuner.compile import CompileError, compile_kernel
    from tuner.kernel_templates import get_family
    from tuner.problem import Problem

    for family, arch, params, problem in json.loads(Path(points_file).read_text()):
        if os.getppid() != parent:
            return
        try:
            compile_kernel(get_family(family), params, Problem(**problem), arch)
        except CompileError:
            continue


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
