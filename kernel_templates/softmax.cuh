// flashtune: the online softmax of FlashAttention-2/3 on tensor-core accumulator fragments.
//
// Both mma.sync (m16n8) and wgmma (m64nN) leave S in the same per-thread shape: for each n8 tile
// a thread holds 4 floats, [0..1] on row r and [2..3] on row r + 8, and the 4 threads of a quad
// share those two rows. So one m16 slab of S is `float s[NTILES][4]` here, and the matching slab of
// O is `float o[DTILES][4]`, whichever instruction produced them.
//
// Base 2 throughout: p = exp2(s * c - m * c), c = softmax_scale * log2(e); l is kept per thread
// and summed across the quad once, at the end.
#pragma once
#include "common.cuh"

// Row and column of accumulator element (nt, e) of a 16-row slab, relative to the slab's origin.
FT_DEVICE int frag_row(int lane, int e) { return lane / 4 + (e >= 2 ? 8 : 0); }
FT_DEVICE int frag_col(int lane, int nt, int e) { return nt * 8 + 2 * (lane % 4) + (e & 1); }

// -inf where the key column is past nk or (causal) after the query row; rows and columns are
// absolute indices of the slab's first row and of the tile's first column. Both bounds fold into
// one limit per row, against which each element's column offset is a constant: one compare and one
// select per element.
template <int NTILES, bool CAUSAL>
FT_DEVICE void mask_slab(float (&s)[NTILES][4], int lane, int row0, int col0, int nk) {
  const int c0 = col0 + frag_col(lane, 0, 0);   // the thread's first column
  int lim[2];                                   // last column kept, less c0, per row half
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    lim[hh] = nk - 1 - c0;
    if constexpr (CAUSAL) lim[hh] = min(lim[hh], row0 + frag_row(lane, 2 * hh) - c0);
  }
#pragma unroll
  for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (nt * 8 + (e & 1) > lim[e / 2]) s[nt][e] = FT_NEG_INF;
}

// mask_slab for rows whose last visible keys are given, `last[hh]` for the thread's row of half hh
// (past nk masked too): packed GQA rows, whose diagonal rises once every `group` rows (PackedRows).
template <int NTILES>
FT_DEVICE void mask_slab_to(float (&s)[NTILES][4], int lane, const int (&last)[2], int col0, int nk) {
  const int c0 = col0 + frag_col(lane, 0, 0);
  const int lim[2] = {min(nk, last[0] + 1) - 1 - c0, min(nk, last[1] + 1) - 1 - c0};
#pragma unroll
  for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (nt * 8 + (e & 1) > lim[e / 2]) s[nt][e] = FT_NEG_INF;
}

// -inf on the columns before key `lo` of a slab whose first column is key `col0`: a K/V tile loaded
// ending at a KV cache's last held key (CACHE_LENS), whose first columns are the tile before's keys.
template <int NTILES>
FT_DEVICE void mask_below(float (&s)[NTILES][4], int lane, int col0, int lo) {
  const int lim = lo - col0 - frag_col(lane, 0, 0);   // the thread's columns under this are masked
#pragma unroll
  for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (nt * 8 + (e & 1) < lim) s[nt][e] = FT_NEG_INF;
}

// -inf on the columns of a paged KV cache's last K/V tile (CACHE_PAGES, flash_fwd_sm90's PagedTail)
// that rows may not see. Its columns before `seg` are keys col0 + col; the box at `seg` was loaded
// `shift` rows early (those columns are keys already run, or zeros), so its columns are keys
// col0 + col - shift; columns past it are zeros (keys past the length). last[hh]: the last key the
// thread's row of half hh may see (the length's last key, or its causal diagonal's).
template <int NTILES>
FT_DEVICE void mask_paged_tail(float (&s)[NTILES][4], int lane, const int (&last)[2], int col0, int seg, int shift) {
  const int c0 = frag_col(lane, 0, 0);
#pragma unroll
  for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = c0 + nt * 8 + (e & 1), late = col >= seg;
      if ((late && col < seg + shift) || col0 + col - (late ? shift : 0) > last[e / 2]) s[nt][e] = FT_NEG_INF;
    }
}

// t[0] <- max(t), pairs STRIDE apart at each level (a template, so every index is a constant).
template <int N, int STRIDE = 1> FT_DEVICE void max_tree(float (&t)[N]) {
  if constexpr (STRIDE < N) {
#pragma unroll
    for (int i = 0; i + STRIDE < N; i += 2 * STRIDE) t[i] = fmaxf(t[i], t[i + STRIDE]);
    max_tree<N, 2 * STRIDE>(t);
  }
}

