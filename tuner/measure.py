"""Inside the worker process: run a candidate and/or SDPA peers, validate each, time them."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from .family import KernelFamily
from .gpu import GpuSpec
from .launch import LaunchError, LoadedKernel, launch_on, raw_stream
from .peers import FA4, SDPA_BACKENDS, peer_dtype
from .problem import Problem, torch_dtype
from .records import CompiledKernel, Measurement, SideBySide, one_line
from .reference import attention_fp64, compare
from .timing import Timer, Timing

class DeviceFault(RuntimeError):
    """The CUDA context is poisoned (illegal address, ...): the worker must exit after reporting."""


def random_inputs(problem: Problem, seed: int, device: str = "cuda"):
    """Fresh normal inputs, never zeros (in fp8 the ~0.1% with |x| < 2^-10 round to 0); (B, H, N, D),
    K/V with kv_heads. A decode step's K/V are views of token-major (B, N, Hk, D) storage, as a KV
    cache holds them (vLLM's and FlashAttention's, kvcache_attention's): a decode config read 0.6x
    of its head-major timing there at d=80 (PERF_NOTES d8), so it is ranked on the layout it serves."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    dt = torch_dtype(problem.dtype)
    # randn makes no float8: draw in float32 and round (|x| < 448, so every value is in range)
    draw = torch.float32 if problem.dtype == "fp8" else dt
    p = problem
    q = torch.randn(p.batch, p.heads, p.seqlen_q, p.head_dim, generator=g, device=device, dtype=draw)
    if p.decode_step:
        k, v = (torch.randn(p.batch, p.seqlen_k, p.kv_heads, p.head_dim, generator=g, device=device,
                            dtype=draw).transpose(1, 2) for _ in range(2))
    else:
        k, v = (torch.randn(p.batch, p.kv_heads, p.seqlen_k, p.head_dim, generator=g, device=device, dtype=draw)
                for _ in range(2))
    return tuple(t.to(dt) for t in (q, k, v))


def poisoned_outputs(problem: Problem, q):
    """O (in the problem's output dtype, bf16 for fp8) and the fp32 LSE for q, filled with NaN:
    every element must be written."""
    import torch

    o = torch.full(q.shape, float("nan"), device=q.device, dtype=torch_dtype(problem.out_dtype))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
    return o, lse


def _sync_or_fault() -> None:
    import torch

    try:
        torch.cuda.synchronize()
    except Exception as exc:  # sticky errors surface here
        raise DeviceFault(str(exc).strip().splitlines()[0]) from None


Prepared = tuple[Callable[[], None] | None, Measurement]  # (what to time, or None: the final result)


def prepare_kernel(family: KernelFamily, params: dict, problem: Problem, ck: CompiledKernel,
                   seed: int, gpu: GpuSpec) -> Prepared:
    """Load and launch the candidate once, and check its output against the fp64 reference."""
    if family.packed:
        return prepare_packed(family, params, problem, ck, seed, gpu)
    base = dict(resources=ck.resources, compile_seconds=ck.compile_seconds)
    launch = family.launch(params, problem, gpu)
    device_index = gpu.index
    launcher, refused = _load(family, params, ck, launch, device_index, base)
    if refused is not None:
        return None, refused

    q, k, v = random_inputs(problem, seed)
    o, lse = poisoned_outputs(problem, q)
    scale = 1.0 / math.sqrt(problem.head_dim)
    try:
        args = family.kernel_args(params, q, k, v, o, lse, scale)
        launch_on(launcher, device_index, *args)
    except (LaunchError, ValueError) as exc:  # ValueError: the arguments cannot be built (tma.TmaError)
        return None, Measurement("launch_error", message=str(exc), **base)
    _sync_or_fault()

    ref_o, ref_lse = attention_fp64(q, k, v, problem.mask, scale)
    err = compare(o, lse, ref_o, ref_lse)
    del ref_o, ref_lse
    figures = dict(rel_err=err.rel, max_abs_err=err.max_abs, lse_err=err.lse)
    if not err.within(problem.rel_budget, problem.lse_budget):
        return None, Measurement("wrong_result", message=f"{_wrong(err)}: rel {err.rel:.3g}, lse {err.lse}", **figures, **base)
    stream = raw_stream(device_index)
    return (lambda: launcher(stream, *args)), Measurement("ok", **figures, **base)


def _load(family: KernelFamily, params: dict, ck: CompiledKernel, launch, device_index: int, base: dict):
    """(the candidate's launcher, None), or (None, the launch_error that says why it cannot load)."""
    try:
        return LoadedKernel.load(ck, launch.smem_bytes, device_index).launcher(launch, family.param_kinds(params)), None
    except LaunchError as exc:
        return None, Measurement("launch_error", message=str(exc), **base)
    except Exception as exc:
        return None, Measurement("launch_error", message=f"cannot load the cubin: {exc}", **base)


def _wrong(err) -> str:
    """What a check over budget found: unwritten or overflowed output, or plain error."""
    return "NaN/Inf in the output (unwritten or overflowed)" if not err.finite else "error over budget"


def prepare_packed(variant, params: dict, problem: Problem, ck: CompiledKernel, seed: int, gpu: GpuSpec) -> Prepared:
    """A varlen variant on the representative packed batches of the padded `problem`
    (tuner/length_mix.py), each launched once into NaN-poisoned O and LSE and checked sequence by
    sequence against the fp64 reference (the worst sequence's errors are the figures); what is
    timed launches them all, one after another."""
    base = dict(resources=ck.resources, compile_seconds=ck.compile_seconds)
    runs, worst = [], dict(rel_err=0.0, max_abs_err=0.0, lse_err=0.0)
    for draw, mix in enumerate(variant.work(problem).mixes):
        run, m = _prepare_mix(variant, params, problem, ck, mix, seed + draw, gpu, base)
        if run is None:
            return None, m
        runs.append(run)
        worst = {key: max(value, getattr(m, key) or 0.0) for key, value in worst.items()}

    def run_all() -> None:
        for run in runs:
            run()
    return run_all, Measurement("ok", **worst, **base)


def _prepare_mix(variant, params: dict, problem: Problem, ck: CompiledKernel, mix, seed: int, gpu: GpuSpec,
                 base: dict) -> Prepared:
    """One packed batch of prepare_packed: launched, checked, and what launches it again."""
    import torch

    q, k, v, cu_q, cu_k = mix.inputs(seed)
    launch = variant.packed_launch(params, problem, gpu, q.shape[0], k.shape[0])
    launcher, refused = _load(variant, params, ck, launch, gpu.index, base)
    if refused is not None:
        return None, refused
    o = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(problem.head_dim)
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, o)]   # (1, H, total, D)
    try:
        args = variant.varlen_values(variant.arg_maker(params), params, problem, launch.grid, views, lse, scale,
                                     cu_q, cu_k, max(mix.lengths_q), max(mix.lengths_k))
        if args is None:
            raise ValueError("the packed views are not as the kernel reads them")
        launch_on(launcher, gpu.index, *args)
    except (LaunchError, ValueError) as exc:
        return None, Measurement("launch_error", message=str(exc), **base)
    _sync_or_fault()
    worst = dict(rel_err=0.0, max_abs_err=0.0, lse_err=0.0)
    seq = lambda t, s, n: t[s:s + n].transpose(0, 1)[None]   # a sequence's rows as (1, H, n, D)
    a = c = 0
    for nq, nk in zip(mix.lengths_q, mix.lengths_k):
        ref_o, ref_lse = attention_fp64(seq(q, a, nq), seq(k, c, nk), seq(v, c, nk), problem.mask, scale)
        err = compare(seq(o, a, nq), lse[:, a:a + nq][None], ref_o, ref_lse)
        if not err.within(problem.rel_budget, problem.lse_budget):
            return None, Measurement("wrong_result", message=f"{_wrong(err)} in sequence ({nq}, {nk}) of the packed batch: "
                                     f"rel {err.rel:.3g}, lse {err.lse}", rel_err=err.rel, max_abs_err=err.max_abs,
                                     lse_err=err.lse, **base)
        worst = dict(rel_err=max(worst["rel_err"], err.rel), max_abs_err=max(worst["max_abs_err"], err.max_abs),
                     lse_err=max(worst["lse_err"], err.lse or 0.0))
        a, c = a + nq, c + nk
    stream = raw_stream(gpu.index)
    return (lambda: launcher(stream, *args)), Measurement("ok", **worst, **base)


