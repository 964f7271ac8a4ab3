"""When a GQA call runs flash_fwd_sm90_gqa, the query heads of a K/V head packed into one tile's rows:
the rules for a decode step (`packs`) and for a prefill (`packs_prefill`), each measured on the H200,
and how the dispatcher serves an entry in that form (`packed_gqa`)."""

from __future__ import annotations

from .borrowing import tuned_problem
from .problem import DECODE_QUERIES, Problem
from .untuned import decode_default, prefill_default

# Packed rows (query heads of a K/V head x queries) from which a GQA decode step's kernel entry runs
# as flash_fwd_sm90_gqa (packed_gqa), in a consumer's 64-row wgmma tile, where flash_decode runs m16
# row blocks of mma.sync that each stream the K/V again. On the H200 32 rows read level (0.98-1.03x
# flash_decode), 56 rows 1.56x (8 queries x 7 heads), 64 and more 1.3-3.0x (PERF_NOTES "g1-g3").
PACK_ROWS = 48
# Past d=128 from fewer: flash_decode's m16 row blocks each hold a 256-wide accumulator row and stream
# the K/V again, where the packed kernel's one consumer takes 64 rows a K/V tile. On the H200 (bf16,
# d=256, PERF_NOTES "n2") 16 rows read 1.10-1.48x what served before on three steps, 24-40 rows
# 1.59-2.28x on four.
PACK_ROWS_WIDE = 16
# At d <= 128 a step of PACK_ROWS_LONG packed rows or more packs over PACK_ROWS_LONG_KEYS keys: its
# K/V stream then outweighs the packed tile's idle rows. On the H200 (PERF_NOTES "x13", bf16, d=128,
# 44 random steps of 28-32 rows that flash_decode served, timed in turns) the 32 over 3000 keys read
# 1.12x geomean packed (0.75-1.83x, 27 of 32 at or above 1: B64-H16/kv4 8 x 28897 138.8 TFLOP/s
# against 113.9, B1-H14/kv2 4 x 13430 1.83x), the 12 under it 0.93x (0.64-1.17x).
PACK_ROWS_LONG = 28
PACK_ROWS_LONG_KEYS = 3000
# Past d=128 under PACK_ROWS_WIDE rows, a step packs where the packed grid (K/V heads x splits) makes
# this share of the SMs' CTAs or more. Once the maps streamed token-major K/V at full bandwidth
# ("i1"), 2-8 rows read 1.03-1.24x what served on 24 of the 2003 random calls whose grid was that
# large (B8-H8/kv4 x 2586 keys: 38.1 µs against 44.9), where 8 smaller grids read 0.47-0.83x: a CTA
# walks its keys alone (B2-H4/kv2 x 1669, 4 CTAs: 34.2 µs against flash_decode's 16.1) or a head's
# many splits wait on one merge (B1-H2/kv1 x 55404, 14 CTAs: 75.6 against 39.1; PERF_NOTES "y1").
PACK_FEW_ROWS_SM_SHARE = 0.25

