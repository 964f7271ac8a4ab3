"""Decode against a KV cache, in one run: flashtune's flash_decode beside SDPA cuDNN, SDPA flash and
FlashAttention-4 (where installed), as achieved TB/s, against the GPU's measured copy bandwidth.

    python3 benchmarks/decode_bench.py [--batch 1,8,32,128] [--keys 1024,8192,32768] [--json OUT]
                                       [--variant NAME=DIR ...] [--same-config] [--config NAME=JSON ...]
                                       [--page 16,64,256]
                                       [--heads 32:8] [--head-dim 128]

Shapes: one query per sequence, 32 query heads sharing 8 K/V heads, d=128, bf16 (a Llama-3-8B
decode step; `--heads H:KV` and `--head-dim D` give another model's, Phi-2's 32:32 and 80 say), a
cache of Nk keys. TB/s is Problem.bytes_moved (q, K, V read once, O written once)
over the median time, L2 flushed before every repetition (tuner.timing), twice over: by the timer's
usual write flush (`tb_s`), whose dirty lines every kernel then writes back (~9 us of the H100's
memory time, 9% of a B8 x 8k step), and by a read flush that leaves none (`tb_s_read_flush`, a
second line), which compares a decode step's bandwidth with the copy's on equal terms. flashtune's config: a
short search on the spot (the family's seeds with splits from the occupancy, then the best seed's
split counts), then timed in turns with the peers; beside it `flashtune_served`, what
`tuner.attention` runs for the shape as a model's decode step calls it (the lookup's entry for its
bucket, its split count re-derived where it was tuned on another grid, else flash_decode's default;
the row's `served`); and `flashtune_cluster`, the spot search's best in the form a call runs it where
that is another (on Hopper, 2, 4 or 8 splits as a cluster that merges in shared memory,
flash_decode_cluster). Each output is checked against SDPA's (max abs difference), since a float64
reference of the large shapes does not fit in memory; the kernel's correctness against float64 is
tests/test_gpu_decode.py's. `--variant NAME=DIR` adds the kernel
compiled from the sources in the folder DIR (e.g. the sources before a change: `git archive <commit>
kernel_templates | tar -x -C .abd` gives .abd/kernel_templates), searched the same way (with
`--same-config`: this checkout's best, a kernel change's A/B) and timed in the same turns, and in its
cluster form too (NAME_cluster) where the call runs one. `--config NAME=JSON` adds a flash_decode
config of your own, in the form a call runs it. `--page SIZES` adds, for each page size, the same cache as pages (a vLLM/FlashAttention
(num_pages, page_size, Hk, D) cache in a shuffled block table), read by flash_decode_paged (row by
row through the table) and, where the page size fits a stage, flash_decode_paged_boxes (a tensor-map
box per page), with the dense search's config, timed in the same turns.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # seed_resources, beside this script


def copy_bandwidth(timer) -> float:
    """TB/s of a 2 GiB device-to-device copy (read + write)."""
    import torch

    a = torch.empty(1 << 29, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    t = timer(lambda: b.copy_(a))
    return 2 * a.numel() * 4 / (t.median_ms * 1e-3) / 1e12


def inputs(problem):
    """A decode step's generator and q (B, H, Nq, D), k, v (B, Hk, N, D views of (B, N, Hk, D) storage,
    a cache's layout: tuner.measure.random_inputs's for a decode step), random from a seed of the
    batch and keys: the same data in every run."""
    import torch

    from tuner.measure import random_inputs

    seed = problem.batch * 100003 + problem.seqlen_k
    return torch.Generator(device="cuda").manual_seed(seed), random_inputs(problem, seed)


def screened(fam, problem, gpu, q, k, v, screen) -> dict:
    """The fastest of the family's seeds (splits from the occupancy), then of that seed's split counts."""
    cands = [p for p in fam.seeds(gpu, problem) if fam.check(p, gpu, problem) is None]
    runs = {json.dumps(p, sort_keys=True): ours(fam, p, problem, gpu, q, k, v)[0] for p in cands}
    t = {key: screen(fn).median_ms for key, fn in runs.items()}
    best = json.loads(min(t, key=t.get))
    for s in fam.space["splits"][1:]:
        p = dict(best, splits=s)
        if fam.check(p, gpu, problem) is None:
            t[json.dumps(p, sort_keys=True)] = screen(ours(fam, p, problem, gpu, q, k, v)[0]).median_ms
    return json.loads(min(t, key=t.get))


def ours(fam, params, problem, gpu, q, k, v, table=None):
    """A launch of one config on these inputs (compiled, loaded, arguments packed), and its O; with a
    block `table`, k and v are the pages of a paged family's cache (paged())."""
    import torch

    from tuner.compile import compile_kernel
    from tuner.launch import LaunchError, LoadedKernel, raw_stream

    ck = compile_kernel(fam, params, problem, gpu.arch)
    launch = fam.launch(params, problem, gpu)
    loaded, kinds = LoadedKernel.load(ck, launch.smem_bytes, gpu.index), fam.param_kinds(params)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    scale = 1.0 / math.sqrt(problem.head_dim)
    if table is None:
        args = fam.kernel_args(params, q, k, v, o, lse, scale)
    else:
        args = fam.cache_args(params, launch, q, k, v, o, lse, scale, problem.seqlen_k, None, table)
    try:
        launcher = loaded.launcher(launch, kinds)
    except LaunchError:   # a variant's older kernel, whose parameters end before K's and V's maps
        launcher, args = loaded.launcher(launch, kinds[:-2]), args[:-2]
    stream = raw_stream(gpu.index)
    # the kernel writes o and lse and reads the pages: they live as long as the launch does
    return (lambda keep=(o, lse, k, v, table): launcher(stream, *args)), o


