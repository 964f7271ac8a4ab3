// flashtune: the keys of one query block split across CTAs (flash_fwd_sm90 with SPLIT_KV), for
// calls whose query blocks x heads leave most SMs idle (a tensor-parallel shard's 512-query chunk
// against 32k cached keys is 32 work tiles on 132 SMs). Split z of gridDim.z runs a contiguous
// share of its block's K/V tiles and writes that share's O (normalized, fp32) and LSE to a
// workspace; the last split of the block to arrive (a self-resetting counter, so a CUDA graph
// replays) merges them by their LSE into O and the LSE. A split whose keys the diagonal hides
// from every row of the block writes an LSE of -inf, and the merge gives it no weight.
#pragma once
#include "common.cuh"
#include "tile_scheduler.cuh"

#ifndef SPLIT_KV
#define SPLIT_KV 0
#endif
#ifndef MERGE_HELD   // a lane's accumulators of the rows merge_rows takes at once (registers)
#define MERGE_HELD 16
#endif
#ifndef TAIL_SPLIT
#define TAIL_SPLIT 0
#endif
#if SPLIT_KV
#define FT_SPLIT_PARAMS , float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ split_counter
#elif TAIL_SPLIT   // the first work tile of the cut tail, the first halves' partials, their arrivals (tile_scheduler.cuh)
#define FT_SPLIT_PARAMS , int tail_from, float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ split_counter
#else
#define FT_SPLIT_PARAMS
#endif

// The splits' workspace: per split, the (B, H, Nq) rows of O (head_dim floats each) and of the LSE;
// an arrival counter per work tile (query block of one batch-head).
struct SplitWorkspace {
  float* o;
  float* lse;
  int* counter;
  int bhs;   // batch x heads: rows of one split are bhs x nq
};

// A work tile as one split runs it: tiles [t0, t0 + ntiles) of the block's, keys from kv_end on masked.
struct SplitTile : WorkTile {
  int t0, kv_end;
};

// Work tile w's share for split `split` of `splits`, as even as whole tiles allow. A block with
// fewer tiles than splits leaves some splits none: they run one tile with every key masked
// (kv_end at its first key), so that every split of the block writes its rows and the merge waits
// for no special case.
template <int COLS>
FT_DEVICE SplitTile keep_split(const WorkTile& w, int nk, int split, int splits) {
  SplitTile s;
  static_cast<WorkTile&>(s) = w;
  const int all = max(1, w.ntiles);
  const int lo = static_cast<int>(static_cast<long long>(split) * all / splits);
  const int hi = static_cast<int>(static_cast<long long>(split + 1) * all / splits);
  if (lo < hi) {
    s.t0 = lo;
    s.ntiles = hi - lo;
    s.kv_end = min(nk, hi * COLS);
  } else {
    s.t0 = all - 1;
    s.ntiles = 1;
    s.kv_end = s.t0 * COLS;
  }
  return s;
}

// Called by every one of `threads` threads (named barrier `bar_id`) once its partials are out:
// whether this CTA is the last split of work tile `tile` to arrive; the last one zeroes the counter
// for the next launch. `flag`: a shared int to broadcast through.
FT_DEVICE bool last_split(const SplitWorkspace& ws, int tile, int splits, int bar_id, int threads, bool leader, int& flag) {
  __threadfence();   // this thread's partials are visible device-wide before its CTA counts itself in
  asm volatile("bar.sync %0, %1;\n" ::"r"(bar_id), "r"(threads) : "memory");
  if (leader) {
    const bool last = atomicAdd(ws.counter + tile, 1) == splits - 1;
    if (last) ws.counter[tile] = 0;   // every split of this tile has arrived: no add is left
    flag = last;
  }
  asm volatile("bar.sync %0, %1;\n" ::"r"(bar_id), "r"(threads) : "memory");
  const bool last = flag;
  if (last) __threadfence();   // the other splits' partials are read after their arrivals
  return last;
}

