"""What the dispatcher chooses from, without a GPU: SDPA's backends as measured lookup entries,
the lookups flashtune ships, and first-call autotuning (its shortlist, its plan during CUDA-graph
capture, and what it stores)."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch

from tuner import autotune, export
from tuner.db.engine import make_engine, session_factory
from tuner.db.queries import BestEntry, best_rows, measurements, record_measurement, update_best
from tuner.dispatch import Dispatcher
from tuner.export import build_lookup, lookup_from_db, read_lookup, write_lookup
from tuner.gpu import A100_SXM, H100_SXM
from tuner.gqa_packing import packs
from tuner.kernel_templates import configs_family, get_family
from tuner.kernel_templates.flash_fwd_sm90_split import auto_splits
from tuner.problem import Problem
from tuner.records import Measurement

SM90 = get_family("flash_fwd_sm90")
SPLIT = get_family("flash_fwd_sm90_split")
BF16 = Problem(1, 32, 8192, 8192, 128, "bf16", "causal", kv_heads=8)
FP32 = Problem(8, 12, 1024, 1024, 64, "fp32", "causal")
SIMT = get_family("flash_fwd_simt")
SIMT_PARAMS = dict(Br=128, Bc=64, TM=8, TN=4, stages=1, min_blocks=1)


def entry(problem: Problem, family: str, params: dict, tflops: float, gpu=H100_SXM) -> BestEntry:
    return BestEntry(gpu.key, family, problem, problem.bucket().key, params, tflops,
                     problem.flops() / tflops / 1e9, 1)


def lookup(path, entries) -> str:
    write_lookup(build_lookup(entries), path)
    return str(path)


@pytest.fixture
def sm90_params():
    return SM90.default(H100_SXM, BF16)


# ---- SDPA as a measured candidate ----

def test_a_peer_that_measured_faster_is_chosen_where_its_backend_takes_the_case(tmp_path, sm90_params):
    d = Dispatcher(lookup(tmp_path / "best.json", [entry(BF16, SM90.name, sm90_params, 400.0),
                                                   entry(BF16, "sdpa_flash", {}, 450.0)]))
    assert d.select(BF16, H100_SXM)["family"] == "sdpa_flash"
    # another shape of the bucket that FlashAttention-2 cannot run (d=256 is fine, fp32 is not):
    # the tuned config serves it, from the same bucket
    fp32 = Dispatcher(lookup(tmp_path / "fp32.json", [entry(FP32, SIMT.name, SIMT_PARAMS, 20.0),
                                                      entry(FP32, "sdpa_flash", {}, 90.0)]))
    assert fp32.select(FP32, H100_SXM)["family"] == SIMT.name
    # a GPU without FlashAttention-2's compute capability skips it too
    old = replace(A100_SXM, major=7, minor=5)
    d = Dispatcher(lookup(tmp_path / "old.json", [replace(entry(BF16, "sdpa_flash", {}, 450.0), gpu_key=old.key)]))
    assert d.select(BF16, old) is None


def test_a_peer_serves_only_calls_that_outlast_its_host_time(tmp_path):
    """A peer measured faster serves its bucket's calls whose work, scaled from what it was measured
    on, keeps it running PEER_MIN_MS or more; a shorter call of the same bucket (the same batch x
    heads class) runs the bucket's kernel, and one with no kernel in reach still runs the peer."""
    from tuner.peer_choice import PEER_MIN_MS, short_peer

    big = Problem(32, 32, 1, 8192, 128, "bf16", "none", kv_heads=8)   # a decode step, 1024 batch-heads
    fd = get_family("flash_decode")
    ms = 3 * PEER_MIN_MS   # the peer's measured time at B32: 0.75 PEER_MIN_MS at B8
    peer = entry(big, "sdpa_flash", {}, big.flops() / ms / 1e9)
    kernel = entry(big, fd.name, fd.default(H100_SXM, big), big.flops() / (1.05 * ms) / 1e9)
    d = Dispatcher(lookup(tmp_path / "best.json", [kernel, peer]))
    assert d.select(big, H100_SXM)["family"] == "sdpa_flash"
    small = replace(big, batch=8)   # 256 batch-heads: the same bucket, a quarter of the work
    assert small.bucket() == big.bucket()
    assert configs_family(d.select(small, H100_SXM)["family"]) == fd.name   # (its splits merged in a cluster)
    entries = {e["family"]: e for e in read_lookup(tmp_path / "best.json")["entries"]}
    assert short_peer(entries["sdpa_flash"], small) and not short_peer(entries["sdpa_flash"], big)
    assert not short_peer(entries[fd.name], small)   # only peers go after
    alone = Dispatcher(lookup(tmp_path / "alone.json", [peer]))
    assert alone.select(small, H100_SXM)["family"] == "sdpa_flash"


def test_a_decode_peer_s_time_scales_with_the_bytes_a_call_streams(tmp_path):
    """A decode step streams its K/V: a peer measured at B32 x 12 heads (MHA, 8k keys, d=64) for
    3 PEER_MIN_MS runs B4 x 32 query heads on 8 K/V heads in about a twelfth of that, under its
    host time, though the FLOPs say a third (over it: the H200 served cuDNN there at 0.85x of cuDNN
    pinned, PERF_NOTES "s5"), so the bucket's kernel serves it; B32 of those heads streams 2/3 of
    the measured bytes and keeps the peer. A prefill still scales by FLOPs."""
    from tuner.peer_choice import PEER_MIN_MS, short_peer

    mha = Problem(32, 12, 1, 8192, 64, "bf16", "none")
    fd = get_family("flash_decode")
    ms = 3 * PEER_MIN_MS
    peer = entry(mha, "sdpa_cudnn", {}, mha.flops() / ms / 1e9)
    kernel = entry(mha, fd.name, fd.default(H100_SXM, mha), mha.flops() / (1.02 * ms) / 1e9)
    path = lookup(tmp_path / "best.json", [kernel, peer])
    entries = {e["family"]: e for e in read_lookup(path)["entries"]}
    gqa = Problem(4, 32, 1, 8192, 64, "bf16", "causal_br", kv_heads=8)
    assert ms * gqa.flops() / mha.flops() >= PEER_MIN_MS > ms * gqa.bytes_moved() / mha.bytes_moved()
    assert short_peer(entries["sdpa_cudnn"], gqa) and not short_peer(entries["sdpa_cudnn"], replace(gqa, batch=32))
    d = Dispatcher(path)
    assert configs_family(d.select(gqa, H100_SXM)["family"]) == fd.name
    assert d.select(replace(gqa, batch=32), H100_SXM)["family"] == "sdpa_cudnn"
    prefill = Problem(1, 12, 2048, 2048, 64, "bf16", "causal")   # a quarter of its FLOPs at 1024: 0.75 PEER_MIN_MS
    measured = build_lookup([entry(prefill, "sdpa_cudnn", {}, prefill.flops() / ms / 1e9)])["entries"][0]
    assert short_peer(measured, replace(prefill, seqlen_q=1024, seqlen_k=1024)) and not short_peer(measured, prefill)



def test_a_peer_that_won_on_few_query_blocks_goes_after_the_kernels_on_more(tmp_path):
    """An 8-head shard's chunk (32 blocks of 128 rows on 132 SMs) measured SDPA flash ahead of the
    split kernel; 28 heads of a chunk in the same bucket (84 blocks) are served by the kernel, as
    are more blocks still; the measured call itself, and a call of as few blocks, keep the peer. A
    peer measured on blocks that filled the GPU keeps its place at any count (PERF_NOTES "n1")."""
    from tuner.peer_choice import PEER_MIN_MS, idle_peer

    shard = Problem(1, 8, 512, 4096, 128, "bf16", "causal_br", kv_heads=1)
    ms = 4 * PEER_MIN_MS   # long enough that short_peer leaves it in place
    split = dict(SPLIT.default(H100_SXM, shard), splits=4)
    path = lookup(tmp_path / "best.json", [entry(shard, "sdpa_flash", {}, shard.flops() / ms / 1e9),
                                           entry(shard, SPLIT.name, split, shard.flops() / (1.04 * ms) / 1e9)])
    entries = {e["family"]: e for e in read_lookup(path)["entries"]}
    more = Problem(1, 28, 350, 3000, 128, "bf16", "causal_br", kv_heads=4)
    assert more.bucket() == shard.bucket() and shard.query_blocks(128) == 32 and more.query_blocks(128) == 84
    assert idle_peer(entries["sdpa_flash"], H100_SXM, more) and not idle_peer(entries["sdpa_flash"], H100_SXM, shard)
    assert not idle_peer(entries[SPLIT.name], H100_SXM, more)   # only peers go after
    d = Dispatcher(path)
    assert d.select(shard, H100_SXM)["family"] == "sdpa_flash"
    assert d.select(replace(shard, seqlen_k=3000), H100_SXM)["family"] == "sdpa_flash"   # as few blocks
    # our kernel: the split entry's at a call it splits, the defaults where it would run one split
    assert d.select(replace(more, heads=12, kv_heads=2), H100_SXM)["family"] == SPLIT.name
    assert auto_splits(split, more, H100_SXM) == 1 and d.select(more, H100_SXM)["family"] == SM90.name
    wide = Problem(8, 32, 512, 4096, 128, "bf16", "causal_br", kv_heads=8)   # 1024 blocks: filled when measured
    filled = build_lookup([entry(wide, "sdpa_flash", {}, wide.flops() / ms / 1e9)])["entries"][0]
    assert not idle_peer(filled, H100_SXM, replace(wide, batch=16))
    assert not idle_peer(entries["sdpa_flash"], H100_SXM, replace(more, seqlen_q=1, seqlen_k=4096))   # a decode step


