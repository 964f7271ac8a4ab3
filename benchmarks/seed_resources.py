"""ptxas's resources (registers, spills, stack, shared memory) and the SASS instruction stream's
length and fingerprint of every flash_fwd_sm90 seed on the compile-test problems, as JSON: what a
change to the kernel may move only on purpose.

    python3 benchmarks/seed_resources.py [-o FILE] [--templates DIR] [-j N]

--templates compiles the kernel sources of another checkout (e.g. a `git worktree` of the commit
before a change), with this checkout's family spec. No GPU needed (NVRTC for sm_90a).
tests/fixtures/sm90_seed_resources.json is its output for the current kernel, and
tests/test_compile.py checks every seed against it (through `problems`, `seeds` and `resources`).
The fingerprint hashes the instructions with registers, labels and immediates renamed away
(tuner.compile.sass_shape): same resources are not the same speed (issue 20's first split kept
every seed's resources and ran 4-10% slower on two configs), the same instruction stream is.
benchmarks/sass_compare.py shows where two kernel sources' streams differ, benchmarks/ab_kernel.py
what that costs on the GPU.
Run it where the package is installed (`pip install -e .`): the kernel sources resolve through it.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def problems():
    from tuner.problem import Problem

    return [Problem(4, 16, 2048, 2048, d, dt, c) for d in (64, 128, 256) for dt in ("fp16", "bf16", "fp8")
            for c in (False, True)]


_PACKAGE_INLINE = []   # the package's own template reader, kept the first time another one replaces it


def use_templates(folder: str | None) -> None:
    """Render kernels from the sources in `folder` from now on; None: the package's own again."""
    import tuner.family as family

    if not _PACKAGE_INLINE:
        _PACKAGE_INLINE.append(family._inline)

    def read(filename: str, seen: set[str]) -> str:
        seen.add(filename)
        text = (Path(folder) / filename).read_text()
        return family._INCLUDE.sub(lambda m: "" if m.group(1) in seen else read(m.group(1), seen), text)

    family._inline = read if folder else _PACKAGE_INLINE[0]
    family.template_text.cache_clear()


def resources(problem, params: dict) -> tuple[str, dict]:
    """The record's key of one seed on one problem, and what ptxas reported for it."""
    from tuner.compile import compile_kernel, disassemble, sass_shape
    from tuner.gpu import H100_SXM
    from tuner.kernel_templates import get_family
    from tuner.records import params_key, short_hash

    ck = compile_kernel(get_family("flash_fwd_sm90"), params, problem, H100_SXM.arch)
    r, sass = ck.resources, disassemble(ck.cubin)
    return f"{problem.key} {params_key(params)}", dict(registers=r.registers, spill_bytes=r.spill_bytes,
                                                        stack_bytes=r.stack_bytes, static_smem=r.static_smem,
                                                        dynamic_smem=r.dynamic_smem, sass_instructions=len(sass),
                                                        sass_shape=short_hash("\n".join(map(sass_shape, sass)), 16))


def _one(args) -> tuple[str, dict]:
    folder, problem, params = args
    use_templates(folder)
    return resources(problem, params)


def seeds(problem) -> list[dict]:
    """The family's seeds that are valid on `problem` (on the H100)."""
    from tuner.gpu import H100_SXM
    from tuner.kernel_templates import get_family

    fam = get_family("flash_fwd_sm90")
    return [s for s in fam.seeds(H100_SXM, problem) if fam.check(s, H100_SXM, problem) is None]


def shipped_configs(gpu_key: str | None = None, family: str = "flash_fwd_sm90") -> list[tuple]:
    """(problem, params, lookup name) of every entry of `family` in the shipped lookups
    (tuner/lookups/), or in the one for `gpu_key`."""
    from tuner.export import SHIPPED_DIR, read_lookup, shipped_lookup
    from tuner.problem import Problem

    paths = [shipped_lookup(gpu_key)] if gpu_key else sorted(SHIPPED_DIR.glob("*.json"))
    return [(Problem.from_dict(e["problem"]), e["params"], path.stem) for path in paths if path.exists()
            for e in read_lookup(path)["entries"] if e["family"] == family]


def seed_points() -> list[tuple]:
    return [(p, s) for p in problems() for s in seeds(p)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output")
    ap.add_argument("--templates")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    import multiprocessing as mp

    work = [(a.templates, p, s) for p, s in seed_points()]
    with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as pool:
        out = dict(pool.map(_one, work))
    text = json.dumps(dict(sorted(out.items())), indent=1)
    (Path(a.output).write_text(text + "\n") if a.output else sys.stdout.write(text + "\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