// Split `lane`'s share of a row, from its LSE `mine` (lane s holds split s's; -inf past the splits
// and for a split that saw no key of the row); `mx` and `sum` get what the row's LSE over every
// split is made of (merged_lse).
FT_DEVICE float split_share(float mine, float& mx, float& sum) {
  mx = group_max<32>(mine);
  const float e = mx == FT_NEG_INF || mine == FT_NEG_INF ? 0.f : __expf(mine - mx);
  sum = group_sum<32>(e);
  return sum > 0.f ? e / sum : 0.f;
}

// The row's LSE over every split from split_share's `mx` and `sum`: -inf where no split saw a key.
FT_DEVICE float merged_lse(float mx, float sum) { return mx == FT_NEG_INF ? FT_NEG_INF : mx + __logf(sum); }

// merge_rows a row at a time, two dependent trips to L2 a row (its LSEs, then its partials): past
// d=128 where a batch would not fit a lane's registers (head dims off the 64-column panels past
// d=128; the plain split kernel at d=256, merge_splits).
template <int DIM, int ODT, class Rows>
FT_DEVICE void merge_row_by_row(const SplitWorkspace& ws, int splits, int bh, int nq, int r0, int rows,
                                typename Elem<ODT>::type* o_bh, const Rows& place, float* lse_bh, int warp, int warps,
                                int lane) {
  constexpr bool WIDE = DIM == 64 || DIM == 128 || DIM == 256;   // 2, 4 or 8 columns a lane (d=192: strips)
  constexpr int VEC = WIDE ? DIM / 32 : 2;               // adjacent columns per lane and strip: 2, 4 or 8
  constexpr int STRIPS = WIDE ? 1 : (DIM + 63) / 64;     // strips of 32 x VEC columns
  static_assert(DIM % 8 == 0, "whole column pairs");
  const long long per_split = static_cast<long long>(ws.bhs) * nq;   // rows of one split
  for (int r = warp; r < rows; r += warps) {
    const int row = r0 + r;
    if (!in_rows(row, nq)) continue;
    const long long at = static_cast<long long>(bh) * nq + row;
    float mx, sum;
    const float weight = split_share(lane < splits ? __ldcg(ws.lse + lane * per_split + at) : FT_NEG_INF, mx, sum);
    float acc[STRIPS][VEC];
#pragma unroll
    for (int st = 0; st < STRIPS; ++st)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[st][j] = 0.f;
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float ws_s = __shfl_sync(0xffffffffu, weight, s);
      if (ws_s == 0.f) continue;   // warp-uniform: a split that saw no key of this row
      const float* src = ws.o + (s * per_split + at) * DIM + lane * VEC;
#pragma unroll
      for (int st = 0; st < STRIPS; ++st) {
        if constexpr (VEC == 2) {
          if (!WIDE && st * 64 + lane * 2 >= DIM) continue;
          const float2 t = __ldcg(reinterpret_cast<const float2*>(src + st * 64));
          acc[st][0] += ws_s * t.x;
          acc[st][1] += ws_s * t.y;
        } else {
#pragma unroll
          for (int j = 0; j < VEC; j += 4) {
            const float4 t = __ldcg(reinterpret_cast<const float4*>(src + j));
            acc[st][j] += ws_s * t.x;
            acc[st][j + 1] += ws_s * t.y;
            acc[st][j + 2] += ws_s * t.z;
            acc[st][j + 3] += ws_s * t.w;
          }
        }
      }
    }
#pragma unroll
    for (int st = 0; st < STRIPS; ++st) {
      if (!WIDE && st * 64 + lane * 2 >= DIM) continue;
      typename Elem<ODT>::type* dst = o_bh + place.o(row) + st * 64 + lane * VEC;
      unsigned packed[VEC / 2];
#pragma unroll
      for (int j = 0; j < VEC / 2; ++j) packed[j] = pack2<ODT>(acc[st][2 * j], acc[st][2 * j + 1]);
      if constexpr (VEC == 8) *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      else if constexpr (VEC == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
      else *reinterpret_cast<unsigned*>(dst) = packed[0];
    }
    if (lane == 0) lse_bh[place.lse(row)] = merged_lse(mx, sum);
  }
}

