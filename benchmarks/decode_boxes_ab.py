"""flash_decode with K/V by tensor-map boxes against the same kernel by cp.async, at padded and
listed head dims, each searched on the spot alike (decode_bench.screened: the seeds, then the best
seed's split counts) and timed in turns with what `tuner.attention` serves and the peers (SDPA
cuDNN, SDPA flash, FA4 where installed), as TB/s. PERF_NOTES "t1".

    python3 benchmarks/decode_boxes_ab.py [--json OUT] [--shapes H:KV:D,...] [--cases B:NK,...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # decode_bench, beside this script

SHAPES = "32:32:80,32:32:96,16:4:160,16:16:192,32:8:128,32:8:80"
CASES = "1:8192,8:8192,32:1024,32:8192,128:1024"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--shapes", default=SHAPES, help="query heads:K/V heads:head dim, comma-separated")
    ap.add_argument("--cases", default=CASES, help="batch:keys, comma-separated")
    args = ap.parse_args()
    import torch

    import decode_bench as db
    from tuner.gpu import detect
    from tuner.kernel_templates.flash_decode import FAMILY, FlashDecode
    from tuner.problem import Problem
    from tuner.timing import Timer

    if not torch.cuda.is_available():
        print("decode_boxes_ab needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2

    class CpAsync(FlashDecode):
        """flash_decode with K/V by cp.async everywhere (KV_TMA 0)."""

        name = "flash_decode_cpasync"

        def kv_tma(self, params, head_dim):
            return False

    gpu, cp = detect(), CpAsync()
    screen, timer = Timer(target_seconds=0.1), Timer()
    copy = db.copy_bandwidth(timer)
    print(f"{gpu.name}: copy {copy:.2f} TB/s", flush=True)
    rows = []
    for heads, kvh, d in (map(int, s.split(":")) for s in args.shapes.split(",")):
        for b, nk in (map(int, c.split(":")) for c in args.cases.split(",")):
            problem = Problem(b, heads, 1, nk, d, "bf16", "causal_br", kvh)
            _, (q, k, v) = db.inputs(problem)
            best = db.screened(FAMILY, problem, gpu, q, k, v, screen)
            best_cp = db.screened(cp, problem, gpu, q, k, v, screen)
            run, o = db.ours(FAMILY, best, problem, gpu, q, k, v)
            run_cp, o_cp = db.ours(cp, best_cp, problem, gpu, q, k, v)
            served, o_served = db.attention_call(q, k, v)
            others = db.peers(problem, q, k, v)
            fns = {"tma": run, "cpasync": run_cp, "served": served} | {n: fn for n, (fn, _) in others.items()}
            t = timer.interleaved(fns)
            tbs = {n: round(problem.bytes_moved() / (tm.median_ms * 1e-3) / 1e12, 3) for n, tm in t.items()}
            ref = next(iter(others.values()))[1]
            diff = {n: float((x.float() - ref.float()).abs().max()) for n, x in (("tma", o), ("cpasync", o_cp), ("served", o_served))}
            peer = max(tbs[n] for n in others)
            row = dict(shape=f"B{b} H{heads}/kv{kvh} d{d} Nk{nk}", tb_s=tbs, tma=best, cpasync=best_cp, maxdiff=diff,
                       tma_kv=FAMILY.kv_tma(best, d))
            rows.append(row)
            print(f"{row['shape']:<28} " + " ".join(f"{n} {x:.2f}" for n, x in tbs.items())
                  + f" | tma/cp {tbs['tma'] / tbs['cpasync']:.3f} tma/peer {tbs['tma'] / peer:.2f}"
                  + f" served/peer {tbs['served'] / peer:.2f} tma {best} cp {best_cp} diff {max(diff.values()):.2g}", flush=True)
            del q, k, v, run, run_cp, served, fns, others, o, o_cp, o_served, ref
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu.name, copy=copy, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
