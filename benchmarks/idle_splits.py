"""Prefill calls whose few query blocks leave SMs idle, as a fresh install serves them (the shipped
lookups, none of the user's): what `attention` runs (a served flash_fwd_sm90 config with its keys
split, or the split family's default where nothing tuned reaches: Dispatcher._split_where_idle,
untuned.split_default) against what it ran before those rules (the config unsplit, or SDPA),
beside SDPA flash and cuDNN, each timed in turns (2 rounds, median; every candidate checked against
float64 first), TFLOP/s (benchmarks/PERF_NOTES.md "p5").

    python3 benchmarks/idle_splits.py OUT.json [bf16] [fp16]
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from tuner import dispatch
from tuner.dispatch import Dispatcher, served_params
from tuner.gpu import detect
from tuner.kernel_templates import get_family
from tuner.problem import Problem
from tuner.runner import GpuRunner

NO_LOOKUP = "/nonexistent/flashtune-lookup.json"   # the user's: none, so the shipped ones serve
SHAPES = ["1,2:1,3169:3276,128,causal_br", "1,2,3000,128,none", "1,1,8192,128,causal", "1,8:1,600:20000,128,causal_br",
          "2,2:1,700:7000,128,causal_br", "1,2,984:49575,64,none", "1,8:1,700:9000,128,causal_br",
          "1,4:1,1024:8192,128,causal_br", "1,1,4096,128,causal", "1,2,8192,64,causal", "1,1,16384,128,none",
          "1,4:1,1500:6000,128,causal_br", "1,2:2,4000,256,none", "1,4:2,2000:16000,256,causal_br"]


def main() -> int:
    if not torch.cuda.is_available():
        print("idle_splits needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import cuda.core  # noqa: F401  (before the compile threads)

    gpu = detect()
    new = Dispatcher(NO_LOOKUP)
    old = Dispatcher(NO_LOOKUP)
    old._split_where_idle = lambda e, p, g: e
    plan = []
    for dtype in sys.argv[2:] or ["bf16"]:
        for shape in SHAPES:
            p = Problem.parse(shape, dtype)
            after = new.serving_entry(p, gpu)
            real = dispatch.split_default   # the rules before p5: no split default either (the name dispatch calls)
            dispatch.split_default = lambda p, g: None
            before = old.serving_entry(p, gpu)
            dispatch.split_default = real
            plan.append((p, before, after))
    from concurrent.futures import ThreadPoolExecutor
    from tuner.compile import compile_kernel
    jobs = [(get_family(e["family"]), served_params(e, p), p) for p, b, a in plan for e in (b, a)
            if e is not None and not e["family"].startswith("sdpa")]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda j: compile_kernel(j[0], j[1], j[2], gpu.arch), jobs))
    r = GpuRunner(gpu)
    out = []
    for p, before, after in plan:
        res = {"before": [], "after": [], "sdpa_flash": [], "sdpa_cudnn": []}
        for _ in range(2):
            for name, e in (("before", before), ("after", after)):
                if e is None or e["family"].startswith("sdpa"):
                    continue
                m = r.measure(get_family(e["family"]), served_params(e, p), p)
                res[name].append(m.tflops or float("nan"))
            for k in ("sdpa_flash", "sdpa_cudnn"):
                m = r.peer(k, p)
                res[k].append(m.tflops or float("nan"))
        row = {k: round(statistics.median(v), 1) if v else None for k, v in res.items()}
        desc = lambda e: "sdpa" if e is None else e["family"] + (f" s{get_family(e['family']).splits(served_params(e, p), p, gpu)}" if "split" in e["family"] else "")
        print(f"{p.key:45s} before {desc(before):28s} after {desc(after):28s}", row, flush=True)
        out.append({"problem": p.key, "before": desc(before), "after": desc(after), "tflops": row})
    with open(sys.argv[1], "w") as f:
        json.dump({"gpu": gpu.name, "gpu_key": gpu.key, "date": time.strftime("%Y-%m-%d"), "rows": out}, f, indent=1)
    r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
