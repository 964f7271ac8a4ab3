// flashtune: rings of shared-memory buffers between warp-specialized roles (sm_90a), and where a
// role stands in one.
//
// A ring has DEPTH buffers, each guarded by a `full` mbarrier (completed by the filler's arrivals or
// by TMA's bytes) and an `empty` one (every reader arrives once it is done with the buffer). A
// role's position in a ring is one running count of the buffers it has passed, as FlashAttention-4's
// PipelineStateSimple keeps one counter: the buffer is count % DEPTH and the phase to wait on flips
// each lap. The filler and every reader keep their own count and advance it by the same sequence,
// so they agree on slots and phases without exchanging them.
#pragma once
#include "sm90.cuh"

template <int DEPTH>
struct PipeState {
  int count;   // buffers passed so far
  FT_DEVICE explicit PipeState(int n) : count(n) {}
  FT_DEVICE int index() const { return count % DEPTH; }
  // parity of the `full` phase that this buffer's fill completes
  FT_DEVICE unsigned phase() const { return static_cast<unsigned>((count / DEPTH) & 1); }
  // the state n buffers on (tile t of a work tile whose first K/V tile is this one: *this + t)
  FT_DEVICE PipeState operator+(int n) const { return PipeState(count + n); }
  FT_DEVICE void advance(int n) { count += n; }
};

// The operations take the state by reference: by value, the two-int struct was passed as one 64-bit
// word, and the unpacking left the producer's K/V loop unrolled half as far (flash_fwd_sm90 at d=64).
template <int DEPTH>
struct MbarRing {
  unsigned long long full[DEPTH], empty[DEPTH];

  // `fills` arrivals complete a fill (1: the thread that posts TMA's bytes), `frees` a release
  FT_DEVICE void init(unsigned fills, unsigned frees) {
    for (int s = 0; s < DEPTH; ++s) {
      mbar_init(&full[s], fills);
      mbar_init(&empty[s], frees);
    }
  }
  // The filler: until the buffer's readers have released its previous lap (none on the first).
  FT_DEVICE void acquire(const PipeState<DEPTH>& p) {
    if (p.count >= DEPTH) mbar_wait(&empty[p.index()], ((p.count / DEPTH) - 1) & 1);
  }
  // The filler, by TMA: the bytes that complete the fill; the copies signal full_bar(p).
  FT_DEVICE void expect(const PipeState<DEPTH>& p, unsigned bytes) { mbar_expect_tx(&full[p.index()], bytes); }
  FT_DEVICE unsigned long long* full_bar(const PipeState<DEPTH>& p) { return &full[p.index()]; }
  // The filler, by its own threads' stores (made visible to the async proxy first).
  FT_DEVICE void commit(const PipeState<DEPTH>& p) { mbar_arrive(&full[p.index()]); }
  // A reader: until the buffer is filled; and, done with it, its release.
  FT_DEVICE void wait(const PipeState<DEPTH>& p) { mbar_wait(&full[p.index()], p.phase()); }
  FT_DEVICE void release(const PipeState<DEPTH>& p) { mbar_arrive(&empty[p.index()]); }
};
