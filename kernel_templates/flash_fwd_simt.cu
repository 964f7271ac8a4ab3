// flash_fwd_simt: FlashAttention-2 forward on CUDA cores, fp32 math.
//
// A block owns BR query rows of one (batch, head) and walks K/V in tiles of BC columns. Its threads
// form a TY x TX grid; thread (ty, tx) computes a TM x TN patch of S = Q K^T and the matching
// TM x (HEAD_DIM / TX) patch of O. Rows and columns are dealt out in vector-wide groups, interleaved
// across threads, so that every shared-memory read of the inner loops is one conflict-free vector.
// Online softmax in base 2: Q is pre-scaled by softmax_scale * log2(e), so p = exp2(s - m).
//
// Stages: 1 loads each K/V tile straight into the compute layout; 2 streams the next tile into a
// raw staging buffer with cp.async while this one is being computed (sm_80+).
//
// Causal: query row i sees keys j <= i + shift, shift 0 for the top-left diagonal (SDPA's is_causal)
// and nk - nq for the bottom-right one (MASK_BR=1: a KV cache). A row that sees no key (bottom-right
// with nq > nk) writes O = 0 and LSE = -inf.
//
// Set by the family spec as defines: BR BC TM TN STAGES MIN_BLOCKS HEAD_DIM IN_DTYPE IS_CAUSAL MASK_BR.
#include "common.cuh"

using T = typename Elem<IN_DTYPE>::type;

constexpr int TX = BC / TN;            // threads sharing a row of S
constexpr int TY = BR / TM;
constexpr int NT = TX * TY;            // threads per block
constexpr int VM = vec_width(TM);      // row group width
constexpr int VN = vec_width(TN);      // column group width
constexpr int DN = HEAD_DIM / TX;      // O columns per thread
constexpr int VD = vec_width(DN);

constexpr int QT_LD = BR + 4;          // Qt[d][row]
constexpr int KT_LD = BC + 4;          // Kt[d][col]
constexpr int VS_LD = HEAD_DIM;        // Vs[col][d]
constexpr int PS_LD = BR;              // Ps[col][row], row groups XOR-swizzled by column
constexpr int STG_LD = HEAD_DIM + (IN_DTYPE == FT_F32 ? 4 : 8);  // raw staging rows, 16-byte aligned
constexpr int ROW_GROUPS = BR / VM;
// Tile loads: four 4-element loads per thread in flight, without the registers of a full unroll.
constexpr int LOAD_UNROLL = 4;
// Unroll O += P V fully while the body stays small enough for the instruction cache.
constexpr int PV_UNROLL = BC * TM * DN <= 4096 ? BC : 16;
// S = Q K^T by 16 head-dim steps a trip (TM x TN FMAs each): the shared-memory offsets stay
// immediates within a trip, and NVVM and ptxas do not optimize a straight line of HEAD_DIM steps,
// which took half of this family's compile time (about 2 s a point at d=128, PERF_NOTES "ci1").
constexpr int KD_UNROLL = 16;
constexpr int SWZ = (ROW_GROUPS & (ROW_GROUPS - 1)) == 0 ? (ROW_GROUPS < 8 ? ROW_GROUPS : 8) : 1;

static_assert(TX * TN == BC && TY * TM == BR, "tile must split evenly into thread patches");
static_assert(32 % TX == 0, "a row's threads must sit inside one warp");
static_assert(NT % 32 == 0, "whole warps only");
static_assert(DN * TX == HEAD_DIM, "head dim must split across a row's threads");
static_assert(HEAD_DIM % 4 == 0, "head dim must be a multiple of 4");

FT_DEVICE int row_of(int i, int ty) { return ((i / VM) * TY + ty) * VM + i % VM; }
FT_DEVICE int col_of(int j, int tx) { return ((j / VN) * TX + tx) * VN + j % VN; }
FT_DEVICE int dcol_of(int j, int tx) { return ((j / VD) * TX + tx) * VD + j % VD; }
FT_DEVICE int ps_index(int col, int row) {
  const int group = (row / VM) ^ ((col / VN) & (SWZ - 1));
  return col * PS_LD + group * VM + row % VM;
}

