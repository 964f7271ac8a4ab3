"""flash_decode: a few queries against many keys (decode), split across CTAs by keys.

Parameters: BC keys per warp per stage, the warps of a CTA (each takes its own keys of a stage),
the depth of the K/V ring (cp.async, or on sm_90 the copy engine's boxes: `kv_tma`), `MT` m16 tiles of packed query rows per CTA (the query rows of the
heads that share a K/V head, all queries of a sequence: group x Nq rows), and `splits`, how many
CTAs share one sequence's keys (0: as many as fill the GPU once, `auto_splits`). Serves problems
of at most MAX_QUERIES queries; prefill belongs to the other families.
"""

from __future__ import annotations

from tuner.family import ELEM_CODE, KernelFamily, Launch, VarlenVariant, ceil_div, padded_head_dim
from tuner.gpu import GpuSpec
from tuner.kernel_templates.decode_workspace import workspace
from tuner.kernel_templates.sm90_tma import MapSlot, map_fields, maps_at, tile_panel, tile_width
from tuner.kernel_templates.sm90_tma import tail_cols as sm90_tail_cols
from tuner.launch import ATTENTION_PARAMS, AttentionArgs, attention_args, clusters_at_once, layout_args
from tuner.problem import DECODE_QUERIES, Problem

MAX_QUERIES = DECODE_QUERIES   # queries per sequence: decode, speculative decode (~16), short chunks
MAX_SPLITS = 128
MAX_CTAS_PER_SM = 32   # sm_80 and sm_90: 32 resident blocks, 64 warps
LONG_STREAM = 32   # stages a CTA reads from which the default takes 8 warps (FlashDecode.seeds)
WIDE_LONG_STREAM = 64   # the same at d = 72-80 in one wave, from which it takes 2 stages rather than 3
# Split counts a cluster merges through shared memory: powers of two, which pack a GPC's SMs, up to
# a portable cluster's 8 CTAs.
CLUSTER_SIZES = (2, 4, 8)
_MAX_REGS = 255
# K/V bytes the GPU keeps on their way where K/V come by tensor-map boxes (sm_90+): about the memory's
# rate times its latency (3.35 TB/s x ~1.5 us on an H100, 4.8 x ~1.2 on an H200). Past it a split more
# only adds partials to merge; short of it the memory idles. Fitted to 94 served sweeps of the split
# count on both GPUs, 1k-24k keys, d=64-256 (PERF_NOTES "s5"): 5-6 MB the same on both.
GPU_IN_FLIGHT = 6 << 20
# Stages of keys a split streams at least: a shorter stream is mostly its ramp and its merge (the
# 1k-2k key rows of "s5", where the fewest splits that fill the memory were still too many).
MIN_SPLIT_STAGES = 3


def tile(head_dim: int) -> int:
    """The K/V (and Q) tile's width: the head dim rounded up to 32 columns, 128 at d = 72-80, in
    panels of 128 bytes there (tile_width, as flash_fwd_sm90's): the copy engine's boxes of 64-byte
    rows (the 96-column tile's panels) kept single-query MHA steps at d=80 to 3.0-3.2 TB/s against
    cuDNN's 3.3-3.8 on the H200 (PERF_NOTES "z1"); on this tile the best configs read 1.05-1.09x
    theirs ("z2"). Q's columns past the head dim are zeros; K's and V's ring holds ring_cols of them."""
    return tile_width(head_dim, 2)


def panel(head_dim: int) -> int:
    """Columns of a K/V box row and of the ring's swizzled panels (KV_TMA): one panel of the tile."""
    return tile_panel(tile(head_dim), 2)


def tail_cols(head_dim: int) -> int:
    """Columns of the ring's tail panel (0: none): sm90_tma.tail_cols of 16-bit K/V (d = 72-80,
    136-144: 16)."""
    return sm90_tail_cols(head_dim, 2)


def ring_cols(head_dim: int) -> int:
    """K's and V's columns in the ring and in the products: the tile's, or with a tail panel the
    head dim rounded up to 16 (d = 72-80: 80 of the tile's 128)."""
    return padded_head_dim(head_dim, 16) if tail_cols(head_dim) else tile(head_dim)


