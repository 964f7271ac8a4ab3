"""The runtime dispatcher: `attention(q, k, v)` runs the best tuned kernel for the shape.

Its hot path is a dictionary lookup and a launch. The first call for a shape reads the lookup
file (once per process), compiles or loads the cubin (disk cache) and keeps the loaded kernel.
Where nothing tuned fits, torch's scaled_dot_product_attention answers, with one warning.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from .family import Launch
from .launch import current_stream
from .measure import TORCH_DTYPES, torch_dtype
from .problem import DTYPE_BYTES, Problem

TORCH_TO_DTYPE = {name: dtype for dtype, name in TORCH_DTYPES.items()}  # "float8_e4m3fn" -> "fp8"


@dataclass
class Plan:
    """What a shape resolved to: a loaded kernel and its launch, or None for the SDPA fallback."""

    kernel: object | None
    launch: Launch | None
    family: str | None
    reason: str = ""
    dtype: str = ""
    make_args: Callable[..., tuple] | None = None  # (q, k, v, o, lse, scale) -> launch arguments
    out: torch.dtype | None = None  # O's dtype (Problem.out_dtype: bf16 for fp8 inputs)


def supported_head_dims() -> set[int]:
    from .kernel_templates import FAMILIES

    return {d for f in FAMILIES.values() for d in f.head_dims}


def problem_of(q, k, v, causal: bool, max_error: float | None = None) -> Problem:
    """Validate the inputs and describe them; every mistake is a ValueError naming it."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; attention runs on CUDA tensors")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v have different dtypes: {q.dtype}, {k.dtype}, {v.dtype}")
    dtype = TORCH_TO_DTYPE.get(str(q.dtype).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unsupported dtype {q.dtype}; use one of {', '.join(TORCH_TO_DTYPE)}")
    b, h, nq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head dim")
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"k/v heads ({k.shape[1]}) must divide q heads ({h})")
    if d not in supported_head_dims():
        raise ValueError(f"unsupported head dim {d}; supported: {sorted(supported_head_dims())}")
    if min(b, h, nq, k.shape[2]) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if max_error is not None and not (isinstance(max_error, (int, float)) and 0 < max_error < 1):
        raise ValueError(f"max_error must be a number in (0, 1), got {max_error!r}")
    return Problem(b, h, nq, k.shape[2], d, dtype, bool(causal), k.shape[1], max_error or 0.0)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _kernel_ready(t, dtype: str) -> bool:
    """Our kernels read 16-byte chunks: the last dim contiguous, pointers and row strides aligned."""
    chunk = 16 // DTYPE_BYTES[dtype]
    return t.stride(3) == 1 and t.data_ptr() % 16 == 0 and all(s % chunk == 0 for s in t.stride()[:3])


