"""Attention geometries of common models: what `tuner search --model NAME` tunes.

| name | attention | H (query heads) | K/V heads | d | mask | length | default batch |
| --- | --- | --- | --- | --- | --- | --- | --- |
| llama3-8b | self | 32 | 8 | 128 | causal | --seqlen (2048, 8192) | 1 |
| llama3-70b | self | 64 | 8 | 128 | causal | --seqlen (2048, 8192) | 1 |
| qwen2.5-7b | self | 28 | 4 | 128 | causal | --seqlen (2048, 8192) | 1 |
| mistral-7b | self | 32 | 8 | 128 | causal | --seqlen (2048, 8192) | 1 |
| gemma2-9b | self | 16 | 8 | 256 | causal | --seqlen (2048, 8192) | 1 |
| gpt2 | self | 12 | 12 | 64 | causal | --seqlen (1024) | 8 |
| gpt2-xl | self | 25 | 25 | 64 | causal | --seqlen (1024) | 8 |
| vit-l16 | self | 16 | 16 | 64 | none | 197 (224 px, 16 px patches, + class) | 32 |
| sdxl | self | 10 / 20 | same | 64 | none | 4096 / 1024 (1024 px: 128 px latents, 2x and 4x down) | 2 |
| sdxl | cross | 10 / 20 | same | 64 | none | 4096 / 1024 queries x 77 text tokens | 2 |
| whisper | self (encoder) | 20 | 20 | 64 | none | 1500 (30 s of audio) | 1 |
| phi3-mini | self | 32 | 32 | 96 | causal | --seqlen (2048, 8192) | 1 |
| phi-2 | self | 32 | 32 | 80 | causal | --seqlen (2048, 8192) | 1 |
| sd15 | self | 8 | 8 | 40 / 80 / 160 | none | 4096 / 1024 / 256 (512 px: 64 px latents, 1x, 2x and 4x down) | 2 |
| sd15 | cross | 8 | 8 | 40 / 80 | none | 4096 / 1024 queries x 77 text tokens | 2 |
| dit-xl2 | self | 16 | 16 | 72 | none | 256 (256 px: 32 px latents, 2 px patches) | 16 |

Whole models, unsharded (with tensor parallelism over G GPUs a layer has H/G and K/V heads/G).
For the models whose length is the user's (the LLMs, GPT-2), `--seqlen` takes lengths, each N
(prefill: N queries, N keys, causal top-left, as SDPA's is_causal) or NQ:NK (NQ new queries
after NK - NQ cached keys: the bottom-right mask of a chunked prefill or a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass

from .problem import GPT2_FP32, Problem, standard_grid


@dataclass(frozen=True)
class Attention:
    """One attention layer shape of a model (a model may have several: SDXL's two resolutions)."""

    heads: int
    kv_heads: int
    head_dim: int
    mask: str = "none"
    seqlen_q: int = 0   # 0: the user's (--seqlen)
    seqlen_k: int = 0   # 0: as seqlen_q


@dataclass(frozen=True)
class Model:
    name: str
    layers: tuple[Attention, ...]
    seqlens: tuple[str, ...] = ()   # the default --seqlen of a model whose length is the user's
    batch: int = 1

    @property
    def fixed(self) -> bool:
        """Its lengths are the model's own (an image, 30 s of audio), not the user's."""
        return all(a.seqlen_q for a in self.layers)

    def problems(self, dtype: str, seqlens: list[str] | None = None, batches: list[int] | None = None) -> list[Problem]:
        """Its attention problems in `dtype`, for each batch and (for a model of the user's
        length) each --seqlen N or NQ:NK."""
        if seqlens and self.fixed:
            raise ValueError(f"model {self.name} has its own sequence lengths "
                             f"({', '.join(sorted({str(a.seqlen_q) for a in self.layers}))}): --seqlen does not apply")
        out = []
        for b in batches or [self.batch]:
            for a in self.layers:
                for nq, nk in ([(a.seqlen_q, a.seqlen_k or a.seqlen_q)] if a.seqlen_q else
                               [_lengths(s) for s in seqlens or self.seqlens]):
                    mask = a.mask if nq == nk or a.mask == "none" else "causal_br"   # a cache: bottom-right
                    out.append(Problem(b, a.heads, nq, nk, a.head_dim, dtype, mask, a.kv_heads))
        return out


def _lengths(text: str) -> tuple[int, int]:
    try:
        nq, *nk = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--seqlen {text!r} must be N or NQ:NK (integers)") from None
    if len(nk) > 1 or nq <= 0 or (nk and nk[0] < nq):
        raise ValueError(f"--seqlen {text!r} must be N or NQ:NK with 0 < NQ <= NK (NK - NQ keys cached)")
    return nq, nk[0] if nk else nq


def _llm(name: str, heads: int, kv: int, d: int) -> Model:
    return Model(name, (Attention(heads, kv, d, "causal"),), ("2048", "8192"))


MODELS: dict[str, Model] = {m.name: m for m in (
    _llm("llama3-8b", 32, 8, 128),
    _llm("llama3-70b", 64, 8, 128),
    _llm("qwen2.5-7b", 28, 4, 128),
    _llm("mistral-7b", 32, 8, 128),
    _llm("gemma2-9b", 16, 8, 256),
    Model("gpt2", (Attention(12, 12, 64, "causal"),), ("1024",), batch=8),
    Model("gpt2-xl", (Attention(25, 25, 64, "causal"),), ("1024",), batch=8),
    Model("vit-l16", (Attention(16, 16, 64, "none", 197),), batch=32),
    Model("sdxl", (Attention(10, 10, 64, "none", 4096), Attention(20, 20, 64, "none", 1024),
                   Attention(10, 10, 64, "none", 4096, 77), Attention(20, 20, 64, "none", 1024, 77)), batch=2),
    Model("whisper", (Attention(20, 20, 64, "none", 1500),)),
    # head dims off the 64-column panels (flash_fwd_sm90 pads its tile to them)
    _llm("phi3-mini", 32, 32, 96),
    _llm("phi-2", 32, 32, 80),
    Model("sd15", (Attention(8, 8, 40, "none", 4096), Attention(8, 8, 80, "none", 1024), Attention(8, 8, 160, "none", 256),
                   Attention(8, 8, 40, "none", 4096, 77), Attention(8, 8, 80, "none", 1024, 77)), batch=2),
    Model("dit-xl2", (Attention(16, 16, 72, "none", 256),), batch=16),
)}


def get_model(name: str) -> Model:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def model_problems(names: list[str], dtype: str, seqlens: list[str] | None = None,
                   batches: list[int] | None = None) -> list[Problem]:
    """The problems of several models, each once."""
    out = [p for n in names for p in get_model(n).problems(dtype, seqlens, batches)]
    return list(dict.fromkeys(out))


def default_dtype(gpu=None) -> str:
    """What a GPU runs attention fastest in: bf16 from sm_80 (tensor cores take it), fp16 before."""
    return "fp16" if gpu is not None and (gpu.major, gpu.minor) < (8, 0) else "bf16"


DEFAULT_HELP = ("With no --shape and no --model: docs/benchmarks.md's standard grid (18 shapes: 16k tokens, hidden 2048, "
                "d 64, 128 and 256, N 1024/4096/16384, full and causal) and every model of the table (tuner/models.py) at "
                "its default lengths and batch, in bf16 (fp16 on GPUs before sm_80); with --dtype fp32, the three "
                "GPT-2 fp32 shapes (B8 N1024, B6 N4096, B1 N8192; H12 d64 causal)")


def default_problems(dtype: str | None = None, gpu=None) -> list[Problem]:
    """DEFAULT_HELP's problems: what matters on `gpu` (None: a GPU with bf16 tensor cores)."""
    dtype = dtype or default_dtype(gpu)
    if dtype == "fp32":
        return list(GPT2_FP32)
    return list(dict.fromkeys(standard_grid(dtype) + model_problems(list(MODELS), dtype)))
