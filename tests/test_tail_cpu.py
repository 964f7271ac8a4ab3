"""flash_fwd_sm90_tail without a GPU: where a persistent launch's tail is cut, how the segments cover
it (a model of tile_scheduler.cuh's arithmetic), which configs the dispatcher serves in that form,
and that its seeds compile for sm_90a without spills."""

from __future__ import annotations

import pytest

from tuner.family import ceil_div
from tuner.gpu import H100_SXM
from tuner.kernel_templates import get_family
from tuner.kernel_templates.flash_fwd_sm90_tail import (TAIL_LONG_KV_TILES, TAIL_SHORT_GAIN, TAIL_SHORT_KV_TILES,
                                                        tail_from, tail_of_launch, tail_start, tail_workspace_size)
from tuner.problem import Problem

TAIL = get_family("flash_fwd_sm90_tail")
SM90 = get_family("flash_fwd_sm90")
GRID_D128 = Problem(1, 16, 16384, 16384, 128, "bf16")   # 2048 tiles of 128 rows: 15.5 rounds on 132 SMs
# served in pairs of CTAs, not this form (flash_fwd_sm90_pairs: d >= 128 with 4096 keys or more);
# this one is cut and not paired: 140 tiles of 128 rows (1.06 rounds), 18 K/V tiles of 176 keys each
TAIL_ONLY = Problem(1, 10, 1792, 3000, 128, "bf16")
PERSISTENT = {"Bc": 176, "chain": 0, "cwg": 2, "overlap": 1, "persistent": 1, "pingpong": 0, "split": 40, "stages": 2,
              "tma_store": 0}


def _pieces(tiles: int, n: int, segs: int, from_: int) -> list[list[tuple[int, int, int]]]:
    """Each segment's pieces (tile, lo, hi) as the producer draws them: tail_pieces, then tail_piece
    for each place (tile_scheduler.cuh, in 32-bit unsigned arithmetic)."""
    bound = lambda j: (j * tiles * n) // segs   # noqa: E731
    out = []
    for j in range(segs):
        b0, b1 = bound(j), bound(j + 1)
        count = (b1 - 1) // n - b0 // n + 1
        seg = []
        for place in range(count):
            i = b0 // n + place
            first = i * n
            seg.append((from_ + i, max(b0, first) - first, min(b1, first + n) - first))
        out.append(seg)
    return out


@pytest.mark.parametrize("tiles,sms,n", [(2048, 132, 94), (140, 132, 2), (2000, 132, 7), (300, 114, 33),
                                          (133, 132, 1000), (1000, 78, 5), (263, 132, 1)])
def test_segments_cover_the_tail_once_in_equal_shares(tiles, sms, n):
    """Wherever a tail starts (tail_start: the last round and the one before), every K/V tile of its
    tiles runs once; a tile is cut once at most (two halves); a segment's work is within one K/V
    tile of every other's, in three pieces at most."""
    from_ = tail_start(tiles, sms)
    assert from_ % sms == 0 and sms <= tiles - from_ < 2 * sms   # the last round and the one before
    segs = _pieces(tiles - from_, n, sms, from_)
    runs = {}
    for seg in segs:
        assert 1 <= len(seg) <= 3
        for tile, lo, hi in seg:
            assert from_ <= tile < tiles and 0 <= lo < hi <= n
            runs.setdefault(tile, []).append((lo, hi))
    assert sorted(runs) == list(range(from_, tiles))
    for tile, parts in runs.items():
        parts.sort()
        assert len(parts) <= 2 and parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), (tile, parts)
    work = [sum(hi - lo for _, lo, hi in seg) for seg in segs]
    assert max(work) - min(work) <= 1


