"""Packed sequences against the same sequences padded, in one run: flashtune's varlen path
(tuner.attention with cu_seqlens) beside flashtune on the padded batch, torch's FlashAttention-2
varlen kernel and FlashAttention-4's varlen call (where installed), bf16, causal self-attention; and a speculative-decoding batch (a few
queries a sequence against ragged caches) as K/V TB/s.

    python3 benchmarks/varlen_bench.py [--json OUT] [--case WORDS] [--family F] [--variant NAME=DIR ...]
                                       [--direct NAME:KEY=VALUE,... ...]

Batches: ragged lengths drawn from a long-tailed mix (documents packed for training, prompts of a
serving batch), fixed seeds. "useful" TFLOP/s counts each sequence's own causal work only; the
padded batch (every sequence at the longest length, right-padded: causal rows never see the
padding) does (1 - useful share) more; it is timed padded with zeros and with random rows (a
model's pad tokens carry activations; on zeros the tensor cores draw less power, so the H100 holds a
higher clock under its power cap). The bar: varlen time <= padded time x useful share, i.e.
faster than the padded batch by at least the padding's share. Timed in turns, L2 flushed
(tuner.timing). Each output is checked against FA2's varlen (max abs difference per run); the
kernel's correctness against float64 is tests/test_gpu_varlen.py's. `--family F` also times F's
varlen variant directly, with the config the dispatcher would build from F's seeds (a family the
dispatcher does not pick on this GPU: flash_fwd_mma on a Hopper), and `--variant NAME=DIR` the same
kernel (F's, or the dispatcher's choice) compiled from the sources in DIR: a kernel change before
and after, in turns (benchmarks/ab_kernel.py's --templates for varlen); `--direct NAME:KEY=VALUE,...`
the same kernel with those parameters changed (e.g. the persistent and the grid schedule, in turns).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = {   # name: (heads, kv heads, head dim, sequences, length range, seed[, queries per sequence: decode])
    "train docs 32k, H32/kv8 d128": (32, 8, 128, 16, (64, 8192), 1),
    "serve prompts, H32/kv8 d128": (32, 8, 128, 64, (16, 2048), 2),
    "train docs 16k, H16 d64": (16, 16, 64, 24, (32, 4096), 3),
    "train docs 32k, H8/kv1 d256": (8, 1, 256, 16, (64, 8192), 4),
    # speculative decoding: 1-8 new queries a sequence against its cache (bottom-right causal)
    "spec decode 1-8 q, H32/kv8 d128": (32, 8, 128, 32, (1024, 32768), 5, (1, 8)),
}


def lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    """Long-tailed: log-uniform between low and high."""
    rng = random.Random(seed)
    return [int(round(low * (high / low) ** rng.random())) for _ in range(count)]


def decode_lengths(count: int, low: int, high: int, seed: int, queries: tuple[int, int]) -> tuple[list[int], list[int]]:
    """A speculative-decoding batch's draw: `queries` (low, high) new queries a sequence, uniform,
    against caches log-uniform between low and high."""
    rng = random.Random(seed)
    return [rng.randint(*queries) for _ in range(count)], lengths(count, low, high, seed)


def padded_shapes(kind: str, words: list[str]) -> list[str]:
    """`tuner search --shape` texts of the cases' padded problems (the batch, the heads, the longest
    lengths): the buckets their varlen calls are served from, which a varlen variant is tuned on.
    kind "prefill": the packed self-attention batches (causal); "decode": the speculative ones
    (bottom-right causal)."""
    shapes = []
    for name, (h, hk, d, count, (low, high), seed, *decode) in CASES.items():
        if bool(decode) != (kind == "decode") or (words and not any(w in name for w in words)):
            continue
        heads = f"{h}:{hk}" if hk != h else f"{h}"
        if decode:
            nq, nk = map(max, decode_lengths(count, low, high, seed, decode[0]))
            shapes.append(f"{count},{heads},{nq}:{nk},{d},causal_br")
        else:
            shapes.append(f"{count},{heads},{max(lengths(count, low, high, seed))},{d},causal")
    return shapes


def main(argv=None) -> int:

    import tuner
    from tuner.gpu import detect
    from tuner.timing import Timer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--case", action="append", default=[], metavar="WORDS",
                    help="only the cases whose name contains WORDS (repeatable; default: every case)")
    ap.add_argument("--family", help="also this family's varlen variant, launched directly (its seeds' config)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                    help="also the direct kernel compiled from the sources in DIR, named NAME (repeatable)")
    ap.add_argument("--direct", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="also the direct kernel with these parameters changed, named NAME (repeatable)")
    ap.add_argument("--shapes", choices=("prefill", "decode"),
                    help="print the --shape arguments of these cases' padded problems (their lookup buckets) and exit")
    a = ap.parse_args(argv)
    if a.shapes:
        print(" ".join(f"--shape {s}" for s in padded_shapes(a.shapes, a.case)))
        return 0
    import torch

    variants = dict(v.split("=", 1) for v in a.variant)
    overrides = {name: {k: int(x) for k, x in (kv.split("=") for kv in spec.split(","))}
                 for name, spec in (d.split(":", 1) for d in a.direct)}
    gpu = detect()
    timer = Timer(gpu.l2_bytes)
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:   # noqa: BLE001 - any import failure: the peer is absent
        flash_attn_varlen_func = None
        print(f"fa4: not run ({str(exc).splitlines()[0][:100]})", file=sys.stderr)
    rows = []
    for name, (h, hk, d, count, (low, high), seed, *decode) in CASES.items():
        if a.case and not any(words in name for words in a.case):
            continue
        if decode:
            run_decode(name, h, hk, d, count, low, high, seed, decode[0], timer, flash_attn_varlen_func, rows)
            continue
        lens = lengths(count, low, high, seed)
        total, longest = sum(lens), max(lens)
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(count)], dtype=torch.int32, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        # the padded batch: (B, longest, H, D) storage, each sequence's rows first, viewed (B, H, N, D);
        # padded with zeros, and with random rows as a model's pad tokens carry activations (the tensor
        # cores draw less power on zeros, so under the H100's power cap the zero-padded batch runs at a
        # higher clock than the same work on real data)
        pads, pads_random = [], []
        for t in (q, k, v):
            for fill, out in ((torch.zeros, pads), (torch.randn, pads_random)):
                p = fill(count, longest, t.shape[1], d, device="cuda", dtype=t.dtype)
                for i, n in enumerate(lens):
                    p[i, :n] = t[cu[i]:cu[i] + n]
                out.append(p.transpose(1, 2))
        fns = {"flashtune_varlen": lambda: tuner.attention(q, k, v, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                           max_seqlen_q=longest, max_seqlen_k=longest),
               "flashtune_padded": lambda: tuner.attention(*pads, is_causal=True),
               "flashtune_padded_random": lambda: tuner.attention(*pads_random, is_causal=True)}
        if a.family or variants or overrides:
            from tuner.varlen import padded_problem

            problem = padded_problem(q, k, cu, longest, longest, "causal", "bf16")
            fns |= direct_kernels(a.family, variants, overrides, problem, gpu, q, k, v, cu, cu, longest, longest)
        outs = run_once(with_peers(fns, q, k, v, cu, cu, longest, longest, flash_attn_varlen_func))
        ref = outs["fa2_varlen"]
        padded = ("flashtune_padded", "flashtune_padded_random")
        diffs = {key: float((o - ref).abs().max()) for key, o in outs.items() if key not in padded}
        for key in padded:   # each sequence's rows of the padded O
            got = outs[key].transpose(1, 2)
            diffs[key] = float((torch.cat([got[i, :n] for i, n in enumerate(lens)]) - ref).abs().max())
        timings = timer.interleaved(fns)
        useful = sum(4 * n * n * d * h / 2 for n in lens)
        padded_work = count * 4 * longest * longest * d * h / 2
        share = useful / padded_work
        row = dict(case=name, heads=h, kv_heads=hk, head_dim=d, lengths=lens, total=total, longest=longest,
                   useful_share=share, **{f"{k} ms": t.median_ms for k, t in timings.items()},
                   **{f"{k} useful TFLOP/s": useful / (t.median_ms * 1e-3) / 1e12 for k, t in timings.items()},
                   **{f"{k} max diff vs fa2": x for k, x in diffs.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, pads, pads_random, outs
        torch.cuda.empty_cache()

    print(f"\n{gpu.name}: packed sequences, bf16, causal; ms (median), useful TFLOP/s; "
          "bar: varlen ms <= padded ms x useful share (padded with zeros / with random rows)")
    main_impls = ("flashtune_varlen", "flashtune_padded", "flashtune_padded_random", "fa2_varlen", "fa4_varlen")
    extra = [k[:-3] for k in (rows[0] if rows else {}) if k.endswith(" ms") and k[:-3] not in main_impls]
    impls = (*main_impls, *extra)
    print("| case | tokens | longest | useful share | " + " | ".join(impls) + " | varlen / (padded x share) |")
    print("| --- " * (5 + len(impls)) + "|")
    for r in rows:
        if "decode" in r:
            continue
        cells = [f"{r[f'{i} ms']:.3f} ms ({r[f'{i} useful TFLOP/s']:.0f})" if f"{i} ms" in r else "-" for i in impls]
        bars = " / ".join(f"{r['flashtune_varlen ms'] / (r[f'{p} ms'] * r['useful_share']):.2f}"
                          for p in ("flashtune_padded", "flashtune_padded_random") if f"{p} ms" in r)
        print(f"| {r['case']} | {r['total']} | {r['longest']} | {r['useful_share']:.2f} | " + " | ".join(cells)
              + f" | {bars} |")
    decode_rows = [r for r in rows if "decode" in r]
    if decode_rows:
        dimpls = ("flashtune_varlen", "fa2_varlen", "fa4_varlen")
        print("\nspeculative decode, packed (bottom-right causal): ms (median) and K/V TB/s")
        print("| case | queries | keys | " + " | ".join(dimpls) + " |")
        print("| --- " * (3 + len(dimpls)) + "|")
        for r in decode_rows:
            cells = [f"{r[f'{i} ms']:.3f} ms ({r[f'{i} TB/s']:.2f})" if f"{i} ms" in r else "-" for i in dimpls]
            print(f"| {r['case']} | {r['total_q']} | {r['total_k']} | " + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": gpu.name, "rows": rows}, f, indent=1)
    return 0


def direct_kernels(family: str | None, variants: dict, overrides: dict, problem, gpu, q, k, v, cu_q, cu_k, mq: int,
                   mk: int) -> dict:
    """Callables that launch a varlen variant directly: `family`'s (this checkout's sources), for
    each NAME=DIR of `variants` the same compiled from DIR, and for each NAME of `overrides` the
    same with those parameters changed; the config is the one the dispatcher builds from the
    family's seeds (`family` None: the family tuner.attention serves)."""
    import torch

    import seed_resources
    from tuner import varlen
    from tuner.compile import compile_kernel
    from tuner.kernel_templates import FAMILIES, VARLEN_VARIANTS
    from tuner.launch import LoadedKernel, launch_on

    if family is None:
        plan = varlen._plan_for(problem, q)
        if plan.family is None:
            print(f"  direct: {plan.reason}", file=sys.stderr)
            return {}
        variant, params = plan.family, plan.params
    else:
        variant = VARLEN_VARIANTS[family]
        fits = (variant.from_tuned(p, problem) for p in FAMILIES[family].seeds(gpu, problem))
        params = next((p for p in fits if variant.check(p, gpu, problem) is None), None)
        if params is None:
            print(f"  direct: {variant.name} has no config for {problem.key} here", file=sys.stderr)
            return {}
    print(f"  direct: {variant.name} {json.dumps(params, sort_keys=True)}", file=sys.stderr)
    out = {}
    runs = {variant.name if family else "direct": (None, params), **{n: (f, params) for n, f in variants.items()},
            **{n: (None, dict(params, **o)) for n, o in overrides.items()}}
    for name, (folder, params) in runs.items():
        if why := variant.check(params, gpu, problem):
            print(f"  {name}: {why}", file=sys.stderr)
            continue
        if name in overrides:
            print(f"  {name}: {json.dumps(params, sort_keys=True)}", file=sys.stderr)
        launch = variant.packed_launch(params, problem, gpu, q.shape[0], k.shape[0])
        seed_resources.use_templates(folder)
        ck = compile_kernel(variant, params, problem, gpu.arch)
        seed_resources.use_templates(None)
        launcher = LoadedKernel.load(ck, launch.smem_bytes, gpu.index).launcher(launch, variant.param_kinds(params))
        o = torch.empty_like(q)   # each its own O, checked against FA2's
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device="cuda")
        views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, o)]
        args = variant.varlen_values(variant.arg_maker(params), params, problem, launch.grid, views, lse, None,
                                     cu_q, cu_k, mq, mk)
        out[name] = lambda launcher=launcher, args=args, o=o, keep=lse: (launch_on(launcher, gpu.index, *args), o)[1]
    return out