def prepare_fa4(problem: Problem, seed: int) -> Prepared:
    """FlashAttention-4's forward on the inputs `seed` makes (in peer_dtype, laid out (B, N, H, D)
    as it takes them), run once (its first call compiles) and checked against the fp64 reference."""
    import torch

    from .peers import fa4_why_not

    cc = torch.cuda.get_device_capability()
    if why := fa4_why_not(problem, cc):
        return None, Measurement("launch_error", message=why)
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:
        return None, Measurement("launch_error", message=f"cannot import FlashAttention-4: {exc}"[:300])
    q, k, v = (t.to(torch_dtype(peer_dtype(problem))) for t in random_inputs(problem, seed))
    qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    causal = problem.mask != "none"   # its causal is the bottom-right diagonal: fa4_why_not saw to it

    def run() -> None:
        flash_attn_func(qn, kn, vn, causal=causal)

    try:
        out = flash_attn_func(qn, kn, vn, causal=causal)
        o = (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        _sync_or_fault()
        ref_o, _ = attention_fp64(q, k, v, problem.mask, 1.0 / math.sqrt(problem.head_dim))
        err = compare(o, None, ref_o, None)
        del ref_o, o
    except DeviceFault:
        raise
    except Exception as exc:
        return None, Measurement("launch_error", message=one_line(exc)[:300])
    if not err.within(problem.rel_budget):
        return None, Measurement("wrong_result", message=f"error over budget: rel {err.rel:.3g}", rel_err=err.rel,
                                 max_abs_err=err.max_abs)
    return run, Measurement("ok", rel_err=err.rel, max_abs_err=err.max_abs)


def prepare_peer(backend: str, problem: Problem, seed: int) -> Prepared:
    """One peer on the inputs `seed` makes (in peer_dtype), run once and checked: a torch SDPA
    backend, pinned, or FlashAttention-4 (prepare_fa4)."""
    if backend == FA4:
        return prepare_fa4(problem, seed)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .torch_attention import sdpa_mask_kwargs

    q, k, v = (t.to(torch_dtype(peer_dtype(problem))) for t in random_inputs(problem, seed))
    kw = sdpa_mask_kwargs(problem.mask, problem.seqlen_q, problem.seqlen_k)
    if problem.kv_heads != problem.heads:
        kw["enable_gqa"] = True
    pinned = getattr(SDPBackend, SDPA_BACKENDS[backend])

    def run() -> None:
        with sdpa_kernel(pinned):
            F.scaled_dot_product_attention(q, k, v, **kw)

    try:
        with sdpa_kernel(pinned):
            o = F.scaled_dot_product_attention(q, k, v, **kw)
        _sync_or_fault()
        ref_o, _ = attention_fp64(q, k, v, problem.mask, 1.0 / math.sqrt(problem.head_dim))
        err = compare(o, None, ref_o, None)
        del ref_o, o
        run()  # a backend can still refuse at the first timed call
    except DeviceFault:
        raise
    except Exception as exc:  # backend not available for this shape/dtype/GPU
        return None, Measurement("launch_error", message=one_line(exc)[:300])
    return run, Measurement("ok", rel_err=err.rel, max_abs_err=err.max_abs)


def timed(m: Measurement, t: Timing, problem) -> Measurement:
    """`m` with the timing; TFLOP/s of `problem` (a Problem, or anything with `.tflops(ms)`: a
    packed variant's length mixes)."""
    return replace(m, median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms,
                   tflops=problem.tflops(t.median_ms), reps=t.reps)


def measure_prepared(prepared: dict[str, Prepared], problem, timer: Timer,
                     rounds: int = 8) -> dict[str, Measurement]:
    """Time whatever prepared cleanly (in turns when there are several), then check for a fault.
    TFLOP/s count `problem`'s work (timed)."""
    runnable = {name: run for name, (run, _) in prepared.items() if run is not None}
    timings = timer.interleaved(runnable, rounds=rounds) if runnable else {}
    _sync_or_fault()
    return {name: timed(m, timings[name], problem) if name in timings else m for name, (_, m) in prepared.items()}


def measure_kernel(family: KernelFamily, params: dict, problem: Problem, ck: CompiledKernel,
                   timer: Timer, seed: int, gpu: GpuSpec) -> Measurement:
    prepared = {"": prepare_kernel(family, params, problem, ck, seed, gpu)}
    return measure_prepared(prepared, family.work(problem), timer)[""]


def measure_peer(backend: str, problem: Problem, timer: Timer, seed: int) -> Measurement:
    return measure_prepared({backend: prepare_peer(backend, problem, seed)}, problem, timer)[backend]


def measure_side_by_side(family: KernelFamily, params: dict, problem: Problem, ck: CompiledKernel,
                         backends: tuple[str, ...], timer: Timer, seed: int, gpu: GpuSpec) -> SideBySide:
    """The candidate and the SDPA peers on the same inputs, timed in turns (docs/benchmarks.md's method).
    A packed variant runs its length mixes, which no dense peer runs: it is timed alone."""
    if family.packed:
        return SideBySide(measure_kernel(family, params, problem, ck, timer, seed, gpu), {})
    prepared = {"": prepare_kernel(family, params, problem, ck, seed, gpu)}
    prepared |= {b: prepare_peer(b, problem, seed) for b in backends}
    out = measure_prepared(prepared, problem, timer)
    return SideBySide(out.pop(""), out)