// The max of this thread's part of row half `hh` of the slab, as a tree: a running max is a chain
// of 2 * NTILES dependent FMNMX (ncu: 11% of a d=64 consumer's time), the tree log2 of that deep.
template <int NTILES> FT_DEVICE float row_max(const float (&s)[NTILES][4], int hh) {
  float t[NTILES];
#pragma unroll
  for (int nt = 0; nt < NTILES; ++nt) t[nt] = fmaxf(s[nt][2 * hh], s[nt][2 * hh + 1]);
  max_tree(t);
  return t[0];
}

// How far (log2 units) a row's max may rise before LAZY softmax_advance moves it: P stays below
// 2^8 meanwhile, exact in fp32 (l, O) and as relatively precise in 16 bits as below 1.
constexpr float FT_RESCALE_LOG2 = 8.f;

// One tile of the online softmax for a 16-row slab, O untouched: S becomes P in place (fp32),
// m and l advance, and alpha[hh] = exp2((m_old - m_new) * c) is what O's rows must be scaled by.
// Kept apart from the rescale so that a kernel can run it while O is still being accumulated.
// Returns whether O must be rescaled at all. LAZY: a row keeps its max unless the tile's rises
// above it by more than FT_RESCALE_LOG2 (or it had none), and O's rescale is needed only where a
// row of the warp moved (a vote, so the skip is warp-uniform): after a row's first tiles its max
// rarely moves that far, and the rescale (d / 2 multiplies a thread, between P V landing and the
// next one issued) is skipped. The result is the same softmax: m, l and O are all taken against
// the kept max, and the LSE is m * c + log2(l) whichever max that is.
template <int NTILES, bool LAZY = false>
FT_DEVICE bool softmax_advance(float (&s)[NTILES][4], float (&m)[2], float (&l)[2], float (&alpha)[2], float scale_log2) {
  bool moved = false;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float mx = group_max<4>(row_max(s, hh));
    // & and |, not && and ||, and selects: a branch would split the softmax's block for ptxas (m1)
    const bool move = !LAZY || ((m[hh] == FT_NEG_INF) & (mx != FT_NEG_INF)) | ((mx - m[hh]) * scale_log2 > FT_RESCALE_LOG2);
    moved |= move;
    const float m_new = move ? fmaxf(m[hh], mx) : m[hh];
    const float m_use = m_new == FT_NEG_INF ? 0.f : m_new * scale_log2;  // a fully masked row so far
    alpha[hh] = fast_exp2(m[hh] * scale_log2 - m_use);                    // 1 where the max stayed
    m[hh] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
      for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
        s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -m_use));
        sum += s[nt][e];
      }
    l[hh] = l[hh] * alpha[hh] + sum;
  }
  if constexpr (LAZY) return __any_sync(0xffffffffu, moved);
  return true;
}

template <int DTILES> FT_DEVICE void rescale_rows(float (&o)[DTILES][4], const float (&alpha)[2]) {
#pragma unroll
  for (int dt = 0; dt < DTILES; ++dt) {
    o[dt][0] *= alpha[0];
    o[dt][1] *= alpha[0];
    o[dt][2] *= alpha[1];
    o[dt][3] *= alpha[1];
  }
}

// Both at once, for kernels whose O is idle during the softmax.
template <int NTILES, int DTILES>
FT_DEVICE void softmax_step(float (&s)[NTILES][4], float (&o)[DTILES][4], float (&m)[2], float (&l)[2],
                            float scale_log2) {
  float alpha[2];
  softmax_advance(s, m, l, alpha, scale_log2);
  rescale_rows(o, alpha);
}

// P's k16 step `ps` as an A fragment (m16k16, row-major): the layout mma.sync and register-A
// wgmma both take, built from the two n8 accumulator tiles it spans.
template <int DT, int NTILES>
FT_DEVICE void p_fragment(unsigned (&a)[4], const float (&s)[NTILES][4], int ps) {
  a[0] = pack2<DT>(s[2 * ps][0], s[2 * ps][1]);
  a[1] = pack2<DT>(s[2 * ps][2], s[2 * ps][3]);
  a[2] = pack2<DT>(s[2 * ps + 1][0], s[2 * ps + 1][1]);
  a[3] = pack2<DT>(s[2 * ps + 1][2], s[2 * ps + 1][3]);
}

