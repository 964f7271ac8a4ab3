"""Shipped lookup entries timed in turns against a variant of their own config: where a search's
winner stood within its run-to-run noise of a twin (one parameter apart), the twin is weighed again
on the entry's own problem in several repeats and, with --draws, on random calls the entry serves.

    python3 benchmarks/retime_entries.py --match chain=1 --set chain=0 [--head-dim 128] [--mask causal]
        [--repeats 5] [--draws 8] [--margin 0.005] [--json OUT] [--lookup-out LOOKUP]

Each entry of this GPU's shipped lookup (tuner/lookups/) of --family whose params hold every
--match is timed beside the same params with every --set applied, both in the form a call runs
them (the dispatcher's served_params and served_form), checked against float64 first, in turns
(tuner.measure, the search's timer): on its own problem once per repeat on fresh inputs, and once on
each of --draws random calls (random_shapes.py: prompts, chunks, cross-attention of the entry's
dtype) that the shipped lookup serves by this entry. An entry answers for its whole bucket, so the
twin replaces it (`verdict`) where it is faster (by more than --margin) in the median of the
repeats and, with draws, in their geometric mean; without draws, where it is faster in every repeat.
--lookup-out writes the winning twins as a lookup (their median over the repeats at the entry's own
problem), for `tuner.export.publish_lookup(doc, shipped_lookup(gpu_key), "merge")`: each replaces its
entry's slot. Both files are written after every entry, so a run cut short keeps what it timed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # random_shapes, beside this script

DRAW_SEED = 7000      # random_shapes seeds from here: none of the PERF_NOTES' random runs used them
DRAWS_PER_SEED = 400


def _assignments(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        out[name.strip()] = int(value)
    return out


def matching(entries: list[dict], family: str, match: dict, head_dim: int | None, mask: str | None) -> list[dict]:
    """The entries of `family` whose params hold every `match`, optionally of one head dim and mask."""
    return [e for e in entries
            if e["family"] == family and all(e["params"].get(k) == v for k, v in match.items())
            and (head_dim is None or e["head_dim"] == head_dim) and (mask is None or e["mask"] == mask)]


def served_draws(entry: dict, dispatcher, gpu, count: int, max_seeds: int = 40) -> list:
    """Up to `count` random calls (Problems) that `dispatcher` serves by `entry` as it is, in the order
    drawn: not where a rule serves another config or family in its place (a cut tail, a split)."""
    import random_shapes
    from tuner.problem import Problem

    out: list = []
    for seed in range(DRAW_SEED, DRAW_SEED + max_seeds):
        for shape in random_shapes.draws(seed, DRAWS_PER_SEED, ("prompt", "chunk", "cross")):
            p = Problem.parse(shape, entry["dtype"])
            if p.head_dim != entry["head_dim"] or p in out:
                continue
            served = dispatcher.select(p, gpu)
            if served is not None and served.get("bucket") == entry["bucket"] and served["family"] == entry["family"] \
                    and served["params"] == entry["params"]:
                out.append(p)
                if len(out) == count:
                    return out
    return out


def _form(entry: dict, params: dict, problem, gpu) -> tuple:
    """(family, params) that a call of `problem` runs `entry` with `params` as (the dispatcher's form)."""
    from tuner.dispatch import served_params
    from tuner.kernel_templates import FAMILIES

    return FAMILIES[entry["family"]].served_form(served_params(dict(entry, params=params), problem), gpu, problem)


def in_turns(entry: dict, twin: dict, problem, gpu, seeds, timer) -> dict[str, list[float]]:
    """Median ms of `entry`'s config and `twin` on `problem`, timed in turns once per seed."""
    from tuner.compile import compile_kernel
    from tuner.measure import measure_prepared, prepare_kernel

    forms = {}
    for name, params in (("entry", entry["params"]), ("twin", twin)):
        fam, served = _form(entry, params, problem, gpu)
        forms[name] = (fam, served, compile_kernel(fam, served, problem, gpu.arch))
    ms: dict[str, list[float]] = {"entry": [], "twin": []}
    for seed in seeds:
        prepared = {name: prepare_kernel(fam, params, problem, ck, seed, gpu) for name, (fam, params, ck) in forms.items()}
        for name, (run, m) in prepared.items():
            if run is None:
                raise SystemExit(f"{entry['bucket']} {problem.key} {name}: {m.status}: {m.message}")
        for name, m in measure_prepared(prepared, problem, timer).items():
            ms[name].append(m.median_ms)
    return ms


def verdict(entry_ms: list[float], twin_ms: list[float], draw_ratios: list[float] = (), margin: float = 0.0) -> dict:
    """Whether the twin replaces the entry. A search's winner stood on one timing at one shape: the
    twin replaces it where faster by more than `margin` in the median of the repeats there and in
    the geometric mean of the draws the entry serves; with no draws, only where faster in every
    repeat. A margin keeps a tie within the timing's noise with the search's pick. (`ratio`: the
    median entry/twin at the entry's own problem; `draws`: the draws' geometric mean.)"""
    ratios = [e / t for e, t in zip(entry_ms, twin_ms, strict=True)]
    ratio = statistics.median(ratios)
    floor = 1.0 + margin
    if not draw_ratios:
        return dict(twin_wins=all(r > floor for r in ratios), ratio=ratio, draws=None)
    draws = math.exp(statistics.fmean(map(math.log, draw_ratios)))
    return dict(twin_wins=ratio > floor and draws > floor, ratio=ratio, draws=draws)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="flash_fwd_sm90")
    ap.add_argument("--match", action="append", default=[], help="NAME=VALUE the entry's params hold (repeatable)")
    ap.add_argument("--set", action="append", default=[], dest="overrides", help="NAME=VALUE of the twin (repeatable)")
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--mask")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--draws", type=int, default=0, help="random calls the entry serves, timed once each")
    ap.add_argument("--margin", type=float, default=0.0,
                    help="how much faster the twin must be (0.005: half a percent), at the shape and over the draws")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--lookup-out", type=Path)
    args = ap.parse_args(argv)
    from tuner import export
    from tuner.borrowing import tuned_problem
    from tuner.dispatch import Dispatcher
    from tuner.gpu import NoGpuError, detect
    from tuner.kernel_templates import FAMILIES
    from tuner.timing import Timer

    overrides = _assignments(args.overrides)
    if not overrides:
        raise SystemExit("--set names the twin: at least one NAME=VALUE")
    try:
        gpu = detect()
    except NoGpuError as e:   # a machine without a GPU: one line, not a traceback
        raise SystemExit(f"retime_entries: {e}") from None
    path = export.shipped_lookup(gpu.key)
    entries = matching(export.read_lookup(path)["entries"], args.family, _assignments(args.match), args.head_dim, args.mask)
    print(f"{gpu.name}: {len(entries)} entries of {path.name} match", flush=True)
    dispatcher, timer = Dispatcher(path), Timer()
    rows, winners = [], []
    for e in entries:
        twin = dict(e["params"], **overrides)
        problem = tuned_problem(e)
        if why := FAMILIES[e["family"]].check(twin, gpu, problem):
            print(f"{e['bucket']}: twin refused: {why}")
            continue
        ms = in_turns(e, twin, problem, gpu, range(args.repeats), timer)
        draws = {}
        for p in served_draws(e, dispatcher, gpu, args.draws) if args.draws else []:
            d = in_turns(e, twin, p, gpu, [0], timer)
            draws[p.key] = d["entry"][0] / d["twin"][0]
        row = dict(bucket=e["bucket"], problem=problem.key, ms=ms, draw_ratios=draws,
                   **verdict(ms["entry"], ms["twin"], list(draws.values()), args.margin))
        rows.append(row)
        print(f"{row['bucket']} {row['problem']}: entry {' '.join(f'{x:.4f}' for x in ms['entry'])} ms, "
              f"twin {' '.join(f'{x:.4f}' for x in ms['twin'])} ms, entry/twin {row['ratio']:.3f}"
              + (f"; {len(draws)} draws {min(draws.values()):.3f}-{max(draws.values()):.3f}, geomean {row['draws']:.3f}"
                 if draws else "") + ("  -> twin" if row["twin_wins"] else ""), flush=True)
        if row["twin_wins"]:
            winners.append((problem, e["family"], twin, problem.tflops(statistics.median(ms["twin"]))))
        save(args, gpu, rows, winners)   # after every entry: a run cut short keeps what it measured
    if args.lookup_out and winners:
        print(f"{len(winners)} twins written to {args.lookup_out}")
    return 0


def save(args, gpu, rows: list[dict], winners: list[tuple]) -> None:
    """The rows so far to --json, the winning twins so far to --lookup-out (each file whole, atomic)."""
    from tuner import export
    from tuner.files import atomic_write

    if args.json:
        doc = dict(gpu=gpu.name, match=args.match, set=args.overrides, margin=args.margin, rows=rows)
        atomic_write(args.json, json.dumps(doc, indent=1).encode())
    if args.lookup_out and winners:
        export.write_lookup(export.lookup_of(gpu.key, winners), args.lookup_out)


if __name__ == "__main__":
    sys.exit(main())
