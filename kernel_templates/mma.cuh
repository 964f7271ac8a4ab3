// flashtune: tensor-core building blocks for sm_80+ (mma.sync, ldmatrix), as inline PTX.
#pragma once
#include "common.cuh"

// 16-byte chunks of a row are XOR-swizzled so that the 8 rows an ldmatrix phase touches (one chunk
// column) land in 8 different bank groups. Rows of 8k chunks (>= 128 B): XOR with the row's low
// 3 bits. Rows of 4 or 12 chunks (64 or 192 B: two rows share a 128-byte line, or straddle them):
// the row's parity already picks the half line, so XOR with the next 2 bits, which keeps a chunk
// inside its aligned group of 4.
template <int CHUNKS> FT_DEVICE int swz(int row, int chunk) {
  static_assert(CHUNKS % 4 == 0, "rows of 4k 16-byte chunks");
  if constexpr (CHUNKS % 8 == 0) return chunk ^ (row & 7);
  else return chunk ^ ((row >> 1) & 3);
}

FT_DEVICE unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

FT_DEVICE void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
FT_DEVICE void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// D = A(16x16, row) * B(16x8, col) + D, fp32 accumulators; DT picks fp16 or bf16 operands.
template <int DT> FT_DEVICE void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (DT == FT_BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// tf32 (sm_80+): D = A(16x8, row) * B(8x8, col) + D on fp32 bit patterns already rounded to tf32.
FT_DEVICE void mma1688_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Fragment registers as an mma operand: fp32 words rounded to nearest tf32 where TF32, else as is.
template <bool TF32, int N> FT_DEVICE void to_operand(unsigned (&r)[N]) {
  if constexpr (TF32) {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = to_tf32(__uint_as_float(r[i]));
  }
}

template <int N> FT_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