class Dispatcher:
    def __init__(self, lookup_path: str | Path | None = None) -> None:
        self._path = lookup_path
        self._table: dict[tuple[str, str], list[dict]] | None = None
        self._plans: dict[tuple, Plan] = {}
        self._gpus: dict[int, object] = {}
        self._warned: set[str] = set()
        self._ignored = ""  # why the lookup file was ignored: the one warning its fallbacks give
        self._lock = threading.Lock()
        self._warn_lock = threading.Lock()  # _warn runs under _lock (plan) and outside it (fallback)

    # ---- slow path, once per shape ----
    def _load_table(self) -> dict[tuple[str, str], list[dict]]:
        from .export import default_lookup_path, read_lookup

        path = Path(self._path) if self._path else default_lookup_path()
        table: dict[tuple[str, str], list[dict]] = {}
        try:  # any lookup, however malformed, is one warning and the SDPA fallback, never a raise
            if not path.exists():
                return table
            for e in read_lookup(path)["entries"]:
                table.setdefault((e["gpu_key"], e["bucket"]), []).append(e)
        except Exception as exc:
            self._ignored = f"ignoring the best-config lookup: {_one_line(exc)}"
            self._warn(self._ignored)
            return {}
        for entries in table.values():
            entries.sort(key=lambda e: -e["tflops"])
        return table

    def _gpu(self, index: int):
        g = self._gpus.get(index)
        if g is None:
            from .gpu import _from_torch

            g = self._gpus[index] = _from_torch(index)
        return g

    def select(self, problem: Problem, gpu) -> dict | None:
        """The lookup entry that serves `problem` on `gpu`: its bucket's fastest runnable family."""
        from .kernel_templates import FAMILIES

        if self._table is None:
            self._table = self._load_table()
        for e in self._table.get((gpu.key, problem.bucket().key), []):
            fam = FAMILIES.get(e["family"])
            if fam is not None and fam.check(e["params"], gpu, problem) is None:
                return e
        return None

    def _plan(self, problem: Problem, device_index: int) -> Plan:
        from .compile import compile_kernel
        from .kernel_templates import FAMILIES
        from .launch import LoadedKernel

        gpu = self._gpu(device_index)
        entry = self.select(problem, gpu)
        out = torch_dtype(problem.out_dtype)
        if entry is None:
            why = self._ignored or f"no tuned config for {problem.bucket().key} on {gpu.key}"
            return Plan(None, None, None, why, out=out)
        fam = FAMILIES[entry["family"]]
        try:  # a looked-up config that fails to compile or load falls back like a missing one
            ck = compile_kernel(fam, entry["params"], problem, gpu.arch)
            launch = fam.launch(entry["params"], problem)
            kernel = LoadedKernel.load(ck, launch.smem_bytes, device_index)
        except Exception as exc:
            return Plan(None, None, None, f"the tuned {fam.name} config for {problem.bucket().key} on {gpu.key} "
                                          f"cannot be used ({_one_line(exc)})", out=out)
        return Plan(kernel, launch, fam.name, dtype=problem.dtype,
                    make_args=partial(fam.kernel_args, entry["params"]), out=out)

    def _warn(self, message: str) -> None:
        with self._warn_lock:  # once per message, even with threads falling back at the same time
            if message in self._warned:
                return
            self._warned.add(message)
        warnings.warn(f"flashtune: {message}; using torch scaled_dot_product_attention", stacklevel=3)

    # ---- hot path ----
    def __call__(self, q, k, v, causal: bool = False, scale: float | None = None, return_lse: bool = False,
                 max_error: float | None = None):
        key = (q.shape, k.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, bool(causal), max_error)
        plan = self._plans.get(key)
        if plan is None:
            problem = problem_of(q, k, v, causal, max_error)
            with self._lock:
                plan = self._plans.get(key)
                if plan is None:
                    plan = self._plans[key] = self._plan(problem, q.device.index or 0)
        if plan.kernel is None:
            return self._fallback(q, k, v, causal, scale, plan, return_lse)
        q, k, v = (t if _kernel_ready(t, plan.dtype) else t.contiguous() for t in (q, k, v))
        with torch.cuda.device(q.device):
            o = torch.empty(q.shape, device=q.device, dtype=plan.out)
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            plan.kernel(current_stream(), plan.launch, *plan.make_args(q, k, v, o, lse, scale))
        return (o, lse) if return_lse else o

    def _fallback(self, q, k, v, causal, scale, plan: Plan, return_lse):
        """torch SDPA, on inputs in O's dtype: it takes no fp8, so e4m3 inputs go up to bf16 (exactly)."""
        import torch.nn.functional as F

        self._warn(plan.reason)
        if q.dtype != plan.out:
            q, k, v = (t.to(plan.out) for t in (q, k, v))
        gqa = k.shape[1] != q.shape[1]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **({"enable_gqa": True} if gqa else {}))
        if return_lse:
            raise ValueError(f"return_lse needs a tuned kernel ({plan.reason})")
        return o


_default: Dispatcher | None = None
_default_lock = threading.Lock()


def attention(q, k, v, causal: bool = False, scale: float | None = None, max_error: float | None = None):
    """Attention forward on CUDA tensors of shape (B, H, N, D) (K/V may have fewer heads).

    Returns O with q's shape and dtype (bf16 for float8_e4m3fn inputs), computed by the best tuned
    kernel for this GPU and shape bucket, or by torch SDPA (with one warning; on bf16 copies of
    fp8 inputs) where nothing tuned fits. `max_error` picks configs tuned under that error budget
    (`tuner search --max-error`): for fp32 inputs, the tf32 or bf16 tensor-core kernels; None
    means the dtype's default budget.
    """
    global _default
    d = _default
    if d is None:
        with _default_lock:  # threads racing on the first call share one dispatcher (one plan cache)
            if _default is None:
                _default = Dispatcher()
            d = _default
    return d(q, k, v, causal, scale, max_error=max_error)


def reset(lookup_path: str | Path | None = None) -> Dispatcher:
    """Drop cached plans and re-read the lookup (after a new search, or to point elsewhere)."""
    global _default
    _default = Dispatcher(lookup_path)
    return _default
