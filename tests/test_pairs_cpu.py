"""flash_fwd_sm90_pairs without a GPU: where a persistent config is served in clusters of two, how the
static schedule covers the pairs of query blocks (a model of tile_scheduler.cuh's arithmetic), the
launch and the cut over pairs and clusters, and that its seeds and the shipped configs it serves
compile for sm_90a without spills."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tuner.family import ceil_div
from tuner.gpu import H100_SXM
from tuner.kernel_templates import get_family
from tuner.kernel_templates.flash_fwd_sm90_pairs import CLUSTER, PAIRS_MIN_KEYS, pair_tiles
from tuner.kernel_templates.flash_fwd_sm90_tail import tail_from, tail_workspace_size
from tuner.problem import Problem

PAIRS = get_family("flash_fwd_sm90_pairs")
TAIL = get_family("flash_fwd_sm90_tail")
SM90 = get_family("flash_fwd_sm90")
D128_16K = Problem(1, 16, 16384, 16384, 128, "bf16")
PERSISTENT = {"Bc": 176, "chain": 0, "cwg": 2, "overlap": 1, "persistent": 1, "pingpong": 0, "split": 40, "stages": 2,
              "tma_store": 0}


def test_pairs_serve_long_unmasked_calls_at_wide_head_dims_only():
    """The rule: tiles 128 columns wide and up (d = 72-80 and over 96) with PAIRS_MIN_KEYS keys or
    more, S tiles (query rows by keys) over 128 x 128 unless O is stored by TMA, a persistent
    unchained config the cut tail's registers allow, 16-bit, unmasked; anything else keeps its
    single-CTA form."""
    assert SM90.served_form(PERSISTENT, H100_SXM, D128_16K) == (PAIRS, PERSISTENT)
    assert SM90.served_form(PERSISTENT, H100_SXM, Problem(4, 16, 4096, 4096, 128, "fp16")) == (PAIRS, PERSISTENT)
    short = Problem(16, 16, 1024, PAIRS_MIN_KEYS - 1, 128, "bf16")
    assert PAIRS.pairs_form(PERSISTENT, H100_SXM, short) is None
    d64 = Problem(1, 32, 16384, 16384, 64, "bf16")
    three = {**PERSISTENT, "Bc": 128, "cwg": 3, "split": 32, "pingpong": 1}
    assert PAIRS.pairs_form(three, H100_SXM, d64) is None
    assert SM90.served_form(three, H100_SXM, d64)[0] is TAIL
    for params, problem in [(dict(PERSISTENT, persistent=0, split=24), D128_16K), (dict(PERSISTENT, chain=1), D128_16K),
                            (PERSISTENT, replace(D128_16K, mask="causal")), (PERSISTENT, replace(D128_16K, dtype="fp8"))]:
        assert PAIRS.pairs_form(params, H100_SXM, problem) is None, (params, problem)
    for bc in (64, 128):   # S tiles of 128 x 128 or less, O stored from registers: pairs cost more than they save
        assert PAIRS.pairs_form(dict(PERSISTENT, Bc=bc), H100_SXM, D128_16K) is None
        assert SM90.served_form(dict(PERSISTENT, Bc=bc), H100_SXM, D128_16K)[0] is TAIL
    stored = dict(PERSISTENT, Bc=128, tma_store=1)   # O by TMA: the same tile gains in pairs
    assert PAIRS.pairs_form(stored, H100_SXM, D128_16K) == stored
    wide = dict(PERSISTENT, Bc=128, cwg=3, pingpong=1)   # 192 x 128
    assert PAIRS.pairs_form(wide, H100_SXM, Problem(1, 16, 16384, 16384, 80, "bf16")) == wide
    d80 = Problem(1, 16, 16384, 16384, 80, "bf16")   # a 128-column tile, 80 columns of products
    assert PAIRS.pairs_form(PERSISTENT, H100_SXM, d80) == PERSISTENT
    d96 = Problem(1, 16, 16384, 16384, 96, "bf16")   # a 96-column tile
    assert PAIRS.pairs_form(PERSISTENT, H100_SXM, d96) is None
    odd = replace(H100_SXM, sm_count=131)   # SMs that do not pair up into clusters
    assert PAIRS.pairs_form(PERSISTENT, odd, D128_16K) is None
    assert PAIRS.tune_skip(H100_SXM, D128_16K) is not None   # derived from flash_fwd_sm90's configs, not searched
    assert SM90.tune_skip(H100_SXM, D128_16K) is None


@pytest.mark.parametrize("queries,paired", [(68, False), (128, False), (129, True), (3 * 128, False),
                                            (29 * 128, False), (31 * 128 - 5, True), (64 * 128 + 1, True)])
def test_pairs_leave_few_ctas_idle_past_a_heads_last_block(queries, paired):
    """A head of an odd count of query blocks pairs its last block with one past its rows, an idle CTA
    turn in blocks + 1: pairs serve where that is 1/PAIRS_MAX_IDLE of the turns or less (an even count,
    or 31 blocks and more), else the single-CTA form (one block a head: half the CTAs idle)."""
    from tuner.kernel_templates.flash_fwd_sm90_pairs import PAIRS_MAX_IDLE

    problem = Problem(8, 16, queries, 8192, 128, "bf16")
    blocks = ceil_div(queries, 128)
    assert paired == (blocks % 2 == 0 or blocks + 1 >= PAIRS_MAX_IDLE)
    assert (PAIRS.pairs_form(PERSISTENT, H100_SXM, problem) is not None) == paired


def test_pairs_run_only_where_the_driver_pairs_every_sm(monkeypatch):
    """Every cluster of a pairs launch must be resident at once (a cut tile's second half waits for
    its first), and the plain form uses every SM: where the device's driver counts fewer clusters of
    two than SMs / 2 (a GPC with an odd number of SMs), a call keeps the single-CTA form; where it
    counts them all (the H100 measured: 66), pairs, at most that many clusters a launch."""
    from tuner import launch

    monkeypatch.setattr(launch, "one_sm_clusters", lambda gpu, size: 65)
    assert PAIRS.pairs_form(PERSISTENT, H100_SXM, D128_16K) is None
    assert SM90.served_form(PERSISTENT, H100_SXM, D128_16K)[0] is TAIL
    monkeypatch.setattr(launch, "one_sm_clusters", lambda gpu, size: 66)
    assert SM90.served_form(PERSISTENT, H100_SXM, D128_16K) == (PAIRS, PERSISTENT)
    assert PAIRS.launch(PERSISTENT, D128_16K, H100_SXM).grid == (2 * 66, 1, 1)


def test_the_kernel_is_built_as_clusters_of_two_with_a_cut_tail():
    lines = PAIRS.define_lines(PERSISTENT, D128_16K)
    assert "#define CLUSTER 2" in lines and "#define TAIL_SPLIT 1" in lines
    assert "CLUSTER" not in SM90.define_lines(PERSISTENT, D128_16K) + TAIL.define_lines(PERSISTENT, D128_16K)
    assert PAIRS.param_kinds(PERSISTENT) == TAIL.param_kinds(PERSISTENT)


@pytest.mark.parametrize("problem,clusters", [
    (D128_16K, 66),                                           # 1024 pairs: every cluster
    (Problem(1, 2, 3 * 128 - 5, 4096, 128, "bf16"), 4),       # 3 blocks a head: 2 pairs a head, the last half empty
    (Problem(1, 132, 128, 8192, 128, "bf16"), 66),            # 132 pairs of one block and one past N
])
def test_the_launch_is_whole_clusters_and_at_most_one_a_pair_of_sms(problem, clusters):
    launch = PAIRS.launch(PERSISTENT, problem, H100_SXM)
    assert launch.grid == (CLUSTER * clusters, 1, 1)
    assert launch.block == SM90.launch(PERSISTENT, problem, H100_SXM).block
    assert pair_tiles(PERSISTENT, problem) == ceil_div(problem.seqlen_q, 256) * problem.batch * problem.heads


def _schedule(total: int, clusters: int, first_cut: int) -> dict[int, list[int]]:
    """The pair tiles each cluster draws (tile_scheduler.cuh's pair_tile in turns: whole ones before
    `first_cut`, then segment number c of the cut ones), as (cluster: tiles or segments)."""
    segs = clusters if first_cut < total else 0
    out: dict[int, list[int]] = {}
    for c in range(clusters):
        it, drawn = 0, []
        while (t := c + it * clusters) < first_cut + segs:
            drawn.append(t)
            it += 1
        out[c] = drawn
    return out


@pytest.mark.parametrize("total,clusters,kv", [(1024, 66, 94), (70, 66, 100), (132, 66, 100), (33, 66, 64), (500, 57, 3)])
def test_the_static_schedule_runs_each_pair_once(total, clusters, kv):
    """Every pair before the cut is drawn by exactly one cluster, and each cluster draws exactly one
    segment of the cut ones (tail_from over pairs and clusters), so both CTAs of a cluster, drawing
    the same sequence, always agree."""
    first = tail_from(total, clusters, kv)
    drawn = _schedule(total, clusters, first)
    whole = sorted(t for ts in drawn.values() for t in ts if t < first)
    assert whole == list(range(first))
    if first < total:
        assert sorted(t - first for ts in drawn.values() for t in ts if t >= first) == list(range(clusters))
        assert total - first >= clusters   # a segment spans a whole pair at least


def test_a_launch_binds_the_cut_over_pairs_and_clusters():
    """B1-H16-N16384 d=128: 1024 pairs on 66 clusters (15.5 rounds) are cut from pair 924; the
    workspace holds a slot per cut, CTA of a cluster and consumer warp, the cut tail's for 132 CTAs."""
    ctas = PAIRS.launch(PERSISTENT, D128_16K, H100_SXM).grid[0]
    assert PAIRS.cut_of_launch(PERSISTENT, D128_16K, ctas) == (14 * 66, tail_workspace_size(PERSISTENT, D128_16K, 132))
    whole = Problem(1, 132, 256, 8192, 128, "bf16")   # 132 pairs: two whole rounds
    assert PAIRS.cut_of_launch(PERSISTENT, whole, PAIRS.launch(PERSISTENT, whole, H100_SXM).grid[0]) == (132, (0, 0))


@pytest.mark.parametrize("d", [128, 256])
def test_seeds_and_served_configs_compile_for_sm90a_without_spills(d):
    """The seeds this family runs and the pairs forms of the shipped configs at this head dim, with no
    spill, no stack and no warning (the cluster's remote frees and the pair's slot cost registers)."""
    from test_tail_cpu import compile_unmasked_seeds_and_shipped

    assert compile_unmasked_seeds_and_shipped(PAIRS, d) or d == 256, "no persistent config to pair at this head dim"
