// flashtune: what the e4m3 (fp8) path of flash_fwd_sm90 needs beyond the 16-bit one.
//
// fp8 wgmma takes only K-major operands, so for O += P V the V tile (keys x d, as TMA loads it) is
// transposed in shared memory into V^T (d x keys) by the producer warpgroup's idle warps. The
// transpose also permutes the keys within each k32 step, so that P goes to the tensor cores
// straight from S's accumulator registers: an S accumulator gives thread (g, c) of a quad the
// columns {2c, 2c+1} of each n8 tile, while the e4m3 A fragment wants logical k = 4c..4c+3 (and
// 16 + 4c..). Logical k = 16h + 4c + i is therefore made to stand for key 16h + 2c + (i & 1) +
// 8 (i >> 1): both P's packing and V^T's rows use that order, and the sum over keys is unchanged.
#pragma once
#include "common.cuh"

// Four floats -> one register of four e4m3 (saturating, round to nearest), x0 in the low byte.
FT_DEVICE unsigned pack4_e4m3(float x0, float x1, float x2, float x3) {
  unsigned r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r) : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return r;
}

// P's k32 step `ps` as an e4m3 A fragment (m64k32 per warpgroup, this warp's m16 slab), in the
// permuted key order above: n8 tiles 4ps..4ps+3 of the accumulator.
template <int NTILES>
FT_DEVICE void p_fragment_e4m3(unsigned (&a)[4], const float (&s)[NTILES][4], int ps) {
  const int t = 4 * ps;
  a[0] = pack4_e4m3(s[t][0], s[t][1], s[t + 1][0], s[t + 1][1]);
  a[1] = pack4_e4m3(s[t][2], s[t][3], s[t + 1][2], s[t + 1][3]);
  a[2] = pack4_e4m3(s[t + 2][0], s[t + 2][1], s[t + 3][0], s[t + 3][1]);
  a[3] = pack4_e4m3(s[t + 2][2], s[t + 2][3], s[t + 3][2], s[t + 3][3]);
}

// Byte offset of (row, col) in a 128-byte-swizzled tile of 128-byte rows (the TMA/wgmma layout):
// the 16-byte chunk index is XORed with the row's position in its 8-row atom.
FT_DEVICE unsigned swz128(int row, int col) {
  return row * 128 + ((((col >> 4) ^ row) & 7) << 4) + (col & 15);
}

// V (ROWS keys x D columns, panels of 128 columns ROWS * 128 bytes apart) -> V^T (D rows x ROWS
// keys, panels of 128 keys D * 128 bytes apart), keys permuted as above; by `nthreads` threads,
// `rank` being this one's. A unit is 4 keys x 4 columns: four 32-bit loads, a 4 x 4 byte
// transpose (8 byte permutes), four 32-bit stores. Consecutive threads take consecutive columns,
// so a warp's loads read whole 128-byte rows.
template <int ROWS, int D>
FT_DEVICE void transpose_v_e4m3(unsigned char* vt, const unsigned char* v, int rank, int nthreads) {
  constexpr int COL4 = D / 4, UNITS = COL4 * (ROWS / 4);
  for (int u = rank; u < UNITS; u += nthreads) {
    const int n = 4 * (u % COL4), k0 = 4 * (u / COL4);   // first column; first logical key
    const int q = (k0 % 32) / 4;                          // 4c + ... : c = q % 4, h = q / 4
    const int key = (k0 / 32) * 32 + (q / 4) * 16 + 2 * (q % 4);   // keys key, +1, +8, +9
    const unsigned char* vp = v + (n / 128) * (ROWS * 128);
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = key + (i & 1) + 8 * (i >> 1);
      w[i] = *reinterpret_cast<const unsigned*>(vp + swz128(r, n % 128));
    }
    const unsigned x0 = __byte_perm(w[0], w[1], 0x5140), y0 = __byte_perm(w[2], w[3], 0x5140);
    const unsigned x1 = __byte_perm(w[0], w[1], 0x7362), y1 = __byte_perm(w[2], w[3], 0x7362);
    const unsigned o[4] = {__byte_perm(x0, y0, 0x5410), __byte_perm(x0, y0, 0x7632), __byte_perm(x1, y1, 0x5410),
                           __byte_perm(x1, y1, 0x7632)};
    unsigned char* tp = vt + (k0 / 128) * (D * 128);
#pragma unroll
    for (int t = 0; t < 4; ++t) *reinterpret_cast<unsigned*>(tp + swz128(n + t, k0 % 128)) = o[t];
  }
}

// Generic-proxy writes to shared memory (the transpose) made visible to the async proxy (wgmma).
FT_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
