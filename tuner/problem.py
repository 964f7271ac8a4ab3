"""The attention problem being tuned: shapes, dtype, masking, FLOP count and shape buckets."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields

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

# The masks: none; "causal", the top-left diagonal (SDPA's is_causal: query i sees keys j <= i); and
# "causal_br", the bottom-right one (FlashAttention's, torch's causal_lower_right: query i sees keys
# j <= i + Nk - Nq), what a KV cache or a chunked prefill needs. They differ only where Nq != Nk.
MASKS = ("none", "causal", "causal_br")
# How problem and bucket keys spell each mask ("full" and "causal" are what older keys say).
MASK_KEYS = {"none": "full", "causal": "causal", "causal_br": "causal_br"}
# The tokens `--shape` takes for each mask (case-insensitive).
MASK_TOKENS = {
    **dict.fromkeys(("none", "full", "0", "false", "noncausal"), "none"),
    **dict.fromkeys(("causal", "c", "1", "true", "top_left"), "causal"),
    **dict.fromkeys(("causal_br", "bottom_right", "br"), "causal_br"),
}
SHAPE_FORMAT = "B,H[:KVH],NQ[:NK],D[,MASK]"


def mask_of(value: object) -> str:
    """A mask name from a mask name or a bool (True: SDPA's is_causal, the top-left diagonal)."""
    if isinstance(value, bool):
        return "causal" if value else "none"
    if value not in MASKS:
        raise ValueError(f"mask must be one of {', '.join(MASKS)} (or a bool), got {value!r}")
    return value  # type: ignore[return-value]


def seen_mask(mask: str, nq: int, nk: int) -> str:
    """The mask as the attention sees it: one query on the bottom-right diagonal sees every key, so
    a decode step's "causal_br" is no mask (one bucket, and SDPA runs it unmasked); with as many
    queries as keys the two diagonals are one, so a prompt's prefill into an empty KV cache is
    "causal" (the buckets the grid and the models tuned)."""
    if mask == "causal_br" and nq == 1:
        return "none"
    return "causal" if mask == "causal_br" and nq == nk else mask


def visible_pairs(nq: int, nk: int, mask: str) -> int:
    """(query, key) pairs a mask leaves visible, exactly: a causal row i sees min(Nk, max(0, i +
    shift + 1)) keys, shift 0 top-left and Nk - Nq bottom-right (rows before -shift see none)."""
    if mask == "none":
        return nq * nk
    shift = nk - nq if mask == "causal_br" else 0
    first = min(nq, max(0, -shift))                # the first row that sees a key
    full = min(nq, max(first, nk - shift - 1))     # the first row that sees every key
    partial = full - first                         # rows first..full-1 see i + shift + 1 keys
    return partial * (shift + 1) + partial * (first + full - 1) // 2 + (nq - full) * nk


def visible_keys(row: int, nq: int, nk: int, mask: str) -> int:
    """The keys query row `row` sees, as visible_pairs counts them: the first ones, up to its diagonal."""
    if mask == "none":
        return nk
    shift = nk - nq if mask == "causal_br" else 0
    return min(nk, max(0, row + shift + 1))


@dataclass(frozen=True, order=True)
class Problem:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "fp32"
    # MASKS; a bool is read as SDPA's is_causal (True: "causal"), the field's meaning before masks
    mask: str = "none"
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
        object.__setattr__(self, "mask", mask_of(self.mask))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")

    @classmethod
    def parse(cls, text: str, dtype: str = "fp32", max_error: float = 0.0) -> "Problem":
        """Parse the CLI's --shape, SHAPE_FORMAT: `B,H[:KVH],NQ[:NK],D[,MASK]`, MASK one of
        MASK_TOKENS (none, causal, causal_br, ...). `2,32:8,512:8192,128,causal_br`: 32 query heads
        sharing 8 K/V heads, 512 queries against 8192 keys, bottom-right causal."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (4, 5) or not all(parts):
            raise ValueError(f"shape {text!r} must be {SHAPE_FORMAT}")
        try:
            (b,), (h, *kv), (nq, *nk), (d,) = (tuple(int(x) for x in p.split(":")) for p in parts[:4])
        except ValueError:
            raise ValueError(f"shape {text!r}: B, H, KVH, NQ, NK and D must be integers ({SHAPE_FORMAT})") from None
        if len(kv) > 1 or len(nk) > 1:
            raise ValueError(f"shape {text!r}: H and N take at most one ':' ({SHAPE_FORMAT})")
        mask = "none"
        if len(parts) == 5:
            mask = MASK_TOKENS.get(parts[4].lower(), "")
            if not mask:
                raise ValueError(f"shape {text!r}: the mask field must be one of {', '.join(MASK_TOKENS)}")
        return cls(b, h, nq, nk[0] if nk else nq, d, dtype, mask, kv[0] if kv else 0, max_error=max_error)

    @classmethod
    def from_dict(cls, record: dict) -> "Problem":
        """The problem in a record holding to_dict's fields among others (a bench row, a recorded
        call), or an older record's (a `causal` bool, no `mask`)."""
        d = {k: v for k, v in record.items() if k in _FIELDS or k == "causal"}
        if "causal" in d:
            if "mask" in d:
                raise ValueError("a problem has a mask or a causal flag, not both")
            d["mask"] = d.pop("causal")
        return cls(**d)

    @property
    def causal(self) -> bool:
        """Any causal mask (top-left or bottom-right)."""
        return self.mask != "none"

    @property
    def bottom_right(self) -> bool:
        """The causal diagonal is the bottom-right one (the kernels' MASK_BR)."""
        return self.mask == "causal_br"

    @property
    def decode_step(self) -> bool:
        """A few queries (up to DECODE_QUERIES) against a longer cache: a decode or speculative step,
        whose K/V a KV cache holds."""
        return self.seqlen_q <= DECODE_QUERIES and self.seqlen_q < self.seqlen_k

    def query_blocks(self, rows: int) -> int:
        """Work tiles of `rows` query rows over every sequence and head: a grid kernel's CTAs."""
        return self.batch * self.heads * -(-self.seqlen_q // rows)

    def flops(self) -> float:
        """4·d per visible (query, key) pair (two matrix products), counted exactly for every mask
        (square causal: N(N+1)/2 pairs, docs/benchmarks.md)."""
        return 4.0 * self.batch * self.heads * self.head_dim * visible_pairs(self.seqlen_q, self.seqlen_k, self.mask)

    def tflops(self, ms: float) -> float:
        return self.flops() / (ms * 1e-3) / 1e12

    def bytes_moved(self) -> int:
        """Fewest bytes through device memory: q, k, v read once, o written once (in its own dtype)."""
        q_or_o = self.batch * self.heads * self.seqlen_q * self.head_dim
        return DTYPE_BYTES[self.dtype] * q_or_o + self.kv_bytes + DTYPE_BYTES[self.out_dtype] * q_or_o

    @property
    def kv_bytes(self) -> int:
        """The bytes of K and V: what a kernel streams from memory once, or from L2 again where they fit."""
        return DTYPE_BYTES[self.dtype] * 2 * self.batch * self.kv_heads * self.seqlen_k * self.head_dim

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
        mask = MASK_KEYS[self.mask]
        nq = str(self.seqlen_q) if self.seqlen_q == self.seqlen_k else f"{self.seqlen_q}x{self.seqlen_k}"
        err = f"-err{self.max_error:g}" if self.max_error else ""
        return f"B{self.batch}-H{self.heads}{kv}-N{nq}-D{self.head_dim}-{self.dtype}-{mask}{err}"

    @classmethod
    def from_key(cls, key: str) -> "Problem":
        """The problem a `key` names (keys round-trip: Problem.from_key(p.key) == p)."""
        m = _PROBLEM_KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"not a problem key: {key!r}")
        nq = int(m["nq"])
        return cls(int(m["b"]), int(m["h"]), nq, int(m["nk"] or nq), int(m["d"]), m["dtype"],
                   _MASK_OF_KEY[m["mask"]], int(m["kv"] or 0), float(m["err"] or 0))

    def to_dict(self) -> dict:
        return asdict(self)