// Merge the splits' partials of rows [r0, r0 + rows) (clipped to [0, nq)) of batch-head (b, h) into
// O (TO, rows `o_sn` apart from `o_bh`) and the LSE (`lse_bh`): a warp per row, lane s reading
// split s's LSE (splits <= 32). At d = 64, 128 each lane takes DIM / 32 adjacent columns (one
// vector load per split), at d = 256 four in each of two passes of 128 columns; otherwise (d = 96,
// 80, 192, ...) column pairs 64 apart, the last strip's lanes past DIM idle. `warp`, `warps`: this
// thread's warp among the `warps` that merge. `place` puts each row in O and the LSE (common.cuh:
// StridedRows, o_sn apart; PackedRows). A warp merges BATCH of its rows at once, their loads in
// flight together: the LSEs of all in one trip to L2, then two splits' partials of all a trip. Row
// after row (two dependent trips a row, 16 rows a warp of a 128-row tile) the merge behind a tile's last split took longer than the main
// loop of a short call: on the H200 this form read 1.10-1.42x the row-by-row one where the split
// count came from the occupancy, up to 2.1x at 16 splits (PERF_NOTES "j1").
template <int DIM, int ODT, class Rows>
FT_DEVICE void merge_rows(const SplitWorkspace& ws, int splits, int bh, int nq, int r0, int rows,
                          typename Elem<ODT>::type* o_bh, const Rows& place, float* lse_bh, int warp, int warps, int lane) {
  constexpr bool WIDE = DIM == 64 || DIM == 128 || DIM == 256;   // 2, 4 or 8 columns a lane (d=192: strips)
  constexpr int PASSES = DIM == 256 ? 2 : 1;             // d=256: two passes of 128 columns (registers)
  constexpr int VEC = WIDE ? DIM / 32 / PASSES : 2;      // adjacent columns per lane, strip and pass: 2 or 4
  constexpr int STRIPS = WIDE ? 1 : (DIM + 63) / 64;     // strips of 32 x VEC columns
  constexpr int PER_ROW = STRIPS * VEC;                  // a lane's columns of one row in a pass
  constexpr int HELD = MERGE_HELD / PASSES / PER_ROW;    // MERGE_HELD accumulators a lane at most (half at d=256)
  constexpr int BATCH = (DIM > 128 && PASSES == 1) || HELD < 1 ? 1 : HELD > 8 ? 8 : HELD;
  constexpr int SPLITS_AT_ONCE = 2;                      // loads in flight: two splits of BATCH rows each
  static_assert(DIM % 8 == 0, "whole column pairs");
  if constexpr (BATCH == 1) {
    merge_row_by_row<DIM, ODT>(ws, splits, bh, nq, r0, rows, o_bh, place, lse_bh, warp, warps, lane);
    return;
  }
  const long long per_split = static_cast<long long>(ws.bhs) * nq;   // rows of one split
  const long long bh_rows = static_cast<long long>(bh) * nq;
  // a lane's columns of row `at` of split `s` into t, unconditionally, so that every load of a batch
  // can be in flight at once: the caller passes a row and split that exist and weighs out the rest
  // (a lane whose columns of a strip lie past DIM reads the row's first two, and stores nothing)
  auto load = [&](int s, long long at, int pass, float (&t)[STRIPS][VEC]) {
    const float* src = ws.o + (s * per_split + at) * DIM;
#pragma unroll
    for (int st = 0; st < STRIPS; ++st) {
      const int col = WIDE || st * 64 + lane * 2 < DIM ? pass * 32 * VEC + st * 64 + lane * VEC : 0;
#pragma unroll
      for (int j = 0; j < VEC; j += VEC == 2 ? 2 : 4) {
        if constexpr (VEC == 2) {
          const float2 v = __ldcg(reinterpret_cast<const float2*>(src + col));
          t[st][0] = v.x;
          t[st][1] = v.y;
        } else {
          const float4 v = __ldcg(reinterpret_cast<const float4*>(src + col + j));
          t[st][j] = v.x;
          t[st][j + 1] = v.y;
          t[st][j + 2] = v.z;
          t[st][j + 3] = v.w;
        }
      }
    }
  };
  for (int first = warp; first < rows; first += warps * BATCH) {
    int row[BATCH];   // the row of O; -1: past the tile's or the call's rows
    float weight[BATCH], lse[BATCH];
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const int r = first + i * warps;
      row[i] = r < rows && in_rows(r0 + r, nq) ? r0 + r : -1;
      weight[i] = row[i] >= 0 && lane < splits ? __ldcg(ws.lse + lane * per_split + bh_rows + row[i]) : FT_NEG_INF;
    }
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {   // the split's LSE in, its share out
      float mx, sum;
      weight[i] = split_share(weight[i], mx, sum);
      lse[i] = merged_lse(mx, sum);
    }
    for (int pass = 0; pass < PASSES; ++pass) {
      float acc[BATCH][STRIPS][VEC];
#pragma unroll
      for (int i = 0; i < BATCH; ++i)
#pragma unroll
        for (int st = 0; st < STRIPS; ++st)
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[i][st][j] = 0.f;
      for (int s = 0; s < splits; s += SPLITS_AT_ONCE) {   // SPLITS_AT_ONCE splits' loads of every row, then their sums
        float w[SPLITS_AT_ONCE][BATCH], t[SPLITS_AT_ONCE][BATCH][STRIPS][VEC];
#pragma unroll
        for (int u = 0; u < SPLITS_AT_ONCE; ++u)
#pragma unroll
          for (int i = 0; i < BATCH; ++i) {
            // past the splits (lane `splits` on: weight 0) or the rows (a tile's first rows may lie before
            // the call's: r0 < 0 where the tiles end at the last query), split s and a row of the call
            // are read and weighed out
            w[u][i] = __shfl_sync(0xffffffffu, weight[i], s + u);
            load(s + u < splits ? s + u : s, bh_rows + (row[i] >= 0 ? row[i] : min(max(r0, 0), nq - 1)), pass, t[u][i]);
          }
#pragma unroll
        for (int u = 0; u < SPLITS_AT_ONCE; ++u)
#pragma unroll
          for (int i = 0; i < BATCH; ++i)
#pragma unroll
            for (int st = 0; st < STRIPS; ++st)
#pragma unroll
              for (int j = 0; j < VEC; ++j)   // weight 0: a split that saw no key of the row (its O may be 0 / 0)
                acc[i][st][j] = w[u][i] != 0.f ? acc[i][st][j] + w[u][i] * t[u][i][st][j] : acc[i][st][j];
      }
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        if (row[i] < 0) continue;
#pragma unroll
        for (int st = 0; st < STRIPS; ++st) {
          if (!WIDE && st * 64 + lane * 2 >= DIM) continue;
          typename Elem<ODT>::type* dst = o_bh + place.o(row[i]) + pass * 32 * VEC + st * 64 + lane * VEC;
          unsigned packed[VEC / 2];
#pragma unroll
          for (int j = 0; j < VEC / 2; ++j) packed[j] = pack2<ODT>(acc[i][st][2 * j], acc[i][st][2 * j + 1]);
          if constexpr (VEC == 8) *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
          else if constexpr (VEC == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
          else *reinterpret_cast<unsigned*>(dst) = packed[0];
        }
        if (pass == PASSES - 1 && lane == 0) lse_bh[place.lse(row[i])] = lse[i];
      }
    }
  }
}
// merge_rows for the plain split kernel (O's rows o_sn apart). Past d=128 a row at a time: there the
// kernel has no registers to spare (two passes of a batch made ptxas spill the CTA's block indices,
// live across the main loop, at every d=256 seed); the packed kernel's one consumer has them.
template <int DIM, int ODT>
FT_DEVICE void merge_splits(const SplitWorkspace& ws, int splits, int bh, int nq, int r0, int rows,
                            typename Elem<ODT>::type* o_bh, long long o_sn, float* lse_bh, int warp, int warps, int lane) {
  if constexpr (DIM > 128)
    merge_row_by_row<DIM, ODT>(ws, splits, bh, nq, r0, rows, o_bh, StridedRows{o_sn}, lse_bh, warp, warps, lane);
  else
    merge_rows<DIM, ODT>(ws, splits, bh, nq, r0, rows, o_bh, StridedRows{o_sn}, lse_bh, warp, warps, lane);
}