def test_a_borrowed_peer_that_led_its_bucket_s_kernels_narrowly_goes_after_them(tmp_path):
    """A call two octaves from the nearest tuned bucket borrows it: there cuDNN led the kernel entry
    by 6% (459 against 432, as the H200's d=64 n4096/small bucket measured), which is no guide to the
    call's shape, so the kernel serves (on the H200 494.7 TFLOP/s against cuDNN's 394.5 on
    B4-H6-N7847, PERF_NOTES "n1"); a peer that led by PEER_MARGIN or more keeps its place, and so
    does a narrow one in the call's own bucket (distance 0) and at a decode step."""
    from tuner.peer_choice import PEER_MARGIN, narrow_peer

    tuned = Problem(2, 10, 4096, 4096, 64, "bf16", "none")
    params = SM90.default(H100_SXM, tuned)
    call = Problem(4, 6, 7847, 7847, 64, "bf16", "none")
    assert call.bucket() != tuned.bucket()

    def served(peer_tflops: float, problem: Problem = call) -> str:
        path = lookup(tmp_path / f"{peer_tflops}.json", [entry(tuned, "sdpa_cudnn", {}, peer_tflops),
                                                          entry(tuned, SM90.name, params, 432.0)])
        return Dispatcher(path).select(problem, H100_SXM)["family"]

    assert served(459.0) == SM90.name
    assert served(432.0 * PEER_MARGIN + 1) == "sdpa_cudnn"
    assert served(459.0, tuned) == "sdpa_cudnn"   # its own bucket: the measurement stands
    entries = read_lookup(lookup(tmp_path / "n.json", [entry(tuned, "sdpa_cudnn", {}, 459.0),
                                                       entry(tuned, SM90.name, params, 432.0)]))["entries"]
    peer = next(e for e in entries if e["family"] == "sdpa_cudnn")
    assert narrow_peer(peer, entries, call) and not narrow_peer(peer, entries, replace(call, seqlen_q=1))
    assert not narrow_peer(peer, [peer], call)   # no kernel of its bucket to weigh it against

def test_a_peer_plan_runs_sdpa_without_the_fallback_warning(tmp_path, monkeypatch):
    d = Dispatcher(lookup(tmp_path / "best.json", [entry(BF16, "sdpa_flash", {}, 450.0)]))
    monkeypatch.setitem(d._gpus, 0, H100_SXM)
    plan = d._plan(BF16, 0)
    assert plan.launcher is None and plan.peer == "sdpa_flash" and plan.family == "sdpa_flash" and not plan.reason
    nothing = Dispatcher(tmp_path / "absent.json")
    monkeypatch.setitem(nothing._gpus, 0, H100_SXM)
    plan = nothing._plan(replace(BF16, dtype="fp32", max_error=2e-3), 0)   # nothing tuned, no Hopper kernel's dtype
    assert plan.peer is None and "no tuned config" in plan.reason


def test_export_carries_the_sdpa_backends_the_dispatcher_runs_at_their_latest_timing(tmp_path, sm90_params):
    sessions = session_factory(make_engine(f"sqlite:///{tmp_path / 'r.db'}"))
    ok = lambda tflops: Measurement("ok", median_ms=BF16.flops() / tflops / 1e9, tflops=tflops)
    with sessions.begin() as s:
        record_measurement(s, H100_SXM, BF16, SM90.name, sm90_params, ok(400.0), run_id="a")
        update_best(s, H100_SXM.key, BF16.key, SM90.name)
        record_measurement(s, H100_SXM, BF16, "sdpa_cudnn", {}, ok(500.0), run_id="a")
        record_measurement(s, H100_SXM, BF16, "sdpa_cudnn", {}, ok(380.0), run_id="b")   # latest: this one
        record_measurement(s, H100_SXM, BF16, "sdpa_cudnn", {}, Measurement("launch_error"), run_id="c")
        record_measurement(s, H100_SXM, BF16, "sdpa_math", {}, ok(50.0), run_id="b")     # never dispatched
        record_measurement(s, H100_SXM, BF16, "fa4", {}, ok(600.0), run_id="b")          # measured, not run
        benched = replace(BF16, seqlen_q=2048, seqlen_k=2048)   # peers timed, no family tuned: not exported
        record_measurement(s, H100_SXM, benched, "sdpa_cudnn", {}, ok(300.0), run_id="b")
    with sessions() as s:
        doc = lookup_from_db(s, H100_SXM.key)
        assert [b.family for b in best_rows(s)] == [SM90.name]   # ft_best stays the tuned families'
    got = {e["family"]: e["tflops"] for e in doc["entries"]}
    assert got == {SM90.name: 400.0, "sdpa_cudnn": 380.0}
    assert {e["bucket"] for e in doc["entries"]} == {BF16.bucket().key}
    assert next(e for e in doc["entries"] if e["family"] == "sdpa_cudnn")["params"] == {}


def test_a_prefill_that_fills_the_gpu_borrows_a_tuned_bucket_at_any_distance(tmp_path, sm90_params):
    """Past NEAREST_OCTAVES a call still runs the nearest tuned config where its query blocks fill
    the GPU (a long prompt past the tuned lengths, a chunk after far more keys); not where few
    blocks would idle most SMs (SDPA serves), and not a decode call (its decode kernel's default)."""
    d = Dispatcher(lookup(tmp_path / "l.json", [entry(BF16, SM90.name, sm90_params, 300.0)]))   # N=8192 causal
    for far in (replace(BF16, seqlen_q=131072, seqlen_k=131072), replace(BF16, batch=16, seqlen_q=1024, seqlen_k=1024),
                replace(BF16, batch=8, seqlen_q=100, seqlen_k=100)):
        assert next(iter(d.candidates(far, H100_SXM)), None) is None, far.key   # out of reach of the nearest rule
        e = d.select(far, H100_SXM)
        assert e is not None and e["params"] == sm90_params, far.key
    few_blocks = replace(BF16, heads=8, kv_heads=8, seqlen_q=1024, seqlen_k=1024)     # 8 x 8 = 64 blocks on 132 SMs
    decode = replace(BF16, batch=64, seqlen_q=8, seqlen_k=65536, mask="causal_br")   # 32 packed rows on a long cache
    for p in (few_blocks, decode):
        assert d.select(p, H100_SXM) is None, p.key
    assert d.serving_entry(decode, H100_SXM)["family"] == "flash_fwd_sm90_gqa"   # gqa_packing.PACK_ROWS_LONG
    # a decode bucket is no far neighbour of a prefill: a chunk after a long cache, with only decode
    # steps of its mask tuned (here SDPA flash's), runs SDPA unpinned, not a decode measurement's pick
    step = Problem(32, 32, 4, 8192, 128, "bf16", "causal_br", 8)   # 4 queries: a speculative step
    d = Dispatcher(lookup(tmp_path / "decode.json", [entry(step, "sdpa_flash", {}, 10.0)]))
    chunk = Problem(8, 32, 512, 65536, 128, "bf16", "causal_br", 8)
    assert d.select(step, H100_SXM)["family"] == "sdpa_flash" and d.select(chunk, H100_SXM) is None


# ---- the shipped lookups ----

@pytest.fixture
def shipped(tmp_path, monkeypatch, sm90_params):
    folder = tmp_path / "shipped"
    folder.mkdir()
    lookup(folder / "h100.json", [entry(BF16, SM90.name, sm90_params, 300.0),
                                  entry(replace(BF16, head_dim=64), SM90.name, SM90.default(H100_SXM, replace(BF16, head_dim=64)), 250.0)])
    monkeypatch.setattr(export, "SHIPPED_DIR", folder)
    monkeypatch.setenv(export.SHIPPED_ENV, "1")
    return folder


def test_shipped_lookups_serve_the_buckets_the_users_lacks(tmp_path, shipped, sm90_params):
    mine = next(p for p in SM90.seeds(H100_SXM, BF16) if p != sm90_params)
    d = Dispatcher(lookup(tmp_path / "mine.json", [entry(BF16, SM90.name, mine, 100.0)]))
    assert d.select(BF16, H100_SXM)["params"] == mine            # the user's bucket wins, however slow
    d64 = d.select(replace(BF16, head_dim=64), H100_SXM)
    assert d64 is not None and d64["tflops"] == 250.0             # the user's lookup has no d=64
    assert Dispatcher(tmp_path / "absent.json").select(BF16, H100_SXM)["tflops"] == 300.0


H200 = replace(H100_SXM, name="NVIDIA H200", memory_bytes=141 * 2**30)
H100_PCIE = replace(H100_SXM, name="NVIDIA H100 PCIe", sm_count=114)


