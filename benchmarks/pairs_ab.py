"""Persistent CTA pairs sharing K/V by multicast (flash_fwd_sm90_pairs) against the single-CTA forms.

    python3 benchmarks/pairs_ab.py [--lookup PATH] [--shape B,H,N,D]... [--dtype bf16] [--peer fa4]
                                   [--rounds 6] [--seconds 0.3] [--power 3] [--json OUT]

For each unmasked shape: the shipped lookup's entry in its single-CTA form (the cut tail where it
cuts: what `attention` served before pairs), the same config in pairs (a grid entry made
persistent, split 24 -> 40 as persistent producers need), and the peers, on the same inputs, each
checked against float64 first, then timed in turns with L2 flushed (tuner.timing.Timer,
docs/benchmarks.md). With --power S each one also runs back to back for S seconds while nvidia-smi
samples the SM clock and the board power (power_state.py's method): whether halving the L2 reads
lowers the draw and raises the clock at the H100's 700 W cap (PERF_NOTES "pw1", "c2").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_SHAPES = ["1,16,16384,128", "4,16,4096,128", "1,8,16384,256", "4,8,4096,256", "1,32,16384,64",
                  "4,32,4096,64"]


def sides(problem, dispatcher, gpu) -> dict[str, tuple]:
    """(family, params) of the entry `dispatcher` serves in its single-CTA form (the cut tail where it
    cuts) and in pairs (wherever that runs, whatever pairs_form's rule says); empty where no
    flash_fwd_sm90 config serves the shape or its pairs form cannot run."""
    from tuner.kernel_templates import get_family
    from tuner.kernel_templates.flash_fwd_sm90_pairs import FAMILY as PAIRS
    from tuner.kernel_templates.flash_fwd_sm90_tail import FAMILY as TAIL

    entry = dispatcher.select(problem, gpu)
    if entry is None or not entry["family"].startswith("flash_fwd_sm90"):
        return {}
    params, sm90 = entry["params"], get_family("flash_fwd_sm90")
    cut = TAIL.tail_form(params, gpu, problem)
    single = (TAIL, cut) if cut is not None else (sm90, params)
    pairs = sm90.schedule(params, True, problem)
    return {"served": single} | ({"pairs": (PAIRS, pairs)} if PAIRS.check(pairs, gpu, problem) is None else {})


def main(argv: list[str] | None = None) -> int:
    from power_state import held_run, sampler
    from tuner.compile import compile_kernel
    from tuner.dispatch import Dispatcher
    from tuner.gpu import detect
    from tuner.measure import measure_prepared, prepare_kernel, prepare_peer
    from tuner.problem import Problem
    from tuner.timing import Timer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lookup",
                    help="the lookup to serve from (default: what `attention` serves: yours, then the shipped ones)")
    ap.add_argument("--shape", action="append", default=[], help="a tuner --shape, unmasked (repeatable)")
    ap.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    ap.add_argument("--peer", action="append", default=[], help="sdpa_cudnn, sdpa_flash, fa4 (default fa4)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--power", type=float, default=0.0, help="seconds back to back per kernel for the clock (0: none)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    gpu = detect()
    dispatcher = Dispatcher(a.lookup)
    timer = Timer(gpu.l2_bytes, target_seconds=a.seconds, max_reps=2000)
    proc, samples = sampler() if a.power else (None, [])
    rows = []
    try:
        for shape in a.shape or DEFAULT_SHAPES:
            problem = Problem.parse(shape, a.dtype)
            ours = sides(problem, dispatcher, gpu)
            if "pairs" not in ours:
                fam, params = ours.get("served", (None, None))
                print(f"{problem.key}: no pairs form of what is served ({fam and fam.name} {params})")
                continue
            prepared = {name: prepare_kernel(fam, ps, problem, compile_kernel(fam, ps, problem, gpu.arch), 0, gpu)
                        for name, (fam, ps) in ours.items()}
            prepared |= {peer: prepare_peer(peer, problem, 0) for peer in a.peer or ["fa4"]}
            out = measure_prepared(prepared, problem, timer, rounds=a.rounds)
            row = dict(problem=problem.key, served=dict(family=ours["served"][0].name, params=ours["served"][1]),
                       pairs=ours["pairs"][1], tflops={k: m.tflops for k, m in out.items() if m.ok},
                       failed={k: f"{m.status} {m.message}" for k, m in out.items() if not m.ok})
            t = row["tflops"]
            ratio = t["pairs"] / t["served"] if "pairs" in t and "served" in t else float("nan")
            print(f"{problem.key:<32} served {t.get('served', 0):6.1f} ({ours['served'][0].name})  pairs "
                  f"{t.get('pairs', 0):6.1f}  {ratio:.3f}x  " + "  ".join(f"{k} {v:6.1f}" for k, v in t.items()
                                                                        if k not in ("served", "pairs"))
                  + (f"  FAILED {row['failed']}" if row["failed"] else ""), flush=True)
            if a.power:
                row["power"] = {}
                for name, (run, m) in prepared.items():
                    if run is None:
                        continue
                    ms, window = held_run(run, a.power, samples)
                    p = dict(tflops=problem.tflops(ms), sm_mhz=statistics.mean(x[1] for x in window),
                             power_w=statistics.mean(x[2] for x in window))
                    row["power"][name] = p
                    print(f"    {name:<8} back to back: {p['tflops']:6.1f} TFLOP/s  {p['sm_mhz']:5.0f} MHz  "
                          f"{p['power_w']:4.0f} W  {p['tflops'] / p['sm_mhz'] * 1e3:5.1f} per GHz", flush=True)
            rows.append(row)
    finally:
        if proc is not None:
            proc.terminate()
    if a.json:
        Path(a.json).write_text(json.dumps(dict(gpu=gpu.name, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