# A GQA prefill call of our Hopper kernels runs flash_fwd_sm90_gqa's default (`packs_prefill`; Bc 176,
# split 24 on these calls) where the query heads of a K/V head packed into two consumers' blocks fill
# them PACK_PREFILL_FILL_GAIN times as well as each head's queries do (short rows: a chunk of a
# prompt, a cross-attention), its packed blocks make PACK_PREFILL_WAVES waves of CTAs or more, over
# PACK_PREFILL_KEYS keys or more, at d <= 128 (past it the packed kernel takes Bc <= 64). On the H200
# (bf16, d=64-128, PERF_NOTES "y1"), once the maps streamed K/V at full bandwidth ("i1"): 1.02-1.37x
# what served on 18 of 19 calls it takes (B4-H16/kv2 517 x 8162 causal_br 743.6 TFLOP/s against 543.7;
# B16-H64/kv8 417 x 6683 738.3 against 622.6, FA4 596.4), 0.99x on one (d=64, 300 x 8192); under
# the old maps ("j1") the same rule lost 0.955-0.973x on 4 of 9. From 1536 keys (4096 before "x3"): of 24
# random d=128 calls under 4096 keys timed in turns, FA4 beside, the 11 over 1536 that the rule takes read
# 1.07-1.37x what served (B8-H64/kv8 151 x 3594 causal_br 569.2 against 416.7, FA4 520.2), one it leaves
# (fill gain 1.11) 1.04x; under 1536 keys 2 of 12 won (1.11-1.16x) and 10 lost 0.64-0.89x (self-attention
# of 265-544 queries, cross-attention over 76-421 keys, B16-H8/kv2 534 x 1247).
PACK_PREFILL_FILL_GAIN = 1.15
PACK_PREFILL_WAVES = 2
PACK_PREFILL_KEYS = 1536
# Under PACK_PREFILL_WAVES waves of packed CTAs a call packs from PACK_PREFILL_FEW_CTAS_KEYS keys, where
# the packed kernel's splits of the keys fill the GPU: of 13 random d=128 GQA chunks of 40-192 packed CTAs
# on the H200 (PERF_NOTES "x3"), the 6 over 6144 keys read 1.10-1.34x what served (B2-H16/kv4 276 x 27118
# bottom-right 578.5 TFLOP/s against the split default's 505.8), the 7 over 1768-4532 keys 0.90-1.02x. Of
# the 55 other random draws it moves, 16 held out: 0.93-1.40x what served, 1.09x geomean, 3 under 1
# (B1-H16/kv4 71 x 7618, 12 CTAs: 0.93x).
PACK_PREFILL_FEW_CTAS_KEYS = 6144
# Where its K and V outgrow PACK_PREFILL_L2_TIMES times the L2, a call packs from a fill gain of
# PACK_PREFILL_L2_FILL_GAIN: every block streams its K/V head, from memory again once they outgrow L2,
# and the packed blocks are fewer. On the H200 (L2 60 MiB; PERF_NOTES
# "x4": random d=128 GQA calls under PACK_PREFILL_FILL_GAIN, the packed default against what served,
# timed in turns): over 120 MB and from 1.05, 0.995-1.21x on 16, 15 over 1, 1.07x geomean (B16-H32/kv8
# 206 x 8722 bottom-right 687.0 TFLOP/s against 567.7); over 120 MB under 1.05, 0.98-1.03x on 15, level;
# under 120 MB 0.85-1.22x on 42, 0.99x geomean (B16-H8/kv2 2169 causal, 34 MB: 0.85x).
PACK_PREFILL_L2_TIMES = 2
PACK_PREFILL_L2_FILL_GAIN = 1.05
# Under PACK_PREFILL_KEYS keys a call packs from PACK_PREFILL_SHORT_KEYS keys where the plain kernel's
# waves of CTAs x rows come out PACK_PREFILL_SHORT_WAVE_GAIN times the packed blocks' (wave_gain): on
# these rows the packed kernel read about 0.72x the plain one's speed per wave (PERF_NOTES "x10", the
# H200, d=128 chunks and cross-attention of 129-397 queries over 718-1419 keys: a wave gain of 2.0 read
# 1.41-1.44x, 1.33-1.4 1.06-1.21x, 1.0 (the same waves, fewer rows) 0.91-1.03x). FA4, which packs such
# rows, read 1.16-1.29x what served on the chunks (B16-H32/kv4 169 x 718 bottom-right 378.8 TFLOP/s
# against 291.9; packed, 336.7). Under 300 keys the packed kernel lost at any fill gain (0.72-0.85x at
# 1.2-1.6); a top-left causal self-attention ("x3": 265-544 queries, 0.64-0.89x) spreads its blocks' work.
PACK_PREFILL_SHORT_KEYS = 700
PACK_PREFILL_SHORT_WAVE_GAIN = 1.3
# Where the packed default runs persistent (flash_fwd_sm90_gqa.persistent_pays: under its
# PERSISTENT_KEYS keys, one split) it packs from PACK_PERSISTENT_KEYS keys and a wave gain of
# PACK_PERSISTENT_WAVE_GAIN, the mask not spreading the blocks' work. On the H200 (PERF_NOTES "x11",
# bf16, d=128, 40 random GQA prefills the rules above left plain, timed in turns): persistent packed
# read 1.05-1.22x what served on all 16 of 317-2775 keys with a wave gain of 1.11-1.5 (B4-H64/kv8 279
# x 1230 bottom-right 1.20x), 0.86-1.01x on 6 of wave gain 1.0 (B1-H32/kv4 1104 x 2229: 0.86x), 0.997x
# at 169 keys; where the mask spreads the work, 0.95-1.09x whatever the gain.
PACK_PERSISTENT_KEYS = 300
PACK_PERSISTENT_WAVE_GAIN = 1.1
# A GQA prefill the split form serves (its blocks leave SMs idle, flash_fwd_sm90_split) runs packed on one
# consumer (`one_consumer_packed`: the packed grid's tile, 64-row blocks, keys split from the occupancy)
# where that form splits the keys into shares of PACK_ONE_CONSUMER_KEYS or fewer: a call of a few
# thousand keys and few blocks, whose time is a CTA's short walk, the merge and the launch. On the H200
# (PERF_NOTES "x12", bf16, d=128, timed in turns against what served) all 38 random draws it moves (seeds
# 0-299) read 0.965-1.157x, 1.075x geomean, 35 faster (B1-H4/kv1 178 x 4410 1.16x, B1-H7/kv1 192 x 3138
# bottom-right 1.15x); the 28 drawn after the threshold was set 1.074x, 26 faster. Longer shares lost
# (B1-H4/kv1 1172 x 25966, 8655 keys a split: 0.72x), and calls the plain grid serves (it fills the
# SMs) 0.61x.
PACK_ONE_CONSUMER_KEYS = 2000


