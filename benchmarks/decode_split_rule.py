"""flash_decode's occupancy split count, two rules, at the default config: a wave of every CTA slot
of the GPU (auto_splits' default) against one CTA an SM (what FlashDecode.splits uses where K/V
come by tensor-map boxes), beside explicit counts (1, 2, 4, 8, 16), timed in turns; each rule's
median against the best count's. PERF_NOTES "s1". The JSON is written after each shape.

    python3 benchmarks/decode_split_rule.py [--json OUT] [--shapes H:KV:D,...] [--batch 1,4,8,16]
                                            [--keys 1024,4096,16384]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # decode_bench, beside this script

SHAPES = "32:8:80,32:8:64,32:32:64,12:12:64,32:8:96,28:4:64"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--shapes", default=SHAPES, help="query heads:K/V heads:head dim, comma-separated")
    ap.add_argument("--batch", default="1,4,8,16")
    ap.add_argument("--keys", default="1024,4096,16384")
    args = ap.parse_args()
    import torch

    import decode_bench as db
    from tuner.family import ceil_div
    from tuner.gpu import detect
    from tuner.kernel_templates.flash_decode import FAMILY, FlashDecode, auto_splits, cta_slots, stage_keys
    from tuner.problem import Problem
    from tuner.timing import Timer

    if not torch.cuda.is_available():
        print("decode_split_rule needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2

    class Fixed(FlashDecode):
        """flash_decode with the keys split n ways whatever the config says (any n, not only the space's)."""

        def __init__(self, n: int) -> None:
            self.n = n

        def splits(self, params, problem, gpu):
            return self.n

    gpu, timer = detect(), Timer(target_seconds=0.15)
    rows = []
    for heads, kvh, d in (map(int, s.split(":")) for s in args.shapes.split(",")):
        for b in map(int, args.batch.split(",")):
            for nk in map(int, args.keys.split(",")):
                p = Problem(b, heads, 1, nk, d, "bf16", "causal_br", kvh)
                params = FAMILY.default(gpu, p)
                smem = FAMILY.smem_bytes(params, p)
                by_slots, by_sm = auto_splits(params, p, gpu, smem), auto_splits(params, p, gpu, smem, gpu.sm_count)
                counts = sorted({by_slots, by_sm, 1, 2, 4, 8, 16} & set(range(1, ceil_div(nk, stage_keys(params)) + 1)))
                _, (q, k, v) = db.inputs(p)
                ms = {n: tm.median_ms for n, tm in timer.interleaved(
                    {n: db.ours(Fixed(n), params, p, gpu, q, k, v)[0] for n in counts}).items()}
                best = min(ms.values())
                row = dict(shape=p.key, params=params, per_sm=cta_slots(params, p, gpu, smem) // gpu.sm_count,
                           slot_rule=by_slots, sm_rule=by_sm, ms={str(n): x for n, x in ms.items()},
                           slot_vs_best=round(best / ms[by_slots], 3), sm_vs_best=round(best / ms[by_sm], 3))
                rows.append(row)
                print(f"{p.key:<40} per_sm {row['per_sm']} slots {by_slots:>2} ({row['slot_vs_best']:.3f}) "
                      f"sm {by_sm:>2} ({row['sm_vs_best']:.3f})  " + " ".join(f"{n}:{x * 1000:.1f}us" for n, x in ms.items()),
                      flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(dict(gpu=gpu.name, rows=rows), f, indent=1)
                del q, k, v
    return 0


if __name__ == "__main__":
    sys.exit(main())