def with_peers(fns: dict, q, k, v, cu_q, cu_k, mq: int, mk: int, fa4_varlen) -> dict:
    """`fns` and the peers' varlen calls on the same sequences: FA2's (torch aten) and FA4's where
    installed, both causal as theirs is (bottom-right, the same as top-left for self-attention)."""
    import torch

    fns["fa2_varlen"] = lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, True, False)[0]
    if fa4_varlen is not None:
        def fa4():
            r = fa4_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk, causal=True)
            return r[0] if isinstance(r, tuple) else r
        fns["fa4_varlen"] = fa4
    return fns


def run_once(fns: dict) -> dict:
    """Each callable's output (a first run before timing); one that refuses the case is left out
    of `fns`, said so."""
    outs = {}
    for key, fn in list(fns.items()):
        try:
            outs[key] = fn()
        except Exception as exc:   # noqa: BLE001 - a peer that refuses the case is left out, said so
            print(f"  {key}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
            del fns[key]
    return outs


def run_decode(name, h, hk, d, count, low, high, seed, queries, timer, fa4_varlen, rows) -> None:
    """A speculative-decoding batch: `queries` (low, high) new queries a sequence against its own
    cache of log-uniform length, bottom-right causal; ours beside FA2's and FA4's varlen calls, as
    K/V TB/s (each sequence's keys and values read once)."""
    import torch

    import tuner

    lens_q, lens_k = decode_lengths(count, low, high, seed, queries)
    off = lambda lens: torch.tensor([0] + [sum(lens[:i + 1]) for i in range(count)], dtype=torch.int32, device="cuda")
    cu_q, cu_k = off(lens_q), off(lens_k)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    mq, mk = max(lens_q), max(lens_k)
    fns = {"flashtune_varlen": lambda: tuner.attention(q, k, v, mask="causal_br", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                       max_seqlen_q=mq, max_seqlen_k=mk)}
    outs = run_once(with_peers(fns, q, k, v, cu_q, cu_k, mq, mk, fa4_varlen))
    timings = timer.interleaved(fns)
    kv_bytes = 2 * sum(lens_k) * hk * d * 2
    row = dict(case=name, decode=True, heads=h, kv_heads=hk, head_dim=d, lengths_q=lens_q, lengths_k=lens_k,
               total_q=sum(lens_q), total_k=sum(lens_k), **{f"{k} ms": t.median_ms for k, t in timings.items()},
               **{f"{k} TB/s": kv_bytes / (t.median_ms * 1e-3) / 1e12 for k, t in timings.items()},
               **{f"{k} max diff vs fa2": float((o - outs["fa2_varlen"]).abs().max()) for k, o in outs.items()})
    rows.append(row)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
