"""The attention problem being tuned: shapes, dtype, masking, FLOP count and shape buckets."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# "fp8" means e4m3 inputs (torch.float8_e4m3fn) and a bf16 O: an output carries no fp8 rounding.
DTYPES = ("fp32", "fp16", "bf16", "fp8")
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
# O's dtype where it is not the inputs' own.
OUT_DTYPE = {"fp8": "bf16"}
# Problem dtype -> torch dtype name (the dispatcher reads it backwards, from tensors).
TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}


def torch_dtype(dtype: str):
    """The torch dtype of a problem dtype name ("fp8" -> torch.float8_e4m3fn); imports torch."""
    import torch

    return getattr(torch, TORCH_DTYPES[dtype])
# Default error budgets by input precision: relative Frobenius error of O against float64. fp32
# math lands near 1e-6; fp16/bf16 outputs carry their own rounding (2^-11, 2^-8). fp8: the
# reference starts from the same e4m3 values, so the inputs' rounding is no error; the kernel's
# P, rounded to e4m3 for the P V product (3 mantissa bits: ~3% rms per element, ~2.5% of O on
# normal inputs, tests/test_fp8_host.py), is the one big error left.
REL_BUDGET = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.2e-2, "fp8": 5e-2}
# Absolute error of the per-row LSE. A widened budget widens it in proportion: lower-precision
# products shift every score by up to |s| x their rounding (|s| reaches ~5 on normal inputs).
LSE_BUDGET = 1e-3
LSE_PER_REL = 5.0
# fp8: the H100's e4m3 wgmma accumulates Q K^T in less than fp32 (its products are exact, the
# running sum keeps fewer bits), so scores, and with them the LSE, carry ~1e-3 of error: 1.6e-3 at
# most over 40 launches of d=128/256 shapes against float64 from the same e4m3 values.
LSE_BUDGET_BY_DTYPE = {"fp8": 5e-3}
# The kernels take heads, lengths and the row count of Q and K/V (batch x heads x seqlen) as 32-bit
# ints and index rows with them (`int row`, `lse[bh * nq + row]`): anything larger would wrap.
INT32_MAX = 2**31 - 1


@dataclass(frozen=True, order=True)
class Problem:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "fp32"
    causal: bool = False
    kv_heads: int = 0  # 0 means "same as heads"
    # The error a kernel may have against float64 (relative, of O); 0 means the dtype's default
    # (REL_BUDGET). A larger budget lets fp32 problems run at tf32 or bf16 precision on tensor cores.
    max_error: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if isinstance(self.max_error, bool) or not isinstance(self.max_error, (int, float)) \
                or not 0 <= self.max_error < 1:
            raise ValueError(f"max_error must be a number in [0, 1), got {self.max_error!r}")
        if self.dtype in REL_BUDGET and self.max_error == REL_BUDGET[self.dtype]:
            object.__setattr__(self, "max_error", 0.0)  # the default, spelled out: one key for both
        object.__setattr__(self, "max_error", float(self.max_error))
        for name in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim", "kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value > INT32_MAX:
                raise ValueError(f"{name} must be below 2^31 (the kernels index with 32-bit ints), got {value}")
        for what, rows in (("batch x heads x seqlen_q", self.batch * self.heads * self.seqlen_q),
                           ("batch x kv_heads x seqlen_k", self.batch * self.kv_heads * self.seqlen_k)):
            if rows > INT32_MAX:
                raise ValueError(f"{what} = {rows} rows must be below 2^31 (the kernels index rows with 32-bit ints)")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")

    @classmethod
    def parse(cls, text: str, dtype: str = "fp32", max_error: float = 0.0) -> "Problem":
        """Parse `B,H,N,D[,causal]` as the CLI's --shape takes it."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if len(parts) not in (4, 5):
            raise ValueError(f"shape {text!r} must be B,H,N,D or B,H,N,D,causal")
        try:
            b, h, n, d = (int(p) for p in parts[:4])
        except ValueError:
            raise ValueError(f"shape {text!r}: B, H, N and D must be integers") from None
        causal = False
        if len(parts) == 5:
            flag = parts[4].lower()
            if flag not in ("causal", "c", "1", "true", "0", "false", "noncausal"):
                raise ValueError(f"shape {text!r}: the fifth field must be 'causal' (or 1/0)")
            causal = flag in ("causal", "c", "1", "true")
        return cls(b, h, n, n, d, dtype, causal, max_error=max_error)

    def flops(self) -> float:
        """4·B·H·Nq·Nk·d (two matrix products), halved for causal, as docs/benchmarks.md counts."""
        f = 4.0 * self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim
        return f / 2 if self.causal else f

    def tflops(self, ms: float) -> float:
        return self.flops() / (ms * 1e-3) / 1e12

    def bytes_moved(self) -> int:
        """Fewest bytes through device memory: q, k, v read once, o written once (in its own dtype)."""
        q_or_o = self.batch * self.heads * self.seqlen_q * self.head_dim
        k_v = 2 * self.batch * self.kv_heads * self.seqlen_k * self.head_dim
        return DTYPE_BYTES[self.dtype] * (q_or_o + k_v) + DTYPE_BYTES[self.out_dtype] * q_or_o

    @property
    def out_dtype(self) -> str:
        """The dtype of O: the inputs' own, except bf16 for fp8 inputs."""
        return OUT_DTYPE.get(self.dtype, self.dtype)

    @property
    def rel_budget(self) -> float:
        return self.max_error or REL_BUDGET[self.dtype]

    @property
    def lse_budget(self) -> float:
        return max(LSE_BUDGET_BY_DTYPE.get(self.dtype, LSE_BUDGET), LSE_PER_REL * self.max_error)

    def bucket(self) -> "Bucket":
        return Bucket.of(self)

    @property
    def key(self) -> str:
        kv = f"/kv{self.kv_heads}" if self.kv_heads != self.heads else ""
        mask = "causal" if self.causal else "full"
        nq = str(self.seqlen_q) if self.seqlen_q == self.seqlen_k else f"{self.seqlen_q}x{self.seqlen_k}"
        err = f"-err{self.max_error:g}" if self.max_error else ""
        return f"B{self.batch}-H{self.heads}{kv}-N{nq}-D{self.head_dim}-{self.dtype}-{mask}{err}"

    def to_dict(self) -> dict:
        return asdict(self)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


