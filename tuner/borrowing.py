"""Which tuned entry a call may borrow: a lookup entry is tuned on one shape and serves its bucket and,
up to tuner.dispatch.NEAREST_OCTAVES away (or at any distance for a call that fills the GPU), its
neighbours' calls. Its config carries across shapes by its work per CTA (KernelFamily.adapt), except
where the shape it was tuned on is unlike the call in a way its search weighed: query blocks that left
SMs idle, the smallest work class, short rows of keys, keys split across CTAs. These rules say where a
borrowed entry misfits a call that fills the GPU (Dispatcher.select then runs the defaults weighed
afresh, tuner.untuned, or the nearest entry that fits), each with what it measured."""

from __future__ import annotations

from .problem import DECODE_QUERIES, WORK_CLASSES, Bucket, Problem

# Past dispatch.NEAREST_OCTAVES, a prefill call whose work fills the GPU (a query block of FILL_ROWS rows per
# SM at least) still borrows the nearest tuned bucket, at any distance (Dispatcher.select).
FILL_ROWS = 128
# Keys a call has at least where a config borrowed from the smallest work class gives way to a larger
# class's or flash_fwd_sm90's default (_tuned_on_few_heads): "r2"'s rows were 1415-27143 keys long.
DEFAULT_KEYS = 1024
# A call that fills the GPU passes over a borrowed entry tuned on fewer than FEW_WAVES waves of query
# blocks where it has MISFIT_BLOCKS times as many, and an unmasked one over an entry tuned under one
# wave (_tuned_on_few_blocks).
FEW_WAVES = 2
MISFIT_BLOCKS = 4
# A call that fills the GPU passes over a borrowed entry tuned on rows of DEFAULT_KEYS keys or fewer
# where it has MISFIT_KEYS times as many (_tuned_on_short_keys).
MISFIT_KEYS = 4


def fills_gpu(problem: Problem, gpu) -> bool:
    """Whether `problem` may borrow a tuned bucket of any distance: a prefill call (more queries
    than decode takes: decode has flash_decode's default) with a query block of FILL_ROWS rows per
    SM at least. A tuned config's work per CTA holds across lengths and batches (long prompts past
    the tuned 16k, chunks after 64k keys: 1.9-2.5x SDPA where measured, PERF_NOTES "p1", "p2"); a
    config tuned where the blocks filled the GPU is no guide where they leave SMs idle, and such a
    call that nothing near serves runs a default (split_default, prefill_default)."""
    return problem.seqlen_q > DECODE_QUERIES and problem.query_blocks(FILL_ROWS) >= gpu.sm_count


def tuned_problem(entry: dict) -> Problem | None:
    """The problem a lookup entry was tuned (a kernel) or measured (an SDPA backend) on; None where
    it names none."""
    measured = entry.get("problem")
    return Problem.from_dict(measured) if isinstance(measured, dict) else None


def tuned_here(entry: dict, problem: Problem) -> Problem | None:
    """The problem `entry` was tuned on where that is in `problem`'s own bucket (its search there
    weighed the alternatives a served-form rule would offer at such a call); None otherwise."""
    tuned = tuned_problem(entry)
    return tuned if tuned is not None and entry.get("bucket") == problem.bucket().key else None


def misfit(dist: float, entry: dict, problem: Problem, gpu) -> bool:
    """Whether `entry`, `dist` octaves away, is borrowed from a shape unlike a call that fills the GPU:
    over DEFAULT_KEYS keys, one of the smallest work class (`_tuned_on_few_heads`) or tuned on under
    FEW_WAVES waves of query blocks where the call has MISFIT_BLOCKS times as many; at any length,
    one tuned under one wave where the call is unmasked (`_tuned_on_few_blocks`); one of short rows
    of keys where the call has MISFIT_KEYS times as many (`_tuned_on_short_keys`), or a split entry
    (`split_entry`). Its own bucket's entries always serve."""
    return dist > 0 and (_tuned_on_few_heads(entry, problem) or _tuned_on_few_blocks(entry, problem, gpu)
                         or _tuned_on_short_keys(entry, problem) or split_entry(entry))


def split_entry(entry: dict) -> bool:
    """Whether `entry` is flash_fwd_sm90_split's: its tile was chosen to split the keys of a call
    whose blocks leave SMs idle (no persistence), and a call that fills the GPU runs it with one or
    two splits: the split default weighs the keys' split for the call instead. On the H200 the 17
    random calls it changed read 0.99-1.49x (B1-H12-N1536x4813 d=64: 303.9 TFLOP/s at
    flash_fwd_sm90's default against 205.0 at two splits; B4-H3-N3144x18763: 453 in three splits of
    the split default against 370; the nearest plain entry read 0.78-0.90x the defaults on four,
    PERF_NOTES "b1", "b2")."""
    return entry["family"] == "flash_fwd_sm90_split"


