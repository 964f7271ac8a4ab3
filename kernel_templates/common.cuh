// flashtune: what every kernel family shares. Self-contained (no CUDA headers), so NVRTC needs no
// include path: element conversions and the async copies are inline PTX.
#pragma once

#define FT_DEVICE __device__ __forceinline__

// Element types as raw storage: float, or the 16-bit patterns of fp16 / bf16.
#define FT_F32 0
#define FT_F16 1
#define FT_BF16 2
#define FT_TF32 3  // a compute precision only: fp32 storage, tf32 tensor-core products
#define FT_E4M3 4  // 1-byte e4m3 inputs (storage unsigned char); the output is bf16

template <int DT> struct Elem;
template <> struct Elem<FT_F32> { using type = float; };
template <> struct Elem<FT_F16> { using type = unsigned short; };
template <> struct Elem<FT_BF16> { using type = unsigned short; };
template <> struct Elem<FT_E4M3> { using type = unsigned char; };

template <int DT> FT_DEVICE float to_f32(typename Elem<DT>::type x);
template <> FT_DEVICE float to_f32<FT_F32>(float x) { return x; }
template <> FT_DEVICE float to_f32<FT_F16>(unsigned short x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
template <> FT_DEVICE float to_f32<FT_BF16>(unsigned short x) {
  return __uint_as_float(static_cast<unsigned>(x) << 16);
}

template <int DT> FT_DEVICE typename Elem<DT>::type from_f32(float x);
template <> FT_DEVICE float from_f32<FT_F32>(float x) { return x; }
template <> FT_DEVICE unsigned short from_f32<FT_F16>(float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
template <> FT_DEVICE unsigned short from_f32<FT_BF16>(float x) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}

// Four consecutive elements <-> four floats (one 16-byte or 8-byte access).
template <int DT> FT_DEVICE void load4(float (&out)[4], const typename Elem<DT>::type* p) {
  if constexpr (DT == FT_F32) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    out[0] = t.x; out[1] = t.y; out[2] = t.z; out[3] = t.w;
  } else {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    out[0] = to_f32<DT>(static_cast<unsigned short>(t.x & 0xffffu));
    out[1] = to_f32<DT>(static_cast<unsigned short>(t.x >> 16));
    out[2] = to_f32<DT>(static_cast<unsigned short>(t.y & 0xffffu));
    out[3] = to_f32<DT>(static_cast<unsigned short>(t.y >> 16));
  }
}

template <int DT, int N> FT_DEVICE void store_n(typename Elem<DT>::type* p, const float (&v)[N]) {
  if constexpr (DT == FT_F32) {
    if constexpr (N == 4) *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    else if constexpr (N == 2) *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
    else p[0] = v[0];
  } else {
    if constexpr (N == 4) {
      uint2 t;
      t.x = from_f32<DT>(v[0]) | (static_cast<unsigned>(from_f32<DT>(v[1])) << 16);
      t.y = from_f32<DT>(v[2]) | (static_cast<unsigned>(from_f32<DT>(v[3])) << 16);
      *reinterpret_cast<uint2*>(p) = t;
    } else if constexpr (N == 2) {
      *reinterpret_cast<unsigned*>(p) = from_f32<DT>(v[0]) | (static_cast<unsigned>(from_f32<DT>(v[1])) << 16);
    } else {
      p[0] = from_f32<DT>(v[0]);
    }
  }
}

