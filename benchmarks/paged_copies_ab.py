"""A paged KV cache's K/V tiles by TMA boxes against the producer warpgroup's cp.async (GATHER_KV).

    python3 benchmarks/paged_copies_ab.py [--page ROWS] [--form NAME=JSON]... [--json OUT] [CASE ...]    # CASE: B,H:KVH,NQ:CAP,D

For each call, kvcache_attention's paged plan (bf16, bottom-right causal, lengths in [cap/2, cap],
zeros past them, a shuffled block table) in up to three forms, timed in turns (tuner.timing.Timer)
beside the dense cache's plan on the same keys: "boxes", the form with its variant's `gather` off (a
TMA box per slot and panel); where that form's tile is wider than 128 keys, which GATHER_KV does not
take, "boxes128", the same at Bc 128; and "gather", the form with the producer's copies (at Bc <=
128 where cache_form finds one), however few boxes its tile would take (`gather_min_boxes` 0).
"served" names the one kvcache_attention serves. Each output is checked against float64 on the
first sequence; FA4 beside where it loads, on the pages (`page_table`) and on the dense cache
("fa4_dense": whether a gap to FA4 is the pages' or the kernel's). `--form NAME=JSON` times one
more config, the served one with JSON's params over it, on the pages and ("NAME_dense") on the dense
cache; JSON's "gather": true makes its paged form gather however few boxes and producer registers it
has (`gather_min_boxes` 0, `gather_min_split` 24), false takes the boxes. What the GATHER_KV rule
(flash_fwd_sm90_cache.CacheLensVariant.gathers, cache_form's narrowing) rests on (PERF_NOTES
"x17", "x18").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# x17's five d=128 calls, then one a head dim: a packed GQA chunk at d=64 (FA4 led on pages of 8, x18),
# Phi-2's d=80 (K's tail panel), Phi-3's d=96 (64-byte panels), Gemma's d=256 (boxes: split 24)
CASES = ["8,32:8,16:8192,128", "32,32:8,8:8192,128", "64,8:1,16:4096,128", "4,32:8,512:8192,128",
         "2,28:4,256:16384,128", "8,40:5,200:8192,64", "2,32:32,256:8192,80", "2,32:32,256:8192,96",
         "2,16:16,256:8192,256"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=CASES, help="B,H:KVH,NQ:CAP,D (default: %(default)s)")
    ap.add_argument("--page", type=int, default=16, help="a page's rows (default: %(default)s)")
    ap.add_argument("--form", action="append", default=[], metavar="NAME=JSON",
                    help='one more config: the served one with JSON over it (e.g. c3=\'{"cwg": 3, "Bc": 128, "gather": true}\')')
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    try:
        extra = {name: json.loads(spec) for name, _, spec in (f.partition("=") for f in args.form)}
    except json.JSONDecodeError as e:
        ap.error(f"--form takes NAME=JSON: {e}")
    if args.page <= 0 or args.page % 8:
        ap.error(f"--page takes a page's rows, a positive multiple of 8, not {args.page}")
    import torch

    if not torch.cuda.is_available():
        print("paged_copies_ab needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from kvcache_steps import cache_case, fa4_call, fa4_paged_call

    from tuner import kvcache, kvcache_attention
    from tuner.kernel_templates.flash_fwd_sm90_cache import GATHER_MAX_BC
    from tuner.reference import attention_fp64, compare
    from tuner.timing import Timer

    served_config, force, asked = kvcache.held_keys_config, {}, {}

    def config(*a):   # the served (variant, params), with `force`'s keys over its params
        asked["problem"] = a[1]
        got = served_config(*a)
        return got if got is None or not force else (got[0], dict(got[1], **force))

    timer, rows = Timer(), []
    kvcache.held_keys_config = config
    try:
        for case in args.cases:
            c = cache_case(case, args.page, 0.5, 1.0, "zero")   # kvcache_steps.py's inputs, --tail zero
            q, k, v, lens, d, seqlens, table, kc, vc = c.q, c.k, c.v, c.lens, c.d, c.seqlens, c.table, c.kc, c.vc

            def cache(dense: bool) -> tuple:   # kvcache_attention's arguments after q: the dense cache, or the pages
                return (k, v, seqlens) if dense else (kc, vc, seqlens, table)

            def plan_of(forced: dict, dense: bool = False):   # the plan kvcache_attention makes with `forced` over the served params
                kvcache._plans.clear()
                force.update(forced)
                try:
                    kvcache_attention(q, *cache(dense))
                finally:
                    force.clear()
                key = next(key for key in kvcache._plans if key[0] == q.shape and key[-1])
                return key, kvcache._plans[key]

            _, served = plan_of({})
            variant = served.family
            if variant is None or not hasattr(variant, "gather"):
                print(f"{case}: not served by a paged Hopper variant ({served.reason}); skipped", file=sys.stderr)
                continue
            problem, plans = asked["problem"], {}
            with mock.patch.object(variant, "gather", False):
                plans["boxes"] = plan_of({})
                if plans["boxes"][1].params["Bc"] > GATHER_MAX_BC:
                    plans["boxes128"] = plan_of({"Bc": GATHER_MAX_BC})
            with mock.patch.object(variant, "gather_min_boxes", 0):   # however few boxes its tile takes
                gather = plan_of({})
                gathers = variant.gathers(gather[1].params, problem)
            if gathers:
                plans["gather"] = gather
            gathered, dense_plans = {"gather": gathers}, {"dense": plan_of({}, dense=True)}
            for name, spec in extra.items():
                spec = dict(spec)
                how = spec.pop("gather", None)
                with contextlib.ExitStack() as stack:
                    if how is False:
                        stack.enter_context(mock.patch.object(variant, "gather", False))
                    elif how:
                        stack.enter_context(mock.patch.object(variant, "gather_min_boxes", 0))
                        stack.enter_context(mock.patch.object(variant, "gather_min_split", 24))
                    plans[name] = plan_of(spec)
                    gathered[name] = variant.gathers(plans[name][1].params, problem)
                dense_plans[f"{name}_dense"] = plan_of(spec, dense=True)
            served_name = "gather" if variant.gathers(served.params, problem) else "boxes"
            assert plans[served_name][1].params == served.params, (case, served_name, served.params)

            def with_plan(key, plan, dense: bool = False):
                def call():
                    kvcache._plans[key] = plan
                    return kvcache_attention(q, *cache(dense))
                return call
            fns = {name: with_plan(*kp) for name, kp in plans.items()}   # (the dense forms share a key: each sets its plan)
            fns.update({name: with_plan(*kp, dense=True) for name, kp in dense_plans.items()})
            if (fa4 := fa4_paged_call(q, kc, vc, seqlens, table)) is not None:
                fns["fa4"] = fa4[0]
                if (fa4_dense := fa4_call(q, k, v, seqlens)) is not None:   # without pages: the kernel's gap
                    fns["fa4_dense"] = fa4_dense[0]
            ref_o, _ = attention_fp64(q[:1], k[:1, :, :lens[0]], v[:1, :, :lens[0]], "causal_br", 1 / math.sqrt(d))
            errs = {}
            for name, fn in fns.items():
                err = compare(fn()[:1], None, ref_o, None)
                errs[name] = err.rel if err.finite else math.inf
            times = timer.interleaved(fns)
            us = {n: t.median_ms * 1e3 for n, t in times.items()}
            forms = {n: dict(family=p.family.name, params=p.params, gathers=gathered.get(n, False))
                     for n, (_, p) in {**plans, **dense_plans}.items()}
            rows.append(dict(case=case, page=args.page, lens=lens, us=us, forms=forms, served=served_name, rel_err=errs))
            print(f"{case:<22} page {args.page} " + "  ".join(f"{n} {x:7.1f} us" for n, x in us.items())
                  + "  Bc " + " ".join(f"{n}:{p.params['Bc']}" for n, (_, p) in plans.items())
                  + f"  served: {served_name}"
                  + f"  max err {max(errs.values()):.2g}", flush=True)
            if args.json:   # after each call, so a run cut short keeps what it timed
                Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        kvcache.held_keys_config = served_config
    return 0


if __name__ == "__main__":
    sys.exit(main())
