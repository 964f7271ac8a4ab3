"""Nsight Compute's view of our served kernel beside a peer's (FlashAttention-4's by default; any
measured peer with --peer, sdpa_cudnn say) on the same problems: each runs a few times, then once
inside an NVTX range "prof" (ours, then the peer, problem by problem), so that
`ncu --nvtx --nvtx-include "prof/"` profiles exactly those launches.

    ncu --nvtx --nvtx-include "prof/" --page raw --csv ... python3 benchmarks/profile_vs_fa4.py \\
        --shape 1,32,8192,80,causal --shape 1,32:8,8192,128,causal
    ... python3 benchmarks/profile_vs_fa4.py --peer sdpa_cudnn --shape 64,32,1:8192,80

`benchmarks/gpu_session.sh profile-fa4` runs it that way (FA4 brought by the two-call carry). Why:
a figure says by how much FA4 leads, the profile says where: in the SMs' active cycles, or in how
many of the elapsed cycles the SMs are active at all (a tail; PERF_NOTES "l3").
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import torch

    import tuner
    from tuner.measure import prepare_peer, random_inputs
    from tuner.peers import FA4, MEASURED_PEERS
    from tuner.problem import Problem

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=[], help="B,H[:Hk],N[:Nk],D[,mask] (repeatable)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--peer", default=FA4, choices=MEASURED_PEERS, help="the kernel beside ours (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_vs_fa4 needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    for text in a.shape or ["1,32,8192,80,causal"]:
        p = Problem.parse(text, a.dtype)
        q, k, v = random_inputs(p, 1)
        peer, m = prepare_peer(a.peer, p, 1)
        if peer is None:
            print(f"{p.key}: {a.peer} {m.status}: {m.message}", file=sys.stderr)
            return 1
        ours = lambda: tuner.attention(q, k, v, mask=p.mask)
        for _ in range(a.warmup):
            ours()
            peer()
        torch.cuda.synchronize()
        for fn in (ours, peer):
            torch.cuda.nvtx.range_push("prof")
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        print(f"{p.key}: ours, then {a.peer}, profiled", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