def test_a_gpu_without_an_entry_for_a_shape_borrows_its_architecture_s_other_gpus(tmp_path, shipped, sm90_params):
    """An H200 (or an H100 PCIe, which flashtune ships no lookup for) on a shape only the H100's
    lookup covers runs the H100's entry, and says so in one warning per source GPU; its own entries
    come first wherever it has one near; another architecture never borrows."""
    own = next(p for p in SM90.seeds(H100_SXM, BF16) if p != sm90_params)
    d = Dispatcher(lookup(tmp_path / "mine.json", [entry(replace(BF16, head_dim=64), SM90.name, own, 90.0, gpu=H200)]))
    assert d.kin(H200) == [H100_SXM.key] and d.kin(A100_SXM) == []
    assert d.kin(H100_PCIE) == sorted([H100_SXM.key, H200.key])
    e = d.select(BF16, H200)
    assert e["gpu_key"] == H100_SXM.key and e["params"] == sm90_params
    assert d.select(replace(BF16, head_dim=64), H200)["params"] == own   # its own d=64 bucket
    assert d.select(BF16, H100_PCIE)["gpu_key"] == H100_SXM.key
    assert d.select(BF16, A100_SXM) is None

    # the plan of an SDPA entry (no compile): the H100 measured SDPA flash fastest there
    d = Dispatcher(lookup(tmp_path / "peer.json", [entry(BF16, "sdpa_flash", {}, 400.0)]))
    d._gpus[0] = H200
    with pytest.warns(UserWarning, match=r"serving configs tuned on NVIDIA-H100-80GB-HBM3/sm_90 \(the same arch"):
        plan = d._plan(BF16, 0)
    assert plan.peer == "sdpa_flash"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # once per source GPU, not per shape
        assert d._plan(replace(BF16, batch=2), 0).peer == "sdpa_flash"


def test_shipped_lookups_can_be_turned_off(tmp_path, shipped, monkeypatch):
    monkeypatch.setenv(export.SHIPPED_ENV, "0")
    assert export.shipped_lookups() == []
    assert Dispatcher(tmp_path / "absent.json").select(BF16, H100_SXM) is None


def test_the_package_ships_lookups_that_read():
    """What the wheel carries under tuner/lookups/ is read by this version, one GPU per file."""
    files = sorted(export.SHIPPED_DIR.glob("*.json"))
    for path in files:
        doc = read_lookup(path)
        assert doc["entries"] and len({e["gpu_key"] for e in doc["entries"]}) == 1, path


@pytest.mark.parametrize("dtype,heads,kv_heads,d", [("bf16", 32, 8, 128), ("fp16", 32, 8, 128), ("bf16", 64, 8, 128),
                                                    ("bf16", 16, 8, 256)])
def test_the_shipped_h100_lookup_serves_chunked_prefill_with_our_kernel(tmp_path, monkeypatch, dtype, heads, kv_heads, d):
    """A prompt's chunk against its cached keys (Nq < Nk, bottom-right), as a serving engine's chunked
    prefill or a KV-cache call of more queries than decode takes: the shipped H100 lookup's own
    buckets or their neighbours serve it with flash_fwd_sm90 (1.8-2.5x SDPA there, PERF_NOTES "p1"),
    not SDPA, for chunks of 256-8192 queries against 2k-64k keys, 32 heads or more."""
    monkeypatch.setenv(export.SHIPPED_ENV, "1")
    dispatcher = Dispatcher(tmp_path / "absent.json")
    shapes = [(1, 512, 4096), (8, 512, 4096), (4, 256, 2048), (2, 1024, 16384), (1, 4096, 8192), (8, 2048, 65536),
              (1, 333, 5000), (2, 8192, 16384)]
    for batch, nq, nk in shapes[:2] if d == 256 else shapes:   # Gemma's shipped chunks: of one sequence
        p = Problem(batch, heads, nq, nk, d, dtype, "causal_br", kv_heads)
        e = dispatcher.select(p, H100_SXM)
        assert e is not None and e["family"] == SM90.name, (p.key, e and e["family"])


def test_the_shipped_h100_lookup_serves_a_shard_s_chunks_with_what_measured_fastest(tmp_path, monkeypatch):
    """A tensor-parallel shard's chunk (8 query heads, 1 K/V head): 32 work tiles of 128 rows at 512
    queries, so the keys split across CTAs (flash_fwd_sm90_split) where that measured fastest (512
    against 32k and 128k keys, 1024 against 64k; at 512 against 4k too, where SDPA flash measured
    level with it but runs 43 us, under its own host time: peer_choice.PEER_MIN_MS), and flash_fwd_sm90
    at 2048 against 16k (128 tiles already)."""
    monkeypatch.setenv(export.SHIPPED_ENV, "1")
    dispatcher = Dispatcher(tmp_path / "absent.json")
    split = "flash_fwd_sm90_split"
    for nq, nk, family in ((512, 4096, split), (512, 32768, split), (512, 131072, split), (1024, 65536, split),
                           (2048, 16384, SM90.name)):
        e = dispatcher.select(Problem(1, 8, nq, nk, 128, "bf16", "causal_br", 1), H100_SXM)
        assert e is not None and e["family"] == family, (nq, nk, e and e["family"])


def test_the_shipped_h200_lookup_serves_d64_gqa_decode_from_its_own_buckets(tmp_path, monkeypatch):
    """A decode step of 32 query heads on 8 K/V heads at d=64 on the H200 (PERF_NOTES "h4"): its own
    buckets serve it, each with what measured fastest at the bucket's shape: flash_decode from B4 to
    B32 (1.02-1.08x the best peer at B4 and B16), cuDNN at B128, its huge bucket's pick. At B16 x 8k
    the merge by speed alone had put B32's cuDNN entry first in the bucket (0.92x of the kernel)."""
    monkeypatch.setenv(export.SHIPPED_ENV, "1")
    dispatcher = Dispatcher(tmp_path / "absent.json")
    for batch, nk, ours in ((4, 1024, True), (4, 8192, True), (16, 1024, True), (16, 8192, True), (32, 8192, True),
                            (128, 8192, False)):
        for dtype in ("bf16", "fp16"):
            p = Problem(batch, 32, 1, nk, 64, dtype, "causal_br", kv_heads=8)
            e = dispatcher.select(p, H200)   # flash_decode, or its cluster form where the splits merge in one
            assert e is not None and (e["gpu_key"], e["bucket"]) == (H200.key, p.bucket().key), (p.key, e)
            assert e["family"].startswith("flash_decode") if ours else e["family"] == "sdpa_cudnn", (p.key, e["family"])


def test_a_split_entry_that_would_pad_more_rows_unsplit_gives_way_to_the_plain_kernels(tmp_path):
    """A bucket tuned at B1 (32 query blocks: the split won, with three consumers: 192 rows for 100
    queries) also serves B7 (224 blocks: one split, the plain kernel padding 92 rows a CTA); there
    the bucket's flash_fwd_sm90 entry (128 rows) serves, not SDPA's, though SDPA measured faster at
    B1. Where the split's estimate is lower (B2: its two splits) or level, the split serves."""
    b1 = Problem(1, 32, 100, 8192, 128, "bf16", "causal_br", kv_heads=8)
    split = dict(SPLIT.default(H100_SXM, b1), Bc=80, cwg=3, stages=3)
    plain = dict(SM90.default(H100_SXM, b1), Bc=176, cwg=2)
    entries = [entry(b1, SPLIT.name, split, 270.0), entry(b1, "sdpa_flash", {}, 190.0),
               entry(b1, SM90.name, plain, 146.0)]
    d = Dispatcher(lookup(tmp_path / "a.json", entries))
    b7 = replace(b1, batch=7)
    assert b7.bucket() == b1.bucket() and auto_splits(split, b7, H100_SXM) == 1
    assert auto_splits(split, replace(b1, batch=2), H100_SXM) > 1
    assert d.select(b1, H100_SXM)["family"] == SPLIT.name
    assert d.select(replace(b1, batch=2), H100_SXM)["family"] == SPLIT.name
    served = d.select(b7, H100_SXM)
    assert served["family"] == SM90.name and served["params"] == plain
    # a bucket without a flash_fwd_sm90 entry keeps serving its split entry (one split)
    d = Dispatcher(lookup(tmp_path / "b.json", entries[:2]))
    assert d.select(b7, H100_SXM)["family"] == SPLIT.name
    # nor does a split of two consumers give way to a plain entry of one (64-row CTAs: both pad to 128)
    small = dict(plain, cwg=1, pingpong=0, split=0, Bc=96)
    d = Dispatcher(lookup(tmp_path / "c.json", [entry(b1, SPLIT.name, dict(split, cwg=2), 270.0),
                                                entry(b1, SM90.name, small, 146.0)]))
    assert d.select(b7, H100_SXM)["family"] == SPLIT.name


