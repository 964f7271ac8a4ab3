"""The TMA maps' L2 promotion, A/B: what `tuner.attention` serves a shape, its maps encoded with each
L2 promotion (cuTensorMapEncodeTiled's l2Promotion: none, 64B, 128B, 256B), timed in turns with the
peers.

    python3 benchmarks/l2_promotion_ab.py [--dtype bf16] [--json OUT] SHAPE...

Why: Nsight Compute put our packed decode kernel's DRAM fills 4-7% above FlashAttention-4's on the
same call, with 1.4x its L2 sector lookups (PERF_NOTES "l2p"); the maps asked for 256-byte promotion,
CUTLASS's default is 128. The promotion is the map's, encoded on the host: the kernels are the same
cubins, so a variant here differs from the served call in that one field. The setting is part of a
map's geometry and of its template's cache key (sm90_tma.L2_PROMOTION): before that, every setting got
the first one's cached map, and "g4"'s A/B read one map four times (PERF_NOTES "i1"). SHAPE is `tuner bench
--shape`'s (B,H[:KVH],NQ[:NK],D[,MASK]).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # served_alternatives, beside this script

PROMOTIONS = {"none": 0, "64B": 1, "128B": 2, "256B": 3}   # CUtensorMapL2promotion
PEERS = ("sdpa_cudnn", "fa4")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("l2_promotion_ab needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from tuner import dispatch
    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.kernel_templates import FAMILIES, sm90_tma
    from tuner.measure import prepare_kernel, prepare_peer
    from tuner.peers import fa4_missing
    from tuner.problem import Problem
    from served_alternatives import report, time_in_turns

    gpu, d, rows = detect(), dispatch.default(), []
    peers = [p for p in PEERS if p != "fa4" or fa4_missing() is None]
    shipped = sm90_tma.L2_PROMOTION
    for text in args.shapes:
        p = Problem.parse(text, args.dtype)
        entry = d.serving_entry(p, gpu)
        if entry is None or entry["family"] not in FAMILIES:
            print(f"{p.key}: SDPA serves it; nothing of ours to weigh", flush=True)
            continue
        form = dispatch._served_form(entry, p, gpu)
        fam, params = FAMILIES[form["family"]], form["params"]
        ck = compile_kernel(fam, params, p, gpu.arch)
        prepared = {b: prepare_peer(b, p, 0) for b in peers}
        try:
            for name, value in PROMOTIONS.items():   # the maps are encoded here, as each is prepared
                sm90_tma.L2_PROMOTION = value
                prepared[name] = prepare_kernel(fam, params, p, ck, 0, gpu)
        finally:
            sm90_tma.L2_PROMOTION = shipped
        row = {"shape": text, "dtype": args.dtype, "family": fam.name, "params": params,
               "tflops": time_in_turns(prepared, p, gpu, args.rounds)}
        report(rows, row, f"{p.key} ({fam.name})", gpu, args.json)
        del prepared
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