def packed_gqa(entry: dict | None, problem: Problem, gpu, timed_packed: bool = False) -> dict | None:
    """`entry`, or where it is a kernel of ours (flash_decode's, tuned or default, or the plain or
    split Hopper kernel's) serving a GQA decode step whose query heads x queries make PACK_ROWS packed
    rows or more (PACK_ROWS_LONG over PACK_ROWS_LONG_KEYS keys; past d=128 PACK_ROWS_WIDE, or fewer
    on a grid that fills the GPU: `packs`),
    flash_fwd_sm90_gqa's default: the Hopper kernel with those rows in its wgmma tile, each K/V tile
    loaded once for them. On the H200 (PERF_NOTES "g1-g3", bf16, against the entries they had): 16
    queries x 8 heads 3.0x flash_decode (0.89x FlashAttention-4, 1.49x at B8), 64 queries x 4 heads
    1.30x flash_fwd_sm90's borrowed prefill config, 16 queries x 5-7 heads 1.84-2.35x; 28-32 rows
    1.12x over 3000 keys ("x13"), 0.93x under, where flash_decode keeps them. A measured SDPA
    backend keeps its bucket; where flash_fwd_sm90_gqa cannot run the call (one query head per K/V
    head, not Hopper, 8-bit, a group wider than its tiles), `entry` as it is. The other way round, a
    flash_fwd_sm90_gqa entry tuned on a problem that packs (a user's search of a decode bucket may
    have kept one) serves a step that does not pack with flash_decode's default. A prefill call:
    `_packed_prefill` (`timed_packed`: whether the entry's bucket search timed the packed family)."""
    from .kernel_templates import FAMILIES, configs_family

    fam = FAMILIES.get("flash_fwd_sm90_gqa")
    if fam is None or entry is None:
        return entry
    if not problem.decode_step:
        return _packed_prefill(entry, problem, gpu, timed_packed)
    few = not packs(problem, gpu)
    if entry["family"] == fam.name and few and _tuned_packs(entry, gpu):
        # tuned on a step that packs (a bucket mixes groups and lengths): where this one does not,
        # flash_decode reads level or ahead
        return decode_default(problem, gpu) or entry
    if (configs_family(entry["family"]) not in ("flash_decode", "flash_fwd_sm90", "flash_fwd_sm90_split")
            or few or fam.supports(gpu, problem)):
        return entry
    try:
        params = fam.default(gpu, problem)
    except ValueError:   # no valid config: a group wider than every tile
        return entry
    return {"family": fam.name, "params": params}


