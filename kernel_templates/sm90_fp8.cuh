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
#include "mma.cuh"
#include "sm90.cuh"

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

// Byte offset of (row, col) in a swizzled tile of WIDTH-byte rows, the layout TMA writes and
// wgmma reads for 128- and 64-byte swizzles: mma.cuh's chunk swizzle is the same XOR pattern.
template <int WIDTH> FT_DEVICE unsigned swizzled(int row, int col) {
  static_assert(WIDTH == 128 || WIDTH == 64, "128- or 64-byte swizzle");
  return row * WIDTH + swz<WIDTH / 16>(row, col >> 4) * 16 + (col & 15);
}

// V (ROWS keys x D columns, panels of VROW columns ROWS * VROW bytes apart, VROW-byte swizzled)
// -> V^T (D rows x ROWS keys, panels of 128 keys D * 128 bytes apart, 128-byte swizzled), keys
// permuted as above; by `nwarps` whole warps,
// `warp` being this one's rank. A step moves 32 keys x 16 columns (512 bytes) with one ldmatrix
// .x4.trans, four byte permutes and one stmatrix .x4: the transposing load gives thread (j, c)
// keys {2c, 2c+1} (+8, +16, +24) of columns 2j and 2j+1, as 16-bit pairs, which are exactly the
// key pairs of the permuted order, so each output word is one permute of two of them.
template <int ROWS, int D, int VROW>
FT_DEVICE void transpose_v_e4m3(unsigned char* vt, const unsigned char* v, int warp, int nwarps) {
  constexpr int COL16 = D / 16, STEPS = COL16 * (ROWS / 32);
  const int lane = threadIdx.x % 32, mi = lane / 8, r = lane % 8;   // this lane's matrix and row
#pragma unroll 1
  for (int u = warp; u < STEPS; u += nwarps) {
    const int col = 16 * (u % COL16), k32 = 32 * (u / COL16);   // first column; first key
    const unsigned src = smem_u32(v + (col / VROW) * (ROWS * VROW) + swizzled<VROW>(k32 + 8 * mi + r, col % VROW));
    unsigned a[4];
    ldmatrix_x4_trans(a, src);
    // a[m] = keys 8m + {2c, 2c+1} at columns col + 2j, col + 2j + 1: [k n0, k n1, k+1 n0, k+1 n1]
    const unsigned o0 = __byte_perm(a[0], a[1], 0x6420), o1 = __byte_perm(a[0], a[1], 0x7531);
    const unsigned o2 = __byte_perm(a[2], a[3], 0x6420), o3 = __byte_perm(a[2], a[3], 0x7531);
    // matrix m of the store: V^T rows col + 2 r + (m & 1), logical keys k32 + 16 (m >> 1) ... + 15
    const int n = col + 2 * r + (mi & 1), kl = k32 + 16 * (mi >> 1);
    const unsigned dst = smem_u32(vt + (kl / 128) * (D * 128) + swizzled<128>(n, kl % 128));
    stmatrix_x4(dst, o0, o1, o2, o3);
  }
}

