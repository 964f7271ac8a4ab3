"""A kernel change on the GPU: the same configs compiled from two kernel sources, timed in turns on
the same inputs (each checked against float64 first), as TFLOP/s before and after.

    python3 benchmarks/ab_kernel.py --templates OLD_DIR [--dtype bf16] [--lookup] [--json OUT]
    python3 benchmarks/ab_kernel.py --templates OLD_DIR --family flash_fwd_sm90_split --at 1,8,256:6113,96 --set splits=2,4,8
    python3 benchmarks/ab_kernel.py --templates kernel_templates --family flash_fwd_sm90_split --at SHAPE --set splits=2,4 --unsplit

OLD_DIR holds the kernel sources before the change (`git archive <commit> kernel_templates | tar
-x -C DIR` gives DIR/kernel_templates); this checkout's sources are "after". With `--after-family
flash_fwd_sm90_tail` (and `--templates kernel_templates`) "after" is each config in that family's
form from this checkout: what a cut tail changes on the same configs (PERF_NOTES "k3"). The configs are the
committed grid winners of this GPU (benchmarks/results/<gpu>-fp16-bf16.json, else the H100's) and,
with --lookup, the other flash_fwd_sm90 configs the shipped lookup serves, each on its own problem.
One ratio moves by about 1.5% between runs on the H100; issue 20's first split read 4-10% slower
on two configs here, its second 1-2% slower on four d=64 ones (benchmarks/PERF_NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

HERE = Path(__file__).resolve().parent


def committed(gpu, grid: str, family: str) -> list[tuple]:
    """(problem, params) of `family`'s rows in the committed results of a grid ("fp16-bf16", "fp32")
    on this GPU, else on the H100."""
    from tuner.problem import Problem

    results = HERE / "results" / f"{gpu.key.replace('/', '_')}-{grid}.json"
    if not results.exists():
        results = HERE / "results" / f"NVIDIA-H100-80GB-HBM3_sm_90-{grid}.json"
    return [(Problem.from_dict(r), r["config"]) for r in json.loads(results.read_text())["rows"]
            if r.get("family") == family and r.get("config")]


def configs(gpu, dtype: str | None, lookup: bool, family: str = "flash_fwd_sm90") -> list[tuple]:
    """(problem, params) of the committed grid (and the shipped lookup), flash_fwd_sm90's; another
    family's: the shipped lookup's entries of it, each on the problem it was tuned on, and its
    winners of the committed fp32 grid (flash_fwd_simt's GPT-2 problems)."""
    if family != "flash_fwd_sm90":
        from seed_resources import shipped_configs

        rows = [(p, params) for p, params, _ in shipped_configs(gpu.key, family)] + committed(gpu, "fp32", family)
        return [(p, params) for p, params in rows if dtype in (None, p.dtype)]

    rows = committed(gpu, "fp16-bf16", family)
    if lookup:
        from seed_resources import shipped_configs

        rows += [(p, params) for p, params, _ in shipped_configs(gpu.key)]
    seen, out = set(), []
    for p, params in rows:
        key = (p.key, json.dumps(params, sort_keys=True))
        if key not in seen and dtype in (None, p.dtype):
            seen.add(key)
            out.append((p, params))
    return out


def timed_points(fam, gpu, at: list[str], sets: list[str], shapes: list[str], dtype: str | None,
                 lookup: bool) -> list[tuple]:
    """(problem, params) to time: `fam`'s default on each shape of `at` (`tuner bench --shape`'s form),
    else its committed configs (`configs`); only problems whose key contains one of `shapes` where
    given; each "KEY=V1,V2" of `sets` over every point, a point per value. Points the family refuses
    are left out, each said why."""
    from tuner.problem import Problem

    if at:
        points = []
        for p in (Problem.parse(s, dtype or "bf16") for s in at):
            if (why := fam.supports(gpu, p)) is not None:
                print(f"left out: {p.key}: {why}")
            else:
                points.append((p, fam.default(gpu, p)))
    else:
        points = configs(gpu, dtype, lookup, fam.name)
    points = [(p, c) for p, c in points if not shapes or any(s in p.key for s in shapes)]
    for key, values in (kv.split("=", 1) for kv in sets):
        points = [(p, c | {key: int(v)}) for p, c in points for v in values.split(",")]
    kept = {}
    for p, c in points:
        if (why := fam.check(c, gpu, p)) is not None:
            print(f"left out: {p.key} {c}: {why}")
        else:
            kept.setdefault((p.key, json.dumps(c, sort_keys=True)), (p, c))
    return list(kept.values())


def unsplit_form(fam, gpu, problem, params: dict) -> tuple | None:
    """`params` in the family `fam` gives way to (flash_fwd_sm90_split's: flash_fwd_sm90), the
    parameters that family has: the point run as one split, for weighing a split count against none;
    None where `fam` gives way to none or that family refuses the point."""
    from tuner.kernel_templates import get_family

    if fam.gives_way_to is None:
        return None
    plain = get_family(fam.gives_way_to)
    ps = {k: v for k, v in params.items() if k in plain.space}
    return None if plain.check(ps, gpu, problem) is not None else (plain, ps)


def _compile(args) -> None:
    import seed_resources

    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family

    folder, family, problem, params = args
    seed_resources.use_templates(folder)
    compile_kernel(get_family(family), params, problem, detect().arch)


def precompile(points: list[tuple], folders: list[str | None], jobs: int, family: str = "flash_fwd_sm90") -> None:
    """Every side of every point into the compile cache, in parallel (NVRTC needs no GPU)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    work = [(side, family, p, params) for p, params in points for side in folders]
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile, work))


def main(argv: list[str] | None = None) -> int:
    import seed_resources

    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import measure_prepared, prepare_kernel
    from tuner.timing import Timer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--templates", required=True, help="the folder of the kernel sources before the change")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                    help="another kernel source to time beside before and after (repeatable)")
    ap.add_argument("--shape", action="append", default=[], help="only problems whose key contains this (repeatable)")
    ap.add_argument("--rounds", type=int, default=8, help="turns per kernel (tuner.timing.Timer)")
    ap.add_argument("--seconds", type=float, default=0.5, help="timed seconds per kernel and config")
    ap.add_argument("--dtype")
    ap.add_argument("--lookup", action="store_true", help="also the shipped lookup's configs")
    ap.add_argument("--family", default="flash_fwd_sm90",
                    help="another family (flash_fwd_sm90_split): its shipped lookup entries, on their own problems")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a parameter of every config (repeatable; e.g. Bc=128 to time a peer's tile; "
                         "splits=2,4,8: a point per value)")
    ap.add_argument("--at", action="append", default=[], metavar="SHAPE",
                    help="the family's default on SHAPE (B,H[:KVH],NQ[:NK],D[,MASK]) instead of the committed configs")
    ap.add_argument("--after-family", metavar="NAME",
                    help="time the after side as each config is served where that is in this family "
                         "(flash_fwd_sm90_tail: a cut tail, KernelFamily.served_form; the others left out), "
                         "both sides from this checkout")
    ap.add_argument("--unsplit", action="store_true",
                    help="also each point in the family it gives way to, from this checkout (a split "
                         "config unsplit: flash_fwd_sm90), as the column 'unsplit'")
    ap.add_argument("--json")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2, help="compiler processes")
    a = ap.parse_args(argv)
    gpu = detect()
    fam = get_family(a.family)
    points = timed_points(fam, gpu, a.at, a.set, a.shape, a.dtype, a.lookup)
    if not points:
        raise SystemExit(f"ab_kernel: no point of {fam.name} to time (any left out are said above)")
    sides = {"before": a.templates, "after": None} | dict(v.split("=", 1) for v in a.variant)
    after_fam, afters = fam, [params for _, params in points]   # the after side's family and params, point by point
    if a.after_family:   # the configs a call serves in another family's form (a cut tail); the others left out
        after_fam = get_family(a.after_family)
        kept = [(p, c, f) for p, c in points for runs, f in [fam.served_form(c, gpu, p)] if runs.name == after_fam.name]
        points, afters = [(p, c) for p, c, _ in kept], [f for _, _, f in kept]
        sides = {"before": a.templates, "after": None}
        precompile(list(zip([p for p, _ in points], afters)), [None], a.jobs, a.after_family)
    precompile(points, [v for k, v in sides.items() if k != "after" or not a.after_family], a.jobs, a.family)
    unsplit = [unsplit_form(fam, gpu, p, c) if a.unsplit else None for p, c in points]
    if any(unsplit):   # all in the one family `fam` gives way to
        precompile([(p, u[1]) for (p, _), u in zip(points, unsplit) if u], [None], a.jobs, fam.gives_way_to)
    timer = Timer(gpu.l2_bytes, target_seconds=a.seconds, max_reps=2000)
    rows = []
    print(f"{gpu.name}: {fam.name} before ({a.templates}) and after (this checkout), in turns, TFLOP/s of the median")
    for (problem, params), after, plain in zip(points, afters, unsplit):
        prepared = {}
        for side, folder in sides.items():
            seed_resources.use_templates(folder)
            f, ps = (after_fam, after) if side == "after" else (fam, params)
            prepared[side] = prepare_kernel(f, ps, problem, compile_kernel(f, ps, problem, gpu.arch), 0, gpu)
        seed_resources.use_templates(None)
        if plain is not None:
            prepared["unsplit"] = prepare_kernel(*plain, problem, compile_kernel(*plain, problem, gpu.arch), 0, gpu)
        out = measure_prepared(prepared, problem, timer, rounds=a.rounds)
        if not all(m.ok for m in out.values()):
            print(f"{problem.key} {params}: " + "; ".join(f"{k} {m.status} {m.message}" for k, m in out.items()))
            rows.append(dict(problem=problem.key, params=params, failed={k: m.status for k, m in out.items()}))
            continue
        before, after = out["before"].tflops, out["after"].tflops
        others = {side: out[side].tflops for side in out if side not in ("before", "after")}
        rows.append(dict(problem=problem.key, params=params, before=before, after=after, ratio=after / before, **others))
        cfg = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
        extra = "".join(f"  {side} {t:.1f} ({t / before:.3f}x)" for side, t in others.items())
        print(f"{problem.key:<36} {cfg:<80} {before:7.1f} {after:7.1f}  {after / before:.3f}x{extra}", flush=True)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    if ratios:
        print(f"\nafter / before over {len(ratios)} configs: min {min(ratios):.3f}, median "
              f"{statistics.median(ratios):.3f}, max {max(ratios):.3f}; {len(rows) - len(ratios)} failed")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(gpu=gpu.name, rows=rows), indent=1))
    return 0 if len(ratios) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
