"""kvcache_attention on a dense or paged cache of ragged lengths: what it serves now against what it
served before, timed in turns, with the peers that take each sequence's length beside them.

    python3 benchmarks/kvcache_steps.py [--fill LO:HI] [--tail nan|zero] [--page ROWS [--boxes]] [--json OUT] [CASE ...]    # CASE: B,H:KVH,NQ:CAP,D

"now": the Hopper kernel attention would serve the call's dense problem with, as the variant that
reads each sequence's length (tuner.kvcache.held_keys_config), where it does; else flash_decode.
"before": flash_decode's plan (held_keys_config off), or past flash_decode's queries, attention a
sequence at a time (one host read of the lengths). Peers: FlashAttention-4's flash_attn_varlen_func
with seqused_k (where installed; its refusal is printed), and SDPA on the whole cache with a boolean
mask of the held keys (what a model without a length-aware kernel runs). Bottom-right causal, bf16,
lengths drawn between LO and HI times the capacity (--fill, default 0.5:1; seeded), NaN past each:
a server's cache sized for its longest sequence holds far fewer keys in most (0.03:0.25, say), and
both plans choose their config (and split count) for the capacity. `--tail zero` fills the rows past
the lengths with zeros instead: a kernel that reads them (FA4's O was not finite on NaN there) is
then timed on a right answer. `--page ROWS`: the same keys in pages of ROWS rows (a shuffled block
table, CAP rounded up to whole pages), "now" and "before" on the pages, "dense" the dense cache's
plan beside them (what the pages cost), FA4 with its page_table; `--boxes` adds "boxes", the paged
plan with its K/V tiles by a TMA box per slot and panel (its variant's `gather` off: what the
producer's cp.async copies, GATHER_KV, gain where a tile is several slots). The default cases
are speculative steps (8-16 queries) of Llama-3-8B (32:8), Qwen2-7B (28:4) and Llama-3-70B at TP8
(8:1) heads, and chunks of 256-512 queries. Every output is checked against float64 on the first
two sequences (tests/test_gpu_decode.py holds the full check).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from unittest import mock

CASES = ["8,32:8,16:8192,128", "32,32:8,8:8192,128", "8,28:4,8:32768,128", "64,8:1,16:4096,128",
         "4,32:8,16:16384,64", "4,32:8,512:8192,128", "2,28:4,256:16384,128"]


def paged(k, table, page: int):
    """The dense (B, Hk, cap, D) cache `k` as (num_pages, Hk, page, D) pages of (num_pages, page, Hk, D)
    storage, sequence b's page j at table[b, j]."""
    import torch

    b, kvh, cap, d = k.shape
    store = torch.empty(table.numel(), page, kvh, d, dtype=k.dtype, device=k.device)
    store[table.flatten().long()] = k.transpose(1, 2).reshape(b * (cap // page), page, kvh, d)
    return store.transpose(1, 2)


@dataclass
class CacheCase:
    """One benchmark call's inputs: q (B, H, Nq, D), the dense cache k, v (B, Hk, cap, D) whose rows
    past each length hold NaN or zeros, the lengths, and the cache the plans run on (kc, vc: the dense
    one, or its pages through `table`)."""
    b: int
    h: int
    kvh: int
    nq: int
    cap: int
    d: int
    lens: list
    q: object
    k: object
    v: object
    seqlens: object
    table: object
    kc: object
    vc: object


def cache_case(case: str, page: int, lo: float, hi: float, tail: str) -> CacheCase:
    """CASE (B,H:KVH,NQ:CAP,D) as bf16 inputs on the GPU, seeded by the case: lengths drawn in
    [LO, HI] x cap (cap rounded up to whole pages), `tail` ("nan" or "zero") past them, and with
    `page` > 0 the same keys in pages of a shuffled block table."""
    import random

    import torch

    parts = case.split(",")
    b, (h, kvh), (nq, cap), d = int(parts[0]), map(int, parts[1].split(":")), map(int, parts[2].split(":")), int(parts[3])
    if page:
        cap = -(-cap // page) * page
    rng = random.Random(f"{case}")
    lens = [rng.randint(int(lo * cap), max(int(lo * cap), int(hi * cap))) for _ in range(b)]
    g = torch.Generator(device="cuda").manual_seed(len(case))
    q = torch.randn(b, nq, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k, v = (torch.randn(b, cap, kvh, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2) for _ in range(2))
    for i, n in enumerate(lens):
        k[i, :, n:], v[i, :, n:] = (float("nan"),) * 2 if tail == "nan" else (0.0, 0.0)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    table = None
    kc, vc = k, v
    if page:
        per = cap // page
        table = torch.randperm(b * per, device="cuda", generator=g).view(b, per).to(torch.int32)
        kc, vc = paged(k, table, page), paged(v, table, page)
    return CacheCase(b, h, kvh, nq, cap, d, lens, q, k, v, seqlens, table, kc, vc)


def fa4_paged_call(q, k, v, seqlens, table):
    """(callable, O) of FlashAttention-4 on pages ((num_pages, Hk, page, D) views) through its
    page_table, or None (why printed)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func

        b, h, nq, d = q.shape
        qn, kn, vn = q.transpose(1, 2).contiguous(), k.transpose(1, 2), v.transpose(1, 2)

        def call():
            r = flash_attn_varlen_func(qn, kn, vn, seqused_k=seqlens, page_table=table, causal=True)
            return (r[0] if isinstance(r, tuple) else r).reshape(b, nq, h, d).transpose(1, 2)
        return call, call()
    except Exception as exc:   # noqa: BLE001 - its refusal, printed
        print(f"  fa4 paged: {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return None


def fa4_call(q, k, v, seqlens):
    """(callable, O) of FlashAttention-4 on the held keys, or None (why printed): the batch as it is
    with seqused_k, else the queries packed (cu_seqlens_q) beside the cache's rows flattened
    (cu_seqlens_k every capacity's rows on) with seqused_k; bottom-right causal, as theirs is."""
    import torch

    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:   # noqa: BLE001 - not installed: said so
        print(f"  fa4: {str(exc).splitlines()[0][:160]}", file=sys.stderr)
        return None
    b, h, nq, d = q.shape
    cap = k.shape[2]
    qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    cu_q = torch.arange(0, (b + 1) * nq, nq, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, (b + 1) * cap, cap, dtype=torch.int32, device="cuda")
    forms = {"batch": lambda: flash_attn_varlen_func(qn, kn, vn, seqused_k=seqlens, causal=True),
             "packed": lambda: flash_attn_varlen_func(qn.view(b * nq, h, d), kn.view(b * cap, -1, d), vn.view(b * cap, -1, d),
                                                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=nq, max_seqlen_k=cap,
                                                      seqused_k=seqlens, causal=True)}
    for name, form in forms.items():
        try:
            def call(form=form):
                r = form()
                return (r[0] if isinstance(r, tuple) else r).reshape(b, nq, h, d).transpose(1, 2)
            o = call()
            torch.cuda.synchronize()
            return call, o
        except Exception as exc:   # noqa: BLE001 - a form FA4 refuses: the next one
            print(f"  fa4 ({name}): {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}", file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=CASES, help="B,H:KVH,NQ:CAP,D (default: %(default)s)")
    ap.add_argument("--fill", default="0.5:1", help="the lengths' range, as fractions of the capacity: LO:HI")
    ap.add_argument("--tail", choices=("nan", "zero"), default="nan", help="what the rows past each length hold")
    ap.add_argument("--page", type=int, default=0, help="a paged cache of this many rows a page (0: dense)")
    ap.add_argument("--boxes", action="store_true", help="with --page: the paged plan with K/V by TMA boxes too")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.page < 0:
        ap.error(f"--page takes a page's rows (0: dense), not {args.page}")
    if args.boxes and not args.page:
        ap.error("--boxes compares K/V copies on pages: give --page ROWS")
    lo, hi = map(float, args.fill.split(":"))
    if not 0 <= lo <= hi <= 1:
        ap.error(f"--fill takes LO:HI with 0 <= LO <= HI <= 1, not {args.fill}")
    import torch

    if not torch.cuda.is_available():
        print("kvcache_steps needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import torch.nn.functional as F

    from tuner import kvcache, kvcache_attention
    from tuner.reference import attention_fp64, compare
    from tuner.timing import Timer

    timer, rows = Timer(), []
    for case in args.cases:
        c = cache_case(case, args.page, lo, hi, args.tail)
        b, kvh, nq, cap, d, lens = c.b, c.kvh, c.nq, c.cap, c.d, c.lens
        q, k, v, seqlens, table, kc, vc = c.q, c.k, c.v, c.seqlens, c.table, c.kc, c.vc   # kc, vc: dense, or pages
        outs = {}
        kvcache._plans.clear()
        outs["now"] = kvcache_attention(q, kc, vc, seqlens, table)
        key = next(key for key in kvcache._plans if key[0] == q.shape and key[-1])
        plans = {"now": kvcache._plans[key]}
        config, kvcache.held_keys_config = kvcache.held_keys_config, lambda *a: None   # flash_decode's plan, or
        kvcache._plans.clear()                                                          # a sequence at a time
        try:
            outs["before"] = kvcache_attention(q, kc, vc, seqlens, table)
            plans["before"] = kvcache._plans[key]
        finally:
            kvcache.held_keys_config = config
        variant = plans["now"].family
        if args.boxes and getattr(variant, "gather", None):   # the same form with TMA boxes
            kvcache._plans.clear()
            with mock.patch.object(variant, "gather", False):
                outs["boxes"] = kvcache_attention(q, kc, vc, seqlens, table)
                plans["boxes"] = kvcache._plans[key]

        def with_plan(plan):   # the two plans share a key: each call puts its own in place
            def call():
                kvcache._plans[key] = plan
                return kvcache_attention(q, kc, vc, seqlens, table)
            return call
        fns = {name: with_plan(plan) for name, plan in plans.items()}
        if args.page:   # the dense cache's plan on the same keys: what the pages cost
            fns["dense"] = lambda: kvcache_attention(q, k, v, seqlens)
            outs["dense"] = fns["dense"]()
        names = {n: p.family.name if p.family is not None else f"attention ({p.reason})" for n, p in plans.items()}
        mask = torch.arange(cap, device="cuda")[None, :] < seqlens[:, None]   # (B, cap) held keys
        causal = torch.arange(cap, device="cuda")[None, None, :] <= (seqlens[:, None, None] - nq
                                                                     + torch.arange(nq, device="cuda")[None, :, None])
        sdpa_mask = (mask[:, None, :] & causal)[:, None]   # (B, 1, Nq, cap)
        kz, vz = (torch.where(mask[:, None, :, None], t, torch.zeros((), dtype=t.dtype, device="cuda")) for t in (k, v))
        fns["sdpa_masked"] = lambda: F.scaled_dot_product_attention(q, kz, vz, attn_mask=sdpa_mask, enable_gqa=True)
        if (fa4 := fa4_paged_call(q, kc, vc, seqlens, table) if args.page else fa4_call(q, k, v, seqlens)) is not None:
            fns["fa4"], outs["fa4"] = fa4
        outs["sdpa_masked"] = fns["sdpa_masked"]()
        torch.cuda.synchronize()
        errs = {}
        for name, o in outs.items():
            worst = 0.0
            for i in range(min(2, b)):
                ref_o, ref_lse = attention_fp64(q[i:i + 1], k[i:i + 1, :, :lens[i]], v[i:i + 1, :, :lens[i]], "causal_br",
                                                1 / math.sqrt(d))
                err = compare(o[i:i + 1], None, ref_o, None)
                worst = max(worst, err.rel if err.finite else math.inf)
            errs[name] = worst
        times = timer.interleaved(fns)
        held = sum(lens) * kvh * d * 2 * 2   # K and V bytes the sequences hold
        us = {n: t.median_ms * 1e3 for n, t in times.items()}
        row = dict(case=case, fill=args.fill, tail=args.tail, page=args.page, lens=lens, served=names["now"], params=plans["now"].params, before=names["before"], us=us,
                   tb_s={n: held / (x * 1e-6) / 1e12 for n, x in us.items()}, rel_err=errs)
        rows.append(row)
        peer = min((x for n, x in us.items() if n not in ("now", "before", "dense", "boxes")), default=float("nan"))
        print(f"{case:<22} {names['now']:<26} " + "  ".join(f"{n} {x:8.1f} us" for n, x in us.items())
              + f"  | now/before {us['before'] / us['now']:.2f}x now/best peer {peer / us['now']:.2f}x"
              + "  err " + " ".join(f"{n} {e:.2g}" for n, e in errs.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
