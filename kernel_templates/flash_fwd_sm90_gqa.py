"""flash_fwd_sm90_gqa: flash_fwd_sm90 with the query heads of each K/V head packed into its tiles' rows.

A decode or speculative step of a GQA model has a few queries per head, and g query heads share
each K/V head. flash_decode packs them into m16 row blocks of mma.sync: at 16 queries x 8 heads
(128 rows) its eight row blocks each stream the same K/V and the call read 0.29x FlashAttention-4,
which packs them into one wgmma tile (H200, benchmarks/PERF_NOTES.md "r1-r3"). Here a work tile's
rows are query r / g of head hk * g + r % g (the kernel's PACK_GQA), so the Hopper kernel runs
g x Nq rows of one K/V head against each K/V tile it loads, with the keys split across CTAs where
the (batch x K/V heads) tiles leave SMs idle, as flash_fwd_sm90_split does.

Its calls: GQA (heads > K/V heads) in 16-bit, a dense batch; a block holds whole groups of query
heads (64 x cwg // g x g rows: 63 of 64 at 7 heads a group). The dispatcher serves a decode step's
kernel entry (flash_decode's, or the plain Hopper kernel's) in this form where its packed rows are
PACK_ROWS (48) or more, PACK_ROWS_LONG (28) or more over PACK_ROWS_LONG_KEYS (3000) keys, past d=128
PACK_ROWS_WIDE (16) or fewer on a grid that fills the GPU (gqa_packing.packs); a search of every family
tunes it on decode steps. On the H200 that read 1.3-8.6x what served before, 0.89-3.8x FA4 (PERF_NOTES
"g1-g3"); 28-32 rows over 3000 keys 1.14x geomean on 62 steps ("x13"); at d=256 from 16 rows 0.93-2.28x, 1.10x or
more on 6 of 8 steps ("n2"). A prefill of short query rows whose packed rows fill the blocks better
runs it too (gqa_packing.packs_prefill: 1.02-1.37x on 18 of 19 calls, "y1"; from 1536 keys, 1.07-1.37x on
11 more and 1.14x geomean on 15 held out, "x3"; where its K/V outgrow two L2s from a fill gain of 1.05,
1.07x geomean on 16 and 1.02x on 16 held out, "x4"), and a search of such a prefill times it beside the
plain families (tune_skip). Such a prefill under PERSISTENT_KEYS keys that its grid would run at one
split runs persistent (`persistent_pays`: one CTA an SM drawing work tiles from the tile counter, as
flash_fwd_sm90's persistent form does; 1.04x geomean on 28 held-out H200 calls, "x11"). A GQA prefill
of few blocks that the split form would serve runs it at one consumer where its keys split into short
shares (gqa_packing.one_consumer_packed: 1.075x geomean on the 38 random H200 calls it moves, "x12").
"""

from __future__ import annotations

from dataclasses import replace

from tuner.family import KernelFamily, ceil_div
from tuner.gpu import GpuSpec
from tuner.kernel_templates.flash_fwd_sm90 import FlashFwdSm90, _Sm90Args, consumer_cost, map_panel
from tuner.kernel_templates.flash_fwd_sm90_split import SplitFlashFwdSm90, _SplitArgs, auto_splits
from tuner.kernel_templates.sm90_tma import MapSlot
from tuner.launch import Launch
from tuner.problem import DECODE_QUERIES, Problem


def group_of(problem: Problem) -> int:
    """The query heads that share a K/V head: the rows a query of one K/V head packs into."""
    return problem.heads // problem.kv_heads


def packed_rows(problem: Problem) -> int:
    """The rows a K/V head's query heads make with their queries packed: g x Nq."""
    return group_of(problem) * problem.seqlen_q


def block_rows(params: dict, problem: Problem) -> int:
    """The packed rows a block of 64 x cwg holds: whole groups of query heads (7 a group: 63 of 64)."""
    rows, g = 64 * params["cwg"], group_of(problem)
    return rows // g * g


def packed_blocks(params: dict, problem: Problem) -> int:
    """Query blocks a K/V head's g x Nq packed rows fill: the grid's x."""
    return ceil_div(packed_rows(problem), block_rows(params, problem))


