"""flash_fwd_sm90_tail: persistent flash_fwd_sm90 with its last rounds of work tiles cut, Stream-K style.

A persistent launch of T work tiles on S SMs runs ceil(T / S) rounds of them, the last with T mod S
tiles; the standard grid's unmasked shapes are 2048 tiles of 128 rows, 15.5 rounds on an H100's or
H200's 132 SMs, and the 16th leaves 64 SMs idle for 3% of the launch (Nsight Compute: SMs active
96.8% of the elapsed cycles at B1-H16-N16384 d=128; benchmarks/PERF_NOTES.md, "k3"). Here the
last round and the one before are cut into one segment of equal work per CTA, across tile
boundaries (kernel_templates/tile_scheduler.cuh); a tile cut in two has its halves joined in
registers by the later one, warp by warp (kernel_templates/split_kv.cuh, join_halves). Unmasked
tiles only: a causal launch's tiles differ in work, and its scheduler already balances them.

Not searched on its own: a persistent unmasked flash_fwd_sm90 config runs in this form where
`tail_from` cuts (`tail_form`, the same tile and schedule otherwise), both where the dispatcher
serves it and where a search times it (FlashFwdSm90.served_form), so that a search ranks persistent
configs by what they run.
"""

from __future__ import annotations

from tuner.family import ceil_div
from tuner.gpu import GpuSpec
from tuner.kernel_templates.decode_workspace import workspace
from tuner.kernel_templates.flash_decode import call_grid
from tuner.kernel_templates.flash_fwd_sm90 import FlashFwdSm90, _Sm90Args, prod_cols
from tuner.problem import Problem

# Where a cut pays, measured on the H100 (PERF_NOTES "k3", ab_kernel.py --after-family, 16 shipped
# and grid configs): with work tiles of 64 K/V tiles or more (N=16k: 1.04-1.06x); with 16 or more
# where the last round's idle SMs cost a tenth of the launch or more (B2-H10-N4096 d=64, 3.3 rounds:
# 1.16x). Shorter tiles lost 3-12% (N=197-1500), and 24-32 K/V tiles at a twentieth read level
# (0.99-1.03x): the segments' extra pieces, Q loads and joins cost about what the last round wasted.
TAIL_LONG_KV_TILES = 64
TAIL_SHORT_KV_TILES = 16
TAIL_SHORT_GAIN = 0.10


def tail_start(tiles: int, sms: int) -> int:
    """Where the cut tail of a persistent launch of `tiles` tiles on `sms` CTAs starts: the last round
    and the one before (so every segment spans a tile at least, and a tile is cut once at most);
    `tiles` (no tail) where the rounds are whole, or where there is one or less."""
    rounds, rest = divmod(tiles, sms)
    return tiles if rounds < 1 or rest == 0 else (rounds - 1) * sms