_FIELDS = {f.name for f in fields(Problem)}


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def _seqlen_bucket(n: int) -> int:
    return max(128, _pow2_ceil(n))


# Up to this many queries a call is decode (one token, or a few speculated ones, per sequence):
# its Nq is bucketed by powers of two from 1, not from 128, since its configs (flash_decode's) are
# not a prefill's.
DECODE_QUERIES = 64


def _query_bucket(n: int) -> int:
    return _pow2_ceil(n) if n <= DECODE_QUERIES else _seqlen_bucket(n)


# The work classes of a bucket, (name, batch x heads below which a call is in it), in order. A decode
# step of 32 query heads spans B8-B63 in "large" and B64 up in "huge": at B128 a call streams four
# times B32's K/V in eight waves of CTAs, and the config and backend that win at B32 lost there
# (0.91-0.94x cuDNN on the H200, PERF_NOTES "h1").
WORK_CLASSES = (("small", 32), ("medium", 256), ("large", 2048), ("huge", math.inf))


@dataclass(frozen=True, order=True)
class Bucket:
    """The shape class a tuned config serves.

    Configs depend on the head dim, dtype and mask exactly, and on the sequence lengths and the
    amount of parallel work only coarsely, so each length is rounded up to a power of two (min
    128; Nq of a decode call, up to DECODE_QUERIES, from 1) and the work (batch x heads) to one of
    four sizes, each 8x the one before (WORK_CLASSES). Nq and Nk are rounded apart: a chunk
    of 512 queries against a cache of 8192 keys wants another config than 8192 against 8192.
    """

    dtype: str
    head_dim: int
    mask: str           # MASKS (a bool: SDPA's is_causal, as in Problem)
    seqlen: int         # Nk rounded
    work: str
    max_error: float = 0.0  # as Problem.max_error: configs tuned under another budget serve other calls
    seqlen_q: int = 0   # Nq rounded; 0 means the same as seqlen

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask", mask_of(self.mask))
        if self.seqlen_q == self.seqlen:
            object.__setattr__(self, "seqlen_q", 0)

    @classmethod
    def of(cls, p: Problem) -> "Bucket":
        bh = p.batch * p.heads
        work = next(name for name, below in WORK_CLASSES if bh < below)
        # a decode step is one bucket whether the caller says bottom-right (a KV cache, --seqlen 1:N)
        # or no mask (SDPA's call); a square bottom-right call is the causal one's
        return cls(p.dtype, p.head_dim, seen_mask(p.mask, p.seqlen_q, p.seqlen_k), _seqlen_bucket(p.seqlen_k), work,
                   p.max_error, _query_bucket(p.seqlen_q))

    @property
    def causal(self) -> bool:
        return self.mask != "none"

    @property
    def queries(self) -> int:
        """Nq rounded (seqlen_q, or seqlen where they agree)."""
        return self.seqlen_q or self.seqlen

    @property
    def key(self) -> str:
        err = f"/err{self.max_error:g}" if self.max_error else ""
        n = f"{self.seqlen_q}x{self.seqlen}" if self.seqlen_q else str(self.seqlen)
        return f"{self.dtype}/d{self.head_dim}/{MASK_KEYS[self.mask]}/n{n}/{self.work}{err}"

    @classmethod
    def from_key(cls, key: str) -> "Bucket":
        m = _BUCKET_KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"not a shape-bucket key: {key!r}")
        try:
            return cls(m["dtype"], int(m["d"]), _MASK_OF_KEY[m["mask"]], int(m["nk"]), m["work"],
                       float(m["err"] or 0), int(m["nq"] or 0))
        except ValueError:
            raise ValueError(f"not a shape-bucket key: {key!r}") from None


