"""Where a short decode step's time goes beyond streaming its bytes: the served call beside SDPA cuDNN,
a copy and a read of the same bytes, and an empty launch, timed the same way.

    python3 benchmarks/decode_fixed_cost.py [--batch 32] [--keys 1024,2048,4096,8192] [--json OUT]

Why: at B32 x 1k keys (a 134 MB K/V read, ~50 us) every decode kernel, ours and cuDNN's alike, reads
0.86-0.88x of the GPU's 2 GiB copy bandwidth under the read flush, while from 8k keys up they reach
1.0-1.05x (PERF_NOTES "q2"-"q4"). A fit of time against bytes gives each contender a fixed cost a call
and a streaming rate. If a plain copy or read of the same bytes pays the same fixed cost, it is the
launch and the memory's ramp, not the kernel's work.

First the 2 GiB copy decode_bench.py measures (the bar's reference, TB/s of read + write). Each
shape (one query, 32 query heads on 8 K/V heads, d=128, bf16, as decode_bench.py) is timed with
tuner.timing's read flush, in turns:
- `served`: `tuner.attention` as a model's decode step calls it; `sdpa_cudnn`.
- `copy`: a device-to-device copy of a buffer the size of K and V (reads and writes those bytes).
- `read`: torch.sum over that buffer (reads them once).
- `empty`: a one-element add: the event pair and one launch, the floor of any call.
and again as two calls between one event pair (`x2`): the second call's launch is queued behind the
first, so x2 - x1 is a call's cost with its launch hidden (not where K and V fit in L2, as B8 x 1k's
34 MB do on the H100: the second call reads them from there). Then torch.profiler gives each call's
kernels (count, and their duration on the GPU's clock), so event time - kernel time is what the
event pair, the launch and the gaps between a call's kernels cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def kernel_times(fn, flush, calls: int = 20) -> tuple[float, float]:
    """Kernels (and copies) a call launches and their summed GPU time (us), median over `calls`
    flushed calls: torch.profiler's CUDA activity in time order, each call's told apart from the
    flush's by a profiled flush alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def kernels(body, n):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                body()
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return sorted(ev, key=lambda e: e.time_range.start)

    per_flush = len(kernels(flush, calls)) // calls
    ev = kernels(lambda: (flush(), fn()), calls)
    per_call = len(ev) // calls - per_flush
    durations = []
    for i in range(calls):
        own = ev[i * (per_flush + per_call) + per_flush:(i + 1) * (per_flush + per_call)]
        durations.append(sum(e.time_range.elapsed_us() for e in own))
    return per_call, statistics.median(durations)


def fit_rows(rows: list[dict]) -> dict:
    """time = fixed + bytes / rate, least squares over each batch's key lengths, for each contender's
    event time and (", kernels") its kernels' GPU time."""
    fits = {}
    for b in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == b]
        if len(mine) < 2:
            continue
        for n in ("served", "sdpa_cudnn", "copy", "read"):
            xs = [r["bytes"][n] for r in mine]
            for label, ys in ((n, [r["us"][n] for r in mine]), (f"{n}, kernels", [r["kernels"][n]["us"] for r in mine])):
                slope, fixed = statistics.linear_regression(xs, ys)   # us per byte, us
                fits[f"B{b} {label}"] = dict(fixed_us=fixed, tb_s=1e-6 / slope if slope > 0 else float("nan"))
    return fits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="32")
    ap.add_argument("--keys", default="1024,2048,4096,8192")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch

    from decode_bench import attention_call, copy_bandwidth, inputs, peers
    from tuner.problem import Problem
    from tuner.timing import Timer

    if not torch.cuda.is_available():
        print("decode_fixed_cost needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    timer = Timer(flush="read")
    tiny = torch.zeros(1, device="cuda")
    copy_tb_s = copy_bandwidth(timer)   # the bar's reference: a 2 GiB copy, as decode_bench.py measures it
    print(f"{torch.cuda.get_device_name()}: 2 GiB device-to-device copy {copy_tb_s:.2f} TB/s", flush=True)
    rows = []
    for b in map(int, args.batch.split(",")):
        for nk in map(int, args.keys.split(",")):
            problem = Problem(b, 32, 1, nk, 128, "bf16", "causal_br", 8)
            _, (q, k, v) = inputs(problem)
            kv_bytes = k.numel() * k.element_size() * 2
            src = torch.randn(kv_bytes // 2, dtype=torch.bfloat16, device="cuda")
            dst = torch.empty_like(src)
            served, _ = attention_call(q, k, v)

            cudnn = peers(problem, q, k, v)["sdpa_cudnn"][0]   # decode_bench's call of the peer
            one = {"served": served, "sdpa_cudnn": cudnn, "copy": lambda: dst.copy_(src),
                   "read": lambda: torch.sum(src, dtype=torch.float32), "empty": lambda: tiny.add_(1)}
            fns = dict(one)
            fns |= {f"{n}_x2": (lambda f=f: (f(), f())) for n, f in one.items()}
            t = timer.interleaved(fns)
            bytes_read = {"served": problem.bytes_moved(), "sdpa_cudnn": problem.bytes_moved(),
                          "copy": 2 * kv_bytes, "read": kv_bytes, "empty": 0}
            row = dict(batch=b, keys=nk, bytes=bytes_read, us={n: x.median_ms * 1e3 for n, x in t.items()}, kernels={})
            for n, f in one.items():
                count, us = kernel_times(f, timer.flush)
                row["kernels"][n] = dict(count=count, us=us)
            rows.append(row)
            print(f"B{b} Nk{nk} ({kv_bytes / 1e6:.0f} MB of K/V):", flush=True)
            for n in one:
                us, us2, kern = row["us"][n], row["us"][f"{n}_x2"], row["kernels"][n]
                tbs = bytes_read[n] / (us * 1e-6) / 1e12 if bytes_read[n] else float("nan")
                print(f"  {n:<11} {us:8.2f} us  x2 {us2:8.2f} (+{us2 - us:7.2f})  {tbs:5.2f} TB/s ({tbs / copy_tb_s:.2f}x the copy)"
                      f"  kernels {kern['count']} {kern['us']:8.2f} us  event - kernels {us - kern['us']:6.2f}", flush=True)
    fits = fit_rows(rows)
    for name, f in fits.items():
        print(f"fit {name:<24} fixed {f['fixed_us']:6.2f} us  streaming {f['tb_s']:.2f} TB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), copy_tb_s=copy_tb_s, rows=rows, fits=fits), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