// TAIL_SPLIT (tile_scheduler.cuh, a cut tail): the two halves of a cut work tile meet warp by warp.
// `slot` is this warp's place in the workspace (the tile's cut x the CTA's consumer warps + this
// warp), where the first half to arrive leaves its accumulators as they are (O unnormalized, the
// running max and the row sums of this thread, lane after lane in 16-byte columns: each store a
// warp's 512 contiguous bytes) and returns false; the second waits for them, folds them into its
// own by their maxima and returns true, to store O and the LSE as a whole tile would. One trip to
// L2 and back a half, every lane at once: the first form of a merge (split_kv's, a warp per row,
// two dependent trips a row) would run behind the launch's last round, where the halves meet.
// The counter reads 1 once one half has arrived, 2 with both, +4 once the first's partial is out;
// the second zeroes it for the next launch.
template <int DTILES>
FT_DEVICE bool join_halves(const SplitWorkspace& ws, int slot, float (&o)[DTILES][4], float (&m)[2], float (&l)[2], int lane,
                           float scale_log2) {
  float4* part = reinterpret_cast<float4*>(ws.o) + static_cast<long long>(slot) * (DTILES + 1) * 32 + lane;
  int* counter = ws.counter + slot;
  const int arrived = __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(counter, 1) : 0, 0);
  if (arrived == 0) {   // first: the partial out, then the flag
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt) __stcg(part + dt * 32, make_float4(o[dt][0], o[dt][1], o[dt][2], o[dt][3]));
    __stcg(part + DTILES * 32, make_float4(m[0], m[1], l[0], l[1]));
    __threadfence();
    __syncwarp();
    if (lane == 0) atomicAdd(counter, 4);
    return false;
  }
  // the wait's test stays warp-uniform (a broadcast), so the warp never diverges around it
  while (__shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(counter, 0) : 0, 0) < 4) __nanosleep(32);
  __threadfence();
  const float4 ml = __ldcg(part + DTILES * 32);
  const float theirs_m[2] = {ml.x, ml.y}, theirs_l[2] = {ml.z, ml.w};
  float mine_w[2], theirs_w[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float mx = fmaxf(m[hh], theirs_m[hh]);
    const float ref = mx == FT_NEG_INF ? 0.f : mx * scale_log2;
    mine_w[hh] = fast_exp2(m[hh] * scale_log2 - ref);
    theirs_w[hh] = fast_exp2(theirs_m[hh] * scale_log2 - ref);
    m[hh] = mx;
    l[hh] = l[hh] * mine_w[hh] + theirs_l[hh] * theirs_w[hh];
  }
#pragma unroll
  for (int dt = 0; dt < DTILES; ++dt) {
    const float4 t = __ldcg(part + dt * 32);
    o[dt][0] = o[dt][0] * mine_w[0] + t.x * theirs_w[0];
    o[dt][1] = o[dt][1] * mine_w[0] + t.y * theirs_w[0];
    o[dt][2] = o[dt][2] * mine_w[1] + t.z * theirs_w[1];
    o[dt][3] = o[dt][3] * mine_w[1] + t.w * theirs_w[1];
  }
  if (lane == 0) atomicExch(counter, 0);
  return true;
}
