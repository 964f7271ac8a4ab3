// flashtune: flash_fwd_sm90's epilogue through shared memory and a TMA store (TMA_STORE).
//
// Each consumer warp owns a 16-row slab of O in shared memory, in 128-byte-swizzled panels of 64
// columns (the O tensor map's box: 64 columns x 16 rows). The warp writes its normalized
// fragments there with stmatrix, and one lane hands the slab to the TMA unit and moves on: the
// warp starts its next work tile while the copy drains, rather than waiting on its global stores.
// The TMA clips rows past N, so ragged tiles need no guard. A store box may not start before
// row 0 (an illegal instruction on H100, though loads from there are zero-filled), so these
// kernels keep causal blocks aligned to the start (FROM_END off): cheaper than a guarded
// store_slab for such slabs (benchmarks/PERF_NOTES.md, h18).
#pragma once
#include "sm90.cuh"
#include "softmax.cuh"

// The 16 x (DTILES * 8) slab at `slab` (1024-byte aligned, panels of 16 x 128 B) <- O / l, and
// one TMA store per panel at (row0 >= 0, h, b); the LSE as in store_slab.
template <int DT, int DTILES>
FT_DEVICE void store_slab_tma(unsigned slab, const void* tmap_o, float* lse_row, const float (&o)[DTILES][4],
                              const float (&m)[2], const float (&l)[2], int lane, int row0, int nq, int h, int b,
                              float scale_log2) {
  static_assert(DT != FT_F32 && DTILES % 8 == 0, "16-bit O in whole 64-column panels");
  float inv[2], row_l[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_l[hh] = group_sum<4>(l[hh]);
    inv[hh] = inv_row_sum(row_l[hh]);
  }
  if (lane == 0) bulk_wait_read<0>();   // the last tile's store has read the slab
  __syncwarp();
  // stmatrix.x4 over a 16 x 16 block: matrices (rows 0-7 | 8-15) x (n8 group dt | dt + 1); lane
  // 8m + r gives the address of row r of matrix m. Within a panel, 16-byte chunk c of row r sits
  // at chunk c ^ (r % 8): the 128-byte swizzle, so the 8 rows of a matrix hit all 32 banks.
  const int mat = lane / 8, r = lane % 8 + (mat & 1) * 8;
#pragma unroll
  for (int dt = 0; dt < DTILES; dt += 2) {
    const int col8 = dt + (mat >> 1);   // this lane's n8 group
    const unsigned addr = slab + (col8 / 8) * 2048 + r * 128 + (((col8 % 8) ^ (r % 8)) << 4);
    stmatrix_x4(addr, pack2<DT>(o[dt][0] * inv[0], o[dt][1] * inv[0]), pack2<DT>(o[dt][2] * inv[1], o[dt][3] * inv[1]),
                pack2<DT>(o[dt + 1][0] * inv[0], o[dt + 1][1] * inv[0]), pack2<DT>(o[dt + 1][2] * inv[1], o[dt + 1][3] * inv[1]));
  }
  fence_proxy_async_smem();
  __syncwarp();
  if (lane == 0) {
#pragma unroll
    for (int p = 0; p < DTILES / 8; ++p) tma_store_4d(tmap_o, slab + p * 2048, p * 64, row0, h, b);
    bulk_commit();
  }
  store_lse(lse_row, m, row_l, lane, row0, nq, scale_log2);
}
