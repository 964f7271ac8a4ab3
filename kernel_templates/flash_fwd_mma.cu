// flash_fwd_mma: FlashAttention-2 forward on tensor cores (mma.sync m16n8k16), fp16/bf16 in,
// fp32 accumulation.
//
// A block owns BR query rows; its WARPS warps split them (BR/WARPS rows each, MT m16 tiles) and
// walk K/V in tiles of BC columns through a STAGES-deep cp.async ring in swizzled shared memory.
// Q stays in registers as mma A-fragments; S = Q K^T comes from ldmatrix'ed K; P = softmax(S)
// never leaves registers: its accumulator layout is repacked as the A operand of O += P V.
// Online softmax in base 2: p = exp2(s * c - m * c) with c = softmax_scale * log2(e).
//
// Q_REGS=1 keeps Q's fragments in registers for the whole block; 0 re-reads them from shared
// memory at every k-step (fewer registers, more ldmatrix).
//
// fp32 inputs run on tensor cores at a lower precision, COMPUTE:
// - FT_BF16 / FT_F16: tiles are converted while they are stored to shared memory (ordinary loads
//   instead of cp.async), then everything is as above.
// - FT_TF32: tiles stay fp32 in shared memory (cp.async) and both products use mma m16n8k8.tf32.
//   ldmatrix on 32-bit data hands thread (g, c) word c of row g, which is exactly the tf32 A/B
//   fragment, so Q and K load as for 16-bit types; P is moved from the accumulator layout into
//   the A layout by shuffles within each quad, and V's fragments are read element by element.
//
// Causal: query row i sees keys j <= i + shift, shift 0 for the top-left diagonal (SDPA's is_causal)
// and nk - nq for the bottom-right one (MASK_BR=1: a KV cache). A row that sees no key (bottom-right
// with nq > nk) writes O = 0 and LSE = -inf (its l stays 0).
//
// VARLEN (common.cuh): packed sequences of their own lengths, a grid of their query blocks.
//
// Set by the family spec as defines: BR BC WARPS STAGES Q_REGS HEAD_DIM D_VALID IN_DTYPE COMPUTE IS_CAUSAL
// MASK_BR (VARLEN where the varlen variant is built). HEAD_DIM is the tiles' width, the head dim
// D_VALID rounded up to 32 columns (family.padded_head_dim): the columns past D_VALID load as zeros
// (nothing is read there) and are never stored.
#include "mma.cuh"
#include "softmax.cuh"

constexpr bool TF32 = COMPUTE == FT_TF32;
using In = typename Elem<IN_DTYPE>::type;          // what q, k, v, o hold in global memory
using T = typename Elem<TF32 ? FT_F32 : COMPUTE>::type;   // what the tiles hold in shared memory
constexpr int NT = WARPS * 32;
constexpr int WROWS = BR / WARPS;       // query rows per warp
constexpr int MT = WROWS / 16;          // m16 tiles per warp
constexpr int NTILES = BC / 8;          // n8 tiles of S
constexpr int DTILES = HEAD_DIM / 8;    // n8 tiles of O
constexpr int KW = TF32 ? 8 : 16;       // k of one mma
constexpr int KSTEPS = HEAD_DIM / KW;   // k steps of S = Q K^T
constexpr int PSTEPS = BC / KW;         // k steps of O += P V
constexpr int CHUNK_ELEMS = 16 / sizeof(T);
constexpr int CHUNKS = HEAD_DIM / CHUNK_ELEMS;    // 16-byte chunks per row

static_assert(WROWS % 16 == 0, "each warp owns whole m16 tiles");
static_assert(BC % 16 == 0, "BC must be a multiple of 16");
static_assert(CHUNKS % 4 == 0 && HEAD_DIM % 32 == 0, "rows of 4k 16-byte chunks, whole k16 steps and n8 pairs");
static_assert(D_VALID % 8 == 0 && D_VALID <= HEAD_DIM && HEAD_DIM - D_VALID < 32, "the tile: D_VALID rounded up to 32");
static_assert(IN_DTYPE == COMPUTE || (IN_DTYPE == FT_F32 && COMPUTE != FT_F32), "compute in the input type, or fp32 in lower");

FT_DEVICE T* at(T* base, int row, int chunk) { return base + row * HEAD_DIM + swz<CHUNKS>(row, chunk) * CHUNK_ELEMS; }

