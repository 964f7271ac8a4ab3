"""flash_fwd_sm90_pairs: persistent flash_fwd_sm90 in clusters of two CTAs sharing each K/V tile.

At bf16 d=128 N=16k every work tile streams its head's whole K and V from L2 (8 MB for each of
2,048 query blocks: ~5 TB/s of L2 reads at 690 TFLOP/s), and the H100 runs the kernel at its 700 W
power cap, so what the chip spends on those reads comes off the SM clock (benchmarks/PERF_NOTES.md,
"pw1"). Here two CTAs of a cluster run neighbouring query blocks of one head and receive each K/V
tile by one TMA multicast (CTA 0 brings K, CTA 1 V): half the L2 reads. The grid form of this
(c1, withdrawn) ran the same grid config 1.01-1.04x at N=16k but tied the persistent configs the
lookup served; this is the persistent form, with the last rounds cut as flash_fwd_sm90_tail cuts
them (a segment a cluster, over pairs of query blocks).

The cluster's tiles come from a static schedule (tile_scheduler.cuh, pair_tile): both CTAs must run
the same K/V tiles in the same order, and the work tiles are equal (unmasked only), so the static
order ends as evenly as the counter's. Like the cut tail, it assumes every cluster of the launch is
resident at once (one CTA an SM, the grid at most the SMs: a cut tile's second half waits for its
first).

Not searched on its own: a persistent unmasked flash_fwd_sm90 config runs in this form where
`pairs_form`'s rule says it pays (tiles 128 columns wide and up; S tiles over 128 x 128 unless O is
stored by TMA; 4096 keys or more; few query blocks past a head's rows), both where the
dispatcher serves it and where a search times it (FlashFwdSm90.served_form).
"""

from __future__ import annotations

from tuner.family import ceil_div
from tuner.gpu import GpuSpec
from tuner.kernel_templates.flash_fwd_sm90 import tile_dim
from tuner.kernel_templates.flash_fwd_sm90_tail import TailFlashFwdSm90, tail_from, tail_workspace_size
from tuner.launch import Launch, clusters_at_once
from tuner.problem import Problem

CLUSTER = 2
# Where pairs pay, measured on the H100 (PERF_NOTES "c2", benchmarks/pairs_ab.py, the served config
# against its pairs form in turns): at d=128 with 4096 keys or more, 1.02-1.05x (bf16 N=16k 1.03x,
# its clock 1424 -> 1496 MHz at the 700 W cap); at N=1024 0.98x, and at d=64 0.93-1.00x, where the
# L2 reads they halve are a smaller share of the work and the cluster's lockstep costs more.
# Tiles of 128 columns and up: d = 72-80 run them too (flash_fwd_sm90.tile_width); on the H200 their
# pairs read 1.00-1.06x their plain form with three consumers, 0.95-1.07x with two (PERF_NOTES "j2").
PAIRS_MIN_KEYS = 4096
PAIRS_MIN_TILE_DIM = 128
# A config that stores O from registers (no TMA store) runs in pairs only where a CTA's S tile a K/V
# tile (64 x cwg query rows by Bc keys) is over 128 x 128. Both CTAs of a cluster wait on each other
# (a K/V stage is refilled once both freed it), and such configs lost: back to back at the power cap,
# two consumers at Bc 128 ran 6-12% less work per clock in pairs than alone against 0.7% at Bc 176,
# which the 6-8% clock pairs gain did not repay (H200: 0.94-0.99x on 7 calls, the 19 random calls the
# rule moved 1.002-1.069x alone; three consumers at Bc 128, d=72-80, 1.00-1.06x in pairs; PERF_NOTES
# "j2", "x4", "x5"). With O stored by TMA the same 128 x 128 tiles gain in pairs: fp16 Bc 128 entries
# on the H200 1.014-1.034x ("x5"), on the H100 1.016x bf16 and 1.045x fp16 ("c2").
PAIRS_MIN_S_TILE = 128 * 128 + 1
# A head's last pair whose second query block lies past its rows leaves that CTA's turn idle: 1 in
# blocks + 1 of the launch's CTA turns for an odd count of blocks. Pairs gain 2-5%, so an idle share
# over 1/PAIRS_MAX_IDLE costs more than they bring (B16-H32 68 x 6188, one block a head: 0.59x the
# plain form, PERF_NOTES "j2").
PAIRS_MAX_IDLE = 32


