// flashtune: which work tiles (one query block of one batch-head) a CTA runs, in which order.
//
// Order: batch-heads one after another, query blocks fastest within each, so the CTAs running at
// once share a few heads' K/V in L2 (heads fastest made every CTA stream its own K/V: 10-33%
// slower). Causal, where batch x heads is at most the SM count (causal_sections), goes by sections
// instead (causal_tile): as many heads as keep their K/V within L2_SECTION_BYTES, and within a
// section the heaviest query blocks of all its heads first, longest processing time first: head
// after head, the last head's heaviest block started when the rest of the work was nearly done
// and ran alone at the end (B1-H32-N2048 causal: a 16-tile block starting with about one tile of
// work per SM left). Each query block runs ordered as before: where
// the kernel can (FROM_END) its blocks are aligned to the end of the sequence: a ragged block is
// the first rows, the one block that needs a single K/V tile, and its rows before row 0 do nothing
// (TMA fills Q's with zeros, the causal mask hides every key from them, no O or LSE is written for
// them). Aligned to the start it would be the last rows, the heaviest block, run by only some of
// its consumers.
//
// Two schedules. Grid: one CTA per work tile, the hardware hands them out as SMs free up.
// Dynamic persistent: one CTA per SM; a CTA's first tile is its blockIdx.x, later ones come from
// a global counter as it finishes the last, so causal's uneven tiles balance as on the grid, while
// the producer already loads the next tile's Q and K/V under the current tile's last products and
// epilogue. The counter is two ints per stream (kernel_templates/sm90_tile_counter.py); it resets itself: the last
// CTA to run out of work zeroes it for the stream's next launch.
#pragma once
#include "sm90_pipeline.cuh"

struct WorkTile {
  int q0, b, h, hk, ntiles;   // first query row, batch, head, K/V head, K/V tiles to run
};

// The rows a block of ROWS holds of packed GQA rows (work_tile's PACK): whole groups of `group`.
template <int ROWS> FT_DEVICE int packed_rows(int group) { return ROWS / group * group; }

// ROWS x COLS: the query block and the K/V tile (the kernels' BR and BC, which are macros).
// BOTTOM_RIGHT: the causal diagonal ends at the last key (a KV cache: query row r is token
// nk - nq + r, so it sees keys up to r + nk - nq); with nq > nk its first rows see no key, and a block of only such rows still runs
// one K/V tile, all masked, so that its O (0) and LSE (-inf) are written like any other's.
// PACK (packed GQA, flash_fwd_sm90's PACK_GQA): the rows are a K/V head's `group` query heads
// interleaved, row r query r / group of head r % group, so nq counts group x the queries, `heads`
// the K/V heads, and a row's diagonal rises once every `group` rows (not with FROM_END: q0 >= 0).
// A block holds whole groups: ROWS / group x group rows (packed_rows), the rest of its tile idle.
template <int ROWS, int COLS, bool CAUSAL, bool FROM_END, bool BOTTOM_RIGHT = false, bool PACK = false>
FT_DEVICE WorkTile work_tile(int qidx, int bh, int heads, int kv_group, int nq, int nk, int group = 1) {
  static_assert(!(PACK && FROM_END), "packed rows start at row 0");
  WorkTile w;
  if constexpr (PACK) {
    const int rows = packed_rows<ROWS>(group);
    w.q0 = (CAUSAL ? (nq + rows - 1) / rows - 1 - qidx : qidx) * rows;
  } else if (!CAUSAL) w.q0 = qidx * ROWS;
  else if (FROM_END) w.q0 = nq - (qidx + 1) * ROWS;   // may be < 0 (see above)
  else w.q0 = ((nq + ROWS - 1) / ROWS - 1 - qidx) * ROWS;
  w.b = bh / heads;
  w.h = bh % heads;
  w.hk = w.h / kv_group;
  int kv_end = CAUSAL ? min(nk, w.q0 + ROWS + (BOTTOM_RIGHT ? nk - nq : 0)) : nk;
  if constexpr (PACK && CAUSAL)
    kv_end = min(nk, (w.q0 + packed_rows<ROWS>(group) - 1) / group + 1 + (BOTTOM_RIGHT ? nk - nq / group : 0));
  w.ntiles = (kv_end + COLS - 1) / COLS;
  if constexpr (BOTTOM_RIGHT || CACHE_LENS) w.ntiles = max(1, w.ntiles);   // (a cache's sequence may hold no key)
  return w;
}