// Stage 1 and the staging pass share this: four elements of K row `c` (or V row `c`) at column
// `d` come from `src(c, d)`; K lands transposed (Kt[d][c]), V row-major.
template <typename SrcK, typename SrcV>
FT_DEVICE void fill_kv(float* Kt, float* Vs, int tid, SrcK src_k, SrcV src_v) {
  constexpr int ITEMS = BC * (HEAD_DIM / 4);
#pragma unroll LOAD_UNROLL
  for (int it = 0; it < (ITEMS + NT - 1) / NT; ++it) {
    const int idx = tid + it * NT;
    if (ITEMS % NT != 0 && idx >= ITEMS) break;
    const int c = idx % BC, d = (idx / BC) * 4;
    float x[4];
    src_k(x, c, d);
#pragma unroll
    for (int e = 0; e < 4; ++e) Kt[(d + e) * KT_LD + c] = x[e];
  }
#pragma unroll LOAD_UNROLL
  for (int it = 0; it < (ITEMS + NT - 1) / NT; ++it) {
    const int idx = tid + it * NT;
    if (ITEMS % NT != 0 && idx >= ITEMS) break;
    const int d = (idx % (HEAD_DIM / 4)) * 4, c = idx / (HEAD_DIM / 4);
    float x[4];
    src_v(x, c, d);
    sts<4>(Vs + c * VS_LD + d, x);
  }
}

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS) flash_fwd_simt(FT_ATTENTION_PARAMS(T)) {
  extern __shared__ float4 smem4[];
  float* Qt = reinterpret_cast<float*>(smem4);
  float* Kt = Qt + HEAD_DIM * QT_LD;
  float* Vs = Kt + HEAD_DIM * KT_LD;
  float* Ps = Vs + BC * VS_LD;
  T* Ks_raw = reinterpret_cast<T*>(Ps + BC * PS_LD);
  T* Vs_raw = Ks_raw + BC * STG_LD;

  const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
  // Causal: the heaviest query blocks (most K/V tiles) go first, so the last wave is short.
  const int qblk = IS_CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int q0 = qblk * BR;
  const int b = blockIdx.y / heads, h = blockIdx.y % heads, hk = h / kv_group;
  const T* qp = q + b * q_sb + h * q_sh;
  const T* kp = k + b * k_sb + hk * k_sh;
  const T* vp = v + b * v_sb + hk * v_sh;

  const int shift = IS_CAUSAL && MASK_BR ? nk - nq : 0;   // the diagonal: key j <= row + shift
  const int kv_end = IS_CAUSAL ? min(nk, q0 + BR + shift) : nk;   // later tiles are fully masked
  const int ntiles = max(0, (kv_end + BC - 1) / BC);

  auto global_k = [&](int k0) {
    return [=](float (&x)[4], int c, int d) {
      x[0] = x[1] = x[2] = x[3] = 0.f;
      if (k0 + c < nk) load4<IN_DTYPE>(x, kp + (k0 + c) * k_sn + d);
    };
  };
  auto global_v = [&](int k0) {
    return [=](float (&x)[4], int c, int d) {
      x[0] = x[1] = x[2] = x[3] = 0.f;
      if (k0 + c < nk) load4<IN_DTYPE>(x, vp + (k0 + c) * v_sn + d);
    };
  };
#if STAGES == 2
  constexpr int CHUNK = 16 / sizeof(T);   // elements per cp.async
  auto issue_tile = [&](int k0) {
    for (int idx = tid; idx < BC * (HEAD_DIM / CHUNK); idx += NT) {
      const int c = idx / (HEAD_DIM / CHUNK), d = (idx % (HEAD_DIM / CHUNK)) * CHUNK;
      const bool ok = k0 + c < nk;
      const int row = ok ? k0 + c : 0;
      cp_async16(Ks_raw + c * STG_LD + d, kp + row * k_sn + d, ok);
      cp_async16(Vs_raw + c * STG_LD + d, vp + row * v_sn + d, ok);
    }
    cp_async_commit();
  };
  auto staged = [](const T* base) {
    return [=](float (&x)[4], int c, int d) { load4<IN_DTYPE>(x, base + c * STG_LD + d); };
  };
  if (ntiles > 0) issue_tile(0);
#else
  (void)Ks_raw; (void)Vs_raw;
#endif

  // ---- load: Q tile, transposed, scaled into the exp2 domain (overlaps tile 0's cp.async) ----
  constexpr int Q_ITEMS = BR * (HEAD_DIM / 4);
#pragma unroll LOAD_UNROLL
  for (int it = 0; it < (Q_ITEMS + NT - 1) / NT; ++it) {   // unrolled: all loads in flight at once
    const int idx = tid + it * NT;
    if (Q_ITEMS % NT != 0 && idx >= Q_ITEMS) break;
    const int r = idx % BR, d = (idx / BR) * 4;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (q0 + r < nq) load4<IN_DTYPE>(x, qp + (q0 + r) * q_sn + d);
#pragma unroll
    for (int e = 0; e < 4; ++e) Qt[(d + e) * QT_LD + r] = x[e] * scale_log2;
  }

  float m[TM], l[TM], acc[TM][DN];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    m[i] = FT_NEG_INF;
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < DN; ++j) acc[i][j] = 0.f;
  }

  for (int t = 0; t < ntiles; ++t) {
    const int k0 = t * BC;
    // ---- load: K/V tile t into Kt / Vs ----
#if STAGES == 2
    cp_async_wait_all();
    __syncthreads();
    fill_kv(Kt, Vs, tid, staged(Ks_raw), staged(Vs_raw));
    __syncthreads();
    if (t + 1 < ntiles) issue_tile(k0 + BC);
#else
    __syncthreads();
    fill_kv(Kt, Vs, tid, global_k(k0), global_v(k0));
    __syncthreads();
#endif

    // ---- S = Q K^T (already in log2 units) ----
    float s[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) s[i][j] = 0.f;
#pragma unroll KD_UNROLL
    for (int kd = 0; kd < HEAD_DIM; ++kd) {
      float a[TM], bb[TN];
#pragma unroll
      for (int i = 0; i < TM; i += VM) lds<VM>(a + i, Qt + kd * QT_LD + row_of(i, ty));
#pragma unroll
      for (int j = 0; j < TN; j += VN) lds<VN>(bb + j, Kt + kd * KT_LD + col_of(j, tx));
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) s[i][j] = fmaf(a[i], bb[j], s[i][j]);
    }

    // ---- mask: the K/V tail, and above the diagonal when causal (only tiles that touch it) ----
    if (k0 + BC > nk || (IS_CAUSAL && k0 + BC - 1 > q0 + shift)) {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const int col = k0 + col_of(j, tx), row = q0 + row_of(i, ty);
          if (col >= nk || (IS_CAUSAL && col > row + shift)) s[i][j] = FT_NEG_INF;
        }
    }

    // ---- online softmax: new running max, rescale O and l once, P = exp2(S - m) ----
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      float mx = s[i][0];
#pragma unroll
      for (int j = 1; j < TN; ++j) mx = fmaxf(mx, s[i][j]);
      mx = group_max<TX>(mx);
      const float m_new = fmaxf(m[i], mx);
      const float m_use = m_new == FT_NEG_INF ? 0.f : m_new;   // a row with nothing unmasked yet
      const float alpha = fast_exp2(m[i] - m_use);
      m[i] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        s[i][j] = fast_exp2(s[i][j] - m_use);
        sum += s[i][j];
      }
      l[i] = l[i] * alpha + sum;   // this thread's columns only; summed across the row at the end