// rows [row0, row0 + ROWS) of a (N, D_VALID) matrix into a swizzled tile; rows >= limit and the
// columns past D_VALID read as 0.
template <int ROWS>
FT_DEVICE void load_tile(T* dst, const In* src, long long stride, int row0, int limit, int tid) {
#pragma unroll
  for (int idx = tid; idx < ROWS * CHUNKS; idx += NT) {
    const int r = idx / CHUNKS, c = idx % CHUNKS;
    const bool ok = row0 + r < limit && c * CHUNK_ELEMS < D_VALID;
    const In* from = src + (ok ? row0 + r : 0) * stride + c * CHUNK_ELEMS;
    if constexpr (sizeof(In) == sizeof(T)) {
      cp_async16(at(dst, r, c), from, ok);
    } else {  // fp32 -> 16-bit while storing: 32 bytes in, 16 out
      uint4 packed = make_uint4(0, 0, 0, 0);
      if (ok) {
        const float4 lo = reinterpret_cast<const float4*>(from)[0], hi = reinterpret_cast<const float4*>(from)[1];
        packed = make_uint4(pack2<COMPUTE>(lo.x, lo.y), pack2<COMPUTE>(lo.z, lo.w), pack2<COMPUTE>(hi.x, hi.y),
                            pack2<COMPUTE>(hi.z, hi.w));
      }
      *reinterpret_cast<uint4*>(at(dst, r, c)) = packed;
    }
  }
}

// One k step of a product on 4 fragment registers of A and 2 of B.
FT_DEVICE void mma_k(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (TF32) mma1688_tf32(d, a, b0, b1);
  else mma16816<COMPUTE>(d, a, b0, b1);
}

extern "C" __global__ void __launch_bounds__(NT, 1) flash_fwd_mma(FT_ATTENTION_PARAMS(In) FT_VARLEN_PARAMS) {
  extern __shared__ float4 smem4[];
  T* Qs = reinterpret_cast<T*>(smem4);
  T* Ks = Qs + BR * HEAD_DIM;
  T* Vs = Ks + STAGES * BC * HEAD_DIM;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // this block's sequence and query block: blockIdx (x, y) = (query block, batch-head), or
  // (VARLEN) (block of all sequences' blocks, head)
#if VARLEN
  const int2 blk = varlen_block<BR>(cu_q, nseq, blockIdx.x);
  if (blk.x < 0) return;
  const int b = blk.x, h = blockIdx.y, qi = blk.y;
#else
  const int b = blockIdx.y / heads, h = blockIdx.y % heads, qi = blockIdx.x;
#endif
  const int hk = h / kv_group;
  const Sequence seq = FT_SEQUENCE(b);
  const int qblks = VARLEN ? (seq.nq + BR - 1) / BR : gridDim.x;
  const int qblk = IS_CAUSAL ? (qblks - 1 - qi) : qi;  // heaviest first
  const int q0 = qblk * BR;
  const In* qp = q + (VARLEN ? seq.q0 * q_sn : b * q_sb) + h * q_sh;
  const In* kp = k + (VARLEN ? seq.k0 * k_sn : b * k_sb) + hk * k_sh;
  const In* vp = v + (VARLEN ? seq.k0 * v_sn : b * v_sb) + hk * v_sh;
  const int shift = IS_CAUSAL && MASK_BR ? seq.nk - seq.nq : 0;   // the diagonal: key j <= row + shift
  const int kv_end = IS_CAUSAL ? min(seq.nk, q0 + BR + shift) : seq.nk;
  const int ntiles = max(0, (kv_end + BC - 1) / BC);
  const int wrow0 = warp * WROWS;

  auto issue_kv = [&](int t) {
    if (t < ntiles) {
      load_tile<BC>(Ks + (t % STAGES) * BC * HEAD_DIM, kp, k_sn, t * BC, seq.nk, tid);
      load_tile<BC>(Vs + (t % STAGES) * BC * HEAD_DIM, vp, v_sn, t * BC, seq.nk, tid);
    }
    cp_async_commit();   // empty groups keep the wait counts uniform
  };

  // ---- load: Q with the first K/V tiles (one cp.async group per tile) ----
  load_tile<BR>(Qs, qp, q_sn, q0, seq.nq, tid);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_kv(s);
  if constexpr (STAGES == 1) cp_async_commit();

  unsigned qf[MT][Q_REGS ? KSTEPS : 1][4];
  float o_acc[MT][DTILES][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) { m[mt][hh] = FT_NEG_INF; l[mt][hh] = 0.f; }
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][dt][e] = 0.f;
  }

  for (int t = 0; t < ntiles; ++t) {
    const int k0 = t * BC;
    if constexpr (STAGES == 1) {
      issue_kv(t);
      cp_async_wait<0>();
    } else {
      cp_async_wait<STAGES - 2>();   // tile t (and Q) have landed
    }
    __syncthreads();
    if constexpr (STAGES > 1) issue_kv(t + STAGES - 1);   // into the buffer tile t-1 just freed
    if (Q_REGS && t == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
          ldmatrix_x4(qf[mt][ks], smem_addr(at(Qs, wrow0 + mt * 16 + lane % 16, ks * 2 + lane / 16)));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) to_operand<TF32>(qf[mt][ks]);
    }
    T* Kt = Ks + (t % STAGES) * BC * HEAD_DIM;
    T* Vt = Vs + (t % STAGES) * BC * HEAD_DIM;

    // ---- S = Q K^T ----
    float s[MT][NTILES][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int kq = Q_REGS ? ks : 0;
      if constexpr (!Q_REGS) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ldmatrix_x4(qf[mt][0], smem_addr(at(Qs, wrow0 + mt * 16 + lane % 16, ks * 2 + lane / 16)));
          to_operand<TF32>(qf[mt][0]);
        }
      }
