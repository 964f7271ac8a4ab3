"""kvcache_attention with more new queries than flash_decode takes (a prompt's prefill into the
cache): attention's dispatcher in one call (a dense cache whose sequences hold every key), per
sequence (lengths given), and torch's float32 math per sequence (what ran these before 13f6980),
timed in turns.

    python3 benchmarks/kvcache_prefill.py

Shapes: B8 x 512 queries after 4096 keys, B4 x 2048 after 8192, B8 x 128 after 1024; 32 query
heads on 8 K/V heads, d=128, bf16, a (B, N, Hk, D) cache. Each output is compared with the float32
path's (max abs difference); kvcache_attention's float64 checks are tests/test_gpu_decode.py's.
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("kvcache_prefill needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from tuner import kvcache_attention
    from tuner.dispatch import out_layout
    from tuner.kvcache import gather_sequence
    from tuner.timing import Timer
    from tuner.torch_attention import MATH

    for b, nq, nk in ((8, 512, 4096), (4, 2048, 8192), (8, 128, 1024)):
        q = torch.randn(b, nq, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(b, nk, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")

        def float32_math(q=q, k=k, v=v, lens=lens, b=b, nk=nk):
            size, stride = out_layout(q)
            o = torch.empty_strided(size, stride, dtype=q.dtype, device=q.device)
            for i in range(b):
                ki, vi = (gather_sequence(t, lens, None, i, nk)[None] for t in (k, v))
                o[i] = MATH.forward(q[i:i + 1], ki, vi, "causal_br", None)[0][0]
            return o

        fns = {"one_call": lambda: kvcache_attention(q, k, v), "per_sequence": lambda: kvcache_attention(q, k, v, lens),
               "float32_per_sequence": float32_math}
        outs = {name: fn() for name, fn in fns.items()}
        torch.cuda.synchronize()
        timings = Timer(target_seconds=0.2).interleaved(fns, rounds=4)
        base = outs["float32_per_sequence"].float()
        print(f"B{b} x {nq} queries after {nk - nq} keys: "
              + "  ".join(f"{name} {t.median_ms:.3f} ms" for name, t in timings.items())
              + "  maxdiff " + ", ".join(f"{name} {float((o.float() - base).abs().max()):.3g}" for name, o in outs.items()),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