#pragma unroll
      for (int j = 0; j < DN; ++j) acc[i][j] *= alpha;
    }
#pragma unroll
    for (int j = 0; j < TN; ++j)
#pragma unroll
      for (int i = 0; i < TM; i += VM) {
        float pv[VM];
#pragma unroll
        for (int e = 0; e < VM; ++e) pv[e] = s[i + e][j];
        sts<VM>(Ps + ps_index(col_of(j, tx), row_of(i, ty)), pv);
      }
    __syncthreads();

    // ---- O += P V ----
#pragma unroll PV_UNROLL
    for (int kk = 0; kk < BC; ++kk) {
      float p[TM], vv[DN];
#pragma unroll
      for (int i = 0; i < TM; i += VM) lds<VM>(p + i, Ps + ps_index(kk, row_of(i, ty)));
#pragma unroll
      for (int j = 0; j < DN; j += VD) lds<VD>(vv + j, Vs + kk * VS_LD + dcol_of(j, tx));
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < DN; ++j) acc[i][j] = fmaf(p[i], vv[j], acc[i][j]);
    }
  }

  // ---- epilogue: O = acc / l, LSE = ln(sum exp(s)) (a row that saw no key: l = 0, O = 0, LSE = -inf) ----
  T* op = o + b * o_sb + h * o_sh;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const float row_l = group_sum<TX>(l[i]);
    const int row = q0 + row_of(i, ty);
    if (row >= nq) continue;
    const float inv = inv_row_sum(row_l);
#pragma unroll
    for (int j = 0; j < DN; j += VD) {
      float out[VD];
#pragma unroll
      for (int e = 0; e < VD; ++e) out[e] = acc[i][j + e] * inv;
      store_n<IN_DTYPE, VD>(op + row * o_sn + dcol_of(j, tx), out);
    }
    if (tx == 0) lse[static_cast<long long>(blockIdx.y) * nq + row] = (m[i] + __log2f(row_l)) * FT_LN2;
  }
}
