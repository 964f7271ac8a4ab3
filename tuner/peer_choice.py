"""When a measured SDPA backend serves a call before our kernels: a lookup entry of SDPA's (peers.
DISPATCHED_PEERS) won its bucket at the shape the search measured, and serves the bucket's calls and
its neighbours'. These rules say where that win does not carry to a call (its host cost on a short
call, a lead measured where our kernels left SMs idle, a narrow lead at another bucket's shape), so the
kernels of its bucket go first (Dispatcher.candidates)."""

from __future__ import annotations

from .borrowing import FILL_ROWS, tuned_problem
from .problem import DECODE_QUERIES, Problem

# A measured SDPA backend serves by torch's Python path (the backend pinned, SDPA's own checks, an
# LSE buffer), some 30-40 µs of host time a call where our kernels launch from C++; a call shorter
# than that leaves the GPU idle behind it. So a peer whose entry, scaled to the call's work, runs
# under PEER_MIN_MS goes after the kernels of its bucket (Dispatcher.candidates): on the H200 a B1
# decode step of 1024 keys served cuDNN at 0.11 TB/s where pinned it read 0.37, B8 x 8192 keys at
# 3.34 against 3.43 pinned and flash_decode's 3.50; from 160 µs served and pinned agreed within 1%
# (benchmarks/PERF_NOTES.md, d10).
PEER_MIN_MS = 0.05
# A measured SDPA entry borrowed from a neighbouring bucket serves a prefill call before that bucket's
# kernels only where it led them by this much at its own shape (narrow_peer).
PEER_MARGIN = 1.10


def short_peer(entry: dict, problem: Problem) -> bool:
    """Whether `entry` is a measured SDPA backend that would run `problem` for less than PEER_MIN_MS:
    its measured time scaled by the work of `problem` against that of the problem it was measured on,
    the bytes through memory for a decode step (which streams its K/V: 32 query heads on 8 K/V
    heads read a quarter of what 32 on 32 do for the same FLOPs), the FLOPs otherwise."""
    from .peers import DISPATCHED_PEERS

    ms, measured = entry.get("median_ms"), tuned_problem(entry)
    if entry["family"] not in DISPATCHED_PEERS or not ms or measured is None:
        return False
    work = Problem.bytes_moved if problem.decode_step else Problem.flops
    return ms * work(problem) / work(measured) < PEER_MIN_MS


def narrow_peer(entry: dict, entries: list[dict], problem: Problem) -> bool:
    """Whether `entry` is a measured SDPA backend that led the best kernel entry of its bucket (and
    GPU), among `entries`, by less than PEER_MARGIN where both were measured, at a prefill call of
    another bucket. Our kernels' configs carry across a bucket's neighbours by their work per CTA
    (KernelFamily.adapt); SDPA's lead at one shape is no guide to another: the d=64 n4096/small
    bucket's cuDNN entry, 6% ahead of its kernel entry at B2-H10-N4096, served B4-H6-N7847 at 399
    TFLOP/s where FA4 read 520 (benchmarks/PERF_NOTES.md, "n1")."""
    from .peers import DISPATCHED_PEERS

    if entry["family"] not in DISPATCHED_PEERS or problem.seqlen_q <= DECODE_QUERIES:
        return False
    kernels = [e["tflops"] for e in entries if e["family"] not in DISPATCHED_PEERS
               and e.get("bucket") == entry.get("bucket") and e.get("gpu_key") == entry.get("gpu_key")]
    return bool(kernels) and max(kernels) * PEER_MARGIN > entry["tflops"]


def idle_peer(entry: dict, gpu, problem: Problem) -> bool:
    """Whether `entry` is a measured SDPA backend that won its bucket on a prefill call whose query
    blocks left SMs idle, serving a call of more blocks. Where a kernel of ours runs few blocks, as
    many SMs work as there are blocks and SDPA's kernels can match it (an 8-head shard's 512 x 4096
    chunk, 32 blocks: SDPA flash 196 TFLOP/s against our split's 188 on the H200); with more blocks
    ours gain and SDPA's do not keep up: 28 heads of a 350 x 3000 chunk (84 blocks), which that entry
    served at 185, read 341 with the bucket's split entry (its keys split from the occupancy: one way)
    and 340 with flash_fwd_sm90's default in the same turns (benchmarks/PERF_NOTES.md, "n1")."""
    from .peers import DISPATCHED_PEERS

    tuned = tuned_problem(entry)
    if entry["family"] not in DISPATCHED_PEERS or tuned is None or problem.seqlen_q <= DECODE_QUERIES:
        return False
    blocks = tuned.query_blocks(FILL_ROWS)
    return tuned.seqlen_q > DECODE_QUERIES and blocks < gpu.sm_count and problem.query_blocks(FILL_ROWS) > blocks