def split_tuned_where_idle(entry: dict, gpu) -> bool:
    """Whether `entry` is a split entry (`split_entry`) tuned on a shape whose query blocks left SMs
    idle: its search weighed splitting the keys of that shape, not of a call of its bucket that fills
    the GPU. Such a call runs the defaults, weighed afresh, where they take three consumers (192-row
    tiles, at d <= 96: flash_fwd_sm90.three_consumers_pay); elsewhere the entry still serves. On the
    H200 (PERF_NOTES "x5"), 23 calls of seven buckets that fill the GPU, timed in turns: where the
    defaults take three consumers (one d=64 bucket, 3 calls) 1.27-1.47x the entry (B1-H25 931 x 30369
    bottom-right 527.2 TFLOP/s against 357.7; FA4 504.2 in another run), 8 more held out 1.20-1.36x;
    where they take two, 0.87-1.16x, 6 of 20 under 0.97 (a tuned config at one split against the
    plain default)."""
    tuned = tuned_problem(entry)
    return split_entry(entry) and tuned is not None and not fills_gpu(tuned, gpu)


def split_runs_whole(entry: dict, problem: Problem, gpu) -> bool:
    """Whether `entry` is a split entry (`split_entry`) that runs `problem`, a call whose query
    blocks leave SMs idle (not `fills_gpu`), in one split: the plain Hopper kernel on a tile chosen
    to split another shape's keys. Such a call runs the defaults weighed afresh (the split default
    where it splits, else flash_fwd_sm90's). On the H200 (PERF_NOTES "x8"), of the 78 random calls
    (seeds 0-299) that ran so, 24 timed in turns read 0.964-1.144x the entry under this rule (1.018x
    geomean): level on 16 short rows (1-3.6k keys) of one d=128 bucket whose entry has Bc 128 and two
    stages, 1.04-1.06x on d=64 calls at flash_fwd_sm90's default and 1.08-1.14x on three at the split
    default's, 1.03-1.04x on 10-16k keys of a d=128 bucket of three stages; 30 held out read
    0.923-1.151x (1.020x, 21 faster; the two under 0.97 had under 1.7k keys)."""
    from .dispatch import served_params
    from .kernel_templates import FAMILIES

    fam = FAMILIES.get(entry["family"])
    if not split_entry(entry) or fam is None or tuned_problem(entry) is None or fills_gpu(problem, gpu):
        return False
    return fam.splits(served_params(entry, problem), problem, gpu) == 1


def _tuned_on_few_blocks(entry: dict, problem: Problem, gpu) -> bool:
    """Whether `entry` was tuned on fewer than FEW_WAVES waves of FILL_ROWS-row query blocks and
    serves a call of MISFIT_BLOCKS times as many over DEFAULT_KEYS keys, or was tuned under one wave
    and serves an unmasked call (which fills the GPU: `misfit`) of any length. A search on one or two
    waves weighs the last wave's idle SMs (persistent schedules, a TMA store, split keys), which a
    call of many waves does not have: on the H200 (PERF_NOTES "n2") B1-H25 6805 x 1639 keys at d=64
    (1350 blocks) ran its neighbour's config tuned on 240 blocks at 373 TFLOP/s, the next bucket's
    (640 blocks) at 479; causal 3588 x 11838 (725 blocks) the n1024 bucket's, tuned on 96, at 400,
    flash_fwd_sm90's default at 506. Within 4x the borrowed config holds (B1-H25 2007 x 5137, 400
    blocks: the 240-block entry read 399, the 96-block one 345). A search under one wave never
    weighed a last wave at all, where all of an unmasked call's tiles are equal and the schedule
    decides how many SMs the last wave idles: the d=80 n1024/small bucket's grid config (tuned on
    128 blocks) served unmasked calls of 1.25-3.9x as many at 0.74-0.99x flash_fwd_sm90's default
    (B1-H8 2505 x 3773: 299.8 against 405.2); of the 18 random calls this moves on the H200 17 read
    1.01-1.56x what served before, one 0.90x (PERF_NOTES "x2"). Short rows too (no DEFAULT_KEYS floor
    since "x9"): the 33 random calls of 73-962 keys (seeds 0-299) it then moved read 0.99-1.41x, 1.15x
    geomean (B16-H8 1024 x 77 cross-attention at d=80: 119.2 TFLOP/s against 89.8). Masked calls'
    tiles are not equal: 20 causal ones that the same rule would move read 0.95-1.05x, so they keep
    the 4x."""
    tuned = tuned_problem(entry)
    if tuned is None:
        return False
    blocks = tuned.query_blocks(FILL_ROWS)
    if blocks < gpu.sm_count and not problem.causal:
        return True
    return (problem.seqlen_k >= DEFAULT_KEYS and blocks < FEW_WAVES * gpu.sm_count
            and problem.query_blocks(FILL_ROWS) >= MISFIT_BLOCKS * blocks)


