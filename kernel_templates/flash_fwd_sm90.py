"""flash_fwd_sm90: the Hopper kernel (TMA + wgmma + warp specialization), fp16/bf16/e4m3, sm_90a only.

Parameters: Bc (the K/V tile, the n of the first wgmma), stages (depth of the TMA ring), cwg
(consumer warpgroups; Br = 64 per consumer), split (registers the producer warpgroup keeps
after setmaxnreg; the consumers share the rest; 0 leaves the allocation alone; 32 runs the
persistent producer warp-wide, so FA3's 192 x 128 fits at d=64), overlap (a
consumer issues S of tile t with P V of tile t-1 and runs the softmax under the latter) and
pingpong (the consumers take turns at the tensor cores, one's softmax under the others' products)
persistent (one CTA per SM takes work tiles from a dynamic scheduler as it finishes the last,
loading the next under the current epilogue; kernel_templates/tile_scheduler.cuh) and tma_store
(O staged in shared memory, Br x d more of it, and stored by TMA: kernel_templates/sm90_epilogue.cuh)
and chain (two persistent overlapped consumers: a second Q buffer, and the next work tile's first S
issued with this one's last P V, so it runs under this tile's epilogue).

Head dims: any multiple of 8 from 8 to 256 in fp16/bf16. The tile is the head dim rounded up to 64
bytes (`tile_cols`), in panels of the widest swizzle that divides it (128 bytes at d = 64, 128, 192,
256; 64 at d = 96, 160), except d = 72 and 80, whose 96-column tile its products do not fill: 128
columns of 128-byte panels there (`tile_width`); the tensor maps end at the head dim, so the columns past
it read as zeros and are never stored. The products run over the head dim rounded up to a k step
only (`prod_cols`: 80 of d=80's 96 columns), the tile's zero columns skipped. Lookups serve a head
dim only from buckets of that head dim; a prefill that fills the GPU and that none reaches runs
this family's default (dispatch).

fp8 (e4m3 inputs, bf16 O): the producer warpgroup's warps 1-3 transpose each V tile for the K-major
P V (kernel_templates/sm90_fp8.cuh), so the V^T buffer costs a third K/V-sized ring, the transposers
need split 0 or 40, and Bc is a whole 128-key panel. At d=64 an e4m3 row is 64 bytes: Q, K and V
use the 64-byte swizzle.
"""

from __future__ import annotations

from tuner.family import ELEM_CODE, KernelFamily, VarlenVariant, ceil_div, padded_head_dim
from tuner.launch import AttentionArgs, Launch
from tuner.gpu import GpuSpec
from tuner.problem import DECODE_QUERIES, DTYPE_BYTES, Problem, visible_keys, visible_pairs
from tuner.kernel_templates.sm90_tile_counter import tile_counter_ptr
from tuner.kernel_templates.sm90_tma import O_BOX_ROWS, MapSlot, map_fields, maps_at, tail_cols, tile_cols, tile_panel, tile_width
from tuner.kernel_templates.wgmma_gen import wrappers

_REGS_PER_BLOCK = 65536
_MAX_REGS = 255
_BARRIER_SLACK = 1024 + 256  # alignment of the first tile to 1024 B, then the mbarriers
_WGMMA_MARK = "// <wgmma wrappers>"


def tile_dim(problem: Problem) -> int:
    """The width of the kernel's Q, K and V tiles for `problem` (tile_width)."""
    return tile_width(problem.head_dim, DTYPE_BYTES[problem.dtype])


def half_panels(problem: Problem) -> bool:
    """Whether the 64-byte rule's tile (tile_cols) is in 64-byte panels: d = 72-96 and 160, the head
    dims whose seeds and P path were chosen on that tile (p_in_smem, seeds), whatever tile_width makes of it."""
    return tile_cols(problem.head_dim, DTYPE_BYTES[problem.dtype]) % 64 != 0


def map_panel(t) -> int:
    """Columns of a box row of tensor `t`'s maps: one panel of the kernel's tile at its head dim
    (O's at its own element size)."""
    return tile_panel(tile_width(t.shape[-1], t.element_size()), t.element_size())