def stage_elems(params: dict, head_dim: int) -> int:
    """One tensor's elements of a ring slot: stage_keys rows of ring_cols, in whole KB with a tail
    (each slot's 128-byte panels start on the copy engine's 1 KB swizzle period)."""
    n = stage_keys(params) * ring_cols(head_dim)
    return ceil_div(n, 512) * 512 if tail_cols(head_dim) else n


def stage_keys(params: dict) -> int:
    """Keys a CTA reads per stage: BC for each warp."""
    return params["Bc"] * params["warps"]


def in_flight_bytes(params: dict, problem: Problem) -> int:
    """K/V bytes a CTA has on their way while it works on one stage: the ring's other STAGES - 1
    (the tile's bytes, as the split counts timed in "z2" had: at d = 72-80 128 columns a row, though
    the ring holds 80 since "y2", whose one-wave long streams then split less than they need: item 6)."""
    return (params["stages"] - 1) * stage_keys(params) * tile(problem.head_dim) * 2 * 2


def row_blocks(params: dict, problem: Problem) -> int:
    """CTAs per (sequence, K/V head) along the packed query rows."""
    group = problem.heads // problem.kv_heads
    return ceil_div(group * problem.seqlen_q, 16 * params["MT"])


def ctas_per_split(params: dict, problem: Problem) -> int:
    """CTAs that share one split of the keys: a CTA per sequence, K/V head and row block."""
    return problem.batch * problem.kv_heads * row_blocks(params, problem)


