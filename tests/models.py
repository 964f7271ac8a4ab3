"""Small models for the tests and benchmarks: what a user's model does around attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lookup_with_defaults(path, problems, gpu) -> None:
    """A best-config lookup that serves each problem with the first family that runs it on `gpu`,
    at that family's default config: the dispatcher then runs our kernel, not a fallback."""
    from tuner.export import lookup_of, write_lookup
    from tuner.kernel_templates import get_family

    served = []
    for p in problems:
        fam = next(get_family(n) for n in ("flash_fwd_sm90", "flash_fwd_mma", "flash_fwd_simt")
                   if get_family(n).supports(gpu, p) is None)
        served.append((p, fam.name, fam.default(gpu, p), 1.0))
    write_lookup(lookup_of(gpu.key, served), path)


class Attention(torch.nn.Module):
    """Llama-style: one QKV projection, GQA, (B, N, H, D) views of it, causal attention, output projection."""

    def __init__(self, dim: int, heads: int, kv_heads: int, impl: str = "flashtune") -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.impl = heads, kv_heads, dim // heads, impl
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import tuner

        b, n, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q, k, v = (t.view(b, n, -1, d).transpose(1, 2) for t in (q, k, v))
        if self.impl == "flashtune":
            y = tuner.attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 256, heads: int = 2, kv_heads: int = 1, layers: int = 2,
                 impl: str = "flashtune") -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict({
                "norm1": torch.nn.LayerNorm(dim), "attn": Attention(dim, heads, kv_heads, impl),
                "norm2": torch.nn.LayerNorm(dim),
                "mlp": torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)),
            }))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm1"](x))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(x)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