def test_a_split_entry_tuned_where_sms_idled_gives_way_to_three_consumers_in_its_own_bucket(tmp_path):
    """A d=64 bottom-right chunk bucket tuned at B1-H12 1024 x 32768 (96 query blocks: SMs idle, the
    split won) also holds B1-H25 931 x 30369 (200 blocks of 128 rows: the GPU filled). There the defaults
    weighed afresh take three consumers and serve (1.27-1.47x the entry on the H200, PERF_NOTES "x5");
    the tuned shape itself, and a d=128 call whose defaults take two consumers, keep the entry."""
    from tuner.untuned import prefill_default, split_default

    tuned = Problem(1, 12, 1024, 32768, 64, "bf16", "causal_br")
    split = dict(SPLIT.default(H100_SXM, tuned), Bc=128, cwg=2, stages=3, split=40, splits=0)
    d = Dispatcher(lookup(tmp_path / "a.json", [entry(tuned, SPLIT.name, split, 400.0)]))
    assert d.select(tuned, H100_SXM)["family"] == SPLIT.name
    call = replace(tuned, heads=25, kv_heads=25, seqlen_q=931, seqlen_k=30369)
    assert call.bucket() == tuned.bucket()
    fresh = split_default(call, H100_SXM) or prefill_default(call, H100_SXM)
    served = d.select(call, H100_SXM)
    assert fresh["params"]["cwg"] == 3 and served["params"]["cwg"] == 3, served
    assert configs_family(served["family"]) == configs_family(fresh["family"])
    wide = replace(tuned, head_dim=128)
    d = Dispatcher(lookup(tmp_path / "b.json", [entry(wide, SPLIT.name, dict(split, Bc=80), 400.0)]))
    call = replace(wide, heads=25, kv_heads=25, seqlen_q=931, seqlen_k=30369)
    assert (split_default(call, H100_SXM) or prefill_default(call, H100_SXM))["params"]["cwg"] == 2
    assert d.select(call, H100_SXM)["family"] == SPLIT.name


def test_a_split_entry_that_would_not_split_a_call_under_a_wave_serves_the_defaults(tmp_path):
    """A d=64 chunk bucket's split entry (128-row tiles, tuned at B1-H8 512 x 16384: 32 blocks, its keys
    split) is the nearest for B1-H25 chunks of 100 blocks under a wave, which its occupancy runs in one
    split: the plain kernel on a tile chosen to split. There the defaults weighed afresh serve: flash_fwd_sm90's
    where the split default would not split either (1.04-1.06x the entry on the H200, PERF_NOTES
    "x8"), the split default where its 192-row tiles split the keys (1.08-1.14x). The tuned shape,
    and a call the entry splits, keep it."""
    from tuner.untuned import prefill_default, split_default

    tuned = Problem(1, 8, 512, 16384, 64, "bf16", "causal_br")
    split = dict(SPLIT.default(H100_SXM, tuned), Bc=128, cwg=2, stages=3, split=40, splits=0)
    d = Dispatcher(lookup(tmp_path / "a.json", [entry(tuned, SPLIT.name, split, 250.0)]))
    assert d.select(tuned, H100_SXM)["params"] == split
    short = replace(tuned, heads=25, kv_heads=25, seqlen_q=496, seqlen_k=2183)
    long = replace(short, seqlen_q=426, seqlen_k=18770)
    for call in (short, long):
        assert next(d.candidates(call, H100_SXM))[1]["params"] == split and auto_splits(split, call, H100_SXM) == 1
    assert split_default(short, H100_SXM) is None
    served = d.select(short, H100_SXM)
    assert served["family"] == SM90.name and served["params"] == prefill_default(short, H100_SXM)["params"]
    fresh = split_default(long, H100_SXM)
    served = d.select(long, H100_SXM)
    assert served["family"] == SPLIT.name and served["params"] == fresh["params"] and fresh["params"]["cwg"] == 3
    assert SPLIT.splits(served["params"], long, H100_SXM) > 1
    few = replace(long, heads=6, kv_heads=6)   # 24 blocks: the entry splits the keys
    assert auto_splits(split, few, H100_SXM) > 1 and d.select(few, H100_SXM)["params"] == split


def test_a_two_consumer_entry_serves_the_defaults_where_three_consumers_pay_and_did_not_where_tuned(tmp_path):
    """A d=80 unmasked bucket tuned at B2-H8 1024 (128 blocks of 128 rows, one wave; 192-row tiles
    would make one wave of longer CTAs, so two consumers won there) serves B2-H16 593, whose 160
    blocks of 128 rows make two waves and 128 of 192 one: the defaults weighed afresh serve, three
    consumers (1.10-2.06x the entry on the H200, PERF_NOTES "x9"). The tuned shape, and a call whose
    waves favour two (B4-H8 1024 x 77), keep the entry; so does a d=96 causal call, where the
    three-consumer default runs on the grid (the persistent form spills) and the entry is persistent."""
    from tuner.kernel_templates.flash_fwd_sm90 import three_consumers_pay
    from tuner.untuned import prefill_default

    tuned = Problem(2, 8, 1024, 1024, 80, "bf16", "none")
    two = dict(SM90.default(H100_SXM, tuned), stages=3)
    assert two["cwg"] == 2 and not three_consumers_pay(H100_SXM, tuned)
    d = Dispatcher(lookup(tmp_path / "a.json", [entry(tuned, SM90.name, two, 300.0)]))
    assert d.select(tuned, H100_SXM)["params"] == two
    call = replace(tuned, heads=16, kv_heads=16, seqlen_q=593, seqlen_k=593)
    assert next(d.candidates(call, H100_SXM))[1]["params"] == two and three_consumers_pay(H100_SXM, call)
    served = d.select(call, H100_SXM)
    assert served["params"] == prefill_default(call, H100_SXM)["params"] and served["params"]["cwg"] == 3
    few = replace(tuned, batch=4, seqlen_k=77)   # one wave of 128-row blocks against two of 192
    assert not three_consumers_pay(H100_SXM, few) and d.select(few, H100_SXM)["params"]["cwg"] == 2
    # under a mask: at d=80 the default keeps the persistent schedule and serves; at d=96 it would not
    for head_dim, cwg in ((80, 3), (96, 2)):
        tuned = Problem(1, 32, 1700, 1700, head_dim, "bf16", "causal")   # 4 waves of 128 rows, 3 of 192
        persistent = dict(SM90.default(H100_SXM, tuned), persistent=1)
        assert persistent["cwg"] == 2 and not three_consumers_pay(H100_SXM, tuned)
        d = Dispatcher(lookup(tmp_path / f"d{head_dim}.json", [entry(tuned, SM90.name, persistent, 300.0)]))
        call = replace(tuned, seqlen_q=2260, seqlen_k=2260)   # 5 waves of 128 rows, 3 of 192
        assert next(d.candidates(call, H100_SXM))[1]["params"] == persistent and three_consumers_pay(H100_SXM, call)
        assert d.select(call, H100_SXM)["params"]["cwg"] == cwg


TILE = ("Bc", "stages", "cwg", "split")


def test_a_plain_config_serving_a_call_that_leaves_sms_idle_splits_its_keys(tmp_path, sm90_params):
    """A flash_fwd_sm90 config tuned where its blocks filled the GPU (B1-H32/kv8 8k causal) serves
    one head of that prompt (64 blocks on 132 SMs) with the keys split, its tile kept; where the
    blocks fill the GPU it runs as tuned, and an entry tuned on a call that left SMs idle stands as
    measured (a search of every family weighed the split against it there)."""
    d = Dispatcher(lookup(tmp_path / "l.json", [entry(BF16, SM90.name, sm90_params, 300.0)]))
    one_head = replace(BF16, heads=1, kv_heads=1)
    e = d.select(one_head, H100_SXM)
    assert e["family"] == SPLIT.name and SPLIT.splits(e["params"], one_head, H100_SXM) > 1
    assert {k: e["params"][k] for k in TILE} == {k: sm90_params[k] for k in TILE}
    assert SPLIT.check(e["params"], H100_SXM, one_head) is None
    assert d.select(BF16, H100_SXM)["params"] == sm90_params
    assert d.select(replace(BF16, heads=8, kv_heads=8), H100_SXM)["family"] == SM90.name   # 512 blocks
    d = Dispatcher(lookup(tmp_path / "idle.json", [entry(one_head, SM90.name, sm90_params, 150.0)]))
    assert d.select(replace(one_head, seqlen_q=7000, seqlen_k=7000), H100_SXM)["family"] == SM90.name
    assert SPLIT.split_form(sm90_params, H100_SXM, replace(one_head, seqlen_q=300, seqlen_k=300)) is None
    # 2000 keys: two splits would halve the main loop, but the merge's tail eats the gain (0.72x
    # measured): the occupancy's estimate counts it and keeps one
    short = Problem(1, 2, 2000, 2000, 128, "bf16", "none", 2)
    plain = dict(SM90.default(H100_SXM, short), Bc=176, cwg=2, split=24)
    as_split = dict(SPLIT.default(H100_SXM, short), **{k: plain[k] for k in TILE})
    assert SPLIT.check(as_split, H100_SXM, short) is None and auto_splits(as_split, short, H100_SXM) == 1
    assert SPLIT.split_form(plain, H100_SXM, short) is None


