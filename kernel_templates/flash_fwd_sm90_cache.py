"""The Hopper kernels on a dense KV cache whose sequences each hold their own number of keys
(CACHE_LENS, kernel_templates/common.cuh): flash_fwd_sm90, its split and its packed-GQA forms with
the cache's lengths (B,) int32 as one more parameter. tuner/kvcache.py runs one where the lookup
serves the cache call's dense problem (the cache's capacity as Nk) with one of those families:
a speculative step of many packed GQA rows (flash_fwd_sm90_gqa, which flash_decode's m16 row blocks
trail), or a chunk of a prompt against the cache, which flash_decode does not take.

Never tuned or looked up by these names: a variant runs the config its family's entry serves, as a
grid launch (one work tile a CTA reads its sequence's length once; a persistent config runs in its
grid form).
"""

from __future__ import annotations

from tuner.family import KernelFamily
from tuner.gpu import GpuSpec
from tuner.problem import Problem

from .flash_fwd_sm90 import FlashFwdSm90
from .flash_fwd_sm90_gqa import PackedGqaFlashFwdSm90
from .flash_fwd_sm90_split import SplitFlashFwdSm90


class CacheLensVariant:
    """A Hopper family's kernel with CACHE_LENS: its parameters, then the cache's lengths. Mixed in
    before the family it varies."""

    dtypes: tuple[str, ...] = ("fp16", "bf16")

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        return {**super().defines(params, problem), "CACHE_LENS": 1}

    def param_kinds(self, params: dict) -> tuple[str, ...]:
        return super().param_kinds(params) + ("ptr",)   # cache_lens

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        if params["persistent"] or params["chain"]:
            return "a KV cache's lengths are read once per CTA: a grid launch (persistent 0, chain 0)"
        return super()._check(params, gpu, problem)

    def cache_form(self, params: dict, problem: Problem) -> dict:
        """`params` (its family's, or a served form's of it) as this variant runs them: the family's
        keys only, on the grid (FlashFwdSm90.schedule), unchained, O by ordinary stores (a TMA store
        pays only where a persistent warp has a next tile to start: the family's rule)."""
        own = {k: v for k, v in params.items() if k in self.space}
        return self.schedule(dict(own, chain=0, tma_store=0), False, problem)

    def cache_args(self, make_args, q, k, v, o, lse, scale, cache_seqlens) -> tuple | None:
        """The kernel's values: its family's for q and the (B, Hk, N, D) cache views (`make_args`,
        the plan's arg_maker), then the lengths; None where the views are not kernel-ready."""
        args = make_args(q, k, v, o, lse, scale)
        return None if args is None else args + (cache_seqlens.data_ptr(),)


class CacheFlashFwdSm90(CacheLensVariant, FlashFwdSm90):
    name = "flash_fwd_sm90_cache"
    cuts_tail = False


class CacheSplitFlashFwdSm90(CacheLensVariant, SplitFlashFwdSm90):
    name = "flash_fwd_sm90_split_cache"
    cuts_tail = False

    def cache_form(self, params: dict, problem: Problem) -> dict:
        # past d=128 the split's Bc 80 spilled 8-80 B under the lengths' masks (ptxas, sm_90a): Bc 64
        form = super().cache_form(params, problem)
        return dict(form, Bc=64) if problem.head_dim > 128 and form["Bc"] > 64 else form

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        if problem.head_dim > 128 and params["Bc"] > 64:
            return "past d=128 split keys under a cache's lengths take Bc <= 64 (Bc 80 spills)"
        return super()._check(params, gpu, problem)


class CachePackedGqaFlashFwdSm90(CacheLensVariant, PackedGqaFlashFwdSm90):
    name = "flash_fwd_sm90_gqa_cache"
    cuts_tail = False

    def cache_form(self, params: dict, problem: Problem) -> dict:
        # a persistent packed config splits no keys; its grid form's come from the occupancy
        form = super().cache_form(params, problem)
        return dict(form, splits=0) if params.get("persistent") else form


# the variant of each family whose configs a cache call may be served (tuner.kernel_templates.configs_family)
CACHE_VARIANTS: dict[str, KernelFamily] = {"flash_fwd_sm90": CacheFlashFwdSm90(),
                                           "flash_fwd_sm90_split": CacheSplitFlashFwdSm90(),
                                           "flash_fwd_sm90_gqa": CachePackedGqaFlashFwdSm90()}
