"""The Hopper kernels on a KV cache whose sequences each hold their own number of keys
(CACHE_LENS, kernel_templates/common.cuh): flash_fwd_sm90, its split and its packed-GQA forms with
the cache's lengths (B,) int32 as one more parameter; on a paged cache (CACHE_PAGES: `paged`) its
block table and row stride too, each K/V tile then a box per slot of a page. tuner/kvcache.py runs one where the lookup
serves the cache call's dense problem (the cache's capacity as Nk) with one of those families:
a speculative step of many packed GQA rows (flash_fwd_sm90_gqa, which flash_decode's m16 row blocks
trail), or a chunk of a prompt against the cache, which flash_decode does not take.

Never tuned or looked up by these names: a variant runs the config its family's entry serves, as a
grid launch (one work tile a CTA reads its sequence's length once; a persistent config runs in its
grid form).
"""

from __future__ import annotations

import functools
import math

from tuner.family import KernelFamily
from tuner.gpu import GpuSpec
from tuner.problem import DTYPE_BYTES, Problem

from .flash_fwd_sm90 import FlashFwdSm90, consumer_regs, k_tail, p_in_smem, prod_cols, tile_dim
from .flash_fwd_sm90_gqa import PackedGqaFlashFwdSm90
from .flash_fwd_sm90_split import SplitFlashFwdSm90
from .sm90_tma import tile_panel


GATHER_MAX_BC = 128   # GATHER_KV's widest K/V tile: a lane reads one row's place (Bc 176 spilled 16-32 B with two)