_MASK_OF_KEY = {v: k for k, v in MASK_KEYS.items()}
_MASK_RE = "|".join(sorted(_MASK_OF_KEY, key=len, reverse=True))
_BUCKET_KEY = re.compile(rf"(?P<dtype>\w+)/d(?P<d>\d+)/(?P<mask>{_MASK_RE})/n(?:(?P<nq>\d+)x)?(?P<nk>\d+)"
                         rf"/(?P<work>\w+)(?:/err(?P<err>[0-9.e+-]+))?")
_PROBLEM_KEY = re.compile(rf"B(?P<b>\d+)-H(?P<h>\d+)(?:/kv(?P<kv>\d+))?-N(?P<nq>\d+)(?:x(?P<nk>\d+))?"
                          rf"-D(?P<d>\d+)-(?P<dtype>\w+?)-(?P<mask>{_MASK_RE})(?:-err(?P<err>[0-9.e+-]+))?")


GPT2_FP32 = (
    Problem(8, 12, 1024, 1024, 64, "fp32", True),
    Problem(6, 12, 4096, 4096, 64, "fp32", True),
    Problem(1, 12, 8192, 8192, 64, "fp32", True),
)


def standard_grid(dtype: str) -> list[Problem]:
    """docs/benchmarks.md's grid, its 18 shapes for one dtype (36 over fp16 and bf16): 16k tokens per
    batch, hidden 2048, d in {64, 128, 256}."""
    out = []
    for d in (64, 128, 256):
        for n in (1024, 4096, 16384):
            for causal in (False, True):
                out.append(Problem(16384 // n, 2048 // d, n, n, d, dtype, causal))
    return out