def test_tail_is_cut_only_where_it_measured_a_gain():
    """Long tiles (N=16k) whenever the last round leaves an eighth of the SMs idle or more; tiles of
    16-63 K/V tiles only where the last round costs a tenth of the launch; shorter ones never."""
    sms = 132
    assert tail_start(2048, sms) == 14 * sms and tail_start(2 * sms, sms) == 2 * sms and tail_start(100, sms) == 100
    assert tail_from(2048, sms, TAIL_LONG_KV_TILES) == 14 * sms          # B1-H16-N16384 d=128: 1.04x
    assert tail_from(2048, sms, TAIL_LONG_KV_TILES - 1) == 2048          # N=4096: 3% idle, level measured
    assert tail_from(440, sms, 32) == 2 * sms                            # B2-H10-N4096 d=64, 3.3 rounds: 1.16x
    assert (-(-440 // sms) - 440 / sms) / -(-440 // sms) >= TAIL_SHORT_GAIN
    assert tail_from(440, sms, TAIL_SHORT_KV_TILES - 1) == 440           # N=1500 at 128 keys a tile: lost 11%
    assert tail_from(2 * sms, sms, 1000) == 2 * sms                      # whole rounds
    assert tail_from(100, sms, 1000) == 100                              # less than one round
    assert tail_from(2 * sms - 10, sms, 1000) == 2 * sms - 10            # the last round nearly full
    assert tail_from(2048, sms, 200_000) == 2048                         # past the kernel's 32-bit bounds


def test_tail_form_of_persistent_unmasked_configs_only():
    assert TAIL.tail_form(PERSISTENT, H100_SXM, GRID_D128) == PERSISTENT
    assert TAIL.check(PERSISTENT, H100_SXM, GRID_D128) is None
    assert TAIL.tail_form(dict(PERSISTENT, persistent=0), H100_SXM, GRID_D128) is None
    assert TAIL.tail_form(dict(PERSISTENT, chain=1), H100_SXM, GRID_D128) is None
    causal = Problem(1, 16, 16384, 16384, 128, "bf16", "causal")
    assert TAIL.tail_form(PERSISTENT, H100_SXM, causal) is None and "runs the masks none" in TAIL.check(PERSISTENT, H100_SXM, causal)
    whole = Problem(1, 132, 128, 4096, 128, "bf16")   # 132 tiles: one whole round
    assert TAIL.tail_form(PERSISTENT, H100_SXM, whole) is None
    assert TAIL.tail_form(PERSISTENT, H100_SXM, Problem(1, 16, 16384, 16384, 128, "fp8")) is None
    assert TAIL.tune_skip(H100_SXM, GRID_D128) is not None   # never searched: derived from flash_fwd_sm90's


def test_the_kernel_takes_the_first_cut_tile_and_the_workspace():
    assert "#define TAIL_SPLIT 1" in TAIL.define_lines(PERSISTENT, GRID_D128)
    assert "TAIL_SPLIT" not in SM90.define_lines(PERSISTENT, GRID_D128)
    assert TAIL.param_kinds(PERSISTENT) == SM90.param_kinds(PERSISTENT) + ("i32", "ptr", "ptr", "ptr")
    assert TAIL.launch(PERSISTENT, GRID_D128, H100_SXM).grid == (132, 1, 1)
    floats, counters = tail_workspace_size(PERSISTENT, GRID_D128, 132)
    assert counters == 132 * 8 and floats == counters * 32 * 4 * (128 // 8 + 1)   # a slot per consumer warp


def test_dispatcher_serves_a_persistent_entry_with_its_tail_cut(tmp_path):
    """select() turns a persistent flash_fwd_sm90 entry into its cut form on an unmasked call whose
    last round is part-full, and leaves it on a call of whole rounds and on a grid config."""
    from tuner.dispatch import Dispatcher
    from tuner.export import lookup_of, write_lookup

    def served(params, problem, tuned=TAIL_ONLY):
        path = tmp_path / f"lookup-{len(list(tmp_path.iterdir()))}.json"
        write_lookup(lookup_of(H100_SXM.key, [(tuned, SM90.name, params, 600.0)]), path)
        return Dispatcher(path).select(problem, H100_SXM)

    e = served(PERSISTENT, TAIL_ONLY)
    assert e["family"] == TAIL.name and e["params"] == PERSISTENT
    same_bucket_whole = Problem(1, 11, 1536, 3000, 128, "bf16")   # 11 x 12 = 132 tiles: one whole round
    assert same_bucket_whole.bucket() == TAIL_ONLY.bucket()
    assert served(PERSISTENT, same_bucket_whole)["family"] == SM90.name
    assert served(dict(PERSISTENT, persistent=0), TAIL_ONLY)["family"] == SM90.name
    assert served(PERSISTENT, GRID_D128, GRID_D128)["family"] == "flash_fwd_sm90_pairs"   # paired, its tail cut there


@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_seeds_compile_for_sm90a_without_spills(d):
    """Every seed that passes check and the tail forms of the shipped persistent unmasked configs
    at this head dim, with no spill, no stack and no warning: the segment's bounds cost the
    persistent producer registers (64-bit ones spilled 52 B at split 40), the halves' join the
    consumers."""
    assert compile_unmasked_seeds_and_shipped(TAIL, d) or d == 256, "no persistent config to cut at this head dim"


def compile_unmasked_seeds_and_shipped(fam, d: int) -> int:
    """Compiles `fam`'s seeds and the shipped unmasked configs at head dim d that it runs, asserting
    no spill, no stack and no warning from ptxas; how many it compiled."""
    from test_compile import SEED_RESOURCES
    from tuner.compile import compile_kernel

    problem = Problem(1, 16, 8192, 8192, d, "bf16")
    points = fam.seeds(H100_SXM, problem)
    points += [p for pr, p, _ in SEED_RESOURCES.shipped_configs() if pr.head_dim == d and pr.mask == "none"]
    points = list({str(sorted(p.items())): p for p in points if fam.check(p, H100_SXM, problem) is None}.values())
    for params in points:
        ck = compile_kernel(fam, params, problem, H100_SXM.arch)
        assert (ck.resources.spill_bytes, ck.resources.stack_bytes) == (0, 0), (params, ck.resources)
        assert "warning" not in ck.log and "C75" not in ck.log, ck.log
    return len(points)


def test_a_launch_binds_the_cut_and_the_workspace_of_its_own_ctas():
    """A call's first cut tile and workspace, worked out for the CTAs the launch makes (the kernel's
    segments are its gridDim.x): on 132 SMs B1-H16-N16384 d=128 cuts from tile 1848 with a slot per
    consumer warp and segment; one round of tiles (a grid of that many CTAs) cuts nothing."""
    ctas = TAIL.launch(PERSISTENT, GRID_D128, H100_SXM).grid[0]
    assert tail_of_launch(PERSISTENT, GRID_D128, ctas) == (14 * 132, tail_workspace_size(PERSISTENT, GRID_D128, 132))
    one_round = Problem(1, 100, 128, 8192, 128, "bf16")
    ctas = TAIL.launch(PERSISTENT, one_round, H100_SXM).grid[0]
    assert ctas == 100 and tail_of_launch(PERSISTENT, one_round, ctas) == (100, (0, 0))


def test_the_plain_family_runs_its_persistent_configs_cut_and_its_variants_as_they_are():
    """served_form: flash_fwd_sm90's persistent config on a call whose tail is cut runs as
    flash_fwd_sm90_tail; a grid config, a call of whole rounds, and the families made from it (the
    split, the tail itself, the varlen variant) run as they are."""
    from tuner.kernel_templates import VARIANTS_BY_NAME

    assert SM90.served_form(PERSISTENT, H100_SXM, TAIL_ONLY) == (TAIL, PERSISTENT)
    grid = dict(PERSISTENT, persistent=0)
    assert SM90.served_form(grid, H100_SXM, TAIL_ONLY) == (SM90, grid)
    whole = Problem(1, 132, 128, 4000, 128, "bf16")   # one whole round (and too few keys for pairs)
    assert SM90.served_form(PERSISTENT, H100_SXM, whole) == (SM90, PERSISTENT)
    for fam in (TAIL, get_family("flash_fwd_sm90_pairs"), get_family("flash_fwd_sm90_split"),
                VARIANTS_BY_NAME["flash_fwd_sm90_varlen"]):
        assert fam.served_form(PERSISTENT, H100_SXM, GRID_D128) == (fam, PERSISTENT)


def test_a_search_times_and_compiles_a_point_as_it_is_served():
    """GpuRunner.measure and bench compile and time a persistent point in its cut form (the worker
    told the tail family), prefetch compiles that form, and a grid point stays itself: the search
    ranks what the dispatcher serves."""
    from types import SimpleNamespace

    from tuner.records import Measurement, SideBySide
    from tuner.runner import GpuRunner

    runner = GpuRunner.__new__(GpuRunner)   # no worker process or GPU: the compiler and the worker recorded
    runner.gpu, runner._versions = H100_SXM, {}
    compiled, jobs, submitted = [], [], []

    def compile_(fam, params, problem):
        compiled.append((fam.name, params))
        return SimpleNamespace(resources=None, compile_seconds=0.0)

    def run(job, timeout=None):
        jobs.append((job.kind, job.family, job.params))
        return SideBySide(Measurement("ok")) if job.kind == "bench" else Measurement("ok")

    runner._compile = compile_
    runner._worker = SimpleNamespace(run=run, timeout=1.0)
    runner._compilers = SimpleNamespace(submit=lambda fn, args: submitted.append(args[:2]))
    grid = dict(PERSISTENT, persistent=0)
    runner.measure(SM90, PERSISTENT, TAIL_ONLY)
    runner.measure(SM90, grid, TAIL_ONLY)
    runner.bench(SM90, PERSISTENT, TAIL_ONLY, ())
    runner.prefetch(SM90, [PERSISTENT, grid], TAIL_ONLY)
    assert compiled == [(TAIL.name, PERSISTENT), (SM90.name, grid), (TAIL.name, PERSISTENT)]
    assert jobs == [("kernel", TAIL.name, PERSISTENT), ("kernel", SM90.name, grid), ("bench", TAIL.name, PERSISTENT)]
    assert submitted == [(TAIL.name, PERSISTENT), (SM90.name, grid)]


def test_an_untuned_prefill_runs_its_persistent_default_cut():
    """The default that serves a head dim nobody tuned (d=96: two persistent consumers first) runs in
    its cut form where the tail is cut, as a tuned entry would."""
    from tuner.dispatch import Dispatcher

    problem = Problem(1, 16, 16384, 16384, 96, "bf16")   # 2048 tiles of 128 rows, 128 K/V tiles each
    default = SM90.default(H100_SXM, problem)
    assert default["persistent"] and TAIL.tail_form(default, H100_SXM, problem) == default
    e = Dispatcher("/nonexistent/lookup.json").serving_entry(problem, H100_SXM)
    assert e["family"] == TAIL.name and e["params"] == default