def test_an_untuned_prefill_that_leaves_sms_idle_runs_the_split_default_where_it_splits(tmp_path):
    """Nothing tuned near a few heads of a 3k prompt (bottom-right, as a KV cache's prefill puts
    it): flash_fwd_sm90_split's default splits its 50 blocks' keys, where SDPA ran it on 50 SMs
    (114 TFLOP/s against SDPA flash's 45 on the H200, PERF_NOTES "p5"); `tuner bench --lookup`
    times that. Too few keys to split: flash_fwd_sm90's default unsplit, as for blocks that fill the
    GPU (test_an_untuned_head_dim_that_fills_the_gpu_runs_the_hopper_default; PERF_NOTES "n1": it
    read 1.14-2.8x SDPA's best on such calls); fp32, which no Hopper kernel takes: SDPA."""
    from tuner.cli import _served

    path = lookup(tmp_path / "far.json", [entry(replace(BF16, head_dim=64), SM90.name,
                                                SM90.default(H100_SXM, replace(BF16, head_dim=64)), 300.0)])
    d = Dispatcher(path)
    shard = Problem(1, 2, 3169, 3276, 128, "bf16", "causal_br", 1)
    e = d.serving_entry(shard, H100_SXM)
    assert d.select(shard, H100_SXM) is None and e["family"] == SPLIT.name
    assert e["params"] == SPLIT.default(H100_SXM, shard) and SPLIT.splits(e["params"], shard, H100_SXM) > 1
    assert _served(path, [shard], H100_SXM)[shard.key].family == SPLIT.name
    short = replace(shard, seqlen_q=300, seqlen_k=300)   # (10 blocks of 64 rows: at one consumer)
    assert d.serving_entry(short, H100_SXM) == {"family": SM90.name, "params": dict(SM90.default(H100_SXM, short), cwg=1,
                                                                                     pingpong=0, split=0)}
    assert d.serving_entry(replace(shard, dtype="fp32"), H100_SXM) is None
    full = replace(shard, batch=8, heads=32, kv_heads=8)
    assert d.serving_entry(full, H100_SXM) == {"family": SM90.name, "params": SM90.default(H100_SXM, full)}



def test_an_untuned_prefill_of_two_waves_of_default_tiles_runs_the_default_unsplit(tmp_path):
    """Nothing tuned at d=96: B8-H4 1078 x 8849 keys makes 288 tiles of 128 rows, over two waves of
    132 SMs, and runs flash_fwd_sm90's default (persistent) unsplit: 476 TFLOP/s against the split
    default's 446 on the H200 (PERF_NOTES "j3"); B1-H16 1260 x 27529, 160 tiles of 128 rows (1.2 waves),
    ran the split (540 against 391 at two consumers) until the default took three consumers at d=96,
    112 tiles of 192 rows, one wave: 570 against the split's 550 ("x3"). At d=64 three consumers' tiles
    weigh against the split the same way and lose there: the split stands."""
    from tuner.untuned import DEFAULT_WAVES

    from tuner.kernel_templates.flash_fwd_sm90 import three_consumers_pay

    d = Dispatcher(lookup(tmp_path / "none.json", []))
    two = Problem(8, 4, 1078, 8849, 96, "bf16", "causal_br", 4)
    # its default takes three consumers (192 tiles of 192 rows), counted as two consumers' 128-row
    # tiles: the plain default read 1.06-1.08x the split on three such calls (PERF_NOTES "x2")
    assert three_consumers_pay(H100_SXM, two) and SM90.default(H100_SXM, two)["cwg"] == 3
    assert two.query_blocks(192) < DEFAULT_WAVES * H100_SXM.sm_count <= two.query_blocks(128)
    assert d.serving_entry(two, H100_SXM) == {"family": SM90.name, "params": SM90.default(H100_SXM, two)}
    one = Problem(1, 16, 1260, 27529, 96, "bf16", "causal_br", 16)
    assert SPLIT.splits(SPLIT.default(H100_SXM, one), one, H100_SXM) > 1
    assert d.serving_entry(one, H100_SXM) == {"family": SM90.name, "params": SM90.default(H100_SXM, one)}
    # B1-H25 1362 x 30286 at d=64: 200 tiles of 192 rows, two waves plain, split three ways read 1.13x ("x3")
    wide = Problem(1, 25, 1362, 30286, 64, "bf16", "causal_br", 25)
    assert SM90.default(H100_SXM, wide)["cwg"] == 3
    e = d.serving_entry(wide, H100_SXM)
    assert e["family"] == SPLIT.name and SPLIT.splits(e["params"], wide, H100_SXM) > 1


def test_a_three_consumer_config_tuned_on_many_blocks_serves_a_call_under_a_wave_at_two(tmp_path):
    """The n1024/medium bucket's config, tuned on 1200 blocks of 192 rows (three consumers,
    persistent), borrowed by 12 heads of a 548-query prompt (36 such blocks on 132 SMs), served
    as flash_fwd_sm90's default, two consumers there: 35.1 TFLOP/s against 28.6 on the H200
    (PERF_NOTES "j3"); its 108 blocks of 64 rows make under a wave, so it runs at one consumer since
    "x10". 24 heads (72 blocks of 192 rows, 216 of 64) run at two. Where the bucket's entry was tuned
    on a call of under a wave itself, it stands; so does it at 1200 blocks."""
    from tuner.untuned import one_consumer_default

    d64 = Problem(8, 25, 1024, 1024, 64, "bf16", "causal", 25)
    three = dict(SM90.default(H100_SXM, d64), persistent=1, split=32)
    assert three["cwg"] == 3 and SM90.check(three, H100_SXM, d64) is None
    d = Dispatcher(lookup(tmp_path / "medium.json", [entry(d64, SM90.name, three, 300.0)]))
    few = Problem(1, 12, 548, 548, 64, "bf16", "causal", 12)
    assert next(d.candidates(few, H100_SXM))[1]["params"] == three   # borrowed: the nearest bucket's
    e = d.serving_entry(few, H100_SXM)
    assert e == one_consumer_default(few, H100_SXM) and e["params"]["cwg"] == 1
    wider = replace(few, heads=24, kv_heads=24)
    assert next(d.candidates(wider, H100_SXM))[1]["params"] == three
    e = d.serving_entry(wider, H100_SXM)
    assert e["family"] == SM90.name and e["params"] == SM90.default(H100_SXM, wider) and e["params"]["cwg"] == 2
    assert d.serving_entry(d64, H100_SXM)["params"] == three
    idle = Problem(1, 12, 600, 600, 64, "bf16", "causal", 12)   # same bucket, tuned under a wave
    assert idle.bucket() == few.bucket()
    d = Dispatcher(lookup(tmp_path / "idle.json", [entry(idle, SM90.name, three, 30.0)]))
    assert d.serving_entry(few, H100_SXM)["params"] == three


def test_a_call_whose_64_row_blocks_make_a_wave_or_less_runs_one_consumer(tmp_path):
    """A two-consumer entry tuned on B4-H8 512 x 1536 (256 blocks of 64 rows), serving 4 heads of a
    300 x 1500 chunk (20 such blocks on 132 SMs), gives way to flash_fwd_sm90's default at one
    consumer: 1.03-1.39x on 26 such H200 calls, 1.18x geomean on 85 held out (PERF_NOTES "x10").
    134 blocks of 64 rows (past a wave) keep the entry; so does an entry tuned in the call's own
    bucket on a call of under a wave (a search there weighed one consumer), and a split form."""
    from tuner.kernel_templates.flash_fwd_sm90 import ONE_CONSUMER_WAVES, one_consumer_pays
    from tuner.untuned import one_consumer_default

    tuned = Problem(4, 8, 512, 1536, 128, "bf16", "none", 8)
    two = SM90.default(H100_SXM, tuned)
    assert two["cwg"] == 2
    d = Dispatcher(lookup(tmp_path / "a.json", [entry(tuned, SM90.name, two, 600.0)]))
    chunk = Problem(1, 4, 300, 1500, 128, "bf16", "none", 4)
    assert next(d.candidates(chunk, H100_SXM))[1]["params"] == two and one_consumer_pays(H100_SXM, chunk)
    one = d.serving_entry(chunk, H100_SXM)
    assert one == one_consumer_default(chunk, H100_SXM) and one["family"] == SM90.name
    assert one["params"] == dict(SM90.default(H100_SXM, chunk), cwg=1, pingpong=0, split=0)
    assert SM90.check(one["params"], H100_SXM, chunk) is None
    wave = replace(chunk, heads=67, kv_heads=67, seqlen_q=128)   # 134 blocks of 64 rows: past one wave
    assert wave.query_blocks(64) > ONE_CONSUMER_WAVES * H100_SXM.sm_count and not one_consumer_pays(H100_SXM, wave)
    assert d.serving_entry(wave, H100_SXM)["params"]["cwg"] >= 2
    assert not one_consumer_pays(H100_SXM, replace(chunk, seqlen_q=16))   # a decode step: not this rule
    own = replace(chunk, seqlen_q=280)   # tuned in the call's bucket, on 20 blocks of 64 rows too
    assert own.bucket() == chunk.bucket()
    d = Dispatcher(lookup(tmp_path / "own.json", [entry(own, SM90.name, two, 60.0)]))
    assert d.serving_entry(chunk, H100_SXM)["params"] == two
    shard = Problem(1, 2, 300, 30000, 128, "bf16", "causal_br", 1)   # keys that split: the split form stands
    assert d.serving_entry(shard, H100_SXM)["family"] in (SPLIT.name, "flash_fwd_sm90_gqa")
    assert one_consumer_default(replace(chunk, dtype="fp8"), H100_SXM) is None