class CacheLensVariant:
    """A Hopper family's kernel with CACHE_LENS: its parameters, then the cache's lengths. Mixed in
    before the family it varies."""

    dtypes: tuple[str, ...] = ("fp16", "bf16")
    pages: int = 0   # a paged cache's rows a page (CACHE_PAGES); 0: dense
    gather: bool = True   # K/V tiles of several slots by cp.async where gathers() allows (False: boxes)
    gather_min_boxes: int = 16   # the fewest boxes (tile_boxes) a K tile takes where it gathers
    gather_min_split: int = 40   # the fewest producer registers (split) a form gathers in

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        own = {"CACHE_LENS": 1}
        if self.pages:
            own["CACHE_PAGES"] = self.pages
            if self.gathers(params, problem):
                own["GATHER_KV"] = 1
        return {**super().defines(params, problem), **own}

    def gathers(self, params: dict, problem: Problem) -> bool:
        """Whether the producer's warpgroup copies each K/V tile by cp.async (GATHER_KV) rather than
        a TMA box per slot and panel: where a tile is several slots of a page, takes 16 boxes or more
        (tile_boxes) and the producer has the registers its copies take (gather_split: 40, which
        producer_regs raises it to; 24 in the packed family at d=64); a K tail panel (d=72-80)
        where it is a row's last 128-byte segment (gather_tile). The copies against the boxes at
        the same Bc (H200, x18): where a tile took 8 boxes, 0.94-1.00x at d=64 on pages of 16 (5
        calls) and 0.93-0.96x at d=128 on pages of 32 (3 of 4); at 16 or more, 1.06-1.16x at d=128
        on pages of 16 (7), 1.14-1.43x at d=64 on pages of 8 (5), 1.27-1.36x at d=96 (24 boxes)
        and 1.15x at d=80 (16, with the tail) on pages of 16."""
        bc, tail = params["Bc"], k_tail(params, problem)
        return (self.gather and bool(self.pages) and self.slot_rows(bc) < bc <= GATHER_MAX_BC
                and params["split"] >= self.gather_split(problem)
                and (not tail or (prod_cols(params, problem) - tail) * DTYPE_BYTES[problem.dtype] % 128 == 0)
                and self.tile_boxes(bc, problem) >= self.gather_min_boxes)

    def gather_split(self, problem: Problem) -> int:
        """The fewest producer registers (split) the copies take without spilling: 40 (gather_min_split)."""
        return self.gather_min_split

    def tile_boxes(self, bc: int, problem: Problem) -> int:
        """The TMA boxes a K tile of `bc` keys takes on this variant's pages: one per slot and panel
        (at d=72-80 the 128-byte panel and K's tail panel)."""
        cols = tile_dim(problem)
        return bc // self.slot_rows(bc) * (cols // tile_panel(cols, DTYPE_BYTES[problem.dtype]))

    def param_kinds(self, params: dict) -> tuple[str, ...]:
        # cache_lens; paged: the block table and its row stride
        return super().param_kinds(params) + (("ptr", "ptr", "i32") if self.pages else ("ptr",))

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        if params["persistent"] or params["chain"]:
            return "a KV cache's lengths are read once per CTA: a grid launch (persistent 0, chain 0)"
        if self.pages % 8:
            return f"pages of {self.pages} rows: the K/V tiles come a box per page, in whole 8-row swizzle atoms"
        return super()._check(params, gpu, problem)

    def paged(self, page_rows: int) -> CacheLensVariant:
        """This variant on a paged cache of `page_rows` rows a page."""
        return _paged(type(self), page_rows)

    def cache_arg_maker(self, params: dict, problem: Problem):
        """The plan's arg maker: its family's, on a paged cache with K/V boxes of a slot of a page
        (the rows the page and the tile share) and the capacity (`problem`'s Nk) as the kernel's nk."""
        make = self.arg_maker(params)
        return make.paged(self.slot_rows(params["Bc"]), problem.seqlen_k) if self.pages else make

    def slot_rows(self, bc: int) -> int:
        """The rows of a slot, a K/V tile of `bc` keys on this variant's pages: those the page and
        the tile share (PAGE_BOX in the kernel), each slot one TMA box per panel."""
        return math.gcd(bc, self.pages)

    def cache_form(self, params: dict, problem: Problem) -> dict:
        """`params` (its family's, or a served form's of it) as this variant runs them: the family's
        keys only, on the grid (FlashFwdSm90.schedule), unchained, O by ordinary stores (a TMA store
        pays only where a persistent warp has a next tile to start: the family's rule); on pages,
        the tile page_tile gives, and where a tile is several slots the producer's registers
        producer_regs gives; and where the tile is wider than GATHER_KV takes, the form at Bc <= 128
        if that one gathers: at d=128 Bc 128 by the copies ran 1.03-1.08x the speed of Bc 176 by boxes
        on pages of 16 (6 calls), 1.47-1.75x on pages of 8 (7); at d=64 on pages of 8 1.24-1.33x (4),
        and on pages of 16, where Bc 128 would not gather, it ran 0.91-0.95x (H200, x18)."""
        form = self.producer_regs(self.own_form(params, problem), problem)
        if self.gather and form["Bc"] > GATHER_MAX_BC and self.slot_rows(form["Bc"]) < form["Bc"]:
            narrow = self.producer_regs(self.own_form(dict(params, Bc=GATHER_MAX_BC), problem), problem)
            if self.gathers(narrow, problem):
                return narrow
        return form

    def own_form(self, params: dict, problem: Problem) -> dict:
        """cache_form before producer_regs: what each variant changes of its family's config."""
        own = {k: v for k, v in params.items() if k in self.space}
        return self.schedule(dict(own, chain=0, tma_store=0, Bc=self.page_tile(own["Bc"])), False, problem)

    def producer_regs(self, form: dict, problem: Problem) -> dict:
        """`form`, its producer warpgroup keeping 40 registers rather than 24 (split) where a K/V tile
        is several slots of a page, up to d=128 where the consumers' estimate fits their 232: the
        producer's warp then issues a box per slot and panel, and Bc 176 on pages of 16 (eleven slots)
        ran 209.6 us against 223.2 with 24, on pages of 8 343.5 against 354.4; Bc 64 steps alike
        (H200, x16). At d=256 (causal) the consumers spilled 104 B in 232; three consumers with P through
        shared memory (d=72-96) 80 B in 152, where the estimate read 144."""
        raised = dict(form, split=40)
        if (self.pages and self.slot_rows(form["Bc"]) < form["Bc"] and form["split"] == 24 and problem.head_dim <= 128
                and not p_in_smem(raised, problem)
                and self.register_estimate(raised, problem) <= consumer_regs(raised["cwg"], 40)):
            return raised
        return form

    def page_tile(self, bc: int) -> int:
        """A K/V tile's keys on this variant's pages: `bc`, or the largest smaller Bc of the family
        whose tile shares more rows with a page. A tile comes as a box per slot of gcd(Bc, page)
        rows: Bc 176 on pages of 256 took eleven 16-row boxes a panel and ran 1.28x the dense cache
        (H200, x15), where Bc 128 takes one (1.02x, x16). Pages every Bc shares alike (16 rows) keep `bc`."""
        if not self.pages:
            return bc
        return max((b for b in self.space["Bc"] if b <= bc), key=lambda b: (self.slot_rows(b), b))

    def cache_args(self, make_args, q, k, v, o, lse, scale, cache_seqlens, block_table=None) -> tuple | None:
        """The kernel's values: its family's for q and the cache views (`make_args`, the plan's
        cache_arg_maker; (B, Hk, N, D), or paged (num_pages, Hk, page, D)), then the lengths and
        (paged) the block table; None where the views are not kernel-ready (on pages, a stride of
        2^31 elements or more: GATHER_KV's copies step by 32-bit strides; a copy's are far under)."""
        if self.pages and max(k.stride() + v.stride()) >= 2**31:
            return None
        args = make_args(q, k, v, o, lse, scale)
        if args is None:
            return None
        if self.pages:   # (no lengths: a null pointer, every sequence its table row's keys)
            lens = 0 if cache_seqlens is None else cache_seqlens.data_ptr()
            return args + (lens, block_table.data_ptr(), block_table.stride(0))
        return args + (cache_seqlens.data_ptr(),)


