"""The SM clock and board power while each kernel runs back to back: what TFLOP/s a kernel reaches
at the H100's power cap, and how many per GHz of the clock it keeps there.

    python3 benchmarks/power_state.py [--shape B,H,N,D[,MASK]]... [--dtype bf16] [--seconds 3]
                                      [--peer sdpa_cudnn --peer fa4] [--json OUT]

Why: the H100 SXM runs attention at its 700 W cap, so its SM clock is not the 1980 MHz boost but
whatever the draw allows (1420-1640 MHz here), and a kernel's TFLOP/s is its work per clock times
the clock its own power draw leaves. Two kernels at the same TFLOP/s can differ in both. This
separates them: each contender (flashtune as `tuner.attention` serves the shape, then the peers,
each checked against float64 first; the same random inputs) runs back to back for `--seconds`
without L2 flushes, after a second of rest, in two rounds, while `nvidia-smi` samples the clock,
the power and the clock event reasons (0x4: the software power cap) every 50 ms; the first second
of each run is left out (the clock settles). TFLOP/s per GHz against the tensor cores' dense peak
per GHz (4096 FLOP a clock an SM in 16 bits on Hopper) is the share of the peak a kernel keeps at
the clock it runs.
TFLOP/s here read 0-3% above `tuner bench` (no flushes, no rests between repetitions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # ablate, beside this script

from ablate import parse_sample, smi_fields  # noqa: E402

PEAK_FLOP_PER_CLOCK_SM = {(9, 0): 4096}   # dense 16-bit wgmma: 1024 FLOP a clock per tensor core, 4 an SM


def sampler() -> tuple[subprocess.Popen, list[tuple[float, float, float, int]]]:
    """nvidia-smi sampling every 50 ms, read as it comes (each run is reported when it ends) into a
    list of ablate.parse_sample's (epoch seconds, SM MHz, W, reason bits)."""
    query = ["nvidia-smi", f"--query-gpu={smi_fields()}", "--format=csv,noheader,nounits", "-lms", "50"]
    proc = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
    samples: list[tuple[float, float, float, int]] = []

    def read() -> None:
        for line in proc.stdout:
            if (sample := parse_sample(line)) is not None:
                samples.append(sample)

    threading.Thread(target=read, daemon=True).start()
    return proc, samples


def run_for(fn, seconds: float) -> tuple[float, float, float]:
    """Runs `fn` back to back for about `seconds`: (ms per call, start, end) by CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, n = time.time(), 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n, t0, time.time()


def held_run(fn, seconds: float, samples: list) -> tuple[float, list]:
    """`fn` back to back for `seconds` after a second's rest: (ms per call, the nvidia-smi samples
    of the run past its first second, when the clock has settled)."""
    import torch

    torch.cuda.synchronize()
    time.sleep(1.0)
    ms, t0, t1 = run_for(fn, seconds)
    window = [x for x in samples if t0 + 1.0 <= x[0] <= t1]
    if not window:
        raise SystemExit("nvidia-smi gave no samples: is it on PATH and the GPU visible?")
    return ms, window


def contenders(problem, peers: list[str]) -> dict:
    """flashtune as `tuner.attention` serves `problem`, and each peer that runs it, on the same inputs."""
    import tuner
    from tuner.measure import prepare_peer, random_inputs

    q, k, v = random_inputs(problem, 0)
    fns = {"flashtune": lambda: tuner.attention(q, k, v, mask=problem.mask)}
    for peer in peers:
        run, m = prepare_peer(peer, problem, 0)
        if run is None:
            print(f"{peer}: {m.status} {m.message}", file=sys.stderr)
        else:
            fns[peer] = run
    return fns


def main(argv: list[str] | None = None) -> int:
    import torch

    from tuner.problem import Problem

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=[],
                    help="a tuner --shape, B,H[:KVH],NQ[:NK],D[,MASK] (default 1,16,16384,128)")
    ap.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    ap.add_argument("--peer", action="append", default=[], help="sdpa_cudnn, sdpa_flash, fa4 (default: sdpa_cudnn, fa4)")
    ap.add_argument("--seconds", type=float, default=3.0, help="each run's length; its first second is left out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    cc = torch.cuda.get_device_capability()
    peak = PEAK_FLOP_PER_CLOCK_SM.get(cc)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    proc, samples = sampler()
    rows = []
    try:
        for shape in a.shape or ["1,16,16384,128"]:
            problem = Problem.parse(shape, a.dtype)
            fns = contenders(problem, a.peer or ["sdpa_cudnn", "fa4"])
            for fn in fns.values():
                fn()
            for rnd in range(a.rounds):
                for name, fn in fns.items():
                    ms, window = held_run(fn, a.seconds, samples)
                    mhz = statistics.mean(x[1] for x in window)
                    tflops = problem.tflops(ms)
                    row = dict(problem=problem.key, kernel=name, round=rnd, ms=ms, tflops=tflops, sm_mhz=mhz,
                               power_w=statistics.mean(x[2] for x in window),
                               reasons=sorted({hex(x[3]) for x in window}), samples=len(window),
                               tflops_per_ghz=tflops / (mhz / 1e3),
                               share_of_peak_per_clock=tflops * 1e12 / (peak * sms * mhz * 1e6) if peak else None)
                    rows.append(row)
                    share = f"{row['share_of_peak_per_clock']:.3f}" if peak else "-"
                    print(f"{problem.key:<34} {name:<10} round {rnd}: {tflops:6.1f} TFLOP/s  {mhz:5.0f} MHz  "
                          f"{row['power_w']:4.0f} W  {row['tflops_per_ghz']:5.1f} per GHz  peak share {share}  "
                          f"reasons {','.join(row['reasons'])}", flush=True)
    finally:
        proc.terminate()
    if a.json:
        Path(a.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
