"""flash_fwd_sm90_split: flash_fwd_sm90 with each query block's keys split across CTAs.

A call whose query blocks x heads leave most SMs idle runs the Hopper kernel on a few of them: a
tensor-parallel shard (8 query heads, 1 K/V head) prefilling a 512-query chunk against 32k cached
keys is 32 work tiles on 132 SMs, and read 205 TFLOP/s against SDPA flash's 303 (benchmarks/
PERF_NOTES.md, "p1"). Here the grid's z splits each block's K/V tiles `splits` ways (0: from the
occupancy, `auto_splits`); each split writes its share of O and the LSE to the decode workspace
(decode_workspace.py) and the block's last split merges them (kernel_templates/split_kv.cuh).

The space is the grid kernel's tiles that long sequences tune to (two or three consumers taking
turns, overlapped), with no persistence, TMA store or chaining: one work tile per CTA. A search of
every family tunes it only where the work tiles leave SMs idle (`tune_skip`); it still runs any
call, with one split where the tiles fill the GPU, so that its entry serves a bucket's calls of
every batch (B1 x 32 heads x 100 queries wants the split, B7 the plain grid, one bucket). Where it
would run one split with more padding rows than the bucket's flash_fwd_sm90 entry, that entry
serves instead (`gives_way`).
"""

from __future__ import annotations

from tuner.family import ceil_div
from tuner.gpu import GpuSpec
from tuner.kernel_templates.flash_decode import call_grid, split_workspace
from tuner.kernel_templates.flash_fwd_sm90 import FlashFwdSm90, _Sm90Args, consumer_cost, cta_rows, row_cost, two_consumers_pay
from tuner.launch import Launch
from tuner.problem import Problem

MAX_SPLITS = 16   # at most 32: the merge reads one split's LSE per lane
MAX_WAVES = 4     # the most waves of CTAs (one per SM) the occupancy's count may make
# What one split's partial costs a query row (its O and LSE written, then read by the merge), in
# keys of the main loop, and the merge's tail once a launch: each block's last split merges the
# partials behind the launch's last wave, a few dependent trips to L2 a row, which a long launch
# hides and a short one pays whole. Both in query rows x keys of the main loop (the tail's trips
# carry d columns as the main loop's keys do: one figure for every head dim). Fitted on the H200
# (PERF_NOTES "j3", the merge of "j1" that keeps a warp's rows in flight) to 18 calls timed at 1, 2,
# 4, 8 and 16 splits in the same turns: the occupancy's count reads the fastest of them on all 18
# (or an untimed count between the fastest and a close neighbour), where the constants fitted to the
# row-by-row merge (235 a partial; the tail, 1100 x 128/d, weighed by split_form alone) missed on 4
# (three at 0.86-0.94x the fastest, one on an untimed count). 47 of the 111 random calls (seeds
# 1-80) whose choice it changes were timed in turns against what served them before: 1.07x
# geomean, 31 faster, 10 at 0.83-0.97x (two calls of 144 tiles split two ways at 0.83-0.87x one,
# where flash_fwd_sm90's default reads more).
PARTIAL_KEYS = 50
MERGE_KEYS = 1100
# A split count must beat one split's estimate by this much: below it the estimate has been wrong
# both ways (a 9% predicted gain at 448 tiles measured 1.6%).
SPLIT_GAIN = 1.10
# From this many waves of one split's CTAs a call runs one split: splitting can only even out a
# last wave the others dwarf ("j3": 448 tiles of 25.6k keys, 3.4 waves, 589 TFLOP/s at 2 splits
# and 652 at one; at 2.3 waves two splits still read 1.04-1.10x one on two calls, 0.92x on a third).
ONE_SPLIT_WAVES = 3


def work_tiles(params: dict, problem: Problem) -> int:
    """Query blocks x batch-heads: the CTAs of one split."""
    return problem.query_blocks(64 * params["cwg"])


def estimate(rows: int, tiles: int, splits: int, problem: Problem, gpu: GpuSpec) -> float:
    """A launch's time, in query rows x keys of one SM's main loop: its waves of CTAs (one per SM)
    x a CTA's rows x its keys, with each split's partial and its share of the merge; split, the
    merge's tail after the last wave."""
    if splits == 1:
        return ceil_div(tiles, gpu.sm_count) * rows * problem.seqlen_k
    keys = problem.seqlen_k / splits + PARTIAL_KEYS * (splits + 1)
    return (ceil_div(tiles * splits, gpu.sm_count) * keys + MERGE_KEYS) * rows


