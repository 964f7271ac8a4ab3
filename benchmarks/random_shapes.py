"""Shapes a model might pose that no bucket was searched at, drawn at random, as `tuner bench`
arguments: what a fresh install serves them (the shipped lookup: a tuned bucket, a borrowed one, a
default, or an SDPA backend) is then timed beside the peers, so the figure is the general case, not
the grid's.

    python3 benchmarks/random_shapes.py [--count 24] [--seed 0] [--kind prompt,chunk,cross,decode]
    # prints: --shape B,H:KVH,NQ:NK,D,MASK ... (one draw per --shape)
    FA4_DTYPE=bf16 FA4_RANDOM=7:32 bash benchmarks/gpu_session.sh fa4bench   # --seed 7 --count 32, with the peers

A draw takes one attention layer of tuner/models.py's table (its heads, K/V heads and head dim),
three times in four an LLM's, which is sharded over 1-8 GPUs by tensor parallelism where its heads
divide and makes one of four calls: a prompt (Nq = Nk, causal or not, 200-32k tokens, odd lengths), a
chunk of a chunked prefill against a longer cache (bottom-right causal), cross-attention (Nq != Nk,
no mask) or a decode step (1-16 queries against 1k-64k keys). A layer with the model's own lengths
(an image, audio) keeps them, at 1-8 times the model's batch. The batch is drawn, then lowered until the call is at most ~2 TFLOP and
its K/V fit 8 GB: large enough to fill the GPU where a model's would, short enough to time.
"""

from __future__ import annotations

import argparse
import math
import random
import sys

KINDS = ("prompt", "chunk", "cross", "decode")
FLOP_CAP = 2e12
KV_BYTES_CAP = 8 << 30


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def draw(rng: random.Random, kinds: tuple[str, ...] = KINDS) -> str:
    """One shape in `Problem.parse`'s format, `B,H:KVH,NQ:NK,D,MASK`."""
    from tuner.models import MODELS

    llm = [m for m in MODELS.values() if not m.fixed]
    model = rng.choice(llm if rng.random() < 0.75 else [m for m in MODELS.values() if m.fixed])
    layer = rng.choice(model.layers)
    heads, kv, batches = layer.heads, layer.kv_heads, [model.batch * x for x in (1, 2, 4, 8)]
    if not layer.seqlen_q:   # an LLM: the user's lengths, sharded over 1-8 GPUs by tensor parallelism
        g = rng.choice([g for g in (1, 2, 4, 8) if heads % g == 0 and kv % g == 0])
        heads, kv = heads // g, kv // g
        kind = rng.choice(kinds)
        if kind == "prompt":
            nq = nk = log_uniform(rng, 200, 32768)
            mask = rng.choice(["causal", "causal", "none"])
        elif kind == "chunk":
            nq = log_uniform(rng, 128, 4096)
            nk, mask = nq + log_uniform(rng, 512, 32768), "causal_br"
        elif kind == "cross":
            nq, nk, mask = log_uniform(rng, 64, 8192), log_uniform(rng, 64, 8192), "none"
        else:
            nq, nk, mask = rng.choice([1, 1, 2, 4, 8, 16]), log_uniform(rng, 1024, 65536), "causal_br"
        batches = [1, 2, 4, 8, 16, 32, 64, 128] if nq <= 16 else [1, 1, 2, 4, 8, 16]
    else:   # the model's own lengths (an image, audio)
        nq, nk, mask = layer.seqlen_q, layer.seqlen_k or layer.seqlen_q, layer.mask
    batch = rng.choice(batches)
    while batch > 1 and (4 * batch * heads * nq * nk * layer.head_dim > FLOP_CAP
                         or 4 * batch * kv * nk * layer.head_dim > KV_BYTES_CAP):
        batch //= 2
    return f"{batch},{heads}:{kv},{nq}:{nk},{layer.head_dim},{mask}"


def draws(seed: int, count: int, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """`count` draws of seed `seed`, each shape once, in the order drawn."""
    rng = random.Random(seed)
    return list(dict.fromkeys(draw(rng, kinds) for _ in range(count)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kind", default=",".join(KINDS), help="the calls to draw, comma-separated: " + ", ".join(KINDS))
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kind.split(",") if k)
    if not kinds or any(k not in KINDS for k in kinds):
        print(f"--kind takes {', '.join(KINDS)}, not {args.kind!r}", file=sys.stderr)
        return 2
    print(" ".join(f"--shape {s}" for s in draws(args.seed, args.count, kinds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