// The tf32 A fragment (m16k8) of P's n8 tile `st`: thread (g, c) needs columns c and c + 4,
// which its quad holds in the accumulator layout (thread c/2 has columns c & ~1, c | 1): two
// shuffles per needed value, the wanted one picked by c's parity.
FT_DEVICE void p_fragment_tf32(unsigned (&a)[4], const float (&st)[4], int lane) {
  const int src = (lane & ~3) | ((lane & 3) >> 1);
  const bool odd = lane & 1;
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {   // i: 0 (row g, col c), 1 (row g+8, col c), 2 (g, c+4), 3 (g+8, c+4)
    const int from = src + (i >= 2 ? 2 : 0), e = (i & 1) ? 2 : 0;
    const float x0 = __shfl_sync(0xffffffffu, st[e], from), x1 = __shfl_sync(0xffffffffu, st[e + 1], from);
    v[i] = odd ? x1 : x0;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = to_tf32(v[i]);
}

// LSE = ln(sum exp(s * scale)) of the quad's two rows (row0 + lane / 4, + 8), from the running
// max `m` and the row sums `row_l` (already reduced over the quad).
template <class Rows = StridedRows>
FT_DEVICE void store_lse(float* lse_row, const float (&m)[2], const float (&row_l)[2], int lane, int row0, int nq,
                         float scale_log2, const Rows& rows = Rows{}) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = row0 + lane / 4 + hh * 8;
    if (lane % 4 == 0 && in_rows(row, nq)) lse_row[rows.lse(row)] = (m[hh] * scale_log2 + __log2f(row_l[hh])) * FT_LN2;
  }
}

// Epilogue for a 16-row slab: O / l in the input precision straight from the fragments, and the
// LSE. `row0` is the slab's first absolute row. 16-bit O goes out in 16-byte stores that fill
// whole 32-byte sectors: with one 4-byte store per fragment pair, half of each sector was written
// per request (H100, flash_fwd_sm90: +3-7% at N=1024). Only the first COLS columns are stored (a
// tile wider than the head dim: flash_fwd_sm90's columns past it are zeros of nobody's O).
// store_rows: the rows placed by `rows` (StridedRows, PackedRows); store_slab: a head's rows o_sn apart.
template <int DT, int DTILES, int COLS = DTILES * 8, class Rows>
FT_DEVICE void store_rows(typename Elem<DT>::type* op, const Rows& rows, float* lse_row, const float (&o)[DTILES][4],
                          const float (&m)[2], const float (&l)[2], int lane, int row0, int nq, float scale_log2) {
  static_assert(COLS % 8 == 0 && COLS <= DTILES * 8, "whole n8 groups of the tile");
  float row_l[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_l[hh] = group_sum<4>(l[hh]);
    const int row = row0 + lane / 4 + hh * 8;
    const float inv = inv_row_sum(row_l[hh]);
    if constexpr (DT != FT_F32 && DTILES >= 4) {
      // The quad's 4 x 4 block of packed pairs (lane q: column pair q of n8 groups 4k..4k+3) is
      // transposed in two shuffle stages, so that lane q holds all of group 4k+q: one 16-byte
      // store per lane, 64 contiguous bytes of a row per quad. The groups past the last whole
      // four (O of a tile 16 columns past 32s) go in 4-byte stores below.
      const int q = lane % 4;
#pragma unroll
      for (int k = 0; k < DTILES / 4; ++k) {
        unsigned u[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) u[j] = pack2<DT>(o[4 * k + j][2 * hh] * inv, o[4 * k + j][2 * hh + 1] * inv);
#pragma unroll
        for (int bit = 1; bit <= 2; bit <<= 1) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (j & bit) continue;   // pair (j, j + bit): send the one whose bit differs from q's
            const bool mine_hi = q & bit;
            const unsigned got = __shfl_xor_sync(0xffffffffu, mine_hi ? u[j] : u[j + bit], bit);
            if (mine_hi) u[j] = got;
            else u[j + bit] = got;
          }
        }
        if (in_rows(row, nq) && (COLS == DTILES * 8 || (4 * k + q) * 8 < COLS))
          *reinterpret_cast<uint4*>(op + rows.o(row) + (4 * k + q) * 8) = make_uint4(u[0], u[1], u[2], u[3]);
      }
    }
    constexpr int FIRST = DT != FT_F32 && DTILES >= 4 ? DTILES / 4 * 4 : 0;   // groups not stored above
    if (FIRST * 8 < COLS && in_rows(row, nq)) {
#pragma unroll
      for (int dt = FIRST; dt < COLS / 8; ++dt) {
        auto* dst = op + rows.o(row) + dt * 8 + 2 * (lane % 4);
        if constexpr (DT == FT_F32) *reinterpret_cast<float2*>(dst) = make_float2(o[dt][2 * hh] * inv, o[dt][2 * hh + 1] * inv);
        else *reinterpret_cast<unsigned*>(dst) = pack2<DT>(o[dt][2 * hh] * inv, o[dt][2 * hh + 1] * inv);
      }
    }
  }
  store_lse(lse_row, m, row_l, lane, row0, nq, scale_log2, rows);
}
template <int DT, int DTILES, int COLS = DTILES * 8>
FT_DEVICE void store_slab(typename Elem<DT>::type* op, long long o_sn, float* lse_row, const float (&o)[DTILES][4],
                          const float (&m)[2], const float (&l)[2], int lane, int row0, int nq, float scale_log2) {
  store_rows<DT, DTILES, COLS>(op, StridedRows{o_sn}, lse_row, o, m, l, lane, row0, nq, scale_log2);
}
