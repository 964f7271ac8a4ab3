"""flash_fwd_sm90's SASS under two kernel sources, compared instruction by instruction, without a
GPU: a first look at what a change to the kernel moved, before benchmarks/ab_kernel.py times it.

    python3 benchmarks/sass_compare.py --templates OLD_DIR [-j N] [--show N] [--json FILE] [--differing EARLIER]

OLD_DIR holds the kernel sources to compare against (e.g. `git archive HEAD kernel_templates |
tar -x -C /tmp/old` gives /tmp/old/kernel_templates); this checkout's family spec renders both. The
points are every seed on the compile-test problems (seed_resources.py) and every config the shipped
lookups (tuner/lookups/) serve, on its own problem. Per point it prints the instruction counts and
whether the instruction streams are the same once registers, labels and immediates are renamed
away (tuner.compile.sass_shape), ptxas's registers and spills on each side, and where the streams
differ, the opcodes whose counts moved. `--differing` takes an earlier run's --json and compares
only the points that differed there (a change reworked until they are the same again).

Why not ptxas's resources alone: in issue 20's first split every seed kept its registers, spills and
shared memory, and two configs ran 4-10% slower on the H100, from integer address arithmetic that
moved in the SASS (benchmarks/PERF_NOTES.md, "The Hopper kernel split by roles"). Why not identical
SASS as the bar: ptxas schedules the whole kernel at once, so moving the same source into functions
reorders even untouched loops; only the GPU can say whether a reordering costs anything.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tuner.compile import disassemble, sass_shape  # noqa: E402


def opcode(insn: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", insn).split()[0]


def points() -> list[tuple]:
    """(family, problem, params, where from): the seeds, then the shipped lookups' distinct configs,
    each also as the varlen variant the dispatcher builds from it."""
    from seed_resources import seed_points, shipped_configs

    fam, varlen = _family("flash_fwd_sm90"), _family("flash_fwd_sm90_varlen")
    out = [(fam.name, p, s, "seed") for p, s in seed_points()]
    for p, params, name in shipped_configs():
        out.append((fam.name, p, params, name))
        if p.dtype != "fp8":
            out.append((varlen.name, p, varlen.from_tuned(params, p), name + " varlen"))
    seen, unique = set(), []
    for point in out:
        key = (point[0], point[1].key, json.dumps(point[2], sort_keys=True))
        if key not in seen:
            seen.add(key)
            unique.append(point)
    return unique


def _family(name: str):
    from tuner.kernel_templates import VARLEN_VARIANTS, get_family

    variants = {v.name: v for v in VARLEN_VARIANTS.values()}
    return variants[name] if name in variants else get_family(name)


def _compile(folder: str | None, family: str, problem, params) -> tuple[list[str], str]:
    """The SASS instructions, and ptxas's registers and spills as text."""
    import seed_resources

    from tuner.compile import compile_kernel
    from tuner.gpu import H100_SXM

    seed_resources.use_templates(folder)
    ck = compile_kernel(_family(family), params, problem, H100_SXM.arch)
    r = ck.resources
    serialized = " wgmma serialized" if re.search(r"C751[019]", ck.log) else ""
    return disassemble(ck.cubin), f"{r.registers}r" + (f" {r.spill_bytes}B spilled" if r.spill_bytes else "") + serialized


def compare(args) -> dict:
    old_dir, family, problem, params, origin = args
    (old, old_res), (new, new_res) = _compile(old_dir, family, problem, params), _compile(None, family, problem, params)
    same = [sass_shape(i) for i in old] == [sass_shape(i) for i in new]
    raw = sum(a != b for a, b in zip(old, new)) if same else None   # instructions that differ in a register or immediate
    delta = Counter(map(opcode, new))
    delta.subtract(Counter(map(opcode, old)))
    return dict(family=family, problem=problem.key, params=params, origin=origin, old=len(old), new=len(new),
                old_resources=old_res, new_resources=new_res, same=same, raw_differ=raw,
                moved={k: v for k, v in sorted(delta.items()) if v})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--templates", required=True, help="the folder of the kernel sources to compare against")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--show", type=int, default=12, help="at most this many moved opcodes per point")
    ap.add_argument("--json")
    ap.add_argument("--differing", help="an earlier run's --json: only its points that differed")
    a = ap.parse_args(argv)
    import multiprocessing as mp

    work = [(a.templates, *point) for point in points()]
    if a.differing:
        earlier = {(r["family"], r["problem"], json.dumps(r["params"], sort_keys=True))
                   for r in json.loads(Path(a.differing).read_text()) if not r["same"]}
        work = [w for w in work if (w[1], w[2].key, json.dumps(w[3], sort_keys=True)) in earlier]
    with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as pool:
        rows = list(pool.map(compare, work))
    for r in rows:
        cfg = ",".join(f"{k}={v}" for k, v in sorted(r["params"].items()))
        verdict = f"same ({r['raw_differ']} renamed)" if r["same"] else f"{r['new'] - r['old']:+d}"
        moved = " ".join(f"{k}{v:+d}" for k, v in list(r["moved"].items())[: a.show])
        name = r["problem"] + (" varlen" if r["family"].endswith("varlen") else "")
        res = r["new_resources"] if r["new_resources"] == r["old_resources"] else f"{r['old_resources']} -> {r['new_resources']}"
        print(f"{name:<41} {cfg:<80} {r['old']:>6} {r['new']:>6} {verdict:>18} {res:>12} {moved}")
    same = sum(r["same"] for r in rows)
    print(f"\n{same} of {len(rows)} points have the same instruction stream "
          f"(registers, labels and immediates aside); {sum(r['old'] != r['new'] for r in rows)} differ in length")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