def tail_from(tiles: int, sms: int, kv_tiles: int) -> int:
    """The first work tile of the cut tail (tail_start) where the cut pays by the rule above, else
    `tiles` (none): it weighs the share of the launch the last round leaves idle, ceil(T / S) - T / S
    of ceil(T / S) rounds, against the tiles' length in K/V tiles."""
    start = tail_start(tiles, sms)
    if start >= tiles or sms * (tiles - start) * kv_tiles >= 1 << 31:   # the kernel's segment bounds are 32-bit
        return tiles
    if (sms - tiles % sms) * 8 < sms:   # the last round nearly full: little to win
        return tiles
    rounds = -(-tiles // sms)
    idle = (rounds - tiles / sms) / rounds
    if kv_tiles >= TAIL_LONG_KV_TILES or (kv_tiles >= TAIL_SHORT_KV_TILES and idle >= TAIL_SHORT_GAIN):
        return start
    return tiles


class TailFlashFwdSm90(FlashFwdSm90):
    name = "flash_fwd_sm90_tail"
    configs_of = "flash_fwd_sm90"
    cuts_tail = False
    dtypes = ("fp16", "bf16")
    masks = ("none",)   # a causal launch's tiles differ in work; its scheduler balances them already
    space = {**FlashFwdSm90.space, "persistent": (1,), "chain": (0,)}

    def tune_skip(self, gpu: GpuSpec, problem: Problem) -> str | None:
        return (f"{self.name} is flash_fwd_sm90's persistent configs with a cut tail: the dispatcher "
                f"serves them in that form (tail_form), a search tunes flash_fwd_sm90")

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        # ptxas: the segment's K/V range and the halves' join cost the consumers registers that these
        # configs, at their limit without a cut tail, do not have
        if problem.head_dim > 128 and params["Bc"] > 64 and params["split"] > 24:
            return "at d=256 a cut tail's bounds leave Bc > 64 short of registers under split=40 (ptxas spills): Bc=64"
        if params["pingpong"] and params["Bc"] >= 176 and problem.head_dim > 64:
            return "with ping-pong at Bc=176 a cut tail's join leaves the consumers short of registers (ptxas spills)"
        return super()._check(params, gpu, problem)

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        return [s for s in super().seeds(gpu, problem) if s["persistent"] and not s["chain"]]

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        return {**super().defines(params, problem), "TAIL_SPLIT": 1}

    def tail_form(self, plain: dict, gpu: GpuSpec, problem: Problem) -> dict | None:
        """flash_fwd_sm90's config `plain` as it serves `problem`, in this family: where it runs
        persistent and unchained on an unmasked call whose tail `tail_from` cuts; else None."""
        params = dict(plain)
        if self.check(params, gpu, problem) is not None:   # not persistent, chained, masked, fp8, or short of registers
            return None
        tiles = problem.query_blocks(64 * params["cwg"])
        if tail_from(tiles, gpu.sm_count, ceil_div(problem.seqlen_k, params["Bc"])) >= tiles:
            return None
        return params

    def cut_of_launch(self, params: dict, problem: Problem, ctas: int) -> tuple[int, tuple[int, int]]:
        """A launch's first cut tile and its workspace's size (tail_of_launch), for its CTAs."""
        return tail_of_launch(params, problem, ctas)

    def param_kinds(self, params: dict) -> tuple[str, ...]:
        # then the first cut tile, the first halves' partials, (an unused LSE slot) and their counters
        return super().param_kinds(params) + ("i32", "ptr", "ptr", "ptr")

    def arg_maker(self, params: dict):
        return _TailArgs(self, params)


def tail_workspace_size(params: dict, problem: Problem, segments: int) -> tuple[int, int]:
    """Floats of the first halves' partials and their counters: a slot per consumer warp of every
    cut (segments - 1 of them; indexed by segment), each lane's O fragments, max and row sums."""
    warps = 4 * params["cwg"]
    return segments * warps * 32 * 4 * (prod_cols(params, problem) // 8 + 1), segments * warps


def tail_of_launch(params: dict, problem: Problem, ctas: int) -> tuple[int, tuple[int, int]]:
    """A launch's first cut tile (tail_from) and its workspace's size (tail_workspace_size), for the
    CTAs it makes: they are the kernel's segments (its gridDim.x)."""
    tiles = problem.query_blocks(64 * params["cwg"])
    first = tail_from(tiles, ctas, ceil_div(problem.seqlen_k, params["Bc"]))
    return first, tail_workspace_size(params, problem, ctas if first < tiles else 0)


class _TailArgs(_Sm90Args):
    """flash_fwd_sm90's arguments, then the first cut tile and the halves' workspace on the current
    stream (sized by the layout; its address may change as it grows)."""

    def __init__(self, family: TailFlashFwdSm90, params: dict) -> None:
        super().__init__(64 * params["cwg"], params["Bc"], bool(params["tma_store"]), True)
        self._family, self._params = family, params

    def bind(self, q, k, v, o, scale):
        inner = super().bind(q, k, v, o, scale)
        if inner is None:
            return None
        from tuner.dispatch import problem_of

        (ctas, _, _), _ = call_grid(self._family, self._params, q, k)
        return (inner, *self._family.cut_of_launch(self._params, problem_of(q, k, k, False), ctas))

    def values(self, bound, pointers, q):
        inner, first, (floats, counters) = bound
        if not counters:
            return super().values(inner, pointers, q) + (first, 0, 0, 0)
        o, _, count = workspace(q.get_device(), floats, 0, counters)
        return super().values(inner, pointers, q) + (first, o, 0, count)

    def address_fields(self, bound):
        return super().address_fields(bound[0])


FAMILY = TailFlashFwdSm90()