def test_a_three_consumer_config_serves_a_causal_call_whose_blocks_differ_under_a_wave_at_two(tmp_path):
    """The d=96 n8192/medium bucket's grid config (three consumers, tuned on B1-H32 x 8192 causal:
    1376 blocks of 192 rows), borrowed by 4 heads of a 5837-token prompt (124 such blocks, under a
    wave, each head's later blocks seeing more keys): the longest block is the launch, and
    flash_fwd_sm90's default runs it at two consumers, persistent: 401 TFLOP/s against 299 on the
    H200 (PERF_NOTES "x2"). The same prompt over 32 heads, blocks past a wave, keeps the config."""
    from tuner.kernel_templates.flash_fwd_sm90 import rows_spread_idle

    tuned = Problem(1, 32, 8192, 8192, 96, "bf16", "causal", 32)
    three = dict(SM90.default(H100_SXM, tuned), cwg=3, split=24, persistent=0, stages=2)
    assert SM90.check(three, H100_SXM, tuned) is None
    d = Dispatcher(lookup(tmp_path / "medium.json", [entry(tuned, SM90.name, three, 560.0)]))
    few = Problem(1, 4, 5837, 5837, 96, "bf16", "causal", 4)
    assert few.query_blocks(192) < H100_SXM.sm_count and rows_spread_idle(H100_SXM, few)
    e = d.serving_entry(few, H100_SXM)
    assert e["family"] == SM90.name and e["params"] == SM90.default(H100_SXM, few) and e["params"]["cwg"] == 2
    assert d.serving_entry(tuned, H100_SXM)["params"] == three
    wide = replace(few, heads=32, kv_heads=32)   # 992 blocks
    assert not rows_spread_idle(H100_SXM, wide) and d.serving_entry(wide, H100_SXM)["params"] == three


def test_a_borrowed_split_entry_gives_way_on_a_call_that_fills_the_gpu(tmp_path):
    """A split entry tuned on 8 heads of a 1024 x 32768 chunk (64 blocks: its keys split) is the
    only tuned bucket near 12 heads of a 1536 x 4813 chunk (144 blocks of 128 rows, over a wave):
    the call runs flash_fwd_sm90's default, not the split tile at one or two splits (303.9 TFLOP/s
    against 205.0-247.4 on the H200, PERF_NOTES "j3"). A call that leaves SMs idle keeps it."""
    tuned = Problem(1, 8, 1024, 32768, 64, "bf16", "causal_br", 8)
    params = dict(SPLIT.default(H100_SXM, tuned), splits=4)
    d = Dispatcher(lookup(tmp_path / "split.json", [entry(tuned, SPLIT.name, params, 400.0)]))
    full = Problem(1, 12, 1536, 4813, 64, "bf16", "causal_br", 12)
    e = d.serving_entry(full, H100_SXM)
    assert e["family"] == SM90.name and e["params"] == SM90.default(H100_SXM, full)
    idle = Problem(1, 4, 1024, 30000, 64, "bf16", "causal_br", 4)
    assert d.serving_entry(idle, H100_SXM)["family"] == SPLIT.name


def test_a_borrowed_split_entry_gives_way_to_the_split_default_where_that_splits(tmp_path):
    """Where the split entry gives way, the keys' split is weighed afresh for the call: 12 heads of
    four 3144 x 18763 chunks (204 blocks of 192 rows, a wave and a half) run flash_fwd_sm90_split's
    default in three splits (453 TFLOP/s on the H200, against 421 for flash_fwd_sm90's default and
    370 for the borrowed entry, PERF_NOTES "b2")."""
    tuned = Problem(1, 8, 1024, 32768, 64, "bf16", "causal_br", 8)
    params = dict(SPLIT.default(H100_SXM, tuned), splits=4, cwg=2, stages=3, split=40)
    d = Dispatcher(lookup(tmp_path / "split.json", [entry(tuned, SPLIT.name, params, 400.0)]))
    call = Problem(4, 3, 3144, 18763, 64, "bf16", "causal_br", 3)
    e = d.serving_entry(call, H100_SXM)
    assert e["family"] == SPLIT.name and e["params"] == SPLIT.default(H100_SXM, call)
    assert SPLIT.splits(e["params"], call, H100_SXM) == 3

@pytest.mark.parametrize("d", [80, 96, 192, 248])
def test_an_untuned_head_dim_that_fills_the_gpu_runs_the_hopper_default(tmp_path, monkeypatch, d):
    """Lookups borrow only within a head dim and dtype (tuner.nearest), and the shipped ones tune fp16
    at 64, 128 and 256 only: an fp16 prefill at Phi-3's 96 (Stable Diffusion's 80, 192, ...) that
    fills the GPU runs flash_fwd_sm90's default, its tile padded to the head dim; a decode step runs
    flash_decode's, padded too; so does one of blocks that leave SMs idle, with keys too few to
    split; a GPU without wgmma, or a head dim no kernel takes (84: not a multiple of 8) runs SDPA,
    and the plan's reason says which."""
    from tuner.cli import _served
    from tuner.untuned import one_consumer_default

    monkeypatch.setenv(export.SHIPPED_ENV, "1")
    d_ = Dispatcher(tmp_path / "absent.json")
    prefill = Problem(1, 32, 4096, 4096, d, "fp16", "causal", kv_heads=8)   # the shipped d=80, 96 buckets are bf16
    e = d_.serving_entry(prefill, H100_SXM)
    assert d_.select(prefill, H100_SXM) is None and e == {"family": SM90.name, "params": SM90.default(H100_SXM, prefill)}
    assert SM90.check(e["params"], H100_SXM, prefill) is None
    assert _served(str(tmp_path / "absent.json"), [prefill], H100_SXM)[prefill.key].family == SM90.name
    few = replace(prefill, heads=8, seqlen_q=512, seqlen_k=512)   # 32 blocks: SMs idle, 512 keys too few to split
    decode = replace(prefill, seqlen_q=1, seqlen_k=8192)
    # (64 blocks of 64 rows: under a wave, so at one consumer)
    assert d_.serving_entry(few, H100_SXM) == one_consumer_default(few, H100_SXM) != None
    for p, gpu in ((prefill, A100_SXM), (replace(prefill, head_dim=84), H100_SXM)):
        assert d_.serving_entry(p, gpu) is None, (p.key, gpu.name)
    step = d_.serving_entry(decode, H100_SXM)   # in its cluster form where its keys split 2-8 ways
    if d > 128:   # past d=128 a GQA step of few rows packs its query heads where their grid fills the GPU
        assert packs(decode, H100_SXM)   # 8 K/V heads x 7 splits of 8192 keys: 56 CTAs (gqa_packing.PACK_FEW_ROWS_SM_SHARE)
        gqa = get_family("flash_fwd_sm90_gqa")
        assert step == {"family": gqa.name, "params": gqa.default(H100_SXM, decode)}
    else:
        assert configs_family(step["family"]) == "flash_decode"
        assert dict(step["params"], splits=0) == get_family("flash_decode").default(H100_SXM, decode)
    monkeypatch.setitem(d_._gpus, 0, H100_SXM)
    assert "no flashtune kernel takes head dim 84" in d_._plan(replace(prefill, head_dim=84), 0).reason


def test_the_shipped_h100_lookup_serves_a_speculative_steps_batches(tmp_path, monkeypatch):
    """B1-H32/kv8, 100 queries against 8k keys (a speculative step) splits the keys; B7 of the same
    bucket fills the GPU: in bf16 the split's entry there takes 192 rows a CTA and the bucket's
    flash_fwd_sm90 entry (128) serves; in fp16 the split's takes 128 too and keeps serving."""
    monkeypatch.setenv(export.SHIPPED_ENV, "1")
    dispatcher = Dispatcher(tmp_path / "absent.json")
    for batch, dtype, family in ((1, "bf16", SPLIT.name), (2, "bf16", SPLIT.name), (3, "bf16", SM90.name),
                                 (7, "bf16", SM90.name), (1, "fp16", SPLIT.name), (7, "fp16", SPLIT.name)):
        e = dispatcher.select(Problem(batch, 32, 100, 8192, 128, dtype, "causal_br", 8), H100_SXM)
        assert e is not None and e["family"] == family, (batch, dtype, e and e["family"])


# ---- first-call autotuning ----

def test_autotune_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(autotune.ENV, raising=False)
    assert not autotune.enabled()
    monkeypatch.setenv(autotune.ENV, "1")
    assert autotune.enabled()
    autotune.set_autotune(False)
    try:
        assert not autotune.enabled()
    finally:
        autotune.set_autotune(None)
    assert autotune.enabled()


def test_the_shortlist_is_the_nearest_distinct_configs_and_the_backends_that_take_the_case(sm90_params):
    others = [p for p in SM90.seeds(H100_SXM, BF16) if p != sm90_params][:3]
    entries = [{"family": SM90.name, "params": sm90_params}, {"family": "sdpa_flash", "params": {}},
               {"family": SM90.name, "params": dict(sm90_params)}] + [{"family": SM90.name, "params": p} for p in others]
    short = autotune.shortlist(BF16, H100_SXM, entries)
    configs = [e["params"] for e in short if e["family"] == SM90.name]
    assert configs == [sm90_params, *others[:autotune.MAX_CONFIGS - 1]]
    peers = {e["family"] for e in short if e["family"] != SM90.name}
    assert {"sdpa_flash", "sdpa_efficient"} <= peers and "sdpa_math" not in peers
    fp32 = {e["family"] for e in autotune.shortlist(FP32, H100_SXM, [])}
    assert fp32 == {"sdpa_efficient"}   # cuDNN and FlashAttention-2 take no fp32


