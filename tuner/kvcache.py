"""Decode against a KV cache: a few new queries per sequence against the keys cached so far, each
sequence with its own length, the cache dense or paged (a block table of fixed-size pages, as
vLLM and FlashAttention lay it out).

Served by flash_decode (kernel_templates/flash_decode.py): the config the lookup holds for the
call's bucket (the dense problem of the same shape: a paged cache reads the same bytes), else the
family's default, which needs no tuning to be right. A call that attention would serve, on the
dense problem of the cache's capacity, with a Hopper kernel (a speculative step of many packed GQA
rows, a chunk of a prompt) runs that kernel's config on the held keys instead (`_held_keys_plan`:
flash_fwd_sm90's variants that read each sequence's length, and on a paged cache its pages).
Where neither can serve (more than MAX_QUERIES queries on a paged cache of pages that are not whole
8-row atoms, or before Hopper; fp32; a head dim flash_decode lacks) attention's dispatcher answers
(`through_attention`): the tuned prefill kernels on the held keys, one call where a dense cache's
sequences hold every key, else per sequence after one read of the lengths (a host sync, with one
warning).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .dispatch import default, dtype_name, out_layout, served_params
from .launch import Launch, Launcher, kernel_scale, launch_on
from .plan_cache import DispatcherPlans
from .problem import Problem, mask_of
from .records import one_line


@dataclass
class _Plan:
    launcher: Launcher | None
    family: object = None
    params: dict | None = None
    launch: Launch | None = None
    reason: str = ""
    make_args: object = None   # a Hopper kernel on the held keys (CACHE_LENS): its family's arg maker


_plans = DispatcherPlans()   # a call's layout -> _Plan, chosen from the dispatcher's lookup
_warned: set[str] = set()


def kvcache_attention(q, k_cache, v_cache, cache_seqlens=None, block_table=None, *, causal: bool | str = True,
                      scale: float | None = None, return_lse: bool = False):
    """Attention of q (B, H, Nq, D) against cached keys and values, O as q's layout (and the
    natural-log LSE (B, H, Nq) with `return_lse`). Inference only: no gradient flows.

    - Dense cache: k_cache, v_cache (B, Hk, N, D) views (any strides, the last dim contiguous; a
      (B, N, Hk, D) cache as `.transpose(1, 2)`), Hk dividing H.
    - Paged cache: with `block_table` (B, pages) int32, k_cache and v_cache are (num_pages, Hk,
      page_size, D) views (a vLLM/FlashAttention (num_pages, page_size, Hk, D) cache as
      `.transpose(1, 2)`); sequence b's key j is row j % page_size of page block_table[b, j // page_size].
    - `cache_seqlens` (B,) int32: the keys each sequence holds, the new queries' included (at most
      the cache's capacity); None: all of them.
    - `causal` (default True) is the bottom-right diagonal against each sequence's own length: the
      Nq queries are its last Nq positions. False: every held key is visible. Rows that see no key
      (a length of 0) are O = 0, LSE = -inf.

    Under torch.compile it is the operator flashtune::kvcache_attention (traced by its fake, no
    graph break); CUDA graphs capture it. No gradient flows: it is for inference.
    """
    mask = "causal_br" if causal is True else mask_of(causal)
    if torch.compiler.is_compiling():   # the registered operator, which the compiler traces by its fake
        from . import op  # noqa: F401  (registers flashtune::kvcache_attention)

        o, lse = torch.ops.flashtune.kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, mask, scale)
    else:
        o, lse = kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, mask, scale)
    return (o, lse) if return_lse else o


def kvcache_forward(q, k_cache, v_cache, cache_seqlens=None, block_table=None, mask: str = "causal_br",
                    scale: float | None = None):
    """O and the LSE of kvcache_attention for a problem mask (flashtune::kvcache_attention's kernel:
    its defaults are the schema's, which a compiled graph leaves out)."""
    nk, _ = check_cache_inputs(q, k_cache, v_cache, cache_seqlens, block_table)
    q, scale = kernel_scale(q, scale)
    b, h, nq, d = q.shape
    problem = Problem(b, h, nq, nk, d, dtype_name(q), mask, k_cache.shape[1])
    paged = block_table is not None
    lens = cache_seqlens is not None
    key = (q.shape, k_cache.shape, q.dtype, q.device, mask, paged, block_table.shape if paged else None, lens)
    plan = _plans.plan(key, lambda: _plan(problem, k_cache.shape[2] if paged else 0, q.device.index or 0, lens))
    if plan.launcher is None:
        return through_attention(q, k_cache, v_cache, cache_seqlens, block_table, nk, mask, scale, plan.reason)
    size, stride = out_layout(q)
    o = torch.empty_strided(size, stride, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    args = _args(plan, q, k_cache, v_cache, o, lse, scale, nk, cache_seqlens, block_table)
    if args is None:   # misaligned rows or a strided last dim: copies the kernel can read
        args = _args(plan, q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), o, lse, scale, nk,
                     cache_seqlens, block_table)
    launch_on(plan.launcher, q.device.index or 0, *args)
    return o, lse


def _args(plan: _Plan, q, k, v, o, lse, scale, nk: int, cache_seqlens, block_table) -> tuple | None:
    """The plan's kernel values for these views: a held-keys variant's (its plan's arg maker, then
    the lengths), else flash_decode's; None where the views are not kernel-ready."""
    if plan.make_args is not None:
        return plan.family.cache_args(plan.make_args, q, k, v, o, lse, scale, cache_seqlens, block_table)
    return plan.family.cache_args(plan.params, plan.launch, q, k, v, o, lse, scale, nk, cache_seqlens, block_table)


def check_cache_inputs(q, k, v, cache_seqlens, block_table, *, cuda: bool = True) -> tuple[int, int]:
    """Validate the inputs (each mistake a one-line ValueError; `cuda=False` leaves the device
    alone); (keys a sequence can hold, page size or 0)."""
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if cuda and t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; kvcache_attention runs on CUDA tensors")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k_cache, v_cache are on different devices: {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k_cache, v_cache must share one of float16, bfloat16, float32: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    b, h, nq, d = q.shape
    if k.shape[3] != d or k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"k_cache {tuple(k.shape)} does not fit q {tuple(q.shape)}: the head dim must match and "
                         "the cache's heads divide q's")
    if b == 0 or h == 0 or nq == 0:
        raise ValueError(f"empty q: {tuple(q.shape)}")
    for name, t, dims in (("cache_seqlens", cache_seqlens, 1), ("block_table", block_table, 2)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dims or t.device != q.device:
            raise ValueError(f"{name} must be a {dims}-D int32 tensor on {q.device}")
        if t.shape[0] != b:
            raise ValueError(f"{name} has {t.shape[0]} rows for a batch of {b}")
    if cache_seqlens is not None and not cache_seqlens.is_contiguous():
        raise ValueError("cache_seqlens must be contiguous")
    if block_table is None:
        if k.shape[0] != b:
            raise ValueError(f"k_cache's batch {k.shape[0]} is not q's {b} (a paged cache needs block_table)")
        return k.shape[2], 0
    if block_table.stride(1) != 1:
        raise ValueError("block_table's rows must be contiguous")
    return block_table.shape[1] * k.shape[2], k.shape[2]


def _plan(problem: Problem, page_size: int, device_index: int, lens: bool = True) -> _Plan:
    """The launch for a cache call: dense (`page_size` 0), or pages, as tensor-map boxes where
    their size fits a stage's rows (PAGED_BOXES.page_fits), else row by row. A call that the lookup
    serves with a Hopper prefill or packed kernel runs that (_held_keys_plan)."""
    from .kernel_templates.flash_decode import FAMILY, PAGED, PAGED_BOXES

    dispatcher = default()
    gpu = dispatcher._gpu(device_index)
    if (held := _held_keys_plan(dispatcher, problem, gpu, device_index, lens, page_size)) is not None:
        return held
    if why := FAMILY.supports(gpu, problem):
        return _Plan(None, reason=why)
    tuned = [e for _, e in dispatcher.candidates(problem, gpu) if e["family"] == FAMILY.name]
    params = served_params(tuned[0], problem) if tuned else FAMILY.default(gpu, problem)
    boxes = PAGED_BOXES.kv_tma(params, problem.head_dim) and PAGED_BOXES.page_fits(params, page_size)
    fam = FAMILY if not page_size else PAGED_BOXES if boxes else PAGED
    fam, params = fam.served_form(params, gpu, problem)   # a dense cache's splits merged in a cluster
    try:
        return _built(fam, params, problem, gpu, device_index)
    except Exception as exc:
        return _Plan(None, reason=f"{fam.name} {params} cannot be used ({one_line(exc)})")


def _built(fam, params: dict, problem: Problem, gpu, device_index: int, **extra) -> _Plan:
    """A plan launching `fam`'s `params` for `problem` (compiled, or from the cubin cache; loaded)."""
    from .compile import compile_kernel
    from .launch import LoadedKernel

    ck = compile_kernel(fam, params, problem, gpu.arch)
    launch = fam.launch(params, problem, gpu)
    launcher = LoadedKernel.load(ck, launch.smem_bytes, device_index).launcher(launch, fam.param_kinds(params))
    return _Plan(launcher, fam, params, launch, **extra)


def _held_keys_plan(dispatcher, problem: Problem, gpu, device_index: int, lens: bool,
                    page_size: int = 0) -> _Plan | None:
    """Where attention would serve the cache call's dense problem with a Hopper kernel
    (held_keys_config), that config's variant on the held keys (of `page_size`-row pages, where
    given); a dense cache with no lengths (every key held) goes to attention itself, one call on the
    cache (`through_attention`), a paged one to the variant (no lengths: every sequence holds its
    table row's keys). None elsewhere, and where the variant does not build (flash_decode's plan then
    answers, with one warning)."""
    config = held_keys_config(dispatcher, problem, gpu, page_size)
    if config is None:
        return None
    variant, params = config
    if not lens and not page_size:
        return _Plan(None, reason=f"attention serves {problem.key} with a Hopper kernel: one call on the cache")
    try:
        return _built(variant, params, problem, gpu, device_index, make_args=variant.cache_arg_maker(params, problem))
    except Exception as exc:
        _warn(f"{variant.name} {params} cannot be used ({one_line(exc)}); flash_decode's plan serves the cache")
        return None


def held_keys_config(dispatcher, problem: Problem, gpu, page_size: int = 0) -> tuple[object, dict] | None:
    """(variant, params) where attention would serve the cache call's dense problem (the cache's
    capacity as Nk) with flash_fwd_sm90, its split or its packed-GQA form: that config as the
    variant reading each sequence's length (and, `page_size` > 0, its pages) runs it
    (kernel_templates/flash_fwd_sm90_cache.py, on the grid). A speculative step of 48 GQA rows or
    more then runs packed, as attention's does
    (PERF_NOTES "g1-g3": 1.3-3.0x flash_decode on the H200), and a chunk of a prompt in one launch,
    where it went through attention a sequence at a time. None where flash_decode or a peer serves,
    or the variant does not take the config."""
    from .kernel_templates import configs_family
    from .kernel_templates.flash_fwd_sm90_cache import CACHE_VARIANTS

    entry = dispatcher.serving_entry(problem, gpu)
    variant = CACHE_VARIANTS.get(configs_family(entry["family"])) if entry is not None else None
    if variant is None:
        return None
    if page_size:
        variant = variant.paged(page_size)
    params = variant.cache_form(served_params(entry, problem), problem)
    return None if variant.check(params, gpu, problem) is not None else (variant, params)


def through_attention(q, k_cache, v_cache, cache_seqlens, block_table, nk: int, mask: str, scale, why: str):
    """O and the LSE of a cache call flash_decode cannot serve (`why`), from attention's dispatcher
    (the lookup's prefill kernels, else torch): a dense cache whose sequences hold every key is one
    call on it as it is (no sync: CUDA graphs capture it); otherwise each sequence's held keys (its
    pages gathered) in a call of its own, after one read of the lengths, with one warning."""
    dispatcher = default()
    if cache_seqlens is None and block_table is None:
        return dispatcher.forward(q, k_cache, v_cache, mask, scale, None, need_lse=True)
    _warn(f"{why}; each sequence's held keys through attention, one at a time (the lengths read on the host)")
    size, stride = out_layout(q)
    o = torch.empty_strided(size, stride, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    lengths = cache_seqlens.tolist() if cache_seqlens is not None else [nk] * q.shape[0]
    for i, n in enumerate(lengths):
        if min(n, nk) <= 0:   # nothing held: every row sees no key
            o[i], lse[i] = 0.0, float("-inf")
            continue
        k, v = (held_keys(t, block_table, i, min(n, nk))[None] for t in (k_cache, v_cache))
        oi, li = dispatcher.forward(q[i:i + 1], k, v, mask, scale, None, need_lse=True)
        o[i], lse[i] = oi[0], li[0]
    return o, lse


def _warn(message: str) -> None:
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(f"flashtune: {message}", stacklevel=5)


def gather_sequence(k_cache, cache_seqlens, block_table, index: int, nk: int):
    """Sequence `index`'s held keys (or values) as a (Hk, n, D) tensor: what the kernel reads."""
    n = nk if cache_seqlens is None else min(int(cache_seqlens[index]), nk)
    return held_keys(k_cache, block_table, index, n)


def held_keys(k_cache, block_table, index: int, n: int):
    """The first `n` keys (or values) of sequence `index` as a (Hk, n, D) tensor: a view of a dense
    cache, its pages gathered where `block_table` is given."""
    if block_table is None:
        return k_cache[index, :, :n]
    page = k_cache.shape[2]
    pages = block_table[index, : -(-n // page)].long()
    return k_cache[pages].permute(1, 0, 2, 3).reshape(k_cache.shape[1], -1, k_cache.shape[3])[:, :n]

