"""The packed batches a varlen variant is tuned on: representative mixes of sequence lengths for
a padded problem (its batch of sequences at their longest lengths), and what counts as their work.

A packed batch's bucket is its padded problem's (tuner/varlen.py), so a varlen config tuned for a
bucket should have been timed on lengths like those a call of that bucket brings: long-tailed,
from the longest down. A mix here is log-uniform over seven octaves below the longest length
(varlen_bench's batches: documents of 64-8192 tokens, prompts of 16-2048), the first sequence at
the longest. A trial runs DRAWS such batches one after another, the same ones for every trial of a
study (fixed draws), so trials compare alike: in one draw of 16 sequences a few long ones decide
how the launch's tail falls, and a config tuned on it alone lost 4% to the untuned one on another
draw of the same bucket (benchmarks/PERF_NOTES.md, "v11").
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .problem import DECODE_QUERIES, Problem, visible_pairs

OCTAVES = 7   # the mix spans lengths from the longest / 2^7 up to the longest
DRAWS = 4     # packed batches a trial runs (draws 0 .. DRAWS - 1 of each padded problem)


@dataclass(frozen=True)
class LengthMix:
    """Sequence b has lengths_q[b] queries and lengths_k[b] keys; heads, head dim and mask are the
    padded problem's."""

    problem: Problem
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]

    def flops(self) -> float:
        """The useful work: each sequence's own visible (query, key) pairs, 4·d each."""
        p = self.problem
        pairs = sum(visible_pairs(nq, nk, p.mask) for nq, nk in zip(self.lengths_q, self.lengths_k))
        return 4.0 * p.heads * p.head_dim * pairs

    def tflops(self, ms: float) -> float:
        return self.flops() / (ms * 1e-3) / 1e12

    def inputs(self, seed: int, device: str = "cuda"):
        """Fresh normal packed q (total_q, H, D), k and v (total_k, Hk, D) in the problem's dtype,
        and the int32 offsets cu_q, cu_k."""
        import itertools

        import torch

        from .problem import torch_dtype

        p, g = self.problem, torch.Generator(device=device).manual_seed(seed)
        dt = torch_dtype(p.dtype)
        q = torch.randn(sum(self.lengths_q), p.heads, p.head_dim, generator=g, device=device, dtype=dt)
        k, v = (torch.randn(sum(self.lengths_k), p.kv_heads, p.head_dim, generator=g, device=device, dtype=dt)
                for _ in range(2))
        offsets = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        return q, k, v, offsets(self.lengths_q), offsets(self.lengths_k)


def _log_uniform(rng: random.Random, longest: int) -> int:
    low = max(1, longest >> OCTAVES)
    return max(1, min(longest, round(low * (longest / low) ** rng.random())))


@dataclass(frozen=True)
class MixSet:
    """The batches a trial of a varlen variant runs back to back; its TFLOP/s count their useful
    work over the time of all of them."""

    problem: Problem
    mixes: tuple[LengthMix, ...]

    def flops(self) -> float:
        return sum(m.flops() for m in self.mixes)

    def tflops(self, ms: float) -> float:
        return self.flops() / (ms * 1e-3) / 1e12


def representative_mixes(problem: Problem, draws: int = DRAWS) -> MixSet:
    """Draws 0 .. draws - 1 of `problem`'s representative mix."""
    return MixSet(problem, tuple(representative_mix(problem, d) for d in range(draws)))


def representative_mix(problem: Problem, draw: int = 0) -> LengthMix:
    """Draw `draw` of `problem.batch` sequences for the padded `problem`: the first at (Nq, Nk),
    the others log-uniform below. Self-attention (Nq == Nk) keeps each sequence's queries and keys
    equal; otherwise a sequence's keys scale with its queries (a chunk against its cache), and a
    decode batch (Nq <= DECODE_QUERIES) draws its query counts uniformly and its caches log-uniformly."""
    rng = random.Random(f"{draw}-{problem.key}")
    nq, nk = problem.seqlen_q, problem.seqlen_k
    lq, lk = [nq], [nk]
    for _ in range(problem.batch - 1):
        if nq <= DECODE_QUERIES:
            q, k = rng.randint(1, nq), _log_uniform(rng, nk)
        else:
            q = _log_uniform(rng, nq)
            k = q if nq == nk else max(1, min(nk, math.ceil(q * nk / nq)))
        lq.append(q)
        lk.append(k)
    return LengthMix(problem, tuple(lq), tuple(lk))
