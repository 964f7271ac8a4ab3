// flashtune: rings of shared-memory buffers between warp-specialized roles (sm_90a), and where a
// role stands in one.
//
// A ring has DEPTH buffers, each guarded by a `full` mbarrier (completed by its filler: TMA's
// bytes, or the filler's arrivals) and an `empty` one (each reader arrives once done with it).
// A role's place in a ring is one running count of the buffers it has passed, as FlashAttention-4's
// PipelineStateSimple keeps it: the buffer is count % DEPTH, and the parity of the phase to wait on
// flips with each lap. The filler and every reader count the same sequence of buffers, so they agree
// on slots and phases without telling each other. The count never goes negative, and the compiler is
// told so: a power-of-two depth is then a mask and a shift, a depth of 3 an unsigned division.
#pragma once
#include "sm90.cuh"

template <int DEPTH>
struct PipelineState {
  int count;   // buffers passed so far

  FT_DEVICE int index() const {
    __builtin_assume(count >= 0);
    return count % DEPTH;
  }
  // the parity of the `full` phase that fills this buffer
  FT_DEVICE unsigned phase() const {
    __builtin_assume(count >= 0);
    return static_cast<unsigned>((count / DEPTH) & 1);
  }
  // the state n buffers further on (K/V tile t of a work tile whose first tile is here: *this + t)
  FT_DEVICE PipelineState operator+(int n) const { return PipelineState{count + n}; }
  FT_DEVICE void advance(int n = 1) { count += n; }
};

template <int DEPTH>
struct MbarRing {
  unsigned long long full[DEPTH], empty[DEPTH];

  // `fills` arrivals complete a fill (1: the thread that posts TMA's byte count), `frees` a release
  FT_DEVICE void init_stage(int s, unsigned fills, unsigned frees) {
    mbar_init(&full[s], fills);
    mbar_init(&empty[s], frees);
  }
  FT_DEVICE void init(unsigned fills, unsigned frees) {
#pragma unroll
    for (int s = 0; s < DEPTH; ++s) init_stage(s, fills, frees);
  }
  // The filler: until the readers have released this buffer's previous lap (none before the first).
  FT_DEVICE void acquire(const PipelineState<DEPTH>& p) {
    if (p.count >= DEPTH) mbar_wait(&empty[p.index()], p.phase() ^ 1);
  }
  // The filler by TMA: the bytes that complete the fill; the copies complete on full_bar(p).
  FT_DEVICE void expect(const PipelineState<DEPTH>& p, unsigned bytes) { mbar_expect_tx(&full[p.index()], bytes); }
  FT_DEVICE unsigned long long* full_bar(const PipelineState<DEPTH>& p) { return &full[p.index()]; }
  // The filler by its own threads' stores (made visible to the async proxy first).
  FT_DEVICE void commit(const PipelineState<DEPTH>& p) { mbar_arrive(&full[p.index()]); }
  // The filler by cp.async (each of the `fills` threads): its arrival once its copies have landed.
  FT_DEVICE void commit_copies(const PipelineState<DEPTH>& p) { mbar_arrive_on_copies(&full[p.index()]); }
  // A reader: until the buffer is filled; then, done with it, its release.
  FT_DEVICE void wait(const PipelineState<DEPTH>& p) { mbar_wait(&full[p.index()], p.phase()); }
  FT_DEVICE void release(const PipelineState<DEPTH>& p) { mbar_arrive(&empty[p.index()]); }
};
