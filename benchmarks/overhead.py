"""Host time per attention call, fresh tensors each call: flashtune against each SDPA backend.

    python3 benchmarks/overhead.py [--results benchmarks/results/<gpu>-fp16-bf16.json] [--json OUT]

For each shape and implementation, `reps` calls are timed on the host clock (the GPU is idle at the
start and the launch queue never fills, so the figure is what the call costs the CPU), 15 times,
median. "cycled": 64 input sets in turn, as a model's activations come back at the same addresses
from torch's caching allocator; "new": every call on tensors at addresses not seen before (the
tensor maps of the Hopper kernel are then patched). The implementations are timed in turns (each
of the 15 trials times every one once, the order rotating; an SDPA backend's calls run inside its
`sdpa_kernel` context, entered once per trial). flashtune runs the tuned configs of the
results file (its lookup is made from it); `torch.ops` is the same call through the operator
dispatcher, as torch.compile runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # name: (B, H, N, D, causal)
    "tiny": (1, 4, 128, 64, True),
    "small": (2, 16, 512, 128, True),
    "d128 N4096": (4, 16, 4096, 128, True),
}


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tuner
    from results_lookup import write_lookup
    from tuner.gpu import detect
    from tuner.problem import Problem
    from tuner import dispatch, native

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "NVIDIA-H100-80GB-HBM3_sm_90-fp16-bf16.json"))
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    lookup = Path(tempfile.mkdtemp()) / "best.json"
    extra = [Problem(b, h, n, n, d, "bf16", c) for b, h, n, d, c in SHAPES.values()]
    write_lookup(a.results, lookup, extra, detect())
    dispatch.reset(lookup)
    python_path = dispatch.Dispatcher(lookup, native=False)
    if native.module(wait=True) is None:
        print(f"the C++ call path is not available ({native.failure()}): flashtune takes the Python path")
    impls = {
        "flashtune": lambda q, k, v, c: tuner.attention(q, k, v, is_causal=c),
        "python path": lambda q, k, v, c: python_path.output(q, k, v, c),
        "torch.ops": lambda q, k, v, c: torch.ops.flashtune.attention(q, k, v, c, None, None, False),
        "sdpa_cudnn": (SDPBackend.CUDNN_ATTENTION, None),
        "sdpa_flash": (SDPBackend.FLASH_ATTENTION, None),
        "sdpa_efficient": (SDPBackend.EFFICIENT_ATTENTION, None),
    }
    rows = []
    for shape, (b, h, n, d, causal) in SHAPES.items():
        # tuned for the grid: this shape's bucket is a grid shape's (or the fallback, which the table says)
        big = b * h * n * d > 1 << 22
        sets = 4 if big else 64
        for mode in ("cycled", "new"):
            if mode == "new" and big:
                continue
            pool_n = sets if mode == "cycled" else a.reps * 16
            pool = [tuple(torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                    for _ in range(pool_n)]
            calls, pinned = {}, {}
            for name, impl in impls.items():
                if isinstance(impl, tuple):
                    pinned[name] = impl[0]

                    def call(q, k, v, c):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=c)
                else:
                    call = impl
                with sdpa_kernel(pinned[name]) if name in pinned else contextlib.nullcontext():
                    for i in range(3):
                        call(*pool[i % len(pool)], causal)   # plans, cuDNN graphs
                calls[name] = call
            torch.cuda.synchronize()
            # in turns: each trial times every implementation once, the order rotating, so that a
            # host whose clock or load drifts over the run moves all of them alike
            times = {name: [] for name in calls}
            names = list(calls)
            for trial in range(15):
                for name in names[trial % len(names):] + names[:trial % len(names)]:
                    with sdpa_kernel(pinned[name]) if name in pinned else contextlib.nullcontext():
                        start = time.perf_counter()
                        for i in range(a.reps):
                            calls[name](*pool[(trial * a.reps + i) % len(pool)], causal)
                        times[name].append((time.perf_counter() - start) / a.reps * 1e6)
                    torch.cuda.synchronize()
            plan = next(iter(dispatch.default()._plans.values()), None)
            for name in names:
                rows.append(dict(shape=shape, mode=mode, impl=name, us=statistics.median(times[name]),
                                 kernel=(plan.family or "fallback") if plan and name == "flashtune" else ""))
                print(f"{shape:>11} {mode:>6} {name:>14} {rows[-1]['us']:7.1f} us/call {rows[-1]['kernel']}", flush=True)
            dispatch.default()._plans.clear()
            python_path._plans.clear()
            del pool
    print("\nhost us per call (median of 15 x %d calls):" % a.reps)
    print("| shape | tensors | flashtune | its Python path | torch.ops.flashtune | SDPA cuDNN | SDPA flash | SDPA efficient |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in SHAPES:
        for mode in ("cycled", "new"):
            r = {x["impl"]: x["us"] for x in rows if x["shape"] == shape and x["mode"] == mode}
            if r:
                print(f"| {shape} {SHAPES[shape]} | {mode} | " + " | ".join(f"{r[k]:.1f}" for k in impls) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
