"""What `tuner.attention` serves a shape beside what it could serve instead, timed in turns with the
peers: the dispatcher's choice, flash_fwd_sm90's default and flash_fwd_sm90_split's (each in the form
a call runs it, whether or not a rule would pick it), for a GQA call of few queries flash_fwd_sm90_gqa's
default (packed rows) and, for a decode step, what served it before packing (flash_decode), and the
lookup's next tuned candidates in order of distance. For weighing a dispatch rule on shapes nobody tuned before changing it (PERF_NOTES
"r1-r3": configs borrowed from B1 buckets against the default).

    python3 benchmarks/served_alternatives.py [--dtype bf16] [--near 3] [--octaves 3] [--json OUT] SHAPE...
    python3 benchmarks/served_alternatives.py --random SEED[:COUNT] [--kind prompt,chunk,cross]
    python3 benchmarks/served_alternatives.py --measured 6 SHAPE...   # after a `tuner search` of SHAPE
    python3 benchmarks/served_alternatives.py --config 'bc80=flash_fwd_sm90_gqa:{"Bc": 80}' SHAPE...
    python3 benchmarks/served_alternatives.py --served-as pairs=flash_fwd_sm90_pairs SHAPE...
    PYTHONPATH=<another checkout's install> python3 benchmarks/served_alternatives.py --save-served before.json SHAPE...
    python3 benchmarks/served_alternatives.py --entries before=before.json SHAPE...

--served-as NAME=FAMILY times the served config's params in FAMILY's form too (where FAMILY takes
them): what a served-form rule (pairs_form, tail_form, split_form) chose against, on the same config.

--save-served FILE writes what serves each shape (family and params, a split count from the occupancy
fixed to the count it resolves to) and times nothing; --entries NAME=FILE times FILE's config of each
shape under NAME. Together they weigh a dispatch rule's change in turns: the served column is this
checkout's, NAME another's, run as that checkout served it (PERF_NOTES "j3": the split estimate refit);
the run ends with served over NAME's figure, geometric mean and range (`served_over`; PERF_NOTES "x2").

--measured N adds the N fastest configs the results database (TUNER_DB) holds for the shape itself
("db1".."dbN"), so that a search's winners, each timed alone as it was tried, are weighed in turns
before one is shipped (PERF_NOTES "g1": a search's winner read 0.89-0.93x the default in turns).

SHAPE is `tuner bench --shape`'s (B,H[:KVH],NQ[:NK],D[,MASK]); --random draws them with
random_shapes.py (decode steps are weighed only where asked for by --kind).
Every entry is checked against float64 before it is timed (tuner.measure); FA4 is timed where installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # random_shapes, beside this script

PEERS = ("sdpa_cudnn", "sdpa_flash", "fa4")


def alternatives(dispatcher, problem, gpu, near: int = 3, octaves: float = 3.0) -> dict[str, tuple[str, dict]]:
    """name -> (family, params) of each kernel that could serve `problem`, in the form a call runs
    it, each once: "served" (absent where SDPA serves), "default", "split" (where its occupancy splits
    the keys), "packed" and "unpacked" (GQA with few queries: flash_fwd_sm90_gqa's default, and a decode
    step's entry as it served before packing), then "near<i>@<octaves>" for the next `near` tuned
    kernel candidates within `octaves`."""
    from tuner.dispatch import _served_form, served_params
    from tuner.untuned import decode_default, split_default
    from tuner.kernel_templates import FAMILIES
    from tuner.problem import DECODE_QUERIES

    out: dict[str, tuple[str, dict]] = {}

    def add(name: str, entry: dict | None) -> None:
        if entry is None or entry["family"] not in FAMILIES:
            return
        form = _served_form(entry, problem, gpu)
        # a tuned entry's params as a call runs them: its family's adapt from the shape it was tuned
        # on (a split count fitted to the tuned grid is served from the occupancy), as the plan does
        key = (form["family"], served_params(form, problem) if form is entry else form["params"])
        if key not in out.values():
            out[name] = key

    add("served", dispatcher.serving_entry(problem, gpu))
    sm90 = FAMILIES.get("flash_fwd_sm90")
    if sm90 is not None and sm90.supports(gpu, problem) is None:
        add("default", {"family": sm90.name, "params": sm90.default(gpu, problem)})
    add("split", split_default(problem, gpu))
    gqa = FAMILIES.get("flash_fwd_sm90_gqa")
    if gqa is not None and problem.seqlen_q <= DECODE_QUERIES and gqa.supports(gpu, problem) is None:
        try:
            add("packed", {"family": gqa.name, "params": gqa.default(gpu, problem)})
        except ValueError:   # a group that divides none of its tiles
            pass
    if problem.decode_step:
        add("unpacked", dispatcher.select(problem, gpu) or decode_default(problem, gpu))
    taken = 0
    for dist, entry in dispatcher.candidates(problem, gpu, octaves):
        if taken == near:
            break
        before = len(out)
        add(f"near{taken + 1}@{dist:g}", entry)
        taken += len(out) > before
    return out


def measured(problem, gpu, count: int) -> dict[str, tuple[str, dict]]:
    """"db1".."db<count>": the fastest distinct kernel configs (family, params) TUNER_DB holds for
    `problem` on `gpu`, each as measured alone by a search; none where there is no database."""
    from tuner.db import queries
    from tuner.db.engine import DatabaseError, open_readonly, session_factory
    from tuner.kernel_templates import FAMILIES

    try:
        engine = open_readonly()
    except DatabaseError as e:
        print(f"--measured: {e}", file=sys.stderr)
        return {}
    with session_factory(engine)() as s:
        rows = queries.measurements(s, gpu.key, problem_key=problem.key)
    engine.dispose()
    out: dict[str, tuple[str, dict]] = {}
    seen: set[tuple[str, str]] = set()
    for r in sorted(rows, key=lambda r: -(r["tflops"] or 0.0)):
        key = (r["family"], r["params_key"])
        if r["status"] != "ok" or not r["tflops"] or r["family"] not in FAMILIES or key in seen:
            continue
        seen.add(key)
        out[f"db{len(out) + 1}"] = (r["family"], r["params"])
        if len(out) == count:
            break
    return out


def configured(problem, gpu, specs: list[str]) -> dict[str, tuple[str, dict]]:
    """--config NAME=FAMILY:JSON: the family's default for `problem` with JSON's params over it, under
    NAME; one that the family refuses for the shape is left out, with its reason printed."""
    from tuner.kernel_templates import FAMILIES

    out: dict[str, tuple[str, dict]] = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        family, _, overrides = rest.partition(":")
        fam = FAMILIES.get(family)
        if not name or fam is None:
            raise SystemExit(f"--config {spec!r}: give NAME=FAMILY:JSON with a family of {sorted(FAMILIES)}")
        why = fam.supports(gpu, problem)
        params = None if why else {**fam.default(gpu, problem), **json.loads(overrides or "{}")}
        why = why or fam.check(params, gpu, problem)
        if why:
            print(f"    {name}: left out for {problem.key}: {why}")
            continue
        out[name] = (fam.name, params)
    return out


def served_as(served: tuple[str, dict] | None, problem, gpu, specs: list[str]) -> dict[str, tuple[str, dict]]:
    """--served-as NAME=FAMILY: the served config's params in FAMILY, under NAME; left out, its reason
    printed, where nothing of ours serves or FAMILY refuses them for the shape."""
    from tuner.kernel_templates import FAMILIES

    out: dict[str, tuple[str, dict]] = {}
    for spec in specs:
        name, _, family = spec.partition("=")
        fam = FAMILIES.get(family)
        if not name or fam is None:
            raise SystemExit(f"--served-as {spec!r}: give NAME=FAMILY with a family of {sorted(FAMILIES)}")
        why = "no kernel of ours serves it" if served is None else fam.supports(gpu, problem) or fam.check(served[1], gpu, problem)
        if why:
            print(f"    {name}: left out for {problem.key}: {why}")
            continue
        out[name] = (fam.name, dict(served[1]))
    return out


def add_more(alts: dict[str, tuple[str, dict]], more: dict[str, tuple[str, dict]]) -> dict[str, str]:
    """`more`'s candidates (--measured, --config, --served-as, --entries) added to `alts` where they
    are not among them; for one that is, NAME -> the alternative it repeats, so that it is compiled
    and timed once and an A/B (--entries old=FILE) still reads its figure under that name."""
    same: dict[str, str] = {}
    for name, fp in more.items():
        twin = next((k for k, v in alts.items() if v == fp), None)
        if twin is None:
            alts[name] = fp
        else:
            same[name] = twin
    return same


def served_over(rows: list[dict], name: str) -> dict[str, float]:
    """shape -> what served it over candidate `name`'s TFLOP/s (its own figure, or that of the
    alternative it repeats: a row's `same`), for the rows where both were timed: an A/B's reading
    of `--entries name=FILE` (another checkout's choices) against this one's."""
    out = {}
    for row in rows:
        t = row["tflops"]
        other = t.get(row.get("same", {}).get(name, name))
        if t.get("served") and other:
            out[row["shape"]] = t["served"] / other
    return out


def fixed_counts(family: str, params: dict, problem, gpu) -> dict:
    """`params` with a split count left to the occupancy (0) fixed to the count it resolves to for
    `problem`, so that another checkout's estimate does not re-derive it."""
    from tuner.kernel_templates import FAMILIES

    fam = FAMILIES[family]
    if params.get("splits") == 0 and hasattr(fam, "splits"):
        return {**params, "splits": fam.splits(params, problem, gpu)}
    return params


def from_files(problem, specs: list[str]) -> dict[str, tuple[str, dict]]:
    """--entries NAME=FILE: FILE's (family, params) for `problem` (a --save-served file, keyed by
    problem key), under NAME; none where FILE has no kernel of ours for it."""
    out: dict[str, tuple[str, dict]] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise SystemExit(f"--entries {spec!r}: give NAME=FILE (a --save-served file)")
        entry = _served_file(path).get(problem.key)
        if entry:
            out[name] = (entry[0], entry[1])
    return out


@cache
def _served_file(path: str) -> dict:
    """A --save-served file, read once for all the shapes."""
    return json.loads(Path(path).read_text())


def time_in_turns(prepared: dict, problem, gpu, rounds: int = 4) -> dict[str, float | None]:
    """TFLOP/s of each prepared candidate and peer, timed in turns on the same inputs with L2
    flushed (None: it failed its float64 check or its launch)."""
    from tuner.measure import measure_prepared
    from tuner.timing import Timer

    timed = measure_prepared(prepared, problem, Timer(gpu.l2_bytes, target_seconds=0.2), rounds=rounds)
    return {k: m.tflops if m.ok else None for k, m in timed.items()}


def report(rows: list[dict], row: dict, label: str, gpu, json_path: str) -> None:
    """`row` added to `rows` and printed as `label`: name TFLOP/s ...; with `json_path`, all the rows
    written there after every shape, so a run cut short keeps what it measured."""
    rows.append(row)
    print(f"{label}: " + "  ".join(f"{k} {v:.1f}" if v else f"{k} -" for k, v in row["tflops"].items()), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(dict(gpu=gpu.name, rows=rows), indent=1))


def shapes_of(args) -> list[str]:
    if not args.random:
        return args.shapes
    import random_shapes

    seed, _, count = args.random.partition(":")
    return random_shapes.draws(int(seed), int(count or 24), tuple(args.kind.split(",")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--near", type=int, default=3)
    ap.add_argument("--octaves", type=float, default=3.0)
    ap.add_argument("--random", default="", metavar="SEED[:COUNT]")
    ap.add_argument("--kind", default="prompt,chunk,cross")
    ap.add_argument("--measured", type=int, default=0, metavar="N",
                    help="also the N fastest configs TUNER_DB holds for each shape")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=FAMILY:JSON",
                    help="also FAMILY's default with JSON's params over it (repeatable)")
    ap.add_argument("--served-as", action="append", default=[], metavar="NAME=FAMILY",
                    help="also the served config's params in FAMILY's form (e.g. pairs=flash_fwd_sm90_pairs)")
    ap.add_argument("--entries", action="append", default=[], metavar="NAME=FILE",
                    help="also FILE's config of each shape (a --save-served file, e.g. another checkout's)")
    ap.add_argument("--save-served", default="", metavar="FILE",
                    help="write what serves each shape (split counts fixed) to FILE and time nothing")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if not args.shapes and not args.random:
        ap.error("give shapes, or --random SEED[:COUNT]")
    import torch

    if not torch.cuda.is_available():
        print("served_alternatives needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from concurrent.futures import ThreadPoolExecutor

    import cuda.core  # noqa: F401  (imported here, before the compile threads would each import it)

    from tuner import dispatch
    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.kernel_templates import FAMILIES
    from tuner.measure import prepare_kernel, prepare_peer
    from tuner.peers import fa4_missing
    from tuner.problem import Problem

    gpu, d, rows = detect(), dispatch.default(), []
    if args.save_served:
        served = {}
        for text in shapes_of(args):
            p = Problem.parse(text, args.dtype)
            fp = alternatives(d, p, gpu, near=0).get("served")
            served[p.key] = fp and [fp[0], fixed_counts(*fp, p, gpu)]
        Path(args.save_served).write_text(json.dumps(served, indent=1))
        print(f"what serves {len(served)} shapes: {args.save_served}")
        return 0
    peers = [p for p in PEERS if p != "fa4" or fa4_missing() is None]
    for text in shapes_of(args):
        p = Problem.parse(text, args.dtype)
        alts = alternatives(d, p, gpu, args.near, args.octaves)
        more = {**(measured(p, gpu, args.measured) if args.measured else {}), **configured(p, gpu, args.config),
                **served_as(alts.get("served"), p, gpu, args.served_as), **from_files(p, args.entries)}
        same = add_more(alts, more)
        with ThreadPoolExecutor(8) as pool:   # NVRTC runs outside the GIL
            # a split count fixed outside the family's space (--entries) shares the cubin of its occupancy's
            cubins = dict(zip(alts, pool.map(lambda fp: compile_kernel(FAMILIES[fp[0]], FAMILIES[fp[0]].compiled(fp[1]),
                                                                       p, gpu.arch), alts.values())))
        prepared = {b: prepare_peer(b, p, 0) for b in peers}
        for name, (fam, params) in alts.items():
            prepared[name] = prepare_kernel(FAMILIES[fam], params, p, cubins[name], 0, gpu)
        row = {"shape": text, "dtype": args.dtype, "alternatives": {k: [f, v] for k, (f, v) in alts.items()},
               "same": same, "tflops": time_in_turns(prepared, p, gpu)}
        report(rows, row, p.key, gpu, args.json)
        for name, (fam, params) in alts.items():
            print(f"    {name}: {fam} {json.dumps(params, sort_keys=True)}")
        for name, twin in same.items():
            print(f"    {name}: the same config as {twin}")
        del prepared
        torch.cuda.empty_cache()
    for spec in args.entries:
        name = spec.partition("=")[0]
        ratios = served_over(rows, name)
        if ratios:
            geo = statistics.geometric_mean(ratios.values())
            print(f"served / {name}: {geo:.3f}x geometric mean over {len(ratios)} shapes "
                  f"({min(ratios.values()):.3f}-{max(ratios.values()):.3f}), {sum(r < 1 for r in ratios.values())} under 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