def block_fill(problem: Problem, cwg: int = 2) -> float:
    """How full the call's g x Nq packed rows leave the blocks of `cwg` consumers (64 rows each) they
    take: at two, 0.625 for 80 rows, 0.5 for 64, 0.875 for 112 (one block of 7-head groups), 1.0 for
    256; at three, 1.0 for 192 rows, 0.667 for 256."""
    rows = packed_rows(problem)
    return rows / (ceil_div(rows, block_rows(dict(cwg=cwg), problem)) * 64 * cwg)


# At d <= 64 the packed kernel's first seed is three consumers at Bc 128 (split 24: FlashAttention-4's
# 192 x 128 tile there) where their 192-row blocks hold the packed rows THREE_CONSUMERS_FILL times as
# full as two consumers' 128-row blocks, or fuller. On the H200 (bf16, bottom-right, 4096-12000 keys,
# timed in turns, PERF_NOTES "x19"), against what served (prefills: Bc 176 at two consumers; steps: Bc
# 128 at two, split 40): first 1.04-1.23x on four prefills of fill ratio 0.93-0.96, 1.57x on a step of
# 48 queries x 4 heads (ratio 1.33: 192 rows), 0.81x on one of 64 x 4 (0.67: 256 rows in two 192-row
# blocks), so at equal fill three consumers ran about 1.1x two; then, the rule in place, 1.01-1.39x on
# the 8 calls it moves, 5 of them held out (B8-H28/kv4 180 x 12000 443.5 TFLOP/s against 385.1, FA4
# 455.6; B64-H32/kv8 40 x 4096 417.4 against 299.8, FA4 401.1).
THREE_CONSUMERS_FILL = 0.9


def three_consumers_pay(problem: Problem) -> bool:
    """Whether the packed kernel at d <= 64 starts from three consumers (THREE_CONSUMERS_FILL)."""
    return problem.head_dim <= 64 and block_fill(problem, 3) >= THREE_CONSUMERS_FILL * block_fill(problem)


def fill_gain(problem: Problem) -> float:
    """How much fuller the g x Nq packed rows leave two consumers' blocks than the Nq rows of each
    query head leave the plain kernel's 128-row blocks: 1.185 for 8 heads of 417 queries (96.5%
    against 81.4%), 1.0 where Nq fills its blocks."""
    return block_fill(problem) / (problem.seqlen_q / (ceil_div(problem.seqlen_q, 128) * 128))


def wave_gain(problem: Problem, gpu: GpuSpec) -> float:
    """How many times the plain kernel's waves of two consumers' CTAs x their rows (consumer_cost)
    come out over the packed blocks': the fill gain where the CTAs make many waves, none where both
    make one (B2-H28/kv4 162 x 1274: 112 plain CTAs, 72 packed, one wave each)."""
    two = dict(cwg=2)
    return consumer_cost(gpu, problem, 2) / consumer_cost(gpu, packed_problem(two, problem), 2)


# A packed prefill whose grid runs one split runs persistent (one CTA an SM, the next work tile's Q and
# K/V loaded under this one's last products and epilogue) under PERSISTENT_KEYS keys, where a work
# tile's main loop is short beside what a grid CTA spends starting and ending one. On the H200 (bf16,
# d=128, PERF_NOTES "x11"; Bc 128, two consumers taking turns, split 40) against the grid default (Bc
# 176, split 24), timed in turns on 26 random draws it served: under 4096 keys 1.01-1.18x on 13 of 13
# (B16-H16/kv4 162 x 717 386 TFLOP/s against 327; 5 chunks and cross-attentions of 129-180 queries
# over 718-1419 keys 1.06-1.19x), from 4483 keys 0.95-1.02x (long chunks' bottom-right masks, 0.97x
# geomean over 13k keys).
PERSISTENT_KEYS = 4096


def persistent_pays(grid: dict, problem: Problem, gpu: GpuSpec) -> bool:
    """Whether a packed prefill runs persistent: under PERSISTENT_KEYS keys, where its `grid` config's
    occupancy would run one split (a persistent launch splits no keys)."""
    return (problem.seqlen_q > DECODE_QUERIES and problem.seqlen_k < PERSISTENT_KEYS
            and auto_splits(grid, packed_problem(grid, problem), gpu) == 1)


def packed_problem(params: dict, problem: Problem) -> Problem:
    """`problem` as the packed kernel's grid sees it (for counting its blocks, not for its mask): one
    head per K/V head, as many 64 x cwg-row query blocks as the g x Nq packed rows fill."""
    return replace(problem, heads=problem.kv_heads, seqlen_q=packed_blocks(params, problem) * 64 * params["cwg"])


