"""Shapes past every shipped bucket's reach, as `tuner.attention` serves them (Dispatcher.select's
rule for a prefill call that fills the GPU), beside SDPA cuDNN, SDPA flash and FlashAttention-4
(where installed), timed in turns; TFLOP/s count the visible half of a causal score matrix.

    python3 benchmarks/long_prompts.py [--seqlen 65536] [--json OUT]

Shapes: 64k-token causal prompts (bf16 and fp16 at d=128 with 32 query and 8 K/V heads, d=256 with
16 and 8, d=64 at B2 with 32 heads). This only times: each output is compared with cuDNN's (max abs
difference), where `tuner bench --lookup FILE --shape ... --peer fa4` checks every candidate against
float64 first (PERF_NOTES "p2").
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("long_prompts needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tuner
    from tuner.timing import Timer

    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:   # not installed, or not for this GPU
        flash_attn_func = None
        print(f"no FA4: {str(exc).splitlines()[0][:100]}", file=sys.stderr)
    n, rows = args.seqlen, []
    for b, h, kvh, d, dt in ((1, 32, 8, 128, torch.bfloat16), (1, 32, 8, 128, torch.float16),
                             (1, 16, 8, 256, torch.bfloat16), (2, 32, 32, 64, torch.bfloat16)):
        q = torch.randn(b, n, h, d, device="cuda", dtype=dt)
        k, v = (torch.randn(b, n, kvh, d, device="cuda", dtype=dt) for _ in range(2))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        fns = {"flashtune": lambda: tuner.attention(qt, kt, vt, is_causal=True)}
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            fns[name] = run
        if flash_attn_func is not None:
            fns["fa4"] = lambda: flash_attn_func(q, k, v, causal=True)
        outs = {}
        for name, fn in list(fns.items()):
            try:
                r = fn()
                outs[name] = (r[0] if isinstance(r, tuple) else r).transpose(1, 2) if name == "fa4" else r
                torch.cuda.synchronize()
            except Exception as exc:   # a backend that refuses the case
                print(f"  {name}: {str(exc).splitlines()[0][:100]}", file=sys.stderr)
                del fns[name]
        served = tuner.dispatch.default().plan(qt, kt, vt, True).family or "sdpa"
        timings = Timer(target_seconds=0.3).interleaved(fns, rounds=3)
        flops = 4 * b * h * n * n * d / 2
        tflops = {name: flops / (t.median_ms * 1e-3) / 1e12 for name, t in timings.items()}
        ref = outs.get("sdpa_cudnn")
        diff = float((outs["flashtune"].float() - ref.float()).abs().max()) if ref is not None else float("nan")
        key = f"B{b}-H{h}/kv{kvh}-N{n}-D{d}-{str(dt).removeprefix('torch.')}-causal"
        rows.append(dict(shape=key, served=served, tflops=tflops, max_abs_diff=diff))
        print(f"{key} served by {served}: " + "  ".join(f"{k} {x:.1f}" for k, x in tflops.items())
              + f"  maxdiff vs cuDNN {diff:.3g}", flush=True)
        del q, k, v, qt, kt, vt, outs, ref
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