def _packed_prefill(entry: dict, problem: Problem, gpu, timed_packed: bool = False) -> dict:
    """`entry`, or where it is a config of our Hopper prefill kernels serving a call that
    `packs_prefill`, flash_fwd_sm90_gqa's default. A measured SDPA backend keeps its bucket, and so
    does an entry of the call's own bucket where that bucket's search timed the packed family beside
    it (`timed_packed`: the bucket holds a packed entry too). Not inferred from the rule: a lookup
    tuned before the rule took the bucket's problems never timed it. A split entry of a call that
    does not pack serves `one_consumer_packed` where that form takes the call. The other way round, a
    packed entry borrowed for a prefill that does not pack serves flash_fwd_sm90's default."""
    from .kernel_templates import FAMILIES, configs_family

    fam = FAMILIES["flash_fwd_sm90_gqa"]
    if entry["family"] == fam.name:
        return entry if packs_prefill(problem, gpu) else (prefill_default(problem, gpu) or entry)
    if timed_packed and entry.get("bucket") == problem.bucket().key:
        return entry
    if configs_family(entry["family"]) not in ("flash_fwd_sm90", "flash_fwd_sm90_split") or not packs_prefill(problem, gpu):
        one = entry["family"] == "flash_fwd_sm90_split" and one_consumer_packed(problem, gpu)
        return {"family": fam.name, "params": one} if one else entry
    params = fam.default(gpu, problem)
    return entry if fam.check(params, gpu, problem) is not None else {"family": fam.name, "params": params}


def packs_prefill(problem: Problem, gpu) -> bool:
    """Whether a GQA prefill call runs packed (_packed_prefill): at d <= 128 over PACK_PREFILL_KEYS
    keys or more, its packed rows filling two consumers' blocks PACK_PREFILL_FILL_GAIN times as well
    as its query rows fill the plain kernel's (PACK_PREFILL_L2_FILL_GAIN times where its K/V outgrow
    PACK_PREFILL_L2_TIMES times the L2), in PACK_PREFILL_WAVES waves of CTAs or more, or in fewer over
    PACK_PREFILL_FEW_CTAS_KEYS keys (its splits of them fill the GPU); over PACK_PREFILL_SHORT_KEYS
    keys, where the plain kernel's waves come out PACK_PREFILL_SHORT_WAVE_GAIN times the packed ones' and
    the mask does not spread the blocks' work (flash_fwd_sm90.mask_spreads); and from PACK_PERSISTENT_KEYS keys
    at a wave gain of PACK_PERSISTENT_WAVE_GAIN where the packed default runs persistent."""
    from .kernel_templates import FAMILIES
    from .kernel_templates.flash_fwd_sm90 import mask_spreads
    from .kernel_templates.flash_fwd_sm90_gqa import fill_gain, packed_blocks, wave_gain

    fam = FAMILIES.get("flash_fwd_sm90_gqa")
    if (fam is None or problem.seqlen_q <= DECODE_QUERIES or problem.head_dim > 128
            or problem.seqlen_k < PACK_PERSISTENT_KEYS or fam.supports(gpu, problem)):
        return False
    # counted in whole waves: not where the mask makes blocks differ
    waves = 0.0 if mask_spreads(problem) else wave_gain(problem, gpu)
    if waves >= PACK_PERSISTENT_WAVE_GAIN and fam.default(gpu, problem)["persistent"]:
        return True
    if problem.seqlen_k < PACK_PREFILL_SHORT_KEYS:
        return False
    if problem.seqlen_k < PACK_PREFILL_KEYS:
        return waves >= PACK_PREFILL_SHORT_WAVE_GAIN
    ctas = packed_blocks(dict(cwg=2), problem) * problem.batch * problem.kv_heads
    gain = fill_gain(problem)
    fills = gain >= PACK_PREFILL_FILL_GAIN or (
        gain >= PACK_PREFILL_L2_FILL_GAIN and problem.kv_bytes >= PACK_PREFILL_L2_TIMES * gpu.l2_bytes)
    return fills and (ctas >= PACK_PREFILL_WAVES * gpu.sm_count or problem.seqlen_k >= PACK_PREFILL_FEW_CTAS_KEYS)