def auto_splits(params: dict, problem: Problem, gpu: GpuSpec) -> int:
    """The fewest splits whose estimated time is within SPLIT_GAIN of the best count's, one split
    unless splitting gains SPLIT_GAIN or where one split makes ONE_SPLIT_WAVES waves; each split
    keeps two K/V tiles at least."""
    tiles, rows = work_tiles(params, problem), 64 * params["cwg"]
    if tiles >= ONE_SPLIT_WAVES * gpu.sm_count:
        return 1
    most = max(1, min(MAX_SPLITS, ceil_div(problem.seqlen_k, params["Bc"]) // 2,
                      ceil_div(MAX_WAVES * gpu.sm_count, tiles)))
    times = {s: estimate(rows, tiles, s, problem, gpu) for s in range(1, most + 1)}
    best = min(times.values())
    return next(s for s, t in times.items() if t <= SPLIT_GAIN * best)


def call_splits(params: dict, problem: Problem, gpu: GpuSpec) -> int:
    """The splits `params` run on `problem`: its own count, or (0) the occupancy's."""
    return params["splits"] or auto_splits(params, problem, gpu)


def plain_estimate(plain: dict, problem: Problem, gpu: GpuSpec) -> float:
    """flash_fwd_sm90's config `plain` on `problem` in `estimate`'s units: its waves of CTAs (as they
    are where its persistent launch cuts its last rounds) x the rows a CTA computes x the keys."""
    cost = consumer_cost(gpu, problem, plain["cwg"], cut=bool(plain["persistent"])) * problem.seqlen_k
    return cost * row_cost(plain["cwg"])


def split_pays(params: dict, plain: dict, problem: Problem, gpu: GpuSpec) -> bool:
    """Whether `params` (this family's, its keys split from the occupancy) beat flash_fwd_sm90's
    `plain` by SPLIT_GAIN in the estimate, each in its own tile and form: auto_splits weighs split
    counts of one tile, while the call would otherwise run the plain default's (three consumers'
    192-row tiles, a persistent launch's cut tail). Rows past the last query row count on neither
    side. On the H200 B1-H16 1151 x 5706 d=96 read 324 TFLOP/s split two ways, 471 and 503 at the
    plain default's three and two consumers (PERF_NOTES "x2", "x3")."""
    rows = cta_rows(problem, params["cwg"])
    split = estimate(rows, work_tiles(params, problem), call_splits(params, problem, gpu), problem, gpu) * row_cost(params["cwg"])
    return split * SPLIT_GAIN < plain_estimate(plain, problem, gpu)