// The SMs of this GPU (PTX's %nsmid).
FT_DEVICE int sm_count() {
  int n;
  asm("mov.u32 %0, %%nsmid;" : "=r"(n));
  return n;
}

// Whether causal work goes by sections (causal_tile): where batch x heads is at most the SM count.
// With more, each head's blocks are a small part of a wave and the heads-in-turn order already
// ends on light blocks; there sections measured 0.93-0.99x on the H100 (B8-H25 and B16-H32 at
// N=1024, persistent), where with fewer they measured 1.00-1.39x (GQA prefill at N=2048-8192,
// d=256; benchmarks/PERF_NOTES.md, "l1, l2").
FT_DEVICE bool causal_sections(int bhs) { return bhs <= sm_count(); }

// K/V bytes a causal section's heads may span (L2 holds 50 MB on the H100, 40 on the A100; a
// section's blocks run at once with the next section's first ones)
constexpr int L2_SECTION_BYTES = 16 << 20;

// Query heads per causal section: as many whole K/V head groups as keep their K and V (nk rows of
// `kv_row_bytes` each) within L2_SECTION_BYTES, at least one; all `bhs` where they fit. In 64-byte
// units, so that the arithmetic stays 32-bit (a 64-bit division is a called routine).
FT_DEVICE int section_heads(int bhs, int kv_group, int nk, int kv_row_bytes) {
  const int kv_head = max(1, nk * (kv_row_bytes / 32));   // K and V of one head, 64-byte units
  const int groups = max(1, (L2_SECTION_BYTES / 64) / kv_head);
  return groups < bhs / kv_group ? groups * kv_group : bhs;
}

// The index of the last causal section: the heads past the whole sections of `sec` join it, rather
// than making a narrower one after it. A narrow last section's heaviest blocks (n_qblk K/V tiles
// each) start as the section before runs out, with too little work left beside them, and run on
// alone at the end: B1-H32-N8192 at d=80 (6-head sections) ended on a section of 2 heads and left
// the SMs idle 10% of the kernel's time, where FlashAttention-4's two sections of 16 left them 1%
// (H200, Nsight Compute). Widening the last section further, to give every SM one of its heaviest
// blocks' worth of work, cost B16-H8-N1024 at d=256 5-8% (benchmarks/PERF_NOTES.md, "l3").
FT_DEVICE int last_section(int bhs, int sec) { return max(0, bhs / sec - 1); }

// Causal work tile `tile` of n_qblk x bhs as (query block, batch-head): sections of `sec` heads
// (section_heads; the `last` one wider, last_section), each the heaviest block (qidx 0,
// work_tile's last rows) of every head in it, then the next heaviest.
FT_DEVICE int2 causal_tile(int tile, int n_qblk, int bhs, int sec, int last) {
  const int s = min(tile / (sec * n_qblk), last), first = s * sec;
  const int width = s == last ? bhs - first : sec, local = tile - first * n_qblk;
  return make_int2(local / width, first + local % width);
}