def prod_cols(params: dict, problem: Problem) -> int:
    """The columns the kernel's products run over (its PROD_COLS): the head dim rounded up to a wgmma
    k step (32 bytes), not to the tile's 64, since S's steps and O's columns past it would only see
    the zeros the tile is padded with (d=80: 80 of 96, d=40: 48 of 64); the whole tile where O goes
    out by TMA (in 64-column panels)."""
    if params["tma_store"]:
        return tile_dim(problem)
    return padded_head_dim(problem.head_dim, 32 // DTYPE_BYTES[problem.dtype])


def tail_panel(tma_store: bool, head_dim: int, esize: int) -> int:
    """Columns of K's tail panel (the kernel's K_TAIL; 0: none): sm90_tma.tail_cols of 16-bit
    inputs, where the products stop short of the tile (not with a TMA-stored O, whose products run
    over the whole tile). K's ring then holds prod_cols columns a row, not the tile's: 1.00-1.05x on
    12 prefill shapes at d = 72-80 and 144 on the H200. V keeps the tile: its tail panel (P V's last
    columns by an n16 wgmma of their own) read 0.95-0.98x at d=80 (benchmarks/PERF_NOTES.md "y3")."""
    return 0 if tma_store or esize != 2 else tail_cols(head_dim, esize)


def k_tail(params: dict, problem: Problem) -> int:
    """tail_panel of a config on a problem."""
    return tail_panel(bool(params["tma_store"]), problem.head_dim, DTYPE_BYTES[problem.dtype])


def p_in_smem(params: dict, problem: Problem) -> bool:
    """Whether P goes through shared memory (the kernel's P_SMEM): three consumers on a 64-byte-panel
    tile (d = 72-96, 160), where P's Bc / 4 registers are what they lack at Bc = 128. FlashAttention-4
    runs 192-row tiles there with P V's A from shared memory ("RS is catastrophic with 192x tiles")."""
    return params["cwg"] == 3 and half_panels(problem) and problem.dtype != "fp8"


def persistent_three_spill(params: dict, problem: Problem) -> bool:
    """Whether `params` are three persistent consumers under a causal mask on a tile of 64-byte panels
    that the products fill (d=96, P through shared memory): ptxas spills 140 B there (120 B in the
    varlen form), where the grid form and the unmasked call spill nothing."""
    return (params["cwg"] == 3 and bool(params["persistent"]) and problem.causal and half_panels(problem)
            and tile_dim(problem) == tile_cols(problem.head_dim, DTYPE_BYTES[problem.dtype]))


# Three consumers (192-row tiles) against two at d = 72-96 (tiles of 64-byte panels or, at d = 72-80, the
# 128-column tile of tile_width), per query row and key: 0.89-0.93x the time on H200 calls whose waves
# of CTAs come out even (PERF_NOTES "j2"); two keep serving calls whose 192-row tiles make more waves
# (0.74x at B4-H16 488 x 3058: two waves of 192 rows for two of 128; at d=96 0.75x on 27k-33k keys where
# 240 blocks of 128 rows made two waves and 160 of 192 did too), and calls of 128 query rows or fewer.
# Rows of any length: a floor of 2048 keys (to "z1"), then 1024, held three off calls where the waves
# said three; lowered to 1024, the 18 of 19 random calls (seeds 1-80, d=80, H200) that took three read
# 0.89-1.29x two, 1.07x geomean, and one of 68 queries that took two read 1.10x three. Dropped ("x9",
# with borrowing.three_consumers_untried), the 122 random calls of seeds 0-299 it moved read 0.99-2.06x
# what served before, 1.18x geomean (95 unmasked of 65-1021 keys, 18 causal of 133-964 keys a row
# 1.01-1.21x); the floor's causal call (0.84x at 875 keys) makes one wave either way: the waves say two.
# At d=96 (PERF_NOTES "x2") 12 of the 15 random calls where the model picks three read 1.01-1.43x two
# (B16-H32 159 x 8823 bottom-right: 424 TFLOP/s on the grid against 320, FA4 424); two of the losses
# (0.75x, 0.78x) are `rows_spread_idle`'s, the third (0.94x, B1-H16 1151 x 5706, few blocks) the split
# default serves.
THREE_CONSUMER_COST = 0.93
# The share of a causal call's query-key pairs its mask hides from which a wave's blocks differ enough
# in work that three consumers under a wave lose to two (rows_spread_idle): 32-50% where measured lost,
# 8% gained (PERF_NOTES "x2").
MASK_SPREAD = 0.2
# Two consumers at d=64 (two_consumers_pay): the waves model counts whole waves and rows a CTA
# computes; it must show this margin, and only in calls of under TWO_CONSUMER_WAVES waves of 192-row
# blocks (past them tiles of few rows even out the last wave: PERF_NOTES "b2").
TWO_CONSUMER_MARGIN = 0.85
TWO_CONSUMER_WAVES = 2
# Two consumers at d=64 on K/V tiles of 176 keys (three stages) against 128, per key column loaded:
# 1.04-1.08x, median 1.06, on eight H200 calls of 3.5k-19k keys, where whole tiles waste little
# (PERF_NOTES "x6"); wide_keys_pay weighs it against the columns a wider tile loads past a block's keys,
# on rows of WIDE_KEYS_MIN keys or more (on average over the mask): on shorter ones 176-key tiles read
# 0.96-1.07x, 1.01x geomean on 22 calls, whatever the columns said.
WIDE_KEYS_GAIN = 1.06
WIDE_KEYS_MIN = 1536
# One consumer (64-row blocks) where they make ONE_CONSUMER_WAVES wave of CTAs or less
# (one_consumer_pays): there one CTA's rows x keys are the launch, and halving them halves it. On the
# H200 (PERF_NOTES "x10", bf16, the default's tile at one consumer against what served, two or three
# consumers, timed in turns with the peers): 26 calls of 8-128 such blocks read 1.03-1.39x (B1-H6 124 x
# 1595 d=64 19.5 TFLOP/s against 14.0, SDPA flash 19.1), where 144-192 blocks read 0.94-1.03x and
# 192-336 0.56-0.80x.
ONE_CONSUMER_WAVES = 1


def cta_rows(problem: Problem, cwg: int) -> int:
    """The query rows a CTA of `cwg` consumers computes: consumers past the last query row skip the work."""
    return min(64 * cwg, ceil_div(problem.seqlen_q, 64) * 64)


def row_cost(cwg: int) -> float:
    """A query row's cost in the main loop at `cwg` consumers a CTA, relative to two's."""
    return THREE_CONSUMER_COST if cwg == 3 else 1.0


def three_consumers_pay(gpu: GpuSpec, problem: Problem) -> bool:
    """Whether the untuned default takes three consumers: at d = 72-96 on more than 128 query rows (two
    consumers' block), where waves of CTAs x rows a CTA computes (consumers past the last query row skip
    the work) x THREE_CONSUMER_COST come out below two consumers', with waves counted whole or, for
    both, as they are where an unmasked persistent launch cuts its last rounds (consumer_cost's `cut`),
    and not where the mask spreads a wave's work (`rows_spread_idle`). The cut count alone moved 30
    random unmasked H200 calls: of the 21 it gives three, 19 read 1.01-1.17x (B1-H8 7781 at d=80: 579
    TFLOP/s against 507); of the 9 it gives two, 6 read 0.89-0.98x, so it only adds three (PERF_NOTES
    "x2"). Rows of any length follow the waves (a 1024-key floor until "x9": the 113 random H200 calls
    under it that three consumers now serve read 0.99-2.06x two)."""
    if not half_panels(problem) or problem.seqlen_q <= 128 or rows_spread_idle(gpu, problem):
        return False   # (rows that two consumers' block holds: a third would share its K/V tiles with none)
    return any(consumer_cost(gpu, problem, 3, cut) * THREE_CONSUMER_COST < consumer_cost(gpu, problem, 2, cut)
               for cut in (False, True))


def rows_spread_idle(gpu: GpuSpec, problem: Problem) -> bool:
    """Whether a causal call's 192-row blocks make under a wave, several of them a head, and the mask
    hides MASK_SPREAD of its pairs or more: a head's later blocks then see far more keys than its
    first, and under a wave the longest block is the launch, where two consumers' persistent schedule
    spreads 128-row ones over the SMs. The waves model counts rows, not that spread: on the H200 three
    read 0.78x two at B2-H4 2562 x 3135 bottom-right (d=96, 112 blocks of 192 rows, 41% of the pairs
    hidden), 0.88x at B4-H4 1324 x 2054 (d=80, 32%); a tuned three-consumer grid config at B1-H4 5837
    causal (124 blocks, half) read 0.75x the two-consumer default; a chunk whose rows see nearly all its
    keys keeps three (B1-H32 688 x 4442, 8% hidden: two read 0.76x; PERF_NOTES "j2", "x2")."""
    if not problem.causal or problem.seqlen_q <= 192 or problem.query_blocks(192) >= gpu.sm_count:
        return False
    return mask_spreads(problem)


def mask_spreads(problem: Problem) -> bool:
    """Whether the mask hides MASK_SPREAD of the call's query-key pairs or more: a head's blocks then
    differ in work, and whole waves of them say little (rows_spread_idle; gqa_packing.packs_prefill)."""
    pairs = problem.seqlen_q * problem.seqlen_k
    return visible_pairs(problem.seqlen_q, problem.seqlen_k, problem.mask) <= (1 - MASK_SPREAD) * pairs


def two_consumers_pay(gpu: GpuSpec, problem: Problem) -> bool:
    """Whether the d=64 default takes two consumers: where 192-row blocks make under
    TWO_CONSUMER_WAVES waves of CTAs, one CTA's rows are the call's critical path, and the waves of
    128-row blocks x their rows come out TWO_CONSUMER_MARGIN below three consumers' (after their
    per-row gain, THREE_CONSUMER_COST). On the H200 (PERF_NOTES "j3", "b2") d=64 calls of 36-250
    such blocks read 1.02-1.35x at two; at 400 blocks, where the waves model's margin held too, 0.93x."""
    return (problem.query_blocks(192) < TWO_CONSUMER_WAVES * gpu.sm_count
            and consumer_cost(gpu, problem, 2) < consumer_cost(gpu, problem, 3) * THREE_CONSUMER_COST * TWO_CONSUMER_MARGIN)


def one_consumer_pays(gpu: GpuSpec, problem: Problem) -> bool:
    """Whether a prefill call's 64-row blocks make ONE_CONSUMER_WAVES wave of CTAs or less, where one
    consumer a CTA beats two or three (dispatch._one_consumer_where_idle)."""
    return problem.seqlen_q > DECODE_QUERIES and problem.query_blocks(64) <= ONE_CONSUMER_WAVES * gpu.sm_count


def at_one_consumer(params: dict) -> dict:
    """`params` on one consumer a CTA: 64-row blocks, no ping-pong (no other consumer to take turns
    with), the registers all the consumer's (no split)."""
    return {**params, "cwg": 1, "pingpong": 0, "split": 0}


def key_columns(problem: Problem, rows: int, bc: int) -> int:
    """K/V columns one head's query blocks of `rows` rows load in tiles of `bc` keys: each block's
    keys up to the last its last row sees (the mask's diagonal), in whole tiles."""
    nq, nk = problem.seqlen_q, problem.seqlen_k
    return sum(ceil_div(visible_keys(min(start + rows, nq) - 1, nq, nk, problem.mask), bc) * bc
               for start in range(0, nq, rows))


def wide_keys_pay(problem: Problem) -> bool:
    """Whether the d=64 two-consumer default takes K/V tiles of 176 keys, not 128: on rows of
    WIDE_KEYS_MIN keys or more, where the columns it loads, whole tiles past each block's keys, stay
    within WIDE_KEYS_GAIN of 128-key tiles'. On the H200 (PERF_NOTES "x6"), 53 calls timed in turns,
    bf16 and fp16: on the 24 this gives 176, 0.99-1.08x, 1.04x geomean (B2-H25 565 x 18838
    bottom-right 419.0 TFLOP/s against 388.5); under WIDE_KEYS_MIN 0.96-1.07x, and where the columns
    say 128 (B1-H25 356 unmasked: 176-key tiles load 528 columns for 356 keys) 0.85-1.02x."""
    mean_keys = visible_pairs(problem.seqlen_q, problem.seqlen_k, problem.mask) / problem.seqlen_q
    return (mean_keys >= WIDE_KEYS_MIN
            and key_columns(problem, 128, 176) < WIDE_KEYS_GAIN * key_columns(problem, 128, 128))


def consumer_cost(gpu: GpuSpec, problem: Problem, cwg: int, cut: bool = False) -> float:
    """Waves of CTAs x the query rows a CTA computes (consumers past the last query row skip the
    work): the time of `cwg` consumers a CTA, per key, where every CTA runs its rows alone. With
    `cut`, an unmasked call whose persistent default cuts its last rounds into equal segments
    (flash_fwd_sm90_tail.tail_from) counts its waves as they are, not rounded up."""
    rows = cta_rows(problem, cwg)
    tiles = problem.query_blocks(64 * cwg)
    if cut and not problem.causal:
        from tuner.kernel_templates.flash_fwd_sm90_tail import tail_from   # (it imports this module)

        if tail_from(tiles, gpu.sm_count, ceil_div(problem.seqlen_k, 128)) < tiles:
            return tiles / gpu.sm_count * rows
    return ceil_div(tiles, gpu.sm_count) * rows


def entry_regs(threads: int) -> int:
    """Registers per thread at launch under __launch_bounds__(threads, 1): the file's share, in 8s."""
    return min(_MAX_REGS, _REGS_PER_BLOCK // threads // 8 * 8)


def consumer_regs(cwg: int, split: int) -> int:
    """What each consumer thread may grow to once the producer keeps only `split` (0: no change)."""
    threads = 128 * (cwg + 1)
    if not split:
        return entry_regs(threads)
    pool = entry_regs(threads) * threads - 128 * split
    return min(240, pool // (128 * cwg) // 8 * 8)


class FlashFwdSm90(KernelFamily):
    name = "flash_fwd_sm90"
    kernel_name = "flash_fwd_sm90"
    source_file = "flash_fwd_sm90.cu"
    min_cc = (9, 0)
    dtypes = ("fp16", "bf16", "fp8")
    head_dims = (64, 128, 256)   # tuned and shipped (and fp8's); it pads to any other
    pads_head_dim = True
    cuts_tail = True   # served_form: a persistent launch's last rounds cut (not the variants made from it)
    space = {
        "Bc": (64, 80, 96, 128, 176),
        "stages": (2, 3),
        "cwg": (1, 2, 3),
        "split": (0, 24, 32, 40),
        "overlap": (0, 1),
        "pingpong": (0, 1),
        "persistent": (0, 1),
        "tma_store": (0, 1),
        "chain": (0, 1),
    }

    def supports(self, gpu: GpuSpec, problem: Problem) -> str | None:
        if (gpu.major, gpu.minor) != (9, 0):
            return f"{self.name} uses sm_90a instructions (wgmma, setmaxnreg): Hopper only, {gpu.name} is {gpu.cc}"
        if problem.dtype == "fp8" and problem.head_dim not in self.head_dims:
            return f"{self.name} takes e4m3 inputs at head dim {', '.join(map(str, self.head_dims))}, not {problem.head_dim}"
        return super().supports(gpu, problem)

    @staticmethod
    def register_estimate(params: dict, problem: Problem) -> int:
        """Per consumer thread: S (Bc/2), O (the products' width / 2), P packed (Bc/4, Bc/8 in e4m3), and ~32 for
        addresses, softmax state and descriptors, 4 more without a split. From ptxas: Bc=176 at d=128 fits split=40's
        232 and Bc=128 at d=64 fits three consumers' 160 with no spill (FA3's tiles there); Bc=96
        at d=128 spills 8-48 B in the 168 of no split."""
        packed = 0 if p_in_smem(params, problem) else params["Bc"] // (8 if problem.dtype == "fp8" else 4)
        return params["Bc"] // 2 + prod_cols(params, problem) // 2 + packed + 32 + (0 if params["split"] else 4)

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        cwg, split = params["cwg"], params["split"]
        if cwg == 1 and split:
            return "with one consumer warpgroup every thread already has 255 registers: no split"
        if params["persistent"] and split == 24:
            return "the persistent producer's scheduler state does not fit in 24 registers (ptxas spills): split 0, 32 or 40"
        if split == 32 and not (params["persistent"] and cwg == 3 and tile_dim(problem) == 64):
            return ("split=32 is for FA3's 192-row tile at d=64, persistent (a warp-wide producer in 32 registers); "
                    "elsewhere 24 or 40 give the consumers as much, or ptxas spills")
        if params["tma_store"] and not params["persistent"]:
            return "a TMA-stored O pays where the warp has a next work tile to start: persistent only"
        if params["tma_store"] and cwg == 3:
            return "three persistent consumers have no registers left for the TMA epilogue (ptxas spills)"
        if params["tma_store"] and tile_dim(problem) % 64:
            return f"a TMA-stored O goes out in 64-column panels: not at head dim {problem.head_dim}"
        if problem.dtype == "fp8":
            if params["Bc"] % 128:
                return "fp8 P V reads V^T in whole panels of 128 keys: Bc must be 128"
            if split == 24:
                return "the fp8 V transposers need more than the producer's 24 registers: split 0 or 40"
        if params["chain"] and not (params["persistent"] and params["overlap"] and cwg == 2):
            return "chaining work tiles (the next one's first S with this one's last P V) is for two persistent, overlapped consumers"
        if params["chain"] and not split:
            return "a chained tile's epilogue runs beside the next tile's S: without a register split ptxas spills"
        if params["pingpong"] and cwg < 2:
            return "ping-pong takes turns between two or three consumer warpgroups"
        if persistent_three_spill(params, problem):
            return "three persistent consumers under a causal mask at d=96 spill (ptxas): persistent 0 or cwg 2"
        need, have = self.register_estimate(params, problem), consumer_regs(cwg, split)
        if need > have:
            return f"consumers need about {need} registers, {cwg} warpgroup(s) with split={split} give {have}"
        return None

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        # From the H100 ablations in benchmarks/PERF_NOTES.md (bf16): at d=128 two consumers with overlap,
        # Bc=176 with ping-pong first, persistent Bc=128 for short sequences (TMA-stored O for
        # causal ones); at d=64 FA3's 192 x 128 (three consumers of Bc=128 taking turns), on the
        # grid for long sequences and persistent (split=32) for short ones, and two persistent
        # consumers with a TMA-stored O for short causal ones, chaining their work tiles.
        d = problem.head_dim
        keys = ("Bc", "stages", "cwg", "split", "overlap", "pingpong", "persistent", "tma_store")
        if problem.dtype == "fp8":   # FA3's fp8 tiles are wider; Bc=128 is what V^T's panels allow
            # H100, 8 trials per shape at d=128: three stages without ping-pong won 5 of 6 shapes
            if d <= 64:   # 64-byte rows: room for three consumers (192 x 128, FA3's 192 x 160 in spirit)
                cands = [(128, 3, 2, 40, 1, 0, 1, 0), (128, 2, 3, 40, 1, 1, 1, 0), (128, 2, 3, 40, 1, 1, 0, 0),
                         (128, 3, 2, 40, 1, 0, 0, 0)]
            elif d <= 128:
                cands = [(128, 3, 2, 40, 1, 0, 0, 0), (128, 3, 2, 40, 1, 0, 1, 0), (128, 2, 2, 40, 1, 1, 0, 0),
                         (128, 3, 2, 40, 1, 1, 1, 0)]
            else:
                cands = [(128, 2, 1, 0, 1, 0, 0, 0), (128, 2, 1, 0, 1, 0, 1, 0)]
            return [dict(zip(keys, c), chain=0) for c in cands]
        if d <= 64:
            cands = [(128, 2, 3, 24, 1, 1, 0, 0), (128, 2, 3, 32, 1, 1, 1, 0), (128, 2, 2, 40, 1, 1, 1, 1), (96, 2, 3, 24, 1, 1, 0, 0),
                     (96, 2, 3, 40, 1, 1, 1, 0), (128, 3, 2, 40, 1, 1, 1, 1), (176, 2, 2, 24, 1, 1, 0, 0)]
            if two_consumers_pay(gpu, problem):   # 192-row blocks leave a wave short: the first seeds at two (j3, b2),
                wide = [(176, 3, 2, 24, 1, 1, 0, 0)] if wide_keys_pay(problem) else []   # where the keys fill 176 (x6)
                cands = wide + [(128, 2, 2, 24, 1, 1, 0, 0)] + cands
        elif d <= 128 and half_panels(problem):   # d = 72-96: Bc 128 won its searches (w1, w2)
            cands = [(128, 2, 2, 40, 1, 1, 1, 0), (128, 2, 3, 24, 1, 1, 0, 0), (128, 2, 2, 24, 1, 0, 0, 0), (128, 2, 2, 24, 1, 1, 0, 0),
                     (64, 3, 3, 0, 1, 1, 0, 0), (176, 2, 2, 24, 1, 1, 0, 0)]
            if three_consumers_pay(gpu, problem):   # long rows at d = 72-96: Phi-2's 8k winner's form first (j2)
                three = (128, 2, 3, 40, 1, 1, 1, 0)
                if persistent_three_spill(dict(zip(keys, three)), problem):
                    three = (128, 2, 3, 24, 1, 1, 0, 0)   # its grid form
                cands.insert(0, three)
        elif d <= 128:
            cands = [(176, 2, 2, 24, 1, 1, 0, 0), (176, 2, 2, 40, 1, 1, 1, 0), (128, 2, 2, 40, 1, 1, 1, 0),
                     (128, 2, 2, 40, 1, 1, 1, 1), (128, 2, 2, 40, 1, 0, 1, 0), (128, 2, 2, 24, 1, 0, 0, 0),
                     (128, 3, 2, 24, 1, 0, 0, 0)]
        else:  # no persistent seed: its extra state spills a few bytes at d=256
            cands = [(80, 2, 2, 24, 1, 1, 0, 0), (64, 2, 2, 24, 1, 0, 0, 0), (64, 2, 1, 0, 0, 0, 0, 0)]
        seeds = [dict(zip(keys, c), chain=0) for c in dict.fromkeys(cands)]   # (an inserted first seed may repeat one)
        if d <= 64 and problem.causal:   # chained work tiles: short causal ones (h16)
            seeds.append(dict(zip(keys, (128, 3, 2, 40, 1, 1, 1, 1)), chain=1))
        return seeds

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        split = params["split"]
        return {
            "BC": params["Bc"],
            "STAGES": params["stages"],
            "CWG": params["cwg"],
            "PRODUCER_REGS": split,
            "CONSUMER_REGS": consumer_regs(params["cwg"], split) if split else 0,
            "OVERLAP": params["overlap"],
            "PINGPONG": params["pingpong"],
            "PERSISTENT": params["persistent"],
            "TMA_STORE": params["tma_store"],
            "CHAIN": params["chain"],
            "HEAD_DIM": tile_dim(problem),
            "D_VALID": problem.head_dim,
            "PROD_COLS": prod_cols(params, problem),
            "PANEL_COLS": tile_panel(tile_dim(problem), DTYPE_BYTES[problem.dtype]),
            "P_SMEM": int(p_in_smem(params, problem)),
            "K_TAIL": k_tail(params, problem),
            "IN_DTYPE": ELEM_CODE[problem.dtype],
            **self.mask_defines(problem),
        }

    def smem_bytes(self, params: dict, problem: Problem) -> int:
        d, esize = tile_dim(problem), DTYPE_BYTES[problem.dtype]
        rings = 3 if problem.dtype == "fp8" else 2   # K, V (and V^T)
        o_stage = 2 * d * 64 * params["cwg"] if params["tma_store"] else 0   # 16-bit O, Br x d
        q_bufs = 2 if params["chain"] else 1   # chaining loads the next tile's Q under this one
        p_bufs = params["cwg"] * 8192 * ceil_div(params["Bc"], 64) if p_in_smem(params, problem) else 0
        k_cols = prod_cols(params, problem) if k_tail(params, problem) else d   # K's ring row
        k_stage = ceil_div(esize * k_cols * params["Bc"], 1024) * 1024   # on the swizzle's 1 KB
        ring_stages = k_stage + (rings - 1) * esize * d * params["Bc"]   # V's (and V^T's): the tile
        return esize * d * q_bufs * 64 * params["cwg"] + params["stages"] * ring_stages + p_bufs + o_stage + _BARRIER_SLACK

    def launch(self, params: dict, problem: Problem, gpu: GpuSpec) -> Launch:
        qblocks = ceil_div(problem.seqlen_q, 64 * params["cwg"])
        bh = problem.batch * problem.heads
        grid = (min(qblocks * bh, gpu.sm_count), 1, 1) if params["persistent"] else (qblocks, bh, 1)
        return Launch(
            grid=grid,
            block=(128 * (params["cwg"] + 1), 1, 1),
            smem_bytes=self.smem_bytes(params, problem),
        )

    def render(self, params: dict, problem: Problem) -> str:
        text = super().render(params, problem)
        return text.replace(_WGMMA_MARK, wrappers((params["Bc"], prod_cols(params, problem)), problem.dtype), 1)

    def param_kinds(self, params: dict) -> tuple[str, ...]:
        # the tensor maps of q, k, v and O (by value; O's unread without tma_store), K's tail
        # panel's (unread without one: k_tail), the batch, and the persistent scheduler's counter
        return super().param_kinds(params) + ("tmap",) * 5 + ("i32", "ptr")

    def arg_maker(self, params: dict):
        return _Sm90Args(64 * params["cwg"], params["Bc"], bool(params["tma_store"]), bool(params["persistent"]))

    @staticmethod
    def schedule(params: dict, persistent: bool, problem: Problem) -> dict:
        """`params` run persistent or on the grid, with a producer split that schedule allows: the
        persistent producer's state needs more than 24 registers (32 only for FA3's 192-row tile at
        d=64, 40 elsewhere), and split 32 exists only for that persistent producer (24 on the grid)."""
        split = params["split"]
        if persistent and split == 24:
            split = 32 if params["cwg"] == 3 and problem.head_dim == 64 else 40
        elif not persistent and split == 32:
            split = 24
        return dict(params, persistent=int(persistent), split=split)

    def served_form(self, params: dict, gpu: GpuSpec, problem: Problem) -> tuple[KernelFamily, dict]:
        # a persistent config runs in clusters of two sharing K/V (flash_fwd_sm90_pairs.pairs_form, its
        # tail cut too) where that pays, else its last two rounds cut (flash_fwd_sm90_tail.tail_form)
        # where the last round would leave SMs idle; the variants made from this family (split, tail,
        # pairs, varlen) run as they are
        if not self.cuts_tail:
            return self, params
        from tuner.kernel_templates.flash_fwd_sm90_pairs import FAMILY as pairs
        from tuner.kernel_templates.flash_fwd_sm90_tail import FAMILY as tail

        if (paired := pairs.pairs_form(params, gpu, problem)) is not None:
            return pairs, paired
        cut = tail.tail_form(params, gpu, problem)
        return (self, params) if cut is None else (tail, cut)


_MAP_SOURCES = (0, 1, 2, 3, 1)   # the maps' tensors (q, k, v, o, then k's tail panel)


class _Sm90Args(AttentionArgs):
    """flash_fwd_sm90's arguments: the shared ones, then the maps of q, k, v, O and K's tail panel
    (a MapSlot per layout, so a new address is patched, not encoded), the batch and the tile
    counter."""

    def __init__(self, q_rows: int, kv_rows: int, tma_store: bool, persistent: bool) -> None:
        super().__init__()
        self._rows, self._tma_store, self._persistent = (q_rows, kv_rows), tma_store, persistent

    def bind(self, q, k, v, o, scale):
        shared = super().bind(q, k, v, o, scale)
        if shared is None:
            return None
        kv_rows = self._rows[1]
        tail = tail_panel(self._tma_store, k.shape[-1], k.element_size())
        slots = (self.q_slot(q, k), MapSlot(k, kv_rows, map_panel(k)), MapSlot(v, kv_rows, map_panel(v)),
                 MapSlot(o, O_BOX_ROWS, map_panel(o)) if self._tma_store else None,
                 MapSlot(k, kv_rows, tail) if tail else None)
        return shared, slots, q.shape[0]

    def paged(self, box_rows: int, held: int) -> _Sm90Args:
        """These arguments on a paged KV cache (flash_fwd_sm90_cache, CACHE_PAGES): k and v are its
        (num_pages, Hk, page, D) views, whose maps take boxes of `box_rows` (a slot of a page), and
        a sequence can hold `held` keys (the kernel's nk)."""
        self._rows, self.held = (self._rows[0], box_rows), held
        return self

    def q_slot(self, q, k) -> MapSlot:
        """Q's maps: boxes of a query block's rows of one head."""
        return MapSlot(q, self._rows[0], map_panel(q))

    def values(self, bound, pointers, q):
        shared, slots, batch = bound
        return pointers + shared + maps_at(slots, pointers, _MAP_SOURCES) + (batch, tile_counter_ptr(q.get_device()) if self._persistent else 0)

    def address_fields(self, bound):
        shared, slots, _ = bound
        maps = map_fields(slots, 5 + len(shared), _MAP_SOURCES)   # the maps follow the shared values
        return None if maps is None else super().address_fields(bound) + maps


class VarlenFlashFwdSm90(VarlenVariant, FlashFwdSm90):
    """flash_fwd_sm90 on packed sequences: persistent (the producer's warp finds each drawn tile's
    sequence, kernel_templates/tile_scheduler.cuh) or a grid (every block finds its own), O by
    ordinary stores (a TMA store box could cross into the next sequence), 16-bit inputs."""

    name = "flash_fwd_sm90_varlen"
    cuts_tail = False

    def block_rows(self, params: dict) -> int:
        return 64 * params["cwg"]

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        if params["tma_store"] or params["chain"]:
            return "varlen stores O by ordinary stores, unchained: tma_store and chain 0"
        return super()._check(params, gpu, problem)

    def from_tuned(self, params: dict, problem: Problem) -> dict:
        # the same tile, persistent where the consumers keep their registers under its split
        persistent = self.schedule(dict(params, tma_store=0, chain=0), True, problem)
        if (self.register_estimate(persistent, problem) <= consumer_regs(persistent["cwg"], persistent["split"])
                and not persistent_three_spill(persistent, problem)):
            return persistent
        return self.schedule(persistent, False, problem)

    def packed_launch(self, params: dict, problem: Problem, gpu: GpuSpec, total_q: int, total_k: int) -> Launch:
        grid = super().packed_launch(params, problem, gpu, total_q, total_k)
        if not params["persistent"]:
            return grid
        # one CTA per SM, at most one per work tile; the producers find where the tiles end
        return Launch(grid=(min(grid.grid[0] * grid.grid[1], gpu.sm_count), 1, 1), block=grid.block,
                      smem_bytes=grid.smem_bytes)


FAMILY = FlashFwdSm90()
VARLEN_FAMILY = VarlenFlashFwdSm90()
