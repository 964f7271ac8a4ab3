"""Inside the worker process: run one candidate (or one SDPA peer), validate it, time it."""

from __future__ import annotations

import math

from .family import KernelFamily
from .launch import LaunchError, LoadedKernel, current_stream
from .problem import Problem
from .records import CompiledKernel, Measurement
from .reference import attention_fp64, compare
from .timing import Timer

TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}


class DeviceFault(RuntimeError):
    """The CUDA context is poisoned (illegal address, ...): the worker must exit after reporting."""


def random_inputs(problem: Problem, seed: int):
    """Fresh normal inputs, never zeros; (B, H, N, D), K/V with kv_heads."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, TORCH_DTYPES[problem.dtype])
    p = problem
    q = torch.randn(p.batch, p.heads, p.seqlen_q, p.head_dim, generator=g, device="cuda", dtype=dt)
    k = torch.randn(p.batch, p.kv_heads, p.seqlen_k, p.head_dim, generator=g, device="cuda", dtype=dt)
    v = torch.randn(p.batch, p.kv_heads, p.seqlen_k, p.head_dim, generator=g, device="cuda", dtype=dt)
    return q, k, v


def _sync_or_fault() -> None:
    import torch

    try:
        torch.cuda.synchronize()
    except Exception as exc:  # sticky errors surface here
        raise DeviceFault(str(exc).strip().splitlines()[0]) from None


def measure_kernel(family: KernelFamily, params: dict, problem: Problem, ck: CompiledKernel,
                   timer: Timer, seed: int, device_index: int = 0) -> Measurement:
    import torch

    base = dict(resources=ck.resources, compile_seconds=ck.compile_seconds)
    launch = family.launch(params, problem)
    try:
        kernel = LoadedKernel.load(ck, launch.smem_bytes, device_index)
    except LaunchError as exc:
        return Measurement("launch_error", message=str(exc), **base)
    except Exception as exc:
        return Measurement("launch_error", message=f"cannot load the cubin: {exc}", **base)

    q, k, v = random_inputs(problem, seed)
    o = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    lse = torch.full(q.shape[:3], float("nan"), device="cuda", dtype=torch.float32)
    scale = 1.0 / math.sqrt(problem.head_dim)
    stream = current_stream()
    try:
        args = family.kernel_args(params, q, k, v, o, lse, scale)
        kernel(stream, launch, *args)
    except (LaunchError, ValueError) as exc:  # ValueError: the arguments cannot be built (tma.TmaError)
        return Measurement("launch_error", message=str(exc), **base)
    _sync_or_fault()

    ref_o, ref_lse = attention_fp64(q, k, v, problem.causal, scale)
    err = compare(o, lse, ref_o, ref_lse)
    del ref_o, ref_lse
    figures = dict(rel_err=err.rel, max_abs_err=err.max_abs, lse_err=err.lse)
    if not err.within(problem.rel_budget, problem.lse_budget):
        what = "NaN/Inf in the output (unwritten or overflowed)" if not err.finite else "error over budget"
        return Measurement("wrong_result", message=f"{what}: rel {err.rel:.3g}, lse {err.lse}", **figures, **base)

    t = timer(lambda: kernel(stream, launch, *args))
    _sync_or_fault()
    return Measurement("ok", median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms,
                       tflops=problem.tflops(t.median_ms), reps=t.reps, **figures, **base)


def measure_peer(backend: str, problem: Problem, timer: Timer, seed: int) -> Measurement:
    """One torch SDPA backend, pinned, on the same kind of inputs, with the same timer."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = random_inputs(problem, seed)
    gqa = problem.kv_heads != problem.heads
    kw = dict(is_causal=problem.causal, enable_gqa=True) if gqa else dict(is_causal=problem.causal)
    run = lambda: F.scaled_dot_product_attention(q, k, v, **kw)  # noqa: E731
    try:
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])):
            o = run()
            _sync_or_fault()
            ref_o, _ = attention_fp64(q, k, v, problem.causal, 1.0 / math.sqrt(problem.head_dim))
            err = compare(o, None, ref_o, None)
            del ref_o, o
            t = timer(run)
    except DeviceFault:
        raise
    except Exception as exc:  # backend not available for this shape/dtype/GPU
        return Measurement("launch_error", message=str(exc).strip().splitlines()[0][:300])
    return Measurement("ok", median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms,
                       tflops=problem.tflops(t.median_ms), reps=t.reps, rel_err=err.rel,
                       max_abs_err=err.max_abs)