class SplitFlashFwdSm90(FlashFwdSm90):
    name = "flash_fwd_sm90_split"
    cuts_tail = False
    dtypes = ("fp16", "bf16")
    space = {
        "Bc": (64, 80, 128, 176),
        "stages": (2, 3),
        "cwg": (2, 3),
        "split": (24, 40),
        "overlap": (1,),
        "pingpong": (1,),
        "persistent": (0,),
        "tma_store": (0,),
        "chain": (0,),
        "splits": (0, 2, 4, 8, 16),
    }
    launch_params = ("splits",)

    def tune_skip(self, gpu: GpuSpec, problem: Problem) -> str | None:
        # It runs such calls (with one split: the plain grid kernel), so that a bucket's entry serves
        # its calls of every batch; a search of it there would only repeat flash_fwd_sm90's.
        if problem.query_blocks(128) >= gpu.sm_count:   # work tiles of 128 rows give every SM one
            return (f"{self.name} splits the keys of calls that leave SMs idle; {problem.key}'s query blocks "
                    f"already fill {gpu.name}'s {gpu.sm_count} SMs")
        return None

    gives_way_to = "flash_fwd_sm90"

    def gives_way(self, params: dict, other: dict, gpu: GpuSpec, problem: Problem) -> bool:
        # A config chosen for splitting may take more query rows a CTA than the call has (three
        # consumers for 100 queries): where few blocks leave SMs idle the split's extra CTAs pay for
        # them, where the blocks fill the GPU the padding rows are work. The bucket's flash_fwd_sm90
        # entry serves where its estimate is lower (1.14-1.19x at 100 queries, PERF_NOTES "p4");
        # at a tie this config, the faster where tuned, keeps serving: the plain entry, tuned where
        # few blocks leave SMs idle, may favour small tiles (64 rows at d=256: 0.78-0.80x there).
        rows = 64 * other["cwg"]
        plain = estimate(rows, problem.query_blocks(rows), 1, problem, gpu)
        return plain < estimate(64 * params["cwg"], work_tiles(params, problem), self.splits(params, problem, gpu),
                                problem, gpu)

    def split_form(self, plain: dict, gpu: GpuSpec, problem: Problem) -> dict | None:
        """flash_fwd_sm90's config `plain` (as it serves `problem`) in this family, its tile and its
        consumers kept, the keys split from the occupancy: where the call's few query blocks leave
        SMs idle and splitting gains by the estimate (auto_splits > 1, the merge's tail counted).
        None where it would run one split, where its tiles fill the SMs (the plain config may be
        persistent, or pairs: on six such calls of 192-468 tiles split read 0.88-0.98x, "j3"), or
        where the tile has no valid split form (d=256's Bc > 64 at split=40)."""
        fixed = {k: v[0] for k, v in self.space.items() if len(v) == 1}
        params = {**{k: plain[k] for k in ("Bc", "stages", "cwg", "split")}, **fixed, "splits": 0}
        if (self.check(params, gpu, problem) is not None or work_tiles(params, problem) >= gpu.sm_count
                or self.splits(params, problem, gpu) < 2):
            return None
        return params

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        if params["splits"] > ceil_div(problem.seqlen_k, params["Bc"]):
            return f"splits={params['splits']} exceeds the {ceil_div(problem.seqlen_k, params['Bc'])} K/V tiles of Nk={problem.seqlen_k}"
        if problem.head_dim > 128 and params["Bc"] > 64 and params["split"] > 24:
            return "at d=256 the split's bounds leave Bc > 64 short of registers under split=40 (ptxas spills): split 24"
        if problem.head_dim > 192 and problem.head_dim % 64 and params["Bc"] > 64:
            return "past d=192, a head dim that ends inside its last panel leaves Bc > 64 short of registers (ptxas spills)"
        return super()._check({k: v for k, v in params.items() if k != "splits"}, gpu, problem)

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        # the long-sequence grid winners of flash_fwd_sm90 (its seeds), splits from the occupancy
        d = problem.head_dim
        if d <= 64:
            cands = [(128, 2, 3, 24), (128, 3, 2, 40), (128, 2, 2, 40)]
            if two_consumers_pay(gpu, problem) and problem.query_blocks(128) >= gpu.sm_count:
                cands.insert(0, (128, 2, 2, 24))   # flash_fwd_sm90's default tile where it fills the SMs (b2)
        elif d <= 128:
            cands = [(176, 2, 2, 24), (128, 2, 2, 40), (176, 2, 2, 40), (128, 3, 2, 24)]
        else:
            cands = [(80, 2, 2, 24), (64, 2, 2, 24)]
        keys = ("Bc", "stages", "cwg", "split")
        return [dict(zip(keys, c), overlap=1, pingpong=1, persistent=0, tma_store=0, chain=0, splits=0) for c in cands]

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        # `splits` is not here: it is the grid's z, so points that differ in it share one cubin
        return {**super().defines(params, problem), "SPLIT_KV": 1}

    def adapt(self, params: dict, tuned: Problem, problem: Problem) -> dict:
        """A tuned split count fits the work tiles it was measured with; served to another count
        (another batch, heads or chunk length) the keys are split from the occupancy instead."""
        if params["splits"] and (work_tiles(params, tuned) != work_tiles(params, problem)
                                 or tuned.bucket().seqlen != problem.bucket().seqlen):
            return dict(params, splits=0)
        return params

    def splits(self, params: dict, problem: Problem, gpu: GpuSpec) -> int:
        return call_splits(params, problem, gpu)

    def launch(self, params: dict, problem: Problem, gpu: GpuSpec) -> Launch:
        grid = super().launch(params, problem, gpu)
        return Launch(grid=(grid.grid[0], grid.grid[1], self.splits(params, problem, gpu)), block=grid.block,
                      smem_bytes=grid.smem_bytes)

    def param_kinds(self, params: dict) -> tuple[str, ...]:
        # then the splits' O and LSE and their arrival counters (nulls with one split)
        return super().param_kinds(params) + ("ptr",) * 3

    def arg_maker(self, params: dict):
        return _SplitArgs(self, params)


class _SplitArgs(_Sm90Args):
    """flash_fwd_sm90's arguments, then the splits' workspace on the current stream: its size is
    fixed by the layout (the grid's splits, the rows), its address may change as it grows."""

    def __init__(self, family: SplitFlashFwdSm90, params: dict) -> None:
        super().__init__(64 * params["cwg"], params["Bc"], False, False)
        self._family, self._params = family, params

    def bind(self, q, k, v, o, scale):
        inner = super().bind(q, k, v, o, scale)
        if inner is None:
            return None
        return (inner, *call_grid(self._family, self._params, q, k, self.held))

    def values(self, bound, pointers, q):
        inner, grid, rows = bound
        return super().values(inner, pointers, q) + split_workspace(q.get_device(), grid, rows, q.shape[3])

    def address_fields(self, bound):
        return super().address_fields(bound[0])


FAMILY = SplitFlashFwdSm90()
