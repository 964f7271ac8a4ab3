"""Forward + backward of a Llama-style attention block, flashtune against SDPA's cuDNN and
FlashAttention-2 backends, on the standard grid's d=128 shapes (bf16, hidden 2048, 16 heads).

    python3 benchmarks/train_step.py [--results benchmarks/results/<gpu>-fp16-bf16.json] [--json OUT]

The block: x (B, N, 2048) -> one QKV projection -> (B, N, H, D) views -> causal or full attention
-> output projection; a step is its forward and the backward of a fixed upstream gradient, every
weight and x requiring gradients. Also the attention alone (forward + backward). The blocks are
timed against each other, then the attention steps (tuner.timing.Timer: CUDA events in turns, the
order rotating, 50 ms of untimed running before each turn, L2 flushed before each repetition).
The ratio is paired: per round, the best SDPA turn's median over flashtune's, then the median of
those over the rounds (with their range), so a clock that drifts over the run moves both sides of
each ratio alike; the plain medians are reported beside. flashtune runs the tuned configs of the
results file (forward) and the backward seam (tuner/backward.py).

--profile prints, per shape, the CUDA kernels of a few attention steps of each implementation
(torch.profiler): what a step spends beside the attention kernels themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GRID = [(16384 // n, 16, n, 128, c) for n in (1024, 4096, 16384) for c in (False, True)]


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tuner
    from results_lookup import write_lookup
    from tuner import dispatch
    from tuner.backward import choose
    from tuner.gpu import detect
    from tuner.timing import Timer
    from tuner.torch_attention import Case

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "NVIDIA-H100-80GB-HBM3_sm_90-fp16-bf16.json"))
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=1.5, help="timed seconds per implementation and shape")
    ap.add_argument("--profile", action="store_true", help="print each step's CUDA kernels (torch.profiler)")
    ap.add_argument("--seqlen", type=int, action="append", help="only these grid lengths (1024, 4096, 16384)")
    a = ap.parse_args(argv)
    gpu = detect()
    lookup = Path(tempfile.mkdtemp()) / "best.json"
    write_lookup(a.results, lookup, (), gpu)
    dispatch.reset(lookup)
    timer = Timer(gpu.l2_bytes, target_seconds=a.seconds, max_reps=1000)

    def attend(impl):
        if impl == "flashtune":
            return lambda q, k, v, c: tuner.attention(q, k, v, is_causal=c)
        backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}[impl]

        def run(q, k, v, c):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=c)
        return run

    impls = ("flashtune", "sdpa_cudnn", "sdpa_flash")
    rows = []
    for b, h, n, d, causal in GRID:
        if a.seqlen and n not in a.seqlen:
            continue
        dim = h * d
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(b, n, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w_qkv = (torch.randn(3 * dim, dim, device="cuda", dtype=torch.bfloat16, generator=g) / dim**0.5).requires_grad_()
        w_out = (torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16, generator=g) / dim**0.5).requires_grad_()
        up = torch.randn(b, n, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        qkv0 = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        grad_o = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)

        def block_step(att):
            def step():
                q, k, v = (x @ w_qkv.t()).view(b, n, 3, h, d).unbind(2)
                y = att(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal)
                out = y.transpose(1, 2).reshape(b, n, dim) @ w_out.t()
                torch.autograd.backward(out, up)
            return step

        def attention_step(att):
            q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in qkv0.unbind(2))

            def step():
                torch.autograd.backward(att(q, k, v, causal), grad_o)
            return step

        fns = {}
        for impl in impls:
            fns[f"block {impl}"] = block_step(attend(impl))
            fns[f"attention {impl}"] = attention_step(attend(impl))
        for fn in fns.values():   # plans, cuDNN's graphs, and a check that each runs
            fn()
        plan = next(iter(dispatch.default()._plans.values()))
        if a.profile:
            for impl in impls:
                print(f"\n{b}x{h}x{n}x{d} {'causal' if causal else 'full'}, attention {impl}: CUDA kernels of 5 steps")
                print(profile(fns[f"attention {impl}"], 5))
        timings = {}
        for part in ("block", "attention"):
            timings.update(timer.interleaved({f"{part} {k}": fns[f"{part} {k}"] for k in impls}, rounds=a.rounds))
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1) * 3.5   # forward + backward (2.5x)
        row = dict(batch=b, heads=h, seqlen=n, head_dim=d, causal=causal, forward=plan.family or "fallback",
                   backward=choose(Case(torch.bfloat16, d, n, n, causal, False, (gpu.major, gpu.minor))).name,
                   **{f"{k} ms": t.median_ms for k, t in timings.items()},
                   **{f"{k} attention TFLOP/s": flops / (timings[f"attention {k}"].median_ms * 1e-3) / 1e12 for k in impls},
                   **{f"{part} paired ratio": paired(timings, part, impls) for part in ("block", "attention")})
        rows.append(row)
        dispatch.default()._plans.clear()
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()

    print(f"\n{gpu.name}: forward + backward, bf16, ms per step (median); ratio = best SDPA / flashtune, "
          f"paired by round: median (min-max over {a.rounds} rounds)")
    print("| B | H | N | d | mask | block flashtune | block SDPA cuDNN | block SDPA flash | block ratio "
          "| attention flashtune | attention SDPA cuDNN | attention SDPA flash | attention ratio | fwd / bwd |")
    print("| --- " * 14 + "|")
    for r in rows:
        cells = []
        for part in ("block", "attention"):
            ours = r[f"{part} flashtune ms"]
            ratio = r[f"{part} paired ratio"]
            cells += [f"{ours:.3f}", f"{r[f'{part} sdpa_cudnn ms']:.3f}", f"{r[f'{part} sdpa_flash ms']:.3f}",
                      f"{ratio['median']:.3f}x ({ratio['min']:.3f}-{ratio['max']:.3f})"]
        print(f"| {r['batch']} | {r['heads']} | {r['seqlen']} | {r['head_dim']} | {'causal' if r['causal'] else 'full'} | "
              + " | ".join(cells) + f" | {r['forward']} / {r['backward']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"gpu": gpu.name, "rows": rows}, indent=1))
    return 0


def paired(timings: dict, part: str, impls: tuple[str, ...]) -> dict:
    """Per round, the best SDPA backend's turn over flashtune's (both medians of that round's
    repetitions); their median, min and max over the rounds."""
    import statistics

    ours = timings[f"{part} flashtune"].rounds
    peers = [timings[f"{part} {k}"].rounds for k in impls if k != "flashtune"]
    ratios = [min(p[i] for p in peers) / ours[i] for i in range(len(ours))]
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios), rounds=ratios)


def profile(step, steps: int) -> str:
    """The CUDA kernels `steps` calls of `step` ran, by total time (torch.profiler's table)."""
    import torch
    from torch.profiler import ProfilerActivity

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70)


if __name__ == "__main__":
    raise SystemExit(main())