class PackedGqaFlashFwdSm90(SplitFlashFwdSm90):
    name = "flash_fwd_sm90_gqa"
    kernel_name = "flash_fwd_sm90"
    gives_way_to = None
    space = {
        "Bc": (64, 80, 128, 176),
        "stages": (2, 3),
        "cwg": (1, 2, 3),
        "split": (0, 24, 40),
        "overlap": (1,),
        "pingpong": (0, 1),
        "persistent": (0, 1),
        "tma_store": (0,),
        "chain": (0,),
        "splits": (0, 2, 4, 8, 16),
    }

    def supports(self, gpu: GpuSpec, problem: Problem) -> str | None:
        if problem.heads == problem.kv_heads:
            return f"{self.name} packs the query heads of a K/V head; {problem.key} has one query head per K/V head"
        return super().supports(gpu, problem)

    def tune_skip(self, gpu: GpuSpec, problem: Problem) -> str | None:
        from tuner.gqa_packing import packs_prefill

        if problem.seqlen_q > DECODE_QUERIES and not packs_prefill(problem, gpu):
            return (f"{self.name} packs the few queries of a decode step, or a prefill's short rows where they fill "
                    f"its blocks better; {problem.key}'s {problem.seqlen_q} queries fill the plain kernel's tiles")
        return None

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        rows, g = 64 * params["cwg"], group_of(problem)
        if rows < g:
            return f"a tile of {rows} rows holds whole groups of query heads: not one of {g}"
        if params["cwg"] > 1 and not params["split"]:
            return "two or three consumers take the producer's registers (split 24 or 40); without, ptxas spills"
        if params["persistent"] and params["splits"]:
            return "a persistent packed launch runs each work tile's keys whole: splits 0"
        if problem.head_dim > 128 and (params["Bc"] > 64 or params["split"] > 24):
            return ("past d=128 the packed rows' bounds and diagonals leave Bc > 64, or consumers under split 40, "
                    "short of registers (ptxas spills)")
        return super()._check(params, gpu, problem)

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        # flash_fwd_sm90_split's tiles, and one consumer of 64 rows for calls that pack no more. A
        # 16-trial search on the H200 (PERF_NOTES "g1") put one consumer of Bc 64 first at d=256 (437.0
        # TFLOP/s against two consumers' 399.3 at 128 packed rows: twice the CTAs, each K/V tile read
        # from L2 by both; 457.6 timed in turns with FA4's 401.7). Past d=64 the first seed follows
        # how full the packed rows leave two consumers' blocks (block_fill, PERF_NOTES "g4").
        d = problem.head_dim
        if d <= 64:
            cands = [(128, 2, 2, 40, 1), (128, 2, 3, 24, 1), (128, 2, 1, 0, 0)]
        elif d <= 128:
            cands = [(128, 2, 2, 40, 1), (80, 2, 2, 24, 1), (64, 2, 2, 24, 1), (80, 2, 2, 40, 1), (176, 2, 2, 24, 1),
                     (128, 2, 1, 0, 0), (64, 2, 3, 24, 1)]
        else:
            cands = [(64, 2, 1, 0, 0), (80, 2, 2, 24, 1), (64, 2, 2, 24, 1)]
        def seed(c: tuple) -> dict:
            return dict(zip(("Bc", "stages", "cwg", "split", "pingpong"), c), overlap=1, persistent=0, tma_store=0,
                        chain=0, splits=0)

        seeds = [seed(c) for c in cands]
        if problem.seqlen_q > DECODE_QUERIES and d <= 128:
            # A prefill of short rows (gqa_packing.packs_prefill): Bc 176 read 1.02-1.07x Bc 128 on 7 calls
            # ("j1"), and served so 1.02-1.37x the plain kernel's configs on 18 of 19 ("y1"); at d <= 64
            # three consumers where their blocks fill as well (three_consumers_pay, "x19").
            first = seed((176, 2, 2, 24, 1))
            persistent = persistent_pays(first, problem, gpu)
            if three_consumers_pay(problem):   # (d <= 64; persistent or not as Bc 176 would run)
                first = seed((128, 2, 3, 24, 1))
            seeds = [first] + [s for s in seeds if s != first]
            if persistent:
                seeds.insert(0, dict(seed((128, 2, 2, 40, 1)), persistent=1))
        elif 64 < d <= 128:
            # Timed in turns on the H200 (d=128, 19 decode steps of 48-256 packed rows, PERF_NOTES
            # "g4"): K/V tiles as narrow as the blocks are empty. Half full or less (48, 64 rows): Bc 64
            # with the second consumer idle, 1.01-1.10x one consumer's Bc 128 on all 7 steps. Up to
            # three quarters (80, 96 rows): Bc 80, 1.02-1.06x Bc 128 where one block a K/V head makes
            # at most a wave of CTAs (7 of 8 steps, level at 32 CTAs); past a wave a toss-up (one step
            # read 0.95x and 1.04x in two calls), 0.95x on two blocks. Fuller (112, 128, 256 rows):
            # Bc 128, 1.05-1.11x Bc 80.
            fill, one_wave = block_fill(problem), problem.batch * problem.kv_heads <= gpu.sm_count
            one_block = packed_rows(problem) <= block_rows(dict(cwg=2), problem)
            first = 64 if fill <= 0.5 else 80 if fill <= 0.75 and one_wave and one_block else 128
            seeds.sort(key=lambda s: (s["Bc"], s["split"]) != (first, 24 if first < 128 else 40))
        elif three_consumers_pay(problem):   # (d <= 64) 192-row blocks as full as 128-row ones
            seeds.sort(key=lambda s: s["cwg"] != 3)
        elif packed_rows(problem) <= block_rows(dict(cwg=1), problem):   # one consumer holds the call's rows
            seeds.sort(key=lambda s: s["cwg"] != 1)
        return seeds

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        packed = {**super().defines(params, problem), "PACK_GQA": 1, "GQA_GROUP": group_of(problem)}
        return {**packed, "SPLIT_KV": 0} if params["persistent"] else packed

    def splits(self, params: dict, problem: Problem, gpu: GpuSpec) -> int:
        if params["persistent"]:
            return 1
        return params["splits"] or auto_splits(params, packed_problem(params, problem), gpu)

    def launch(self, params: dict, problem: Problem, gpu: GpuSpec) -> Launch:
        blocks, heads = packed_blocks(params, problem), problem.batch * problem.kv_heads
        grid = ((min(blocks * heads, gpu.sm_count), 1, 1) if params["persistent"] else
                (blocks, heads, self.splits(params, problem, gpu)))
        return Launch(grid=grid, block=(128 * (params["cwg"] + 1), 1, 1), smem_bytes=self.smem_bytes(params, problem))

    def served_form(self, params: dict, gpu: GpuSpec, problem: Problem) -> tuple[KernelFamily, dict]:
        # A persistent config splits no keys: where its grid form would split them (a call of fewer
        # packed tiles than the one it was tuned on, e.g. a smaller batch of the same bucket), the grid
        # form runs, its splits from the occupancy
        if params["persistent"]:
            grid = dict(params, persistent=0, splits=0)
            if self.check(grid, gpu, problem) is None and self.splits(grid, problem, gpu) > 1:
                return self, grid
        return self, params

    def param_kinds(self, params: dict) -> tuple[str, ...]:
        # persistent: flash_fwd_sm90's (no split workspace)
        return FlashFwdSm90.param_kinds(self, params) if params["persistent"] else super().param_kinds(params)

    def arg_maker(self, params: dict):
        if params["persistent"]:
            return _PersistentPackedArgs(64 * params["cwg"], params["Bc"], False, True)
        return _PackedArgs(self, params)


class _PackedQ:
    """Q's map the 5-d one of packed rows (sm90_tma: boxes of the g query heads x BR / g queries of
    one K/V head)."""

    def q_slot(self, q, k) -> MapSlot:
        return MapSlot(q, self._rows[0], map_panel(q), group=q.shape[1] // k.shape[1])


class _PackedArgs(_PackedQ, _SplitArgs):
    """flash_fwd_sm90_split's arguments with Q's map of packed rows."""


class _PersistentPackedArgs(_PackedQ, _Sm90Args):
    """flash_fwd_sm90's persistent arguments (the tile counter, no split workspace) with Q's map of
    packed rows."""


FAMILY = PackedGqaFlashFwdSm90()