def _tuned_on_short_keys(entry: dict, problem: Problem) -> bool:
    """Whether `entry` was tuned on rows of DEFAULT_KEYS keys or fewer and serves a call of
    MISFIT_KEYS times as many and DEFAULT_KEYS at least (under that the call's rows are short too:
    an entry tuned on cross-attention's 77 keys keeps serving calls of 300-400). A search on short
    rows weighs what a short main loop leaves exposed (a persistent schedule, a TMA store, pairs of
    tiles), which a long one hides: on the H200 the n1024/large bucket's pairs config, tuned on
    1024 x 1024 self-attention, served B16-H32/kv8 315 x 4896 keys at 458 TFLOP/s where
    flash_fwd_sm90's default read 643, B8-H32/kv4 79 x 6436 at 230 against 472; on 12 random calls
    the default read 1.0-2.05x on 10, 0.97-0.99x on 2 (PERF_NOTES "j1", "j2")."""
    tuned = tuned_problem(entry)
    return (tuned is not None and tuned.seqlen_k <= DEFAULT_KEYS <= problem.seqlen_k
            and problem.seqlen_k >= MISFIT_KEYS * tuned.seqlen_k)


def _tuned_on_few_heads(entry: dict, problem: Problem) -> bool:
    """Whether `entry` is borrowed from a bucket of the smallest work class (batch x heads under 32)
    by a call of a larger one over DEFAULT_KEYS keys or more. A search there weighs configs for a
    GPU its query blocks leave partly idle (persistent schedules, pairs, split keys) and keeps what
    wins at that. On calls that fill the GPU (random shapes of the H200, PERF_NOTES "r1-r3") such
    configs read 0.77-0.92x flash_fwd_sm90's default on all four d=64 and d=256 shapes timed (full
    and bottom-right causal), while configs borrowed from the medium class read 0.98-1.08x of it
    (1.06-1.08x for a d=64 N~1.5k call at B8, two octaves away). Short rows of keys keep the
    borrowed config: its tile was fitted to them (cross-attention on 77 text tokens tuned Bc 80
    where the default has 128), the default to swept rows of 4k-16k."""
    smallest = WORK_CLASSES[0][0]
    try:
        tuned = Bucket.from_key(entry.get("bucket", ""))
    except (TypeError, ValueError):   # an entry that names no bucket
        return False
    return tuned.work == smallest and problem.bucket().work != smallest and problem.seqlen_k >= DEFAULT_KEYS


def three_consumers_untried(entry: dict, problem: Problem, gpu) -> bool:
    """Whether `entry` is a flash_fwd_sm90 config of two consumers serving `problem`, a call where
    the default takes three (flash_fwd_sm90.three_consumers_pay: 192-row tiles make fewer waves x
    rows), tuned on a shape where it takes two: its search weighed three consumers where 128-row
    tiles made the better waves, not at this call. Such a call runs the defaults weighed afresh,
    but not where the default would trade the entry's persistent schedule for the grid (three
    consumers under a mask at d=96, where the persistent form spills). On the H200 (PERF_NOTES
    "x9") it moves 77 of 7200 random calls (seeds 0-299), all d=80, all timed in turns against the
    entry: 55 unmasked of 74-1021 keys 1.09-2.06x (1.34x geomean; B16-H8 7434 x 111: 273.0 TFLOP/s
    against 132.7), 22 causal 1.01-1.10x (1.06x). Nine d=96 causal calls it moved before the
    persistent test read 0.94-1.06x (1.006x)."""
    from .dispatch import served_params
    from .kernel_templates import FAMILIES
    from .kernel_templates.flash_fwd_sm90 import three_consumers_pay

    fam, tuned = FAMILIES.get("flash_fwd_sm90"), tuned_problem(entry)
    if fam is None or entry["family"] != fam.name or tuned is None:
        return False
    params = served_params(entry, problem)
    if params.get("cwg") != 2 or not three_consumers_pay(gpu, problem) or three_consumers_pay(gpu, tuned):
        return False
    return fam.default(gpu, problem)["persistent"] >= params["persistent"]
