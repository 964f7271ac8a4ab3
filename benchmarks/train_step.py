"""Forward + backward of a Llama-style attention block, flashtune against SDPA's cuDNN and
FlashAttention-2 backends, on the standard grid's d=128 shapes (bf16, hidden 2048, 16 heads).

    python3 benchmarks/train_step.py [--results benchmarks/results/<gpu>-fp16-bf16.json] [--json OUT]

The block: x (B, N, 2048) -> one QKV projection -> (B, N, H, D) views -> causal or full attention
-> output projection; a step is its forward and the backward of a fixed upstream gradient, every
weight and x requiring gradients. Also the attention alone (forward + backward). Timed with CUDA
events in turns (8 rounds, the order rotating, 50 ms of untimed running before each turn, L2
flushed before each repetition: tuner.timing.Timer), the median per step. flashtune runs the tuned
configs of the results file (forward) and the backward seam (tuner/backward.py).
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
    a = ap.parse_args(argv)
    gpu = detect()
    lookup = Path(tempfile.mkdtemp()) / "best.json"
    write_lookup(a.results, lookup, (), gpu)
    dispatch.reset(lookup)
    timer = Timer(gpu.l2_bytes)

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
        timings = timer.interleaved(fns)
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1) * 3.5   # forward + backward (2.5x)
        row = dict(batch=b, heads=h, seqlen=n, head_dim=d, causal=causal, forward=plan.family or "fallback",
                   backward=choose(Case(torch.bfloat16, d, n, n, causal, False, (gpu.major, gpu.minor))).name,
                   **{f"{k} ms": t.median_ms for k, t in timings.items()},
                   **{f"{k} attention TFLOP/s": flops / (timings[f"attention {k}"].median_ms * 1e-3) / 1e12 for k in impls})
        rows.append(row)
        dispatch.default()._plans.clear()
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()

    print(f"\n{gpu.name}: forward + backward, bf16, ms per step (median); ratio = best SDPA / flashtune")
    print("| B | H | N | d | mask | block flashtune | block SDPA cuDNN | block SDPA flash | block ratio "
          "| attention flashtune | attention SDPA cuDNN | attention SDPA flash | attention ratio | fwd / bwd |")
    print("| --- " * 14 + "|")
    for r in rows:
        cells = []
        for part in ("block", "attention"):
            ours = r[f"{part} flashtune ms"]
            best = min(r[f"{part} sdpa_cudnn ms"], r[f"{part} sdpa_flash ms"])
            cells += [f"{ours:.3f}", f"{r[f'{part} sdpa_cudnn ms']:.3f}", f"{r[f'{part} sdpa_flash ms']:.3f}",
                      f"{best / ours:.3f}x"]
        print(f"| {r['batch']} | {r['heads']} | {r['seqlen']} | {r['head_dim']} | {'causal' if r['causal'] else 'full'} | "
              + " | ".join(cells) + f" | {r['forward']} / {r['backward']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"gpu": gpu.name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