def served_form(fam, params, problem, gpu, q, k, v):
    """A launch of `params` in the form a call runs it (on Hopper, splits of 2, 4 or 8 as a cluster:
    FlashDecode.served_form), or None where that is the family's own."""
    form, formed = fam.served_form(params, gpu, problem)
    return None if form is fam else ours(form, formed, problem, gpu, q, k, v)[0]


def attention_call(q, k, v):
    """`tuner.attention` on these inputs, as a model's decode step calls it (the dispatcher's plan:
    the lookup's entry for this bucket, else flash_decode's default), planned before timing; and its O."""
    import torch

    import tuner

    run = lambda: tuner.attention(q, k, v, mask="causal_br")
    o = run()
    torch.cuda.synchronize()
    return run, o


def served_config(problem, gpu) -> dict:
    """What the dispatcher serves `problem` from (Dispatcher.serving_entry): the family and config
    as it runs here (tuner.dispatch.served_params), and the lookup bucket it came from ("default":
    flash_decode's default, nothing tuned)."""
    from tuner.dispatch import default, served_params

    entry = default().serving_entry(problem, gpu) or {}
    return dict(family=entry.get("family"), params=served_params(entry, problem) if entry else None,
                source=entry.get("bucket", "default"))


def paged(page_size: int, k, v, g):
    """The dense (B, Hk, N, D) cache k, v as pages of `page_size` rows in a shuffled order: the
    pages as (num_pages, Hk, page_size, D) views of a (num_pages, page_size, Hk, D) cache, and the
    (B, pages) int32 block table."""
    import torch

    b, hk, n, d = k.shape
    per = -(-n // page_size)
    order = torch.randperm(b * per, device="cuda", generator=g)
    table = order.view(b, per).to(torch.int32)
    out = []
    for t in (k, v):
        rows = torch.zeros(b, per * page_size, hk, d, dtype=t.dtype, device="cuda")
        rows[:, :n] = t.transpose(1, 2)
        pages = torch.empty_like(rows).view(b * per, page_size, hk, d)
        pages[order] = rows.view(b * per, page_size, hk, d)
        out.append(pages.transpose(1, 2))
    return out[0], out[1], table


def peers(problem, q, k, v) -> dict:
    """The peers that run this case: name -> (callable, O)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            o = run()
            torch.cuda.synchronize()
            out[name] = (run, o)
        except Exception as exc:   # the backend refuses the case
            print(f"  {name}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
    try:
        from flash_attn.cute import flash_attn_func

        qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))

        def fa4():
            r = flash_attn_func(qn, kn, vn, causal=True)
            return (r[0] if isinstance(r, tuple) else r).transpose(1, 2)
        o = fa4()
        torch.cuda.synchronize()
        out["fa4"] = (fa4, o)
    except Exception as exc:
        print(f"  fa4: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32,128")
    ap.add_argument("--keys", default="1024,8192,32768")
    ap.add_argument("--json", default="")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                    help="also the kernel compiled from the sources in DIR, named NAME")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                    help="also this flash_decode config (its splits 0: from the occupancy), in the form a call runs it")
    ap.add_argument("--same-config", action="store_true",
                    help="each variant runs this checkout's spot-search best (a kernel change's A/B), not its own")
    ap.add_argument("--page", default="", help="page sizes: also the cache as pages (comma-separated)")
    ap.add_argument("--heads", default="32:8", help="query heads:K/V heads")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    heads, kv_heads = map(int, args.heads.split(":"))
    d = args.head_dim
    import torch

    import seed_resources
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.kernel_templates.flash_decode import PAGED, PAGED_BOXES
    from tuner.problem import Problem
    from tuner.timing import Timer

    if not torch.cuda.is_available():
        print("decode_bench needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    gpu, fam = detect(), get_family("flash_decode")
    screen, timer, clean = Timer(target_seconds=0.1), Timer(), Timer(flush="read")
    copy = copy_bandwidth(timer)
    print(f"{gpu.name}: device-to-device copy {copy:.2f} TB/s", flush=True)
    rows = []
    for b in map(int, args.batch.split(",")):
        for nk in map(int, args.keys.split(",")):
            problem = Problem(b, heads, 1, nk, d, "bf16", "causal_br", kv_heads)
            g, (q, k, v) = inputs(problem)
            best = screened(fam, problem, gpu, q, k, v, screen)
            run, o = ours(fam, best, problem, gpu, q, k, v)
            served, o_served = attention_call(q, k, v)
            fns = {"flashtune": run, "flashtune_served": served}
            # the spot search's best as a call runs it (its splits in a cluster), where that differs
            if (clustered := served_form(fam, best, problem, gpu, q, k, v)) is not None:
                fns["flashtune_cluster"] = clustered
            configs = {}
            for name, text in (c.split("=", 1) for c in args.config):
                configs[name] = json.loads(text)
                if (why := fam.check(configs[name], gpu, problem)) is None:
                    fns[name] = served_form(fam, configs[name], problem, gpu, q, k, v) \
                        or ours(fam, configs[name], problem, gpu, q, k, v)[0]
                else:
                    print(f"  {name}: {why}", flush=True)
            for name, folder in variants.items():
                seed_resources.use_templates(folder)
                configs[name] = best if args.same_config else screened(fam, problem, gpu, q, k, v, screen)
                fns[name] = ours(fam, configs[name], problem, gpu, q, k, v)[0]
                if (clustered := served_form(fam, configs[name], problem, gpu, q, k, v)) is not None:
                    fns[f"{name}_cluster"] = clustered
                seed_resources.use_templates(None)
            outs = {}
            for size in (int(x) for x in args.page.split(",") if x):
                kp, vp, table = paged(size, k, v, g)
                forms = {"rows": PAGED}
                if PAGED_BOXES.kv_tma(best, problem.head_dim) and PAGED_BOXES.page_fits(best, size):
                    forms["boxes"] = PAGED_BOXES
                for form, paged_fam in forms.items():
                    fns[f"pages{size}_{form}"], outs[f"pages{size}_{form}"] = ours(paged_fam, best, problem, gpu, q, kp, vp, table)
                del kp, vp, table
            others = peers(problem, q, k, v)
            fns |= {n: fn for n, (fn, _) in others.items()}
            timings = timer.interleaved(fns)
            timings_clean = clean.interleaved(fns)
            ref = next(iter(others.values()))[1] if others else None
            diff = float((o.float() - ref.float()).abs().max()) if ref is not None else float("nan")
            diff_pages = {n: float((x.float() - o.float()).abs().max()) for n, x in outs.items()}   # same data, same config
            tbs = {n: problem.bytes_moved() / (tm.median_ms * 1e-3) / 1e12 for n, tm in timings.items()}
            tbs_clean = {n: problem.bytes_moved() / (tm.median_ms * 1e-3) / 1e12 for n, tm in timings_clean.items()}
            splits = fam.launch(best, problem, gpu).grid[2]
            row = dict(batch=b, keys=nk, config=best, splits=splits, served=served_config(problem, gpu), tb_s=tbs,
                       tb_s_read_flush=tbs_clean,
                       variant_configs=configs,
                       ms={n: tm.median_ms for n, tm in timings.items()}, max_abs_diff=diff, copy_tb_s=copy,
                       pages_max_abs_diff=diff_pages)
            rows.append(row)
            mine = set(variants) | {f"{n}_cluster" for n in variants} | set(configs)

            def best_peer(t: dict) -> float:
                return max((x for n, x in t.items() if not n.startswith(("flashtune", "pages")) and n not in mine),
                           default=float("nan"))

            peer_best = best_peer(tbs)
            print(f"B{b:<4} Nk{nk:<6} " + "  ".join(f"{n} {v:.2f}" for n, v in tbs.items())
                  + f"  | ours/copy {tbs['flashtune'] / copy:.2f} ours/best peer {tbs['flashtune'] / peer_best:.2f}"
                  + f" served/best peer {tbs['flashtune_served'] / peer_best:.2f}"
                  + f"  splits {splits} {best}  served {row['served']}  maxdiff {diff:.3g}"
                  + "".join(f"  {n} diff {x:.3g}" for n, x in diff_pages.items()), flush=True)
            clean_peer = best_peer(tbs_clean)
            print(f"  read flush: " + "  ".join(f"{n} {v:.2f}" for n, v in tbs_clean.items())
                  + f"  | served/copy {tbs_clean['flashtune_served'] / copy:.2f} served/best peer {tbs_clean['flashtune_served'] / clean_peer:.2f}", flush=True)
            del q, k, v, run, served, fns, others, o, o_served, ref, outs
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu.name, copy_tb_s=copy, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