// Two floats -> one register of two 2-byte elements (low half first); sm_80+ for bf16.
template <int DT> FT_DEVICE unsigned pack2(float lo, float hi) {
  unsigned r;
  if constexpr (DT == FT_BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// fp32 rounded to nearest tf32, as the 32-bit operand register of a tf32 mma (sm_80+).
FT_DEVICE unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// N consecutive floats in shared memory -> registers, as one vector access where N allows.
template <int N> FT_DEVICE void lds(float* dst, const float* p) {
  if constexpr (N == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    dst[0] = t.x; dst[1] = t.y; dst[2] = t.z; dst[3] = t.w;
  } else if constexpr (N == 2) {
    const float2 t = *reinterpret_cast<const float2*>(p);
    dst[0] = t.x; dst[1] = t.y;
  } else {
    dst[0] = p[0];
  }
}
template <int N> FT_DEVICE void sts(float* p, const float* src) {
  if constexpr (N == 4) *reinterpret_cast<float4*>(p) = make_float4(src[0], src[1], src[2], src[3]);
  else if constexpr (N == 2) *reinterpret_cast<float2*>(p) = make_float2(src[0], src[1]);
  else p[0] = src[0];
}

// The widest vector (4, 2 or 1 floats) that divides n: how a thread's strip of a tile is grouped.
__host__ __device__ constexpr int vec_width(int n) { return n % 4 == 0 ? 4 : (n % 2 == 0 ? 2 : 1); }

// Max over the `width` consecutive lanes that share a row (width divides 32).
template <int WIDTH> FT_DEVICE float group_max(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
template <int WIDTH> FT_DEVICE float group_sum(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// cp.async (sm_80+): 16 bytes global -> shared (its shared-space address, or a pointer to it),
// zero-filled where `valid` is false.
FT_DEVICE void cp_async16(unsigned smem, const void* gmem, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(n));
}
FT_DEVICE void cp_async16(void* smem, const void* gmem, bool valid) {
  cp_async16(static_cast<unsigned>(__cvta_generic_to_shared(smem)), gmem, valid);
}
FT_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
FT_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// 1 / l for the epilogue, 0 for a row with nothing in it (fully masked). l >= 1 otherwise (the
// row's max contributes exp2(0)), where the approximate reciprocal is within 2 ulp and has no
// slow path: IEEE division's branches cost 2-3% of a short tile's time.
FT_DEVICE float inv_row_sum(float l) { return l > 0.f ? __fdividef(1.f, l) : 0.f; }

// 0 <= row < nq in one unsigned compare: flash_fwd_sm90's causal blocks may start before row 0
FT_DEVICE bool in_rows(int row, int nq) { return static_cast<unsigned>(row) < static_cast<unsigned>(nq); }

// Where row r of a work tile's rows goes: O's row at r * sn and the LSE's at r (one head's queries),
// or (PackedRows, packed GQA) query r / group of the tile's head r % group.
struct StridedRows {
  long long sn;
  FT_DEVICE long long o(int r) const { return r * sn; }
  FT_DEVICE int lse(int r) const { return r; }
};
struct PackedRows {
  long long sn, sh;   // O's query and head strides
  int group, nq;      // the query heads interleaved; the queries (a head's LSE rows)
  FT_DEVICE long long o(int r) const { return (r % group) * sh + (r / group) * sn; }
  FT_DEVICE int lse(int r) const { return (r % group) * nq + r / group; }
};

// 2^x on the SFU (ex2.approx, ~2 ulp, -inf -> 0): the softmax needs nothing more exact.
FT_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The argument list every attention family shares, in the order tuner/launch.py's attention_args
// builds it: (B, H, N, D) views with a contiguous last dim, any other strides (in elements), K/V
// heads shared by `kv_group` query heads, and softmax_scale * log2(e).
#define FT_ATTENTION_PARAMS(T)                                                                        \
  const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,    \
      float* __restrict__ lse, int heads, int kv_group, int nq, int nk, long long q_sb,             \
      long long q_sh, long long q_sn, long long k_sb, long long k_sh, long long k_sn, long long v_sb, \
      long long v_sh, long long v_sn, long long o_sb, long long o_sh, long long o_sn, float scale_log2

// VARLEN (a define, 0 where absent): the batch is packed sequences, as FlashAttention's varlen API
// takes them. q, k, v, o are (1, H, total, D) views of (total, H, D) tensors; sequence b is rows
// [cu_q[b], cu_q[b + 1]) of q and o and [cu_k[b], cu_k[b + 1]) of k and v; nq and nk are the longest
// lengths and the LSE is (H, total_q), FlashAttention-2's varlen layout. On a grid of (query blocks
// of all `nseq` sequences, at most total_q / rows + nseq, by heads) a block finds its sequence with
// `varlen_block`, so no block is spent on a short sequence's missing rows; a persistent kernel finds
// each work tile's with `varlen_find_longest` (tile_scheduler.cuh). A kernel appends
// FT_VARLEN_PARAMS to its parameters and reads its sequence with FT_SEQUENCE.
#ifndef VARLEN
#define VARLEN 0
#endif
#if VARLEN
#define FT_VARLEN_PARAMS , const int* __restrict__ cu_q, const int* __restrict__ cu_k, int total_q, int nseq
#else
#define FT_VARLEN_PARAMS
#endif

// CACHE_LENS (a define, 0 where absent): a dense KV cache whose sequences each hold their own number
// of keys, cache_lens[b] of the nk rows the cache has (tuner/kvcache.py). Its rows past a sequence's
// length are not keys and may hold anything, NaN included, which a masked P of 0 would still carry
// into O: a kernel loads no such row (flash_fwd_sm90: the last K/V tile ends at the last held key).
// A kernel appends FT_CACHE_PARAMS to its parameters and reads sequence b's length as FT_HELD_KEYS(b).
// CACHE_PAGES (with CACHE_LENS; 0 where absent): the cache is paged, CACHE_PAGES rows a page, as vLLM
// and FlashAttention lay it out: key j of sequence b is row j % CACHE_PAGES of page
// block_table[b * bt_stride + j / CACHE_PAGES] of the (num_pages, Hk, CACHE_PAGES, D) K and V; nk is
// the keys a table row can name (its pages x CACHE_PAGES), which a null cache_lens gives every
// sequence. Only a sequence's first ceil(length / CACHE_PAGES) table entries are read.
#ifndef CACHE_LENS
#define CACHE_LENS 0
#endif
#ifndef CACHE_PAGES
#define CACHE_PAGES 0
#endif
static_assert(!CACHE_PAGES || CACHE_LENS, "a paged cache comes with its lengths");
#if CACHE_PAGES
#define FT_CACHE_PARAMS , const int* __restrict__ cache_lens, const int* __restrict__ block_table, int bt_stride
#define FT_HELD_KEYS(b) (cache_lens ? min(nk, max(0, cache_lens[(b)])) : nk)
#elif CACHE_LENS
#define FT_CACHE_PARAMS , const int* __restrict__ cache_lens
#define FT_HELD_KEYS(b) min(nk, max(0, cache_lens[(b)]))
#else
#define FT_CACHE_PARAMS
#define FT_HELD_KEYS(b) nk
#endif

// One sequence of the batch: its lengths and its first rows in the packed tensors (0 unless VARLEN).
struct Sequence {
  int nq, nk, q0, k0;
};
FT_DEVICE Sequence sequence_of(const int* cu_q, const int* cu_k, int b) {
  const int q0 = cu_q[b], k0 = cu_k[b];
  return Sequence{cu_q[b + 1] - q0, cu_k[b + 1] - k0, q0, k0};
}
#if VARLEN
#define FT_SEQUENCE(b) sequence_of(cu_q, cu_k, (b))
#else
#define FT_SEQUENCE(b) (Sequence{nq, nk, 0, 0})
#endif

// VARLEN: where a walk over the sequences stands: sequence `seq`'s first block is the launch's
// block `first` ({0, 0}: the start); varlen_find_longest: within octave `level` of those up to `top`
// ({0, 0, top, top}).
struct SeqCursor {
  int seq, first, level, top;
};

// VARLEN: (sequence, place) of the launch's block j, sequence b owning the next ceil(n_b / ROWS) x
// `per` blocks after those of the ones before it (`per`: CTAs a query block, a launch's heads;
// place: j's among b's); (-1, 0) past the last. The calling warp walks the offsets from `at` (a
// sequence at or before j's), 32 sequences a step (a prefix sum by shuffles); every lane gets the
// answer, and `at` moves to j's sequence, so a caller whose j only grows walks each sequence once.
template <int ROWS>
FT_DEVICE int2 varlen_find(const int* cu_q, int nseq, int j, int per, SeqCursor& at) {
  const int lane = threadIdx.x % 32;
  for (int s0 = at.seq, before = at.first; s0 < nseq; s0 += 32) {
    const int s = s0 + lane;
    const int blocks = s < nseq ? (cu_q[s + 1] - cu_q[s] + ROWS - 1) / ROWS * per : 0;
    int upto = blocks;   // inclusive prefix over the chunk
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, upto, off);
      if (lane >= off) upto += t;
    }
    const int first = before + upto - blocks;
    const unsigned hit = __ballot_sync(0xffffffffu, j >= first && j < first + blocks);
    if (hit) {
      const int src = __ffs(hit) - 1;
      at = SeqCursor{s0 + src, __shfl_sync(0xffffffffu, first, src)};
      return make_int2(at.seq, j - at.first);
    }
    before += __shfl_sync(0xffffffffu, upto, 31);
  }
  return make_int2(-1, 0);
}

// VARLEN, persistent: varlen_find with the sequences taken longest first, so a long sequence late in
// the batch does not end the launch alone: octave `level` (the sequences of 2^level to
// 2^(level+1) - 1 query blocks, in the batch's order) after every higher one. `at` starts at {0, 0, top, top}, top the octave of the longest length the launch was given (a sequence
// longer than that, against the caller's word, goes in octave top: none is left out); an octave
// left empty costs one pass over the offsets; a caller whose j only grows walks each octave once.
template <int ROWS>
FT_DEVICE int2 varlen_find_longest(const int* cu_q, int nseq, int j, int per, SeqCursor& at) {
  const int lane = threadIdx.x % 32;
  for (; at.level >= 0; at = SeqCursor{0, at.first, at.level - 1, at.top}) {
    for (int s0 = at.seq; s0 < nseq; s0 += 32) {
      const int s = s0 + lane;
      const int nb = s < nseq ? (cu_q[s + 1] - cu_q[s] + ROWS - 1) / ROWS : 0;
      const int blocks = nb > 0 && min(31 - __clz(nb), at.top) == at.level ? nb * per : 0;
      int upto = blocks;   // inclusive prefix over the chunk
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, upto, off);
        if (lane >= off) upto += t;
      }
      const int first = at.first + upto - blocks;
      const unsigned hit = __ballot_sync(0xffffffffu, j >= first && j < first + blocks);
      if (hit) {
        const int src = __ffs(hit) - 1;
        at = SeqCursor{s0 + src, __shfl_sync(0xffffffffu, first, src), at.level, at.top};
        return make_int2(at.seq, j - at.first);
      }
      at.first += __shfl_sync(0xffffffffu, upto, 31);
    }
  }
  return make_int2(-1, 0);
}

// The octave of `rows` query rows' block count: where varlen_find_longest starts (0 at least).
template <int ROWS>
FT_DEVICE int varlen_top_level(int rows) {
  return rows > ROWS ? 31 - __clz((rows + ROWS - 1) / ROWS) : 0;
}

// VARLEN on a grid: varlen_find for the CTA's block j, walked by warp 0 from the start; every thread
// gets the answer through shared memory, so all of the block must call it.
template <int ROWS>
FT_DEVICE int2 varlen_block(const int* cu_q, int nseq, int j, int per = 1) {
  __shared__ int2 found;
  if (threadIdx.x < 32) {
    SeqCursor at{0, 0, 0, 0};
    const int2 r = varlen_find<ROWS>(cu_q, nseq, j, per, at);
    if (threadIdx.x == 0) found = r;
  }
  __syncthreads();
  return found;
}

constexpr float FT_LN2 = 0.6931471805599453f;
#define FT_NEG_INF (__int_as_float(0xff800000))