@dataclass(frozen=True, order=True)
class Bucket:
    """The shape class a tuned config serves.

    Configs depend on the head dim, dtype and masking exactly, and on the sequence length and the
    amount of parallel work only coarsely, so seqlen is rounded up to a power of two (min 128) and
    the work (batch x heads) to one of three sizes.
    """

    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    work: str
    max_error: float = 0.0  # as Problem.max_error: configs tuned under another budget serve other calls

    @classmethod
    def of(cls, p: Problem) -> "Bucket":
        n = max(128, _pow2_ceil(max(p.seqlen_q, p.seqlen_k)))
        bh = p.batch * p.heads
        work = "small" if bh < 32 else ("medium" if bh < 256 else "large")
        return cls(p.dtype, p.head_dim, p.causal, n, work, p.max_error)

    @property
    def key(self) -> str:
        mask = "causal" if self.causal else "full"
        err = f"/err{self.max_error:g}" if self.max_error else ""
        return f"{self.dtype}/d{self.head_dim}/{mask}/n{self.seqlen}/{self.work}{err}"

    @classmethod
    def from_key(cls, key: str) -> "Bucket":
        try:
            parts = key.split("/")
            err = 0.0
            if len(parts) == 6 and parts[5].startswith("err"):
                err = float(parts.pop()[3:])
            dtype, d, mask, n, work = parts
            if not (d.startswith("d") and n.startswith("n") and mask in ("causal", "full")):
                raise ValueError
            return cls(dtype, int(d[1:]), mask == "causal", int(n[1:]), work, err)
        except ValueError:
            raise ValueError(f"not a shape-bucket key: {key!r}") from None


GPT2_FP32 = (
    Problem(8, 12, 1024, 1024, 64, "fp32", True),
    Problem(6, 12, 4096, 4096, 64, "fp32", True),
    Problem(1, 12, 8192, 8192, 64, "fp32", True),
)


def standard_grid(dtype: str) -> list[Problem]:
    """docs/benchmarks.md's grid, its 12 shapes for one dtype (24 over fp16 and bf16): 16k tokens per
    batch, hidden 2048."""
    out = []
    for d in (64, 128):
        for n in (1024, 4096, 16384):
            for causal in (False, True):
                out.append(Problem(16384 // n, 2048 // d, n, n, d, dtype, causal))
    return out


def default_problems(dtype: str | None = None) -> list[Problem]:
    if dtype in (None, "fp32"):
        return list(GPT2_FP32)
    return standard_grid(dtype)