class CacheFlashFwdSm90(CacheLensVariant, FlashFwdSm90):
    name = "flash_fwd_sm90_cache"
    cuts_tail = False


class CacheSplitFlashFwdSm90(CacheLensVariant, SplitFlashFwdSm90):
    name = "flash_fwd_sm90_split_cache"
    cuts_tail = False

    def own_form(self, params: dict, problem: Problem) -> dict:
        # past d=128 the split's Bc 80 spilled 8-80 B under the lengths' masks (ptxas, sm_90a): Bc 64
        form = super().own_form(params, problem)
        return dict(form, Bc=64) if problem.head_dim > 128 and form["Bc"] > 64 else form

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        if problem.head_dim > 128 and params["Bc"] > 64:
            return "past d=128 split keys under a cache's lengths take Bc <= 64 (Bc 80 spills)"
        return super()._check(params, gpu, problem)


class CachePackedGqaFlashFwdSm90(CacheLensVariant, PackedGqaFlashFwdSm90):
    name = "flash_fwd_sm90_gqa_cache"
    cuts_tail = False

    def gather_split(self, problem: Problem) -> int:
        # rows of one whole 128-byte segment (d=64, 16-bit): the packed producer's copies fit its 24
        # registers, so three consumers (split 24) gather; 8 B spilled at d=56 (groups of 5), 20-36 B in
        # flash_fwd_sm90's producer at d=32-64 (ptxas, sm_90a). On pages of 8 they ran 1.06-1.08x two
        # consumers' copies at 40 (H200, PERF_NOTES "x19").
        return 24 if problem.head_dim * DTYPE_BYTES[problem.dtype] == 128 else super().gather_split(problem)

    def own_form(self, params: dict, problem: Problem) -> dict:
        # a persistent packed config splits no keys; its grid form's come from the occupancy
        form = super().own_form(params, problem)
        return dict(form, splits=0) if params.get("persistent") else form


@functools.cache
def _paged(cls: type, page_rows: int) -> CacheLensVariant:
    variant = cls()
    variant.pages, variant.name = page_rows, f"{cls.name}_paged{page_rows}"
    return variant


# the variant of each family whose configs a cache call may be served (tuner.kernel_templates.configs_family)
CACHE_VARIANTS: dict[str, KernelFamily] = {"flash_fwd_sm90": CacheFlashFwdSm90(),
                                           "flash_fwd_sm90_split": CacheSplitFlashFwdSm90(),
                                           "flash_fwd_sm90_gqa": CachePackedGqaFlashFwdSm90()}
