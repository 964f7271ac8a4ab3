"""flash_decode's occupancy split count, two rules, at the default config: a wave of every CTA slot
of the GPU (auto_splits' default) against one CTA an SM (what FlashDecode.splits uses where K/V
come by tensor-map boxes), beside explicit counts (1, 2, 4, 8, 16), timed in turns; each rule's
median against the best count's. PERF_NOTES "s1". With --served, the config `attention` serves
each shape from (the lookup's entry, else the default), each count in the form a call runs it (2, 4
or 8 splits as one cluster on sm_90), and the bytes each CTA keeps in flight: PERF_NOTES "s3". The
JSON is written after each shape. --replay reads such JSON files instead (no GPU): the count this
checkout's FlashDecode.splits takes on each recorded shape and config, against the recorded times,
so that a change to the rule is weighed against every sweep measured so far before it is timed.

    python3 benchmarks/decode_split_rule.py [--json OUT] [--shapes H:KV:D,...] [--batch 1,4,8,16]
                                            [--keys 1024,4096,16384] [--served] [--flush write|read]
    python3 benchmarks/decode_split_rule.py --replay benchmarks/results/*decode-split*.json
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
    ap.add_argument("--served", action="store_true",
                    help="the served config in its served form at each count, not the default's workspace form")
    ap.add_argument("--flush", default="write", choices=("write", "read"), help="the timer's L2 flush (tuner.timing)")
    ap.add_argument("--replay", nargs="+", default=[], metavar="JSON",
                    help="recorded runs of this script: the rule's count now against their times (no GPU)")
    args = ap.parse_args()
    if args.replay:
        return replay(args.replay)
    import torch

    import decode_bench as db
    from tuner.family import ceil_div
    from tuner.gpu import detect
    from tuner.kernel_templates import configs_family
    from tuner.kernel_templates.flash_decode import (CLUSTER_SIZES, FAMILY, FlashDecode, auto_splits, cta_slots,
                                                     in_flight_bytes, stage_keys)
    from tuner.launch import clusters_at_once
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

    def served(params, n, p, q, k, v):
        """`params` at n splits as a call runs it (FlashDecode.served_form); a count outside the space
        is the occupancy rule's (splits 0)."""
        form, formed = FAMILY.served_form(dict(params, splits=n if n in FAMILY.space["splits"] else 0), gpu, p)
        return db.ours(form, formed, p, gpu, q, k, v)[0]

    gpu, timer = detect(), Timer(target_seconds=0.15, flush=args.flush)
    clusters = {n: clusters_at_once(gpu, n) for n in CLUSTER_SIZES}
    print(f"{gpu.name}: one-SM clusters at once by size {clusters}", flush=True)
    rows = []
    for heads, kvh, d in (map(int, s.split(":")) for s in args.shapes.split(",")):
        for b in map(int, args.batch.split(",")):
            for nk in map(int, args.keys.split(",")):
                p = Problem(b, heads, 1, nk, d, "bf16", "causal_br", kvh)
                source, params = "default", FAMILY.default(gpu, p)
                if args.served and configs_family((sc := db.served_config(p, gpu))["family"] or "") == FAMILY.name:
                    source, params = sc["source"], dict(sc["params"], splits=0)
                smem = FAMILY.smem_bytes(params, p)
                by_slots, by_sm = auto_splits(params, p, gpu, smem), auto_splits(params, p, gpu, smem, gpu.sm_count)
                rule = FAMILY.splits(params, p, gpu)   # what a call takes (FlashDecode.splits)
                # served, a count outside the space is only the rule's (the slot rule's is not served on sm_90)
                counts = sorted(({rule} if args.served else {by_slots, by_sm}) | {1, 2, 4, 8, 16})
                counts = [n for n in counts if n <= ceil_div(nk, stage_keys(params))]
                _, (q, k, v) = db.inputs(p)
                run = (lambda n: served(params, n, p, q, k, v)) if args.served else (
                    lambda n: db.ours(Fixed(n), params, p, gpu, q, k, v)[0])
                ms = {n: tm.median_ms for n, tm in timer.interleaved({n: run(n) for n in counts}).items()}
                best = min(ms.values())
                vs_best = lambda n: round(best / ms[n], 3) if n in ms else None
                row = dict(shape=p.key, source=source, params=params, in_flight=in_flight_bytes(params, p),
                           per_sm=cta_slots(params, p, gpu, smem) // gpu.sm_count, slot_rule=by_slots, sm_rule=by_sm,
                           rule=rule, ms={str(n): x for n, x in ms.items()}, rule_vs_best=vs_best(rule),
                           sm_vs_best=vs_best(by_sm), slot_vs_best=vs_best(by_slots))
                rows.append(row)
                print(f"{p.key:<40} {row['in_flight'] >> 10:>4} KB per_sm {row['per_sm']} "
                      f"slots {by_slots:>2} ({row['slot_vs_best']}) sm {by_sm:>2} ({row['sm_vs_best']}) "
                      f"rule {rule:>2} ({row['rule_vs_best']})  " + " ".join(f"{n}:{x * 1000:.1f}us" for n, x in ms.items()),
                      flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(dict(gpu=gpu.name, flush=args.flush, clusters_at_once=clusters, rows=rows), f, indent=1)
                del q, k, v
    return 0


def replay_rows(doc: dict) -> list[dict]:
    """A recorded run's rows with the count this checkout's rule takes on each (`now`) and that
    count's recorded time against the row's best count (`share`; None where it was not timed)."""
    from dataclasses import replace

    from tuner.gpu import H100_SXM
    from tuner.kernel_templates.flash_decode import FAMILY
    from tuner.problem import Problem

    # the recorded GPUs are GH100s (H100, H200): 132 SMs with the same shared memory and registers
    gpu = replace(H100_SXM, name=doc["gpu"])
    out = []
    for row in doc["rows"]:
        p, ms = Problem.from_key(row["shape"]), {int(n): t for n, t in row["ms"].items()}
        now, best = FAMILY.splits(dict(row["params"], splits=0), p, gpu), min(ms, key=ms.get)
        out.append(dict(shape=row["shape"], recorded=row.get("rule", row.get("sm_rule")), now=now, best=best,
                        share=round(ms[best] / ms[now], 3) if now in ms else None))
    return out


def replay(paths: list[str]) -> int:
    """Each recorded row's count under this checkout's rule against the row's best count, and the
    mean and worst over the rows whose count was timed: all of them, then GPU by GPU."""
    shares: dict[str, list] = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        print(f"{path} ({doc['gpu']}, {doc.get('flush', 'write')} flush)")
        for r in replay_rows(doc):
            print(f"  {r['shape']:<40} recorded rule {r['recorded']:>2}  now {r['now']:>2} ({r['share']})  best {r['best']:>2}")
            shares.setdefault(doc["gpu"], []).append(r["share"])
    groups = {"all": [s for v in shares.values() for s in v], **shares} if len(shares) > 1 else shares
    for name, group in groups.items():
        timed = [s for s in group if s is not None]
        if timed:
            print(f"{name}: {len(timed)} of {len(group)} rows timed at the rule's count: mean "
                  f"{sum(timed) / len(timed):.3f} of the best, worst {min(timed):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