#pragma unroll
      for (int np = 0; np < NTILES / 2; ++np) {
        unsigned bf[4];
        ldmatrix_x4(bf, smem_addr(at(Kt, np * 16 + lane % 8 + (lane / 16) * 8, ks * 2 + (lane / 8) % 2)));
        to_operand<TF32>(bf);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_k(s[mt][2 * np], qf[mt][kq], bf[0], bf[1]);
          mma_k(s[mt][2 * np + 1], qf[mt][kq], bf[2], bf[3]);
        }
      }
    }

    // ---- mask: the K/V tail, and above the diagonal on the tiles that cross it ----
    // (mask_slab's causal limit is its row0's diagonal: the rows passed shifted by `shift`)
    if (k0 + BC > seq.nk || (IS_CAUSAL && k0 + BC - 1 > q0 + wrow0 + shift)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mask_slab<NTILES, IS_CAUSAL>(s[mt], lane, q0 + wrow0 + mt * 16 + shift, k0, seq.nk);
    }

    // ---- online softmax on the accumulators ----
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) softmax_step(s[mt], o_acc[mt], m[mt], l[mt], scale_log2);

    // ---- O += P V, P repacked from accumulators into A fragments ----
    if constexpr (TF32) {
      const int g = lane / 4, c = lane % 4;
#pragma unroll
      for (int ps = 0; ps < PSTEPS; ++ps) {   // k8 step ps is n8 tile ps of S
        unsigned pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) p_fragment_tf32(pa[mt], s[mt][ps], lane);
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) {
          const int col = dt * 8 + g;
          unsigned bv[2] = {__float_as_uint(at(Vt, ps * 8 + c, col / 4)[col % 4]),
                            __float_as_uint(at(Vt, ps * 8 + c + 4, col / 4)[col % 4])};
          to_operand<true>(bv);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_k(o_acc[mt][dt], pa[mt], bv[0], bv[1]);
        }
      }
    } else {
#pragma unroll
      for (int ps = 0; ps < PSTEPS; ++ps) {
        unsigned pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) p_fragment<COMPUTE>(pa[mt], s[mt], ps);
#pragma unroll
        for (int dp = 0; dp < DTILES / 2; ++dp) {
          unsigned bf[4];
          ldmatrix_x4_trans(bf, smem_addr(at(Vt, ps * 16 + lane % 8 + ((lane / 8) % 2) * 8, dp * 2 + lane / 16)));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_k(o_acc[mt][2 * dp], pa[mt], bf[0], bf[1]);
            mma_k(o_acc[mt][2 * dp + 1], pa[mt], bf[2], bf[3]);
          }
        }
      }
    }
    if constexpr (STAGES == 1) __syncthreads();   // the next tile overwrites this buffer
  }

  // ---- epilogue: O = acc / l in the input precision, LSE per row ----
  // (VARLEN: the sequence read again rather than held in registers through the loop)
#if VARLEN
  const int row0 = __ldcg(cu_q + b), rows = __ldcg(cu_q + b + 1) - row0;
  In* op = o + row0 * o_sn + h * o_sh;
  float* lse_row = lse + static_cast<long long>(h) * total_q + row0;
#else
  const int rows = nq;
  In* op = o + b * o_sb + h * o_sh;
  float* lse_row = lse + static_cast<long long>(blockIdx.y) * nq;
#endif
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    store_slab<IN_DTYPE, DTILES, D_VALID>(op, o_sn, lse_row, o_acc[mt], m[mt], l[mt], lane, q0 + wrow0 + mt * 16, rows, scale_log2);
}