// The producer thread asks for the CTA's tiles in turn (it = 0, 1, ...): its first is its
// blockIdx.x, later ones come from the counter, so each CTA's tiles only grow. One past the last
// tile, the CTA signs off (sign_off).
FT_DEVICE int fetch_tile(int* counter, int it) {
  return it == 0 ? static_cast<int>(blockIdx.x) : static_cast<int>(gridDim.x) + atomicAdd(counter, 1);
}
FT_DEVICE void sign_off(int* counter) {
  if (atomicAdd(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
    // every CTA has made its last fetch: no atomicAdd on counter[0] is left in this launch
    atomicExch(counter, 0);
    atomicExch(counter + 1, 0);
  }
}
// PAIRS (clusters of two CTAs sharing each K/V tile, flash_fwd_sm90's CLUSTER): both CTAs of a
// cluster must run the same K/V tiles in the same order, so the cluster's tiles come from a static
// schedule rather than the counter: its it-th is the cluster's index plus `it` times the clusters.
// A tile is then a pair of neighbouring query blocks of one head, one a CTA (TileScheduler::work).
// The tiles are equal (unmasked), so the static order ends as evenly as the counter's.
FT_DEVICE int pair_tile(int it) {
  return static_cast<int>(blockIdx.x) / 2 + it * (static_cast<int>(gridDim.x) / 2);
}
// a tile >= total means the CTA is done, and it has then signed off on the counter
FT_DEVICE int next_tile_dynamic(int* counter, int it, int total) {
  const int tile = fetch_tile(counter, it);
  if (tile >= total) sign_off(counter);
  return tile;
}

// A cut tail (TAIL: flash_fwd_sm90_tail). A persistent launch of T equal work tiles (unmasked) on
// S CTAs runs ceil(T / S) rounds, the last with T mod S tiles: B1-H16-N16384 at 128 rows is 2048
// tiles, 15.5 rounds on 132 SMs, and the 16th leaves 64 SMs idle for 3% of the launch (Nsight
// Compute: SMs active 96.8% of the elapsed cycles; benchmarks/PERF_NOTES.md, "k3"). So the tiles from
// `from` on (S + T mod S of them: the last round and the one before) are cut where S equal segments
// of their K/V tiles, taken tile after tile, meet, as in Stream-K: the CTA that draws segment j
// runs its pieces in turn (at most three: the end of one tile, whole ones, the start of another).
// A segment spans at least one tile, so a tile is cut in two at most, and its halves meet warp by
// warp (split_kv.cuh, join_halves). The producer works out each piece and publishes it whole (the
// work tile, its K/V tiles [lo, hi), the cut inside it), so that every other role gets it as
// warp-uniform values: worked out again by each consumer, the divisions' results sat in vector
// registers, the K/V ring's place with them, and ptxas put a WARPSYNC before each wgmma (the
// first form: 0.82-0.98x on 15 of 16 cut launches, H100).
struct TailPiece {
  int tile, lo, hi;   // the work tile, and its K/V tiles [lo, hi)
};
// Where segment j of `segs` starts among the `tiles` x `n` K/V tiles of the tail. In 32 bits (the
// host cuts only where segs x tiles x n fits, flash_fwd_sm90_tail.tail_from): a 64-bit division is
// a called routine, and the persistent producer that runs it keeps 32-40 registers.
FT_DEVICE int tail_bound(int j, int tiles, int n, int segs) {
  return static_cast<int>(static_cast<unsigned>(j * tiles * n) / static_cast<unsigned>(segs));
}
// The pieces of segment j: the tail tiles its K/V tiles fall in.
FT_DEVICE int tail_pieces(int j, int tiles, int n, int segs) {
  return (tail_bound(j + 1, tiles, n, segs) - 1) / n - tail_bound(j, tiles, n, segs) / n + 1;
}
// Piece `place` of segment j.
FT_DEVICE TailPiece tail_piece(int j, int place, int from, int tiles, int n, int segs) {
  const int b0 = tail_bound(j, tiles, n, segs), b1 = tail_bound(j + 1, tiles, n, segs);
  const int i = b0 / n + place, first = i * n;
  return TailPiece{from + i, max(b0, first) - first, min(b1, first + n) - first};
}
// The producer's place in a drawn segment: how many draws it made from the counter, and the
// segment's next piece (`next` of `count`; none drawn: count 0).
struct TailCursor {
  int fetches = 0, seg = 0, next = 0, count = 0;
};

// The producer publishes each tile to the other roles through a two-slot ring in shared memory;
// PACKED, with its sequence; TAIL, with its piece (K/V tiles lo..hi, the cut inside it).
template <bool PACKED, bool TAIL = false>
struct TileRing : MbarRing<2> {
  int tile[2];
};
template <>
struct TileRing<true, false> : MbarRing<2> {
  int tile[2];
  Sequence seq[2];
};
template <>
struct TileRing<false, true> : MbarRing<2> {
  int tile[2];
  int lo[2], hi[2], cut[2];
};

// A work tile as a role gets it: its index, and the sequence it belongs to (the batch's lengths;
// VARLEN on the grid: the CTA's sequence; PACKED and dynamic: the one the producer found for it);
// TAIL: its K/V tiles [lo, hi) and the cut inside it (the segment boundary; -1: a whole tile).
struct DrawnTile {
  int tile;
  Sequence seq;
  int lo = 0, hi = 0, cut = -1;
};

// The CTA's work tiles in turn, as each role sees them: `it` counts them (0, 1, ...), and a tile
// done() means none is left. DYNAMIC (the kernel's PERSISTENT): the producer draws each tile
// from the dynamic schedule above and hands it to the other roles through a TileRing; otherwise
// the CTA runs the grid's one tile, (qblk, bh) as the launch (or VARLEN's varlen_block) placed it,
// and every loop over tiles folds to one pass. ROWS x COLS: the query block and the K/V tile.
// PACKED (VARLEN): a query block that sees no key still runs one K/V tile, all masked, so that its
// O (0) and LSE (-inf) are written (a sequence with no keys; also bottom-right with Nq > Nk). PACKED
// and DYNAMIC: tile t of the launch is varlen_find_longest's place t among the sequences' query
// blocks x heads (the sequences longest first, by octaves of blocks, sequence after sequence; each
// one's blocks heaviest first, the heads fastest, as on the grid); the producer's warp finds each
// one's sequence as it draws it, walking on from the last (a CTA's tiles only grow), and publishes
// the tile as (its place in its sequence, the sequence); past the last sequence it publishes -1.
// TAIL (DYNAMIC, unmasked): the tiles from `from` on are cut into segments' pieces (TailPiece).
// PAIRS (DYNAMIC, unmasked): the tiles are pairs of query blocks (`n_qblk` pairs a batch-head), drawn by
// pair_tile, and each CTA of a cluster runs its own block of the pair; with TAIL the pairs are cut,
// one segment a cluster.
// HEAD_ROWS (flash_fwd_sm90's PACK_GQA): a tile's rows are a K/V head's query heads (work_tile's PACK).
template <int ROWS, int COLS, bool CAUSAL, bool FROM_END, bool BOTTOM_RIGHT, bool DYNAMIC, bool PACKED, bool TAIL = false,
          bool PAIRS = false, bool HEAD_ROWS = false>
struct TileScheduler {
  static_assert(!HEAD_ROWS || (!PACKED && !TAIL && !PAIRS), "packed GQA rows: a dense batch, whole work tiles of one CTA");
  static_assert(!TAIL || (DYNAMIC && !PACKED && !CAUSAL), "a cut tail: persistent, equal (unmasked) work tiles");
  static_assert(!PAIRS || (DYNAMIC && !PACKED && !CAUSAL), "pairs of CTAs: persistent, equal (unmasked) work tiles");
  int qblk, bh;              // the grid's tile (not DYNAMIC)
  int n_qblk, total;         // query blocks per batch-head; work tiles (DYNAMIC, not PACKED; 1 on the grid)
  int heads, kv_group;
  Sequence seq;              // the batch's lengths (VARLEN on the grid: the CTA's sequence)
  int bhs, sec, last;        // DYNAMIC, causal: batch-heads, heads a section (section_heads) and the last
                             // section's index (last_section), once a launch
  bool sections;             // DYNAMIC: causal tiles in sections (causal_sections)
  const int *cu_q, *cu_k;    // PACKED: the sequences' offsets (common.cuh)
  int nseq;
  int from, segs;            // TAIL: the first cut tile (total: none) and the segments (the CTAs; 0: none)
  int group = 1;             // HEAD_ROWS: the query heads a tile's rows interleave (work_tile's PACK)

  FT_DEVICE bool done(const DrawnTile& d) const {
    if constexpr (PACKED && DYNAMIC) return d.tile < 0;
    return d.tile >= total;
  }
  // TAIL: the K/V tiles of one work tile (all alike, unmasked)
  FT_DEVICE int kv_tiles() const { return (seq.nk + COLS - 1) / COLS; }
  FT_DEVICE WorkTile work(const DrawnTile& d) const {
    int2 at = make_int2(qblk, bh);
    if constexpr (PACKED && DYNAMIC) {
      at = make_int2(d.tile / heads, d.tile % heads);   // batch 0 of the packed views
    } else if constexpr (DYNAMIC) {
      at = CAUSAL && sections ? causal_tile(d.tile, n_qblk, bhs, sec, last)
           : PAIRS           ? make_int2(2 * (d.tile % n_qblk) + static_cast<int>(blockIdx.x & 1), d.tile / n_qblk)
                             : make_int2(d.tile % n_qblk, d.tile / n_qblk);
    }
    WorkTile w = work_tile<ROWS, COLS, CAUSAL, FROM_END, BOTTOM_RIGHT, HEAD_ROWS>(at.x, at.y, heads, kv_group, d.seq.nq, d.seq.nk,
                                                                                   group);
    if constexpr (PACKED) w.ntiles = max(1, w.ntiles);
    return w;
  }
  // Where the producer's walk over a packed batch's sequences starts (draw's `at`).
  FT_DEVICE SeqCursor walk() const {
    const int top = varlen_top_level<ROWS>(seq.nq);
    return SeqCursor{0, 0, top, top};
  }
  // The producer's: the CTA's it-th tile, drawn by `leader` and published to the other roles; a
  // WARP producer's other lanes get it by shuffle, so it stays warp-uniform. PACKED needs the WARP
  // producer: its lanes walk the sequences from `at` (varlen_find_longest).
  // TAIL: `cut` keeps the leader's place in a drawn segment; it counts the draws from the counter.
  template <bool WARP>
  FT_DEVICE DrawnTile draw(TileRing<PACKED, TAIL>& ring, int* counter, int it, bool leader, SeqCursor& at,
                           TailCursor& cut) const {
    DrawnTile d{it, seq};
    if constexpr (DYNAMIC) {
      const PipelineState<2> slot{it};
      ring.acquire(slot);
      if constexpr (TAIL) {
        if (leader) {
          const int n = kv_tiles();
          d.hi = n;
          if (cut.next == cut.count) {   // the drawn segment is done (or none was): draw from the counter
            // a whole tile, a segment or none
            d.tile = PAIRS ? pair_tile(cut.fetches++) : next_tile_dynamic(counter, cut.fetches++, from + segs);
            if (d.tile >= from + segs) d.tile = total;
            cut.count = 0;
            if (d.tile >= from && d.tile < total) {
              cut.seg = d.tile - from;
              cut.count = tail_pieces(cut.seg, total - from, n, segs);
              cut.next = 0;
            }
          }
          if (cut.next < cut.count) {   // the segment's next piece
            const TailPiece p = tail_piece(cut.seg, cut.next++, from, total - from, n, segs);
            d.tile = p.tile;
            d.lo = p.lo;
            d.hi = p.hi;
            if (p.hi - p.lo < n) d.cut = cut.seg + (p.lo > 0 ? 0 : 1);   // the boundary it starts at, or ends at
          }
          const int i = slot.index();
          ring.tile[i] = d.tile;
          ring.lo[i] = d.lo;
          ring.hi[i] = d.hi;
          ring.cut[i] = d.cut;
          ring.commit(slot);
        }
        if constexpr (WARP) {
          d.tile = __shfl_sync(0xffffffffu, d.tile, 0);
          d.lo = __shfl_sync(0xffffffffu, d.lo, 0);
          d.hi = __shfl_sync(0xffffffffu, d.hi, 0);
          d.cut = __shfl_sync(0xffffffffu, d.cut, 0);
        }
      } else if constexpr (PACKED) {
        static_assert(WARP, "a packed batch's tiles are found by the producer's warp");
        const int tile = __shfl_sync(0xffffffffu, leader ? fetch_tile(counter, it) : 0, 0);
        const int2 found = varlen_find_longest<ROWS>(cu_q, nseq, tile, heads, at);
        d.tile = found.x < 0 ? -1 : found.y;
        if (found.x >= 0) d.seq = sequence_of(cu_q, cu_k, found.x);
        if (leader) {
          if (found.x < 0) sign_off(counter);
          ring.tile[slot.index()] = d.tile;
          ring.seq[slot.index()] = d.seq;
          ring.commit(slot);
        }
      } else {
        if (leader) {
          d.tile = PAIRS ? pair_tile(it) : next_tile_dynamic(counter, it, total);
          ring.tile[slot.index()] = d.tile;
          ring.commit(slot);
        }
        if constexpr (WARP) d.tile = __shfl_sync(0xffffffffu, d.tile, 0);
      }
    }
    return d;
  }
  // Every other role's: the CTA's it-th tile, as the producer published it.
  FT_DEVICE DrawnTile take(TileRing<PACKED, TAIL>& ring, int it) const {
    DrawnTile d{it, seq};
    if constexpr (DYNAMIC) {
      const PipelineState<2> slot{it};
      ring.wait(slot);
      const int i = slot.index();
      d.tile = __shfl_sync(0xffffffffu, ring.tile[i], 0);   // warp-uniform: uniform registers downstream
      if constexpr (TAIL) {
        d.lo = __shfl_sync(0xffffffffu, ring.lo[i], 0);
        d.hi = __shfl_sync(0xffffffffu, ring.hi[i], 0);
        d.cut = __shfl_sync(0xffffffffu, ring.cut[i], 0);
      }
      if constexpr (PACKED) {
        d.seq = Sequence{__shfl_sync(0xffffffffu, ring.seq[i].nq, 0), __shfl_sync(0xffffffffu, ring.seq[i].nk, 0),
                         __shfl_sync(0xffffffffu, ring.seq[i].q0, 0), __shfl_sync(0xffffffffu, ring.seq[i].k0, 0)};
      }
      ring.release(slot);
    }
    return d;
  }
};