def auto_splits(params: dict, problem: Problem, gpu: GpuSpec, smem: int, slots: int | None = None) -> int:
    """The fewest splits whose last wave of CTAs is nearly as full as the best count's: a partly
    filled last wave leaves SMs idle on a memory-bound kernel (B8 x 8 K/V heads on 132 SMs: 3
    splits are 1.45 waves, 2 splits 0.97), and each split beyond that adds partials to merge.
    A wave is `slots` CTAs: every CTA slot of the GPU by default, one per SM where the family
    says (FlashDecode.splits). Each split keeps at least one stage of keys."""
    ctas = ctas_per_split(params, problem)
    slots = slots or cta_slots(params, problem, gpu, smem)
    most = max(1, min(MAX_SPLITS, ceil_div(problem.seqlen_k, stage_keys(params)), ceil_div(4 * slots, ctas)))

    def fill(s: int) -> float:   # busy share of the SM slots over the waves of ctas x s CTAs
        return ctas * s / (ceil_div(ctas * s, slots) * slots)

    best = max(fill(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if fill(s) >= 0.85 * best)


def in_flight_splits(params: dict, problem: Problem, gpu: GpuSpec, smem: int) -> int:
    """The fewest splits, a power of two (a cluster's count, merged in shared memory, where it packs),
    whose first wave of CTAs keeps GPU_IN_FLIGHT bytes of K/V on their way, each CTA what its ring
    holds or its whole share of the keys if less; at most as many as leave each split
    MIN_SPLIT_STAGES stages of keys."""
    ctas, keys = ctas_per_split(params, problem), stage_keys(params)
    slots = cta_slots(params, problem, gpu, smem)
    stages = ceil_div(problem.seqlen_k, keys)
    stage_bytes = keys * tile(problem.head_dim) * 2 * 2
    most = max(1, min(MAX_SPLITS, stages // MIN_SPLIT_STAGES))

    def in_flight(s: int) -> int:
        return min(ctas * s, slots) * min(in_flight_bytes(params, problem), ceil_div(stages, s) * stage_bytes)

    s = 1
    while 2 * s <= most and in_flight(s) < GPU_IN_FLIGHT:
        s *= 2
    return s


def cta_slots(params: dict, problem: Problem, gpu: GpuSpec, smem: int) -> int:
    """CTAs of this config the GPU holds at once: SMs x the CTAs an SM fits (shared memory,
    threads, registers, the CTA limit)."""
    per_sm = max(1, min(gpu.smem_per_sm // (smem + 1024) if gpu.smem_per_sm else 1, 64 // params["warps"],
                        MAX_CTAS_PER_SM, gpu.regs_per_sm // (32 * params["warps"] * FlashDecode.register_estimate(params, problem))))
    return gpu.sm_count * per_sm


def ragged_splits(params: dict, problem: Problem, gpu: GpuSpec, smem: int, total_k: int) -> int:
    """Splits for packed sequences of `total_k` keys in all, the longest problem.seqlen_k: enough
    that the longest sequence's share of keys per CTA is no more than an even spread of all keys
    over the GPU's CTA slots (a wave-fill count for the padded batch would give the longest
    sequence one CTA while short ones finish at once). Each split keeps at least one stage."""
    work = max(1, total_k) * problem.kv_heads * row_blocks(params, problem)   # key rows to read, over all CTAs
    per_slot = work / cta_slots(params, problem, gpu, smem)
    want = ceil_div(problem.seqlen_k, max(stage_keys(params), int(per_slot * 1.1)))
    return max(1, min(MAX_SPLITS, ceil_div(problem.seqlen_k, stage_keys(params)), want))


def _first_of(seeds: list[dict], **values) -> list[dict]:
    """`seeds` with the one that has these values moved to the front (the default)."""
    i = next(i for i, p in enumerate(seeds) if all(p[k] == v for k, v in values.items()))
    return [seeds[i]] + seeds[:i] + seeds[i + 1:]


def maps_for(q) -> bool:
    """Whether a launch on q's GPU passes K/V tensor maps (a KV_TMA kernel reads them from sm_90 on)."""
    from tuner.gpu import _from_torch

    return _gpu(q.device.index or 0, _from_torch).major >= 9


class FlashDecode(KernelFamily):
    name = "flash_decode"
    kernel_name = "flash_decode"
    source_file = "flash_decode.cu"
    min_cc = (8, 0)
    max_queries = MAX_QUERIES
    paged = False   # K/V rows through a page table (PagedFlashDecode)
    dtypes = ("fp16", "bf16")
    head_dims = (32, 64, 96, 128, 256)   # tuned and shipped; it pads to any other multiple of 8
    pads_head_dim = True
    space = {
        "Bc": (16, 32, 64),
        "warps": (1, 2, 4, 8),
        "stages": (2, 3, 4),
        "MT": (1, 2),
        "splits": (0, 1, 2, 4, 8, 16, 32, 64),
    }
    launch_params = ("splits",)
    # Whether the splits merge in a cluster's shared memory (flash_decode_cluster) rather than
    # through the workspace; and whether a call may be served so (served_form: the dense family only).
    merges_in_cluster = False
    cluster_form = True

    @staticmethod
    def register_estimate(params: dict, problem: Problem) -> int:
        """Fitted to ptxas's reports for sm_90a (d=64/128/256, every point): O's and S's accumulators
        per m16 tile, and K's fragments that ptxas loads ahead across the k-steps of S = Q K^T
        (d x Bc / 64 of them, capped where it stops doing so)."""
        d, bc = tile(problem.head_dim), params["Bc"]
        return 40 + params["MT"] * (d // 2 + bc) + min(d * bc // 64, 80)

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        regs = self.register_estimate(params, problem)
        if regs > _MAX_REGS:
            return f"needs about {regs} registers per thread (limit {_MAX_REGS}): it would spill"
        rows = (problem.heads // problem.kv_heads) * problem.seqlen_q
        if params["MT"] > 1 and rows <= 16 * (params["MT"] - 1):
            return f"MT={params['MT']} tiles of 16 rows for {rows} packed query rows: a tile would be empty"
        tiles = ceil_div(problem.seqlen_k, stage_keys(params))
        if params["splits"] > tiles:
            return f"splits={params['splits']} exceeds the {tiles} stages of {stage_keys(params)} keys in Nk={problem.seqlen_k}"
        return None

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        # FlashDecoding's shape of work: 4 warps each on its own 16-32 keys, a ring that keeps
        # 32-64 KB of K/V in flight per CTA, splits picked from the occupancy. The first that fits
        # is the default, which serves the decode buckets nothing tuned: 32 keys a warp in 2 stages
        # won 5 of decode_bench.py's 12 H100 shapes (d=128) and 3 stages 4 more, where 16 keys in 3
        # stages, the default before, won none and read 0.88-0.99x of the best (PERF_NOTES "d7")
        mt = 1 if (problem.heads // problem.kv_heads) * problem.seqlen_q <= 16 else 2
        cands = [(32, 4, 2, mt), (32, 4, 3, mt), (16, 4, 3, mt), (16, 8, 2, mt), (16, 4, 4, mt), (64, 2, 2, 1), (16, 4, 2, 1)]
        seeds = [dict(Bc=a, warps=b, stages=c, MT=d, splits=0) for a, b, c, d in cands]
        # With K/V by tensor-map boxes (sm_90+) the warps only compute, and the default moves with
        # that (PERF_NOTES "t1", 30 H100 rows at d=80-192 searched in turns with the peers):
        # - tiles of 160-192 columns: 16 keys a warp in 3 stages, the winner's family on all 10
        #   rows there (32 keys a warp is not by boxes at 192; the old first read 0.91-0.95x);
        # - where each CTA streams LONG_STREAM stages or more (a batch that fills the GPU with one
        #   or two splits of 8k keys): 8 warps of 16 keys, where 4 warps a CTA fell behind the copy
        #   engine; it won all 6 rows of 64 stages and 1 of 2 of 32, the old first read 0.70-0.81x;
        # - d = 72-80 (a 128-column tile, whose K/V ring holds 80 columns: ring_cols): 4 warps of
        #   16 keys where that grid runs in one wave, in 2 stages where each CTA streams
        #   WIDE_LONG_STREAM stages of the first seed or more (8k keys) and 3 below; past one wave
        #   4 warps of 32 keys in 3 stages. Of the seven seeds on 19 H200 steps (Phi-2's MHA B1-B128
        #   x 1k-32k, GQA, 4 queries, d=72; PERF_NOTES "y2") it read 0.997 of the best seed on
        #   average (0.985 at worst), the first seed 0.978 (0.931), and z2's rule for the
        #   128-column ring (8 warps past 96 stages beyond one wave) 0.936 (0.761): with the ring
        #   3/8 smaller, three stages fit where two did. Three stages in one wave read 0.93-0.94x
        #   z2's two on B3 x 20k and B8 x 32k (held out), where two were the better seed before.
        first = next((p for p in seeds if self.check(p, gpu, problem) is None), None)
        if gpu.major >= 9 and first is not None:
            width = tile(problem.head_dim)
            if width > padded_head_dim(problem.head_dim):
                narrow = _first_of(seeds, Bc=16, warps=4, stages=3)
                if not FAMILY.fits_one_wave(narrow[0], problem, gpu):
                    return _first_of(seeds, Bc=32, warps=4, stages=3)
                if mt == 1 and self.stages_per_cta(first, problem, gpu) >= WIDE_LONG_STREAM:
                    return _first_of(seeds, Bc=16, warps=4, stages=2)   # its MT is 1: not past 16 packed rows
                return narrow
            if 128 < width <= 192:
                return _first_of(seeds, Bc=16, warps=4, stages=3)
            if width <= 128 and self.stages_per_cta(first, problem, gpu) >= LONG_STREAM:
                return _first_of(seeds, Bc=16, warps=8, stages=2)
        return seeds

    def stages_per_cta(self, params: dict, problem: Problem, gpu: GpuSpec) -> int:
        """Stages of keys one CTA reads (the longest split's), at the occupancy's split count where
        the config leaves it open."""
        return ceil_div(ceil_div(problem.seqlen_k, stage_keys(params)), self.splits(params, problem, gpu))

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        # `splits` is not here: it is the grid's z, so points that differ in it share one cubin
        return {
            "BC": params["Bc"],
            "WARPS": params["warps"],
            "STAGES": params["stages"],
            "MT": params["MT"],
            "HEAD_DIM": tile(problem.head_dim),
            "D_VALID": problem.head_dim,
            "PANEL_COLS": panel(problem.head_dim),   # KV_TMA's boxes (the maps' box columns)
            **({"RING_COLS": ring_cols(problem.head_dim), "TAIL_COLS": tail}
               if (tail := self.ring_tail(params, problem.head_dim)) else {}),
            "IN_DTYPE": ELEM_CODE[problem.dtype],
            "PAGED": int(self.paged),
            "KV_TMA": int(self.kv_tma(params, problem.head_dim)),
            **self.mask_defines(problem),
        }

    def kv_tma(self, params: dict, head_dim: int) -> bool:
        """Whether the kernel brings K/V stages in as tensor-map boxes where the GPU has a copy
        engine (sm_90+): rows of panels (`panel`: 64 columns, or 32 where the tile is not
        whole 64s), at most 256 rows (one box) a stage. Not past 192 columns: at d=256 O alone is
        128 registers a thread, and with the boxes' zeroing of the rows past a sequence ptxas spills
        (sm_90a, flash_decode_varlen, no mask); at 192, only 16 keys a warp (at 32, the page boxes
        spill 16 B at 255 registers: sm_90a, bottom-right causal)."""
        width = tile(head_dim)
        return (width <= 160 or (width == 192 and params["Bc"] <= 16)) and stage_keys(params) <= 256

    def ring_tail(self, params: dict, head_dim: int) -> int:
        """The tail panel's columns of this config's ring (tail_cols) where K/V come by boxes
        (`kv_tma`), else 0: cp.async rows keep the tile's width."""
        return tail_cols(head_dim) if self.kv_tma(params, head_dim) else 0

    def smem_bytes(self, params: dict, problem: Problem) -> int:
        d, rows = tile(problem.head_dim), 16 * params["MT"]
        slot = stage_elems(params, problem.head_dim) if self.ring_tail(params, problem.head_dim) else stage_keys(params) * d
        ring = 2 * 2 * params["stages"] * slot                             # K and V, 2-byte elements
        merge = 4 * params["warps"] * rows * (d + 2)                       # the warps' O, m and l in fp32
        if self.merges_in_cluster:
            merge += 4 * rows * d                                          # the split's O / l, which rank 0 reads
        return 2 * rows * d + max(ring, merge) + 1024   # + the ring's alignment to 1 KB (the copy engine's swizzle)

    def adapt(self, params: dict, tuned: Problem, problem: Problem) -> dict:
        """A tuned split count fits the grid it was measured on: served to a problem with another
        number of CTAs per split (batch x K/V heads x row blocks) or another length bucket, the keys
        are split from the occupancy instead (B32's one split would leave most of the GPU idle at B8)."""
        if params["splits"] and (
                ctas_per_split(params, tuned) != ctas_per_split(params, problem)
                or tuned.bucket().seqlen != problem.bucket().seqlen):
            return dict(params, splits=0)
        return params

    def fits_one_wave(self, params: dict, problem: Problem, gpu: GpuSpec) -> bool:
        """Whether `params` is valid and its launch (its own or the occupancy's splits) runs every CTA
        at once: no more CTAs than the GPU has slots for it."""
        if self.check(params, gpu, problem) is not None:
            return False
        ctas = ctas_per_split(params, problem) * self.splits(params, problem, gpu)
        return ctas <= cta_slots(params, problem, gpu, self.smem_bytes(params, problem))

    def splits(self, params: dict, problem: Problem, gpu: GpuSpec) -> int:
        """The config's split count, or the occupancy's. Where K/V come by tensor-map boxes (sm_90+),
        the fewest that keep the GPU's memory busy (`in_flight_splits`). Over the recorded served
        sweeps (PERF_NOTES "s5") that reads 0.992 of the best count on average on the H200 (62 rows,
        0.862 at worst) and on the H100 (29 rows, 0.907), where filling each SM once, the rule
        before, read 0.954 (0.823: B12 x 28 heads of 4 K/V x 3k keys, 5 splits where one was best;
        d=64 at long keys, half the best count) and 0.987 (0.887). Elsewhere (cp.async rows, the
        A100) every CTA slot once (`auto_splits`)."""
        if params["splits"]:
            return params["splits"]
        smem = self.smem_bytes(params, problem)
        if gpu.major < 9 or not self.kv_tma(params, problem.head_dim):
            return auto_splits(params, problem, gpu, smem)
        return in_flight_splits(params, problem, gpu, smem)

    def served_form(self, params: dict, gpu: GpuSpec, problem: Problem) -> tuple[KernelFamily, dict]:
        """A call whose keys split 2, 4 or 8 ways on sm_90+ runs as flash_decode_cluster, its splits one
        cluster that merges in shared memory: the workspace's merge waited on L2 round trips (the
        partials' stores and fence, the counter, the last arriver's loads), the end of every CTA's
        stream on a small batch (PERF_NOTES "d8", "q1"). Paged and packed calls keep the workspace."""
        if not self.cluster_form or gpu.major < 9:
            return self, params
        splits = self.splits(params, problem, gpu)
        # clusters of 2, 4 or 8 CTAs, no more than run at once: where a wave of single
        # CTAs would have held them all, a second wave of clusters would double the call
        clustered = dict(params, splits=splits)
        if (splits not in CLUSTER_SIZES or ctas_per_split(params, problem) > clusters_at_once(gpu, splits)
                or CLUSTER_FAMILY.check(clustered, gpu, problem) is not None):
            return self, params
        return CLUSTER_FAMILY, clustered

    def launch(self, params: dict, problem: Problem, gpu: GpuSpec) -> Launch:
        return self.split_launch(params, problem, self.splits(params, problem, gpu))

    def split_launch(self, params: dict, problem: Problem, splits: int) -> Launch:
        """The launch with the keys split `splits` ways: a CTA per (sequence, K/V head, row block) on
        x, row blocks fastest (the kernel derives their count from the longest sequence's queries),
        and a split on z."""
        return Launch(
            grid=(problem.batch * problem.kv_heads * row_blocks(params, problem), 1, splits),
            block=(params["warps"] * 32, 1, 1),
            smem_bytes=self.smem_bytes(params, problem),
        )

    def param_kinds(self, params: dict) -> tuple[str, ...]:
        # the splits' O and LSE, their arrival counters, the per-sequence key counts and the page
        # table (null where absent), the page size and the table's row stride, K's and V's maps
        return ATTENTION_PARAMS + ("ptr",) * 5 + ("i32",) * 2 + ("tmap",) * 4

    def arg_maker(self, params: dict):
        return _DecodeArgs(self, params)

    def kv_slots(self, params: dict, k, v) -> tuple[MapSlot | None, ...] | None:
        """K's and V's map slots for (B, Hk, N, D) views of this geometry, then their tail panel's
        (None where there is no tail: tail_cols), or None where the kernel reads no maps."""
        if not (self.kv_tma(params, k.shape[3]) and maps_for(k)):
            return None
        rows = min(stage_keys(params), k.shape[2]) if self.paged else stage_keys(params)   # a page's rows at most
        cols, tail = panel(k.shape[3]), self.ring_tail(params, k.shape[3])
        tails = (MapSlot(k, rows, tail), MapSlot(v, rows, tail)) if tail else (None, None)
        return MapSlot(k, rows, cols), MapSlot(v, rows, cols), *tails

    def kv_maps(self, params: dict, k, v) -> tuple[bytes, ...]:
        """K's and V's tensor maps for a call on these views, then their tail panel's; empty ones
        where the kernel does not read them."""
        return maps_at(self.kv_slots(params, k, v) or _NO_SLOTS, (0, k.data_ptr(), v.data_ptr()), _KV_SOURCES)

    def cache_args(self, params: dict, launch: Launch, q, k, v, o, lse, scale, nk: int, cache_seqlens,
                   block_table) -> tuple | None:
        """The kernel's values for a KV-cache call (tuner/kvcache.py): k, v as (B, Hk, N, D) views of
        dense caches, or of the pages ((num_pages, Hk, page_size, D)) where this family is paged;
        `nk` the keys a sequence can hold, `cache_seqlens` (B,) int32 how many it holds (or None),
        `block_table` (B, pages) int32 for a paged cache. None where q, k or v is not kernel-ready."""
        args = attention_args(q, k, v, o, lse, scale)
        if args is None:
            return None
        args = args[:8] + (nk,) + args[9:]   # the cache's capacity, not a page's rows
        seqlens = cache_seqlens.data_ptr() if cache_seqlens is not None else 0
        table = (block_table.data_ptr(), k.shape[2], block_table.stride(0)) if self.paged else (0, 0, 0)
        merge = (0, 0, 0) if self.merges_in_cluster else \
            split_workspace(q.get_device(), launch.grid, q.shape[0] * q.shape[1] * q.shape[2], q.shape[3])
        return args + merge + (seqlens,) + table + self.kv_maps(params, k, v)

    def _geometry(self, params: dict, q, k) -> tuple[int, int, int]:
        """(CTAs per split, splits, rows of LSE) of a launch on these tensors, as `launch` sizes it."""
        grid, rows = call_grid(self, params, q, k)
        return grid[0] * grid[1], grid[2], rows


_KV_SOURCES = (1, 2, 1, 2)   # the maps' tensors (k, v, then their tail panels'), as kv_slots gives them
_NO_SLOTS = (None,) * len(_KV_SOURCES)   # where the kernel reads no maps


class _DecodeArgs(AttentionArgs):
    """flash_decode's arguments: the shared ones, then (where the keys are split) the workspace of
    the splits' partial results, on the current stream, and no cache (null lengths and table)."""

    def __init__(self, family: FlashDecode, params: dict) -> None:
        super().__init__()
        self._family, self._params = family, params

    def bind(self, q, k, v, o, scale):
        shared = layout_args(q, k, v, o, scale)
        if shared is None:
            return None
        ctas, splits, rows = self._family._geometry(self._params, q, k)
        return shared, splits, (splits * rows * q.shape[3], splits * rows, ctas), self._family.kv_slots(self._params, k, v)

    def values(self, bound, pointers, q):
        shared, splits, sizes, slots = bound
        maps = maps_at(slots or _NO_SLOTS, pointers, _KV_SOURCES)
        if splits == 1 or self._family.merges_in_cluster:   # no workspace
            return pointers + shared + (0, 0, 0, 0, 0, 0, 0) + maps
        return pointers + shared + workspace(q.get_device(), *sizes) + (0, 0, 0, 0) + maps

    def address_fields(self, bound):
        shared, _, _, slots = bound
        maps = map_fields(slots or (), 5 + len(shared) + 7, _KV_SOURCES)   # after the shared values and 7 more
        return None if maps is None else super().address_fields(bound) + maps


def call_grid(family: KernelFamily, params: dict, q, k, held: int | None = None) -> tuple[tuple[int, int, int], int]:
    """The grid `family.launch` sizes for a call on these (B, H, N, D) tensors (splits on z), and
    the call's query rows (B x H x Nq): what the splits' workspace is sized by. `held`: k is a paged
    KV cache's pages, of which a sequence can hold that many keys."""
    from tuner.dispatch import dtype_name, problem_of
    from tuner.gpu import _from_torch

    if held is None:
        problem = problem_of(q, k, k, False)
    else:
        b, h, nq, d = q.shape
        problem = Problem(b, h, nq, held, d, dtype_name(q), "none", k.shape[1])
    grid = family.launch(params, problem, _gpu(q.device.index or 0, _from_torch)).grid
    return grid, problem.batch * problem.heads * problem.seqlen_q


def split_workspace(index: int, grid: tuple[int, int, int], rows: int, head_dim: int) -> tuple[int, int, int]:
    """The splits' O, LSE and arrival counters for a launch of `grid` (splits on z) over `rows`
    query rows, on device `index`'s current stream; nulls where the keys are not split."""
    if grid[2] == 1:
        return 0, 0, 0
    return workspace(index, grid[2] * rows * head_dim, grid[2] * rows, grid[0] * grid[1])


_gpus: dict[int, GpuSpec] = {}


def _gpu(index: int, make) -> GpuSpec:
    g = _gpus.get(index)
    if g is None:
        g = _gpus[index] = make(index)
    return g


class ClusterMergeFlashDecode(FlashDecode):
    """flash_decode whose 2 to 8 splits of a (sequence, K/V head, row block) run as one thread-block
    cluster and merge through the cluster's shared memory (MERGE_CLUSTER in the kernel), with no
    workspace. Served by rule, not searched: a flash_decode config runs in this form where its call
    splits the keys that many ways on sm_90+ (FlashDecode.served_form), and a search times it so.
    The split count is explicit here: the cluster's size is compiled in."""

    name = "flash_decode_cluster"
    configs_of = "flash_decode"
    min_cc = (9, 0)
    space = {**FlashDecode.space, "splits": CLUSTER_SIZES}
    launch_params = ()   # the cluster's size is compiled in: a cubin per split count
    merges_in_cluster = True
    cluster_form = False

    def tune_skip(self, gpu: GpuSpec, problem: Problem) -> str | None:
        return (f"{self.name} is flash_decode's configs with their splits merged in a cluster: the "
                f"dispatcher serves them in that form (served_form), a search tunes flash_decode")

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        return [dict(p, splits=n) for p in super().seeds(gpu, problem) for n in CLUSTER_SIZES]

    def adapt(self, params: dict, tuned: Problem, problem: Problem) -> dict:
        """As served: served_form derived the split count for this call already (flash_decode's adapt
        reset it to 0 for an entry tuned at another batch, which is no point of this family: the
        dispatcher then could not render it and fell back to SDPA)."""
        return params

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        return {**super().defines(params, problem), "MERGE_CLUSTER": params["splits"]}


class VarlenFlashDecode(VarlenVariant, FlashDecode):
    """flash_decode on packed sequences (each with up to MAX_QUERIES queries of its own and its own
    keys): the padded problem's grid (its batch by K/V heads, the longest sequence's row blocks),
    splits for the ragged keys (ragged_splits), the splits' workspace in (B, H, Nq) rows."""

    name = "flash_decode_varlen"
    cluster_form = False

    def block_rows(self, params: dict) -> int:
        return 16 * params["MT"]

    def from_tuned(self, params: dict, problem: Problem) -> dict:
        """A tuned split count was measured on equal lengths; a ragged batch takes its own
        (ragged_splits, from the keys it holds)."""
        return dict(params, splits=0)

    def packed_launch(self, params: dict, problem: Problem, gpu: GpuSpec, total_q: int, total_k: int) -> Launch:
        splits = params["splits"] or ragged_splits(params, problem, gpu, self.smem_bytes(params, problem), total_k)
        return self.split_launch(params, problem, splits)

    def varlen_values(self, make_args, params, problem, grid, views, lse, scale, cu_q, cu_k, max_q, max_k):
        q = views[0]
        args = attention_args(*views, lse, scale)
        if args is None:
            return None
        rows = problem.batch * problem.heads * problem.seqlen_q   # the padded (B, H, Nq) rows
        args += split_workspace(q.get_device(), grid, rows, problem.head_dim)
        args += (0, 0, 0, 0) + self.kv_maps(params, views[1], views[2])   # no per-sequence key counts, no page table
        return self.packed_args(args, max_q, max_k, cu_q.data_ptr(), cu_k.data_ptr(), q.shape[2], problem.batch)


class PagedFlashDecode(FlashDecode):
    """flash_decode on a paged KV cache: the same configs (a tuned flash_decode entry serves it),
    each K/V row found through the page table. Not searched on its own: tuner/kvcache.py builds it
    from a flash_decode config."""

    name = "flash_decode_paged"
    paged = True
    cluster_form = False

    def kv_tma(self, params: dict, head_dim: int) -> bool:
        return False   # any page size: rows one by one through the table


class PagedBoxesFlashDecode(FlashDecode):
    """flash_decode on a paged KV cache with each page's rows as tensor-map boxes on sm_90+ (the
    family's kv_tma), for page sizes that a stage's rows divide or are divided by, in whole 8-row
    swizzle atoms (`page_fits`); flash_decode_paged takes the other page sizes. Not searched either."""

    name = "flash_decode_paged_boxes"
    paged = True
    cluster_form = False

    @staticmethod
    def page_fits(params: dict, page_size: int) -> bool:
        tk = stage_keys(params)
        return page_size % 8 == 0 and (page_size % tk == 0 or tk % page_size == 0)


FAMILY = FlashDecode()
CLUSTER_FAMILY = ClusterMergeFlashDecode()
PAGED = PagedFlashDecode()
PAGED_BOXES = PagedBoxesFlashDecode()
VARLEN_FAMILY = VarlenFlashDecode()