@pytest.fixture
def tuned_by_hand(monkeypatch):
    """autotune.tune replaced by one that records its calls and answers sdpa_flash at 500 TFLOP/s."""
    calls = []

    def fake_tune(problem, gpu, entries, lookup_path=None):
        calls.append((problem, [e["family"] for e in entries]))
        return build_lookup([entry(problem, "sdpa_flash", {}, 500.0)])["entries"]

    monkeypatch.setattr(autotune, "tune", fake_tune)
    monkeypatch.setattr(autotune, "_forced", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # a CPU build has no CUDA
    return calls


def test_autotune_runs_once_per_untuned_bucket_and_serves_its_winner(tmp_path, monkeypatch, tuned_by_hand,
                                                                      sm90_params):
    other = replace(BF16, seqlen_q=2048, seqlen_k=2048)
    d = Dispatcher(lookup(tmp_path / "best.json", [entry(other, SM90.name, sm90_params, 400.0)]))
    monkeypatch.setitem(d._gpus, 0, H100_SXM)
    plan = d._plan(BF16, 0)
    assert plan.peer == "sdpa_flash" and not plan.provisional
    assert tuned_by_hand == [(BF16, [SM90.name])]   # the nearest bucket's config was a candidate
    d._plan(replace(BF16, seqlen_q=8000, seqlen_k=8000), 0)   # same bucket: served, not tuned again
    d._plan(other, 0)                                         # the user tuned this bucket
    assert len(tuned_by_hand) == 1


def test_autotune_of_a_call_that_packs_times_the_packed_default_and_a_faster_plain_winner_stands(tmp_path, monkeypatch):
    """A GQA prefill that packs (packs_prefill) would run flash_fwd_sm90_gqa's default over any plain
    winner its bucket holds, unweighed; a first call times that default first, beside the nearest
    buckets' configs, and where a plain config measured faster, the plain one serves."""
    gqa = get_family("flash_fwd_sm90_gqa")
    p = Problem.parse("16,8:2,350:29787,128,causal_br", "bf16")
    packed = {"family": gqa.name, "params": gqa.default(H100_SXM, p)}
    timed = []

    def fake_tune(problem, gpu, entries, lookup_path=None):
        timed.append(entries)
        return build_lookup([entry(problem, gqa.name, packed["params"], 650.0),
                             entry(problem, "sdpa_flash", {}, 700.0)])["entries"]

    monkeypatch.setattr(autotune, "tune", fake_tune)
    monkeypatch.setattr(autotune, "_forced", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    near = entry(replace(p, seqlen_q=700), SM90.name, SM90.default(H100_SXM, p), 600.0)
    d = Dispatcher(lookup(tmp_path / "best.json", [near]))
    monkeypatch.setitem(d._gpus, 0, H100_SXM)
    assert d.serving_entry(p, H100_SXM) == packed
    assert d._plan(p, 0).peer == "sdpa_flash"
    assert [e["family"] for e in timed[0]] == [gqa.name, SM90.name] and timed[0][0] == packed
    # the bucket now holds a packed entry: a plain one measured faster stands against it
    d.add_entries(H100_SXM.key, build_lookup([entry(p, SM90.name, SM90.default(H100_SXM, p), 720.0)])["entries"])
    served = d.serving_entry(p, H100_SXM)
    assert served["family"] == SM90.name and served["tflops"] == 720.0
    # a call that does not pack times the nearest buckets' entries alone
    assert d._autotune_candidates(BF16, H100_SXM) == [e for _, e in d.candidates(BF16, H100_SXM, autotune.OCTAVES)]


def test_no_autotune_during_graph_capture_and_the_plan_is_made_again_after(tmp_path, monkeypatch, tuned_by_hand):
    d = Dispatcher(tmp_path / "absent.json")
    monkeypatch.setitem(d._gpus, 0, H100_SXM)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    plan = d._plan(BF16, 0)
    assert plan.provisional and plan.peer is None and tuned_by_hand == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    plan = d._plan(BF16, 0)
    assert not plan.provisional and plan.peer == "sdpa_flash" and len(tuned_by_hand) == 1


def test_autotune_stores_every_measurement_and_merges_the_winners_into_the_lookup(tmp_path, monkeypatch,
                                                                                   sm90_params):
    db = tmp_path / "results.db"
    monkeypatch.setenv("TUNER_DB", f"sqlite:///{db}")
    path = tmp_path / "best.json"
    kept = entry(FP32, SIMT.name, SIMT_PARAMS, 20.0)
    lookup(path, [kept])
    ms = BF16.flops() / 450e9
    measured = [(SM90.name, sm90_params, Measurement("ok", median_ms=ms, tflops=450.0)),
                (SM90.name, dict(sm90_params, Bc=64), Measurement("wrong_result", message="error over budget")),
                ("sdpa_flash", {}, Measurement("ok", median_ms=ms * 1.1, tflops=409.0))]
    monkeypatch.setattr(autotune, "measure", lambda problem, gpu, shortlist, seed=0: measured)
    got = autotune.tune(BF16, H100_SXM, [], path)
    assert [(e["family"], e["tflops"]) for e in got] == [(SM90.name, 450.0), ("sdpa_flash", 409.0)]
    doc = read_lookup(path)
    assert {(e["family"], e["bucket"]) for e in doc["entries"]} == {
        (SIMT.name, FP32.bucket().key), (SM90.name, BF16.bucket().key), ("sdpa_flash", BF16.bucket().key)}
    sessions = session_factory(make_engine(f"sqlite:///{db}"))
    with sessions() as s:
        best = best_rows(s, H100_SXM.key)
        assert [(b.family, b.params, b.tflops) for b in best] == [(SM90.name, sm90_params, 450.0)]
        rows = measurements(s)
    assert len(rows) == 3 and all(r["run_id"].startswith("autotune-") for r in rows)


def test_autotune_that_cannot_store_still_serves_with_one_warning(tmp_path, monkeypatch, sm90_params):
    monkeypatch.setenv("TUNER_DB", f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'r.db'}")
    (tmp_path / "no").write_text("a file where a folder should be")
    monkeypatch.setattr(autotune, "measure", lambda problem, gpu, shortlist, seed=0: [
        (SM90.name, sm90_params, Measurement("ok", median_ms=1.0, tflops=450.0))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = autotune.tune(BF16, H100_SXM, [], tmp_path / "best.json")
    assert [e["family"] for e in got] == [SM90.name]
    assert len(caught) == 1 and "used but not stored" in str(caught[0].message)


# ---- timing what the dispatcher serves ----

def test_bench_times_what_a_lookup_serves_a_peer_among_the_peers(tmp_path, sm90_params):
    from tuner.bench import Bench
    from tuner.cli import _served

    near = replace(BF16, seqlen_q=4096, seqlen_k=4096)
    path = lookup(tmp_path / "best.json", [entry(near, SM90.name, sm90_params, 400.0), entry(FP32, "sdpa_efficient", {}, 9.0)])
    far = replace(BF16, head_dim=64)   # no bucket of its head dim: the Hopper default, as the dispatcher runs it
    small = replace(far, heads=4, kv_heads=1, seqlen_q=512, seqlen_k=512)   # SMs idle, too few keys to split: the default
    fp32 = replace(FP32, head_dim=128)   # no bucket of its head dim, no Hopper kernel of its dtype: SDPA
    served = _served(path, [BF16, FP32, far, small, fp32], H100_SXM)
    assert served[BF16.key].family == SM90.name and served[BF16.key].params == sm90_params   # from the nearer bucket
    assert served[FP32.key].family == "sdpa_efficient" and fp32.key not in served
    assert served[small.key].family == SM90.name   # (32 blocks of 64 rows: at one consumer)
    assert served[small.key].params == dict(SM90.default(H100_SXM, small), cwg=1, pingpong=0, split=0)
    assert served[far.key].family == SM90.name and served[far.key].params == SM90.default(H100_SXM, far)
    # a split count tuned at B1 is timed as the dispatcher runs it at B3: from the occupancy
    shard = Problem(1, 8, 512, 32768, 128, "bf16", "causal_br", 1)
    tuned = dict(SPLIT.default(H100_SXM, shard), splits=4)
    path = lookup(tmp_path / "split.json", [entry(shard, SPLIT.name, tuned, 550.0)])
    b3 = replace(shard, batch=3)
    assert _served(path, [shard, b3], H100_SXM)[shard.key].params == tuned
    assert _served(path, [b3], H100_SXM)[b3.key].params == dict(tuned, splits=0)

    class Peers:
        gpu = H100_SXM
        timed: list[str] = []

        def peer(self, backend, problem):
            self.timed.append(backend)
            return Measurement("ok", median_ms=1.0, tflops={"sdpa_efficient": 9.5, "sdpa_math": 1.0}[backend])

    runner = Peers()
    sessions = session_factory(make_engine(f"sqlite:///{tmp_path / 'b.db'}"))
    r = Bench(runner, sessions).best(FP32, served[FP32.key])
    assert r.family == "sdpa_efficient" and r.best.tflops == 9.5 and set(r.peers) == {"sdpa_efficient", "sdpa_math"}
    assert sorted(runner.timed) == ["sdpa_efficient", "sdpa_math"]


def test_a_search_on_another_gpu_of_the_architecture_starts_from_the_shipped_configs(tmp_path, shipped, sm90_params):
    """An H200 (no stored bests) opens its study with the shipped H100 winner of the nearest
    problem, before the family's default and seeds; an A100 (another architecture) does not."""
    from types import SimpleNamespace

    from tuner.search import Search

    h200 = replace(H100_SXM, name="NVIDIA H200", memory_bytes=141 << 30)
    shipped_params = next(p for p in SM90.seeds(H100_SXM, BF16) if p != SM90.default(h200, BF16))
    lookup(shipped / "h100.json", [entry(replace(BF16, seqlen_q=4096, seqlen_k=4096), SM90.name, shipped_params, 500.0)])
    url = f"sqlite:///{tmp_path / 's.db'}"
    search = Search(SimpleNamespace(gpu=h200), session_factory(make_engine(url)), url)
    starts = search.starts(SM90, BF16)
    assert starts[0] == shipped_params and SM90.default(h200, BF16) in starts[1:]
    a100 = Search(SimpleNamespace(gpu=A100_SXM), session_factory(make_engine(url)), url)
    assert a100.starts(get_family("flash_fwd_mma"), BF16)[0] == get_family("flash_fwd_mma").default(A100_SXM, BF16)


def test_a_varlen_search_measures_what_the_plan_serves_without_it(tmp_path, shipped):
    """A study of flash_fwd_sm90_varlen with no entry of its own starts from its family's tuned
    configs made varlen (what the varlen plan serves in its absence), the padded problem's own
    (this GPU's database) first, then the shipped one; its own shipped entry comes before both."""
    from types import SimpleNamespace

    from tuner.search import Search

    variant = get_family("flash_fwd_sm90_varlen")
    padded = replace(BF16, batch=16)
    url = f"sqlite:///{tmp_path / 's.db'}"
    sessions = session_factory(make_engine(url))
    search = Search(SimpleNamespace(gpu=H100_SXM), sessions, url)
    made = lambda p: variant.from_tuned(p, padded)
    dense = next(p for p in SM90.seeds(H100_SXM, padded) if made(p) != variant.default(H100_SXM, padded))
    lookup(shipped / "h100.json", [entry(BF16, SM90.name, dense, 300.0)])
    served = made(dense)
    assert search.starts(variant, padded)[0] == served
    mine = next(p for p in SM90.seeds(H100_SXM, padded) if made(p) not in (served, variant.default(H100_SXM, padded)))
    with sessions.begin() as s:   # the padded problem itself tuned densely on this GPU
        record_measurement(s, H100_SXM, padded, SM90.name, mine,
                           Measurement("ok", median_ms=padded.flops() / 500.0 / 1e9, tflops=500.0), run_id="a")
        update_best(s, H100_SXM.key, padded.key, SM90.name)
    starts = search.starts(variant, padded)
    assert starts[:2] == [made(mine), served], starts[:3]
    own = made(next(p for p in SM90.seeds(H100_SXM, padded) if made(p) not in starts[:2]))
    lookup(shipped / "h100.json", [entry(BF16, SM90.name, dense, 300.0), entry(padded, variant.name, own, 200.0)])
    assert search.starts(variant, padded)[0] == own


# ---- FlashAttention-4 as a peer ----

def test_fa4_is_a_default_peer_only_where_installed_and_it_runs_the_case(monkeypatch):
    import importlib.util
    import types

    from tuner import peers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn.cute" else real(name, *a))
    assert peers.fa4_missing() and "pip install 'flashtune[fa4]'" in peers.fa4_missing()
    assert "fa4" not in peers.peers_for(BF16, (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: types.SimpleNamespace() if name == "flash_attn.cute" else real(name, *a))
    assert peers.fa4_missing() is None
    assert peers.peers_for(BF16, (9, 0))[-1] == "fa4"
    assert "fa4" not in peers.peers_for(BF16, (8, 0))                      # an A100: no FA4 forward
    assert "fa4" not in peers.peers_for(FP32, (9, 0))                      # fp32
    top_left = replace(BF16, seqlen_q=512)                                # SDPA's causal, Nq != Nk
    assert "fa4" not in peers.peers_for(top_left, (9, 0))
    assert "fa4" in peers.peers_for(replace(top_left, mask="causal_br"), (9, 0))
    assert "fa4" in peers.peers_for(replace(BF16, dtype="fp8"), (9, 0))    # its peers run bf16 copies


def test_bench_peer_fa4_without_it_installed_says_so_in_one_line(monkeypatch, tmp_path):
    import importlib.util
    import subprocess
    import sys

    code = ("import importlib.util as u; real = u.find_spec; "
            "u.find_spec = lambda n, *a: None if n == 'flash_attn.cute' else real(n, *a); "
            "from tuner.cli import main; import sys; sys.argv = ['tuner', 'bench', '--peer', 'fa4', '--shape', "
            "'1,8,1024,128', '--dtype', 'bf16', '--db', 'sqlite:///" + str(tmp_path / "b.db") + "']; main()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "", "NO_COLOR": "1"})
    out = run.stdout + run.stderr
    assert "--peer fa4 skipped: FlashAttention-4 is not installed" in out
    assert run.returncode != 0 and "no CUDA GPU is visible" in out   # then the CPU-only machine says so
    bad = subprocess.run([sys.executable, "-m", "tuner.cli", "bench", "--peer", "fa3"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unknown peer 'fa3'" in bad.stdout + bad.stderr and "fa4" in bad.stdout + bad.stderr


# the H200 as the dispatcher sees it: the H100's SM (same count and shared memory), more HBM
H200 = replace(H100_SXM, name="NVIDIA H200", memory_bytes=141 * 10**9)


@pytest.mark.parametrize("gpu", [H100_SXM, H200], ids=["h100", "h200"])
def test_the_shipped_lookups_tune_every_model_of_the_table_in_its_own_bucket(tmp_path, monkeypatch, gpu):
    """Every bf16 problem of tuner/models.py (Phi-3's d=96, SD 1.5's 40/80/160, DiT's 72 among them)
    is served on the H100 and the H200 by an entry of its own bucket and GPU, a tuned config or an
    SDPA backend that measured faster, not by a neighbour's, another GPU's or a default."""
    from tuner.models import MODELS, model_problems

    monkeypatch.setenv(export.SHIPPED_ENV, "1")
    d = Dispatcher(tmp_path / "absent.json")
    for p in model_problems(list(MODELS), "bf16"):
        e = d.select(p, gpu)
        assert e is not None and e["bucket"] == p.bucket().key, (p.key, e and e["bucket"])
        assert e["gpu_key"] == gpu.key, (p.key, e["gpu_key"])
        assert e["family"] in (SM90.name, SPLIT.name, "flash_fwd_sm90_tail", "sdpa_cudnn", "sdpa_flash",
                               "sdpa_efficient"), (p.key, e["family"])


@pytest.mark.parametrize("gpu", [H100_SXM, H200], ids=["h100", "h200"])
def test_a_shipped_decode_bucket_serves_what_measured_fastest_in_it(tmp_path, monkeypatch, gpu):
    """A decode step (one query) of each shipped decode bucket is served by that bucket's fastest
    measured entry: an SDPA backend where one led (cuDNN runs one query against 2 or more keys;
    on the H200 it leads the large batches at 8k and 32k keys), else flash_decode; but a backend
    that runs the call in under PEER_MIN_MS goes after the kernels, its host time being longer
    than the call (the H200's B1 x 1024 keys, where cuDNN measured 4% ahead and served 0.3x)."""
    import json

    from tuner.peer_choice import PEER_MIN_MS, short_peer
    from tuner.problem import Bucket

    monkeypatch.setenv(export.SHIPPED_ENV, "1")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    doc = json.loads(next(p for p in export.shipped_lookups() if gpu.key.replace("/", "_") in p.name).read_text())

    def runs_as(family: str, p: Problem) -> str:
        # flash_decode's entry serves a GQA step past d=128 packed where its grid fills the GPU (gqa_packing.packs)
        return "flash_fwd_sm90_gqa" if family == "flash_decode" and p.head_dim > 128 and packs(p, gpu) else family

    buckets: dict[str, list[dict]] = {}
    for e in doc["entries"]:
        if Bucket.from_key(e["bucket"]).queries == 1:
            buckets.setdefault(e["bucket"], []).append(e)
    assert len(buckets) >= 8
    d = Dispatcher(tmp_path / "absent.json")
    served, demoted = {}, 0
    for bucket, entries in buckets.items():
        fastest = min(entries, key=lambda e: e["median_ms"])
        p = Problem.from_dict(fastest["problem"])
        assert p.bucket().key == bucket
        want = min(entries, key=lambda e: (short_peer(e, p), e["median_ms"]))
        served[bucket] = configs_family(d.serving_entry(p, gpu)["family"])   # flash_decode's in any form
        assert served[bucket] == runs_as(want["family"], p), (bucket, served[bucket], want["family"])
        if short_peer(fastest, p):
            assert fastest["median_ms"] < PEER_MIN_MS and served[bucket] == runs_as("flash_decode", p)
            demoted += 1
            # the same bucket's entry at a batch whose call outlasts the host time serves the peer
            big = replace(p, batch=p.batch * math.ceil(2 * PEER_MIN_MS / fastest["median_ms"]))
            if big.bucket().key == bucket:
                assert configs_family(d.serving_entry(big, gpu)["family"]) == fastest["family"]
    if gpu is H200:
        assert "sdpa_cudnn" in served.values() and demoted, served