def one_consumer_packed(problem: Problem, gpu) -> dict | None:
    """flash_fwd_sm90_gqa's grid seed for a prefill at one consumer (no ping-pong, the registers all
    the consumer's), where it splits the call's keys into shares of PACK_ONE_CONSUMER_KEYS or fewer
    (the occupancy's count, two or more); None elsewhere, at d > 128, or where it does not run the call."""
    from .kernel_templates import FAMILIES
    from .kernel_templates.flash_fwd_sm90 import at_one_consumer

    fam = FAMILIES.get("flash_fwd_sm90_gqa")
    if (fam is None or problem.seqlen_q <= DECODE_QUERIES or problem.head_dim > 128
            or fam.supports(gpu, problem)):
        return None
    params = at_one_consumer(next(s for s in fam.seeds(gpu, problem) if not s["persistent"]))
    if fam.check(params, gpu, problem) is not None:
        return None
    splits = fam.splits(params, problem, gpu)
    return params if splits >= 2 and problem.seqlen_k <= PACK_ONE_CONSUMER_KEYS * splits else None


def pack_rows(problem: Problem) -> int:
    """The packed rows (query heads of a K/V head x queries) from which a GQA decode step of
    `problem`'s head dim runs packed (packed_gqa) at any length: PACK_ROWS, past d=128
    PACK_ROWS_WIDE (`packs` adds the steps of fewer rows that pack)."""
    return PACK_ROWS_WIDE if problem.head_dim > 128 else PACK_ROWS


def packs(problem: Problem, gpu) -> bool:
    """Whether a GQA decode step runs packed (packed_gqa): from `pack_rows` packed rows; at d <= 128
    from PACK_ROWS_LONG over PACK_ROWS_LONG_KEYS keys; past d=128 from fewer where
    flash_fwd_sm90_gqa's default grid fills PACK_FEW_ROWS_SM_SHARE of the SMs."""
    from .kernel_templates import FAMILIES
    from .kernel_templates.flash_fwd_sm90_gqa import packed_rows

    rows = packed_rows(problem)
    if rows >= pack_rows(problem):
        return True
    if problem.head_dim <= 128:
        return rows >= PACK_ROWS_LONG and problem.seqlen_k >= PACK_ROWS_LONG_KEYS
    fam = FAMILIES.get("flash_fwd_sm90_gqa")
    if fam is None or fam.supports(gpu, problem):
        return False
    try:
        grid = fam.launch(fam.default(gpu, problem), problem, gpu).grid
    except ValueError:   # no valid config
        return False
    return grid[0] * grid[1] * grid[2] >= PACK_FEW_ROWS_SM_SHARE * gpu.sm_count


def _tuned_packs(entry: dict, gpu) -> bool:
    """Whether the problem `entry` was tuned on packs by the decode rule (`packs`: a prefill's many
    rows do); False where it names none."""
    tuned = tuned_problem(entry)
    return tuned is not None and packs(tuned, gpu)