def pair_tiles(params: dict, problem: Problem) -> int:
    """The launch's work tiles: pairs of query blocks (the last one's second block may be past N) of
    each batch-head."""
    return ceil_div(problem.seqlen_q, CLUSTER * 64 * params["cwg"]) * problem.batch * problem.heads


class PairsFlashFwdSm90(TailFlashFwdSm90):
    name = "flash_fwd_sm90_pairs"
    dtypes = ("fp16", "bf16")
    masks = ("none",)   # both CTAs run the same K/V tiles: equal (unmasked) work tiles

    def tune_skip(self, gpu: GpuSpec, problem: Problem) -> str | None:
        return (f"{self.name} is flash_fwd_sm90's persistent configs in clusters of two: the dispatcher "
                f"serves them in that form (pairs_form), a search tunes flash_fwd_sm90")

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        return {**super().defines(params, problem), "CLUSTER": CLUSTER}

    def launch(self, params: dict, problem: Problem, gpu: GpuSpec) -> Launch:
        plain = super().launch(params, problem, gpu)
        clusters = min(pair_tiles(params, problem), clusters_at_once(gpu, CLUSTER))
        return Launch(grid=(CLUSTER * clusters, 1, 1), block=plain.block, smem_bytes=plain.smem_bytes)

    def pairs_form(self, plain: dict, gpu: GpuSpec, problem: Problem) -> dict | None:
        """flash_fwd_sm90's config `plain` as it serves `problem`, in this family: where it runs so
        (persistent, unchained, unmasked 16-bit, the registers a cut tail needs) and the rules above
        say it pays (the tile's width, its S tile and O's store, the keys, the CTAs a head's odd
        query block leaves idle); else None. Every SM must pair up into a cluster of the launch, all
        resident at once (a cut tile's second half waits for its first): the driver's count of
        clusters of two (clusters_at_once) covers the SMs on the H100 measured (66 for 132, PERF_NOTES
        "s3"); a GPU whose GPCs leave an SM unpaired runs the plain form, which uses every SM."""
        blocks = ceil_div(problem.seqlen_q, 64 * plain["cwg"])
        turns = CLUSTER * ceil_div(blocks, CLUSTER)   # a head's CTA turns in pairs, the idle ones past its rows
        small_tile = 64 * plain["cwg"] * plain["Bc"] < PAIRS_MIN_S_TILE
        if (tile_dim(problem) < PAIRS_MIN_TILE_DIM or (small_tile and not plain["tma_store"])
                or problem.seqlen_k < PAIRS_MIN_KEYS
                or (turns - blocks) * PAIRS_MAX_IDLE > turns
                or CLUSTER * clusters_at_once(gpu, CLUSTER) < gpu.sm_count
                or self.check(plain, gpu, problem) is not None):
            return None
        return dict(plain)

    def cut_of_launch(self, params: dict, problem: Problem, ctas: int) -> tuple[int, tuple[int, int]]:
        """The first cut pair (tail_from over pairs and clusters) and the workspace's size: a slot per
        cut, CTA of the cluster and consumer warp, so the cut tail's size for the same CTAs."""
        tiles, clusters = pair_tiles(params, problem), ctas // CLUSTER
        first = tail_from(tiles, clusters, ceil_div(problem.seqlen_k, params["Bc"]))
        return first, tail_workspace_size(params, problem, ctas if first < tiles else 0)


FAMILY = PairsFlashFwdSm90()
