// flash_decode: attention for a few queries against many keys (decode, speculative decode, short
// chunks against a KV cache), on tensor cores (mma.sync m16n8k16), fp16/bf16 in, fp32 accumulation.
//
// Memory-bound by design: each key's K and V row must cross from memory once, so
// - the query rows of all heads that share one K/V head are packed into one tile (row r is query
//   r / group of head hk * group + r % group): a K/V head is read once for its whole group, not once
//   per query head;
// - the keys are split across CTAs (gridDim.z splits of whole tiles) so that a small batch still
//   fills the GPU; each split writes its O (normalized, fp32) and LSE to a workspace, and the last
//   split of a tile to finish (a self-resetting arrival counter) merges them by their LSE;
// - inside a CTA, the WARPS warps take different keys of each stage (BC each) rather than
//   different rows, and their partial softmax states are merged through shared memory at the end.
// K/V stages come through a STAGES-deep cp.async ring; rows are addressed one by one, so a paged
// cache (PAGED=1: key j of sequence b lives in page block_table[b][j / page_size], row j % page_size;
// k_sb / v_sb are then the page strides) costs one table read per row. `seqused_k` (where not null)
// gives each sequence its own number of valid keys; the causal diagonal is that length's.
// KV_TMA (tiles up to 192 columns, at most 256 keys a stage; pages where their size and a stage's
// divide one another) on sm_90 and later: a stage comes in through the copy engine, as boxes of
// PANEL_COLS columns x TK rows of K and of V per panel (pages: a box per page, issued by warp 0's
// lanes), swizzled as wide as a panel row (128 bytes, or 64 where the tile is not whole 128-byte
// panels: flash_decode.panel), counted on the stage's mbarrier; the boxes' columns past D_VALID
// come as zeros. Rows past a sequence's keys come as the
// tensor holds them (an unwritten cache tail, the next packed sequence), so each warp zeroes its V
// rows there before P V. cp.async's 16-byte loads, tracked by the SM's load units, read K/V below
// the copy bandwidth that the tensor-map peers reach.
//
// HEAD_DIM is the tile's width, the head dim D_VALID rounded up to 32 columns, or to 128 at 72-80
// (flash_decode.tile: 128-byte panels): Q's, K's and V's columns past D_VALID come in as zeros (cp.async reads nothing there), and only
// D_VALID columns are stored, to O and to the splits' workspace (rows of D_VALID floats).
// RING_COLS of K's and V's columns are in the ring and in the products: HEAD_DIM, or (TAIL_COLS > 0)
// D_VALID rounded up to 16, whole panels then a tail panel of TAIL_COLS (16 or 32: 32- or 64-byte rows,
// swizzled as wide) by a box of its own (tmap_kt, tmap_vt). A panel box whose row lies mostly past
// the tensor's columns is not free: at d = 80 the copy engine asked L2 for 1.33x the sectors of
// the rows it brought, and the decode kernel read 11% more from memory than the K/V it held, where a
// 16-column tail box asks for none more (PERF_NOTES "y2"; flash_decode.ring_cols).
//
// MERGE_CLUSTER (2-8, sm_90; flash_decode_cluster): the splits of a (sequence, K/V head, row block)
// run as one thread-block cluster along z, each leaves its rows (O / l and the LSE) in its own
// shared memory, and rank 0 merges them from there: no workspace, fence or arrival counter, so the
// last split's merge waits on the cluster's shared memory rather than on L2 round trips.
//
// VARLEN (common.cuh): packed sequences, each with its own queries (up to nq) and keys; the grid
// has the longest sequence's row blocks for each, a sequence's extra ones exit at once.
//
// Set by the family spec as defines: BC WARPS STAGES MT HEAD_DIM D_VALID PANEL_COLS IN_DTYPE IS_CAUSAL MASK_BR PAGED
// KV_TMA (VARLEN) (MERGE_CLUSTER).
#include "mma.cuh"
#include "softmax.cuh"
// sm90.cuh: TmaMap (a parameter on every arch); its copies only where FT_TMA
#include "sm90.cuh"
#if KV_TMA && __CUDA_ARCH__ >= 900
#define FT_TMA 1
#else
#define FT_TMA 0
#endif

#ifndef MERGE_CLUSTER
#define MERGE_CLUSTER 1
#endif
static_assert(MERGE_CLUSTER == 1 || (MERGE_CLUSTER >= 2 && MERGE_CLUSTER <= 8 && !VARLEN),
              "a cluster of 2-8 splits (a portable cluster), each launch's CTAs all running to its end");

using T = typename Elem<IN_DTYPE>::type;
constexpr int NT = WARPS * 32;
constexpr int ROWS = 16 * MT;             // packed query rows per CTA
constexpr int TK = WARPS * BC;            // keys per stage
constexpr int NTILES = BC / 8;            // n8 tiles of a warp's S
#ifndef RING_COLS
#define RING_COLS HEAD_DIM
#define TAIL_COLS 0
#endif
constexpr int DTILES = RING_COLS / 8;     // n8 tiles of O that P V computes (the rest of the tile's are zeros)
constexpr int KSTEPS = RING_COLS / 16;    // k16 steps of S = Q K^T
constexpr int PSTEPS = BC / 16;           // k16 steps of O += P V
constexpr int CHUNKS = HEAD_DIM / 8;      // 16-byte chunks per row of Q's tile (and of a ring row without panels)
constexpr int RING_CHUNKS = RING_COLS / 8;   // 16-byte chunks of a K/V row in the ring
constexpr int TAIL_CHUNKS = TAIL_COLS / 8;
// one tensor's part of a stage; with a tail, whole KB so that every slot's 128-byte panels start on
// the copy engine's 1 KB swizzle period
constexpr int KV_STAGE_ELEMS = TK * RING_COLS;   // what the boxes bring
constexpr int STAGE_ELEMS = TAIL_COLS ? (KV_STAGE_ELEMS + 511) / 512 * 512 : KV_STAGE_ELEMS;

static_assert(BC % 16 == 0, "BC must be a multiple of 16");
static_assert(D_VALID % 8 == 0 && D_VALID <= HEAD_DIM && (HEAD_DIM - D_VALID < 32 || HEAD_DIM == 128),
              "the tile: D_VALID rounded up to 32, or 128 (d = 72-80)");
static_assert(CHUNKS % 4 == 0 && HEAD_DIM % 32 == 0, "rows of 4k 16-byte chunks, whole k16 steps and n8 pairs");
static_assert(IN_DTYPE == FT_F16 || IN_DTYPE == FT_BF16, "16-bit inputs");
static_assert(!(VARLEN && PAGED), "packed sequences or pages, not both");
static_assert(!KV_TMA || ((PANEL_COLS == 64 || PANEL_COLS == 32) && HEAD_DIM % PANEL_COLS == 0 && TK <= 256),
              "a stage as boxes of PANEL_COLS columns (128- or 64-byte rows) x TK rows");
static_assert(TAIL_COLS == 0 ? RING_COLS == HEAD_DIM
              : KV_TMA && (TAIL_COLS == 16 || TAIL_COLS == 32) && TAIL_COLS < PANEL_COLS && RING_COLS % 16 == 0 &&
                D_VALID <= RING_COLS && RING_COLS < HEAD_DIM && (RING_COLS - TAIL_COLS) % PANEL_COLS == 0,
              "a tail panel of 16 or 32 columns after whole panels, the head dim rounded up to 16");
constexpr int PANEL_CHUNKS = PANEL_COLS / 8;   // 16-byte chunks of a panel's row
constexpr int FULL_PANELS = (RING_COLS - TAIL_COLS) / PANEL_COLS;

FT_DEVICE T* at(T* base, int row, int chunk) { return base + row * HEAD_DIM + swz<CHUNKS>(row, chunk) * 8; }
// A chunk of a K/V row in a ring slot: rows as `at` lays them out, or (FT_TMA) in the copy engine's
// panels of PANEL_COLS columns x TK rows, swizzled as the copy engine writes them (128-byte rows:
// chunk c of row r at c ^ r % 8; 64-byte: c ^ (r / 2) % 4, the pattern `swz` lays 4-chunk rows in);
// every form keeps ldmatrix's 8 row addresses of one chunk column in distinct banks.
// A tail panel's rows are as its box writes them: 32-byte rows, chunk c of row r at c ^ (r / 4) % 2
// (the 32-byte swizzle), 64-byte rows as `swz` lays them; cp.async (before sm_90) writes the same
// layout where there is a tail, as there are no whole rows of a power of two chunks to swizzle.
FT_DEVICE const T* kv_at(const T* base, int row, int chunk) {
  if constexpr (FT_TMA || TAIL_COLS > 0) {
    const int p = chunk / PANEL_CHUNKS, c = chunk % PANEL_CHUNKS;
    if constexpr (TAIL_COLS > 0) {
      if (p == FULL_PANELS) {
        const int sc = TAIL_CHUNKS == 2 ? c ^ ((row >> 2) & 1) : swz<4>(row, c);
        return base + FULL_PANELS * TK * PANEL_COLS + row * TAIL_COLS + sc * 8;
      }
    }
    return base + p * TK * PANEL_COLS + row * PANEL_COLS + swz<PANEL_CHUNKS>(row, c) * 8;
  } else {
    return base + row * HEAD_DIM + swz<CHUNKS>(row, chunk) * 8;
  }
}

// The first element of key j's row of K or V for sequence b, K/V head hk.
FT_DEVICE const T* key_row(const T* base, long long sb, long long sh, long long sn, int b, int hk, int j,
                           const int* __restrict__ block_table, int page_size, int bt_stride) {
  if constexpr (PAGED) {
    const int page = __ldg(block_table + static_cast<long long>(b) * bt_stride + j / page_size);
    return base + page * sb + hk * sh + (j % page_size) * sn;
  } else {
    return base + b * sb + hk * sh + static_cast<long long>(j) * sn;
  }
}

#if MERGE_CLUSTER > 1
#define FT_SPLIT_CLUSTER __cluster_dims__(1, 1, MERGE_CLUSTER)
#else
#define FT_SPLIT_CLUSTER
#endif
extern "C" __global__ void __launch_bounds__(NT, 1) FT_SPLIT_CLUSTER
flash_decode(FT_ATTENTION_PARAMS(T), float* __restrict__ part_o, float* __restrict__ part_lse,
             int* __restrict__ arrivals, const int* __restrict__ seqused_k, const int* __restrict__ block_table,
             int page_size, int bt_stride, const __grid_constant__ TmaMap tmap_k,
             const __grid_constant__ TmaMap tmap_v, const __grid_constant__ TmaMap tmap_kt,
             const __grid_constant__ TmaMap tmap_vt FT_VARLEN_PARAMS) {
  extern __shared__ float4 smem4[];
#if FT_TMA
  // the copy engine's 128-byte swizzle repeats every 1024 bytes: the ring starts on that boundary
  // (Q's rows are a multiple of 1 KB); the family asks 1 KB more than the layout for this
  T* Qs = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(smem4) + ((1024 - (smem_addr(smem4) & 1023)) & 1023));
#else
  T* Qs = reinterpret_cast<T*>(smem4);
#endif
  T* Ks = Qs + ROWS * HEAD_DIM;
  T* Vs = Ks + STAGES * STAGE_ELEMS;
  __shared__ float row_m[ROWS], row_l[ROWS];
  __shared__ int last_flag;
#if FT_TMA
  __shared__ alignas(8) unsigned long long kv_full[STAGES];   // a ring slot's K and V boxes have landed
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(&kv_full[s], 1);
    mbar_fence_init();
    tmap_prefetch(tmap_k);
    tmap_prefetch(tmap_v);
    if constexpr (TAIL_COLS > 0) {
      tmap_prefetch(tmap_kt);
      tmap_prefetch(tmap_vt);
    }
  }
#endif

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int hkv = heads / kv_group;
  // x is (sequence, K/V head, row block) with the row blocks fastest: the CTAs that read the same
  // K/V for different rows are launched together, so all but the first find it in L2. With the row
  // blocks on y, a batch past one wave read each K/V head once from memory per row block.
  // nq: the longest sequence's (VARLEN), at least one row block as the host sizes the grid
  const int row_blocks = max(1, (kv_group * nq + ROWS - 1) / ROWS);
  const int bh = blockIdx.x / row_blocks;
  const int b = bh / hkv, hk = bh % hkv;
  const int split = blockIdx.z, splits = gridDim.z;
  // the sequence's queries and keys: the batch's, or (VARLEN) its packed sequence's, whose row
  // blocks past its queries do nothing (every split of them alike: no merge is owed)
  const Sequence seq = FT_SEQUENCE(b);
  const int nq_b = seq.nq;
  const int packed = kv_group * nq_b;               // query rows that share this K/V head
  const int r0 = blockIdx.x % row_blocks * ROWS;    // this CTA's first packed row
  if (VARLEN && r0 >= packed) return;
  const int nk_b = VARLEN ? seq.nk : (seqused_k != nullptr ? min(seqused_k[b], nk) : nk);
  const int shift = MASK_BR ? nk_b - nq_b : 0;      // the diagonal: key j <= query + shift
  const int last_query = min(nq_b - 1, (r0 + ROWS - 1) / kv_group);
  const int kv_end = IS_CAUSAL ? max(0, min(nk_b, last_query + shift + 1)) : nk_b;
  const int ntiles = (kv_end + TK - 1) / TK;
  const int per_split = (ntiles + splits - 1) / splits;
  const int t_begin = split * per_split, t_end = min(ntiles, t_begin + per_split);
  const float c = scale_log2;

  // stage t goes to ring slot SLOT(t): its own count from t_begin where an mbarrier's phase follows
  // the slot's uses (FT_TMA)
#if FT_TMA
#define SLOT(t) (((t) - t_begin) % STAGES)
#else
#define SLOT(t) ((t) % STAGES)
#endif
#if FT_TMA
  auto issue_kv = [&](int t) {
    if constexpr (PAGED) {
      // maps of the pages ((num_pages, Hk, page_size, D)): a box per page the stage covers, or the
      // stage's rows of one page (the host runs this form only where page_size and TK divide one
      // another, in whole 8-row swizzle atoms). Warp 0's lanes take a box each, so the table reads
      // go out together rather than one after another on one thread. Rows past the sequence's
      // keys read its last valid page (zeroed below as any row past nk_b): the table need not hold
      // more.
      if (t < t_end && warp == 0) {
        const int slot = SLOT(t), box = min(TK, page_size);
        // (the phase needs lane 0's arrival, so bytes that land before its count are counted all the same)
        if (lane == 0) mbar_expect_tx(&kv_full[slot], 2 * KV_STAGE_ELEMS * sizeof(T));
        for (int r = lane * box; r < TK; r += 32 * box) {
          const int j = min(t * TK + r, nk_b - 1);
          const int page = __ldg(block_table + static_cast<long long>(b) * bt_stride + j / page_size);
#pragma unroll
          for (int p = 0; p < FULL_PANELS; ++p) {
            tma_load_4d(Ks + slot * STAGE_ELEMS + p * TK * PANEL_COLS + r * PANEL_COLS, &tmap_k, &kv_full[slot], p * PANEL_COLS,
                        (t * TK + r) % page_size, hk, page);
            tma_load_4d(Vs + slot * STAGE_ELEMS + p * TK * PANEL_COLS + r * PANEL_COLS, &tmap_v, &kv_full[slot], p * PANEL_COLS,
                        (t * TK + r) % page_size, hk, page);
          }
          if constexpr (TAIL_COLS > 0) {
            constexpr int tail = FULL_PANELS * TK * PANEL_COLS;
            tma_load_4d(Ks + slot * STAGE_ELEMS + tail + r * TAIL_COLS, &tmap_kt, &kv_full[slot], FULL_PANELS * PANEL_COLS,
                        (t * TK + r) % page_size, hk, page);
            tma_load_4d(Vs + slot * STAGE_ELEMS + tail + r * TAIL_COLS, &tmap_vt, &kv_full[slot], FULL_PANELS * PANEL_COLS,
                        (t * TK + r) % page_size, hk, page);
          }
        }
      }
    } else if (t < t_end && tid == 0) {
      const int slot = SLOT(t);
      mbar_expect_tx(&kv_full[slot], 2 * KV_STAGE_ELEMS * sizeof(T));
#pragma unroll
      for (int p = 0; p < FULL_PANELS; ++p) {
        // (VARLEN: the packed (1, Hk, total_k, D) tensors, the sequence's rows from seq.k0)
        tma_load_4d(Ks + slot * STAGE_ELEMS + p * TK * PANEL_COLS, &tmap_k, &kv_full[slot], p * PANEL_COLS, seq.k0 + t * TK, hk, VARLEN ? 0 : b);
        tma_load_4d(Vs + slot * STAGE_ELEMS + p * TK * PANEL_COLS, &tmap_v, &kv_full[slot], p * PANEL_COLS, seq.k0 + t * TK, hk, VARLEN ? 0 : b);
      }
      if constexpr (TAIL_COLS > 0) {
        constexpr int tail = FULL_PANELS * TK * PANEL_COLS;
        tma_load_4d(Ks + slot * STAGE_ELEMS + tail, &tmap_kt, &kv_full[slot], FULL_PANELS * PANEL_COLS, seq.k0 + t * TK, hk, VARLEN ? 0 : b);
        tma_load_4d(Vs + slot * STAGE_ELEMS + tail, &tmap_vt, &kv_full[slot], FULL_PANELS * PANEL_COLS, seq.k0 + t * TK, hk, VARLEN ? 0 : b);
      }
    }
  };
  // The ring's first stages go out before Q's loads: their bytes are the launch's longest wait, and
  // a short call pays it once a wave (PERF_NOTES "q6"). Warp 0 issues them (thread 0 for a dense
  // cache, its lanes for pages' boxes), after thread 0's barrier init, which __syncwarp orders before
  // the other lanes' copies; every other thread waits on a barrier only after the __syncthreads below.
  if (warp == 0) {
    __syncwarp();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue_kv(t_begin + s);
  }
#else
  auto issue_kv = [&](int t) {
    if (t < t_end) {
      T* kd = Ks + SLOT(t) * STAGE_ELEMS;
      T* vd = Vs + SLOT(t) * STAGE_ELEMS;
      // not unrolled: unrolled, ptxas keeps every iteration's row offsets in registers across
      // stages (2 x 64-bit per row, +40-70 registers at BC=32-64) for a loop that waits on memory
#pragma unroll 1
      for (int idx = tid; idx < TK * RING_CHUNKS; idx += NT) {
        const int r = idx / RING_CHUNKS, ch = idx % RING_CHUNKS, j = t * TK + r;
        const bool ok = j < nk_b && ch * 8 < D_VALID;
        const int jj = ok ? j : 0;
        cp_async16(const_cast<T*>(kv_at(kd, r, ch)), key_row(k, k_sb, k_sh, k_sn, VARLEN ? 0 : b, hk, seq.k0 + jj, block_table, page_size, bt_stride) + ch * 8, ok);
        cp_async16(const_cast<T*>(kv_at(vd, r, ch)), key_row(v, v_sb, v_sh, v_sn, VARLEN ? 0 : b, hk, seq.k0 + jj, block_table, page_size, bt_stride) + ch * 8, ok);
      }
    }
    cp_async_commit();   // empty groups keep the wait counts uniform
  };
#endif
  // ---- Q: the packed rows, zeros past the group's last ----
  for (int idx = tid; idx < ROWS * CHUNKS; idx += NT) {
    const int r = idx / CHUNKS, ch = idx % CHUNKS, pr = r0 + r;
    const bool ok = pr < packed && ch * 8 < D_VALID;
    const int qi = ok ? pr / kv_group : 0, h = hk * kv_group + (ok ? pr % kv_group : 0);
    cp_async16(at(Qs, r, ch), q + (VARLEN ? seq.q0 * q_sn : b * q_sb) + h * q_sh + qi * q_sn + ch * 8, ok);
  }
#if FT_TMA
  cp_async_commit();    // Q's group
  cp_async_wait<0>();   // Q (every thread's cp.async) has landed ...
  __syncthreads();      // ... and every warp sees it, and the barriers' init
#else
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_kv(t_begin + s);   // (Q's copies join stage 0's group)
#endif

  // Each thread's last visible key per fragment row (mt, half): the sequence's end, and the diagonal.
  int lim[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int pr = r0 + mt * 16 + lane / 4 + hh * 8;
      lim[mt][hh] = IS_CAUSAL ? min(nk_b - 1, min(pr / kv_group, nq_b - 1) + shift) : nk_b - 1;
    }

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

  for (int t = t_begin; t < t_end; ++t) {
    const int slot = SLOT(t);
#if FT_TMA
    mbar_wait(&kv_full[slot], ((t - t_begin) / STAGES) & 1);   // stage t has landed
#else
    cp_async_wait<STAGES - 2>();   // stage t (and Q) have landed
#endif
    __syncthreads();               // and every warp is done with stage t-1's slot
    issue_kv(t + STAGES - 1);      // into the slot stage t-1 just freed
    const T* Kt = Ks + slot * STAGE_ELEMS;
    const T* Vt = Vs + slot * STAGE_ELEMS;
    const int krow0 = warp * BC;               // this warp's keys within the stage
    const int key0 = t * TK + krow0;           // ... and their absolute index
    if (key0 > kv_end - 1) continue;           // nothing visible for this warp in this stage
#if FT_TMA
    // Rows past the sequence's keys came in as the tensor holds them (a cache's unwritten tail, the
    // next packed sequence, a page's spare rows): P is 0 there, but 0 x NaN is NaN in O += P V. So
    // this warp zeroes its own V rows past nk_b (only a sequence's last stage has any) before it
    // reads them; K needs nothing, its scores there are masked to -inf.
    if (key0 + BC > nk_b) {
      for (int idx = lane; idx < BC * RING_CHUNKS; idx += 32) {
        const int r = idx / RING_CHUNKS, ch = idx % RING_CHUNKS;
        if (key0 + r >= nk_b) *reinterpret_cast<uint4*>(const_cast<T*>(kv_at(Vt, krow0 + r, ch))) = make_uint4(0u, 0u, 0u, 0u);
      }
      __syncwarp();
    }
#endif

    float s[MT][NTILES][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      unsigned qf[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(qf[mt], smem_addr(at(Qs, mt * 16 + lane % 16, ks * 2 + lane / 16)));
#pragma unroll
      for (int np = 0; np < NTILES / 2; ++np) {
        unsigned bf[4];
        ldmatrix_x4(bf, smem_addr(kv_at(Kt, krow0 + np * 16 + lane % 8 + (lane / 16) * 8, ks * 2 + (lane / 8) % 2)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<IN_DTYPE>(s[mt][2 * np], qf[mt], bf[0], bf[1]);
          mma16816<IN_DTYPE>(s[mt][2 * np + 1], qf[mt], bf[2], bf[3]);
        }
      }
    }
    // mask: past the sequence's end, and (causal) past each row's diagonal
    const int c0 = key0 + 2 * (lane % 4);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (c0 + nt * 8 + (e & 1) > lim[mt][e / 2]) s[mt][nt][e] = FT_NEG_INF;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) softmax_step(s[mt], o_acc[mt], m[mt], l[mt], c);
#pragma unroll
    for (int ps = 0; ps < PSTEPS; ++ps) {
      unsigned pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) p_fragment<IN_DTYPE>(pa[mt], s[mt], ps);
#pragma unroll
      for (int dp = 0; dp < DTILES / 2; ++dp) {
        unsigned bf[4];
        ldmatrix_x4_trans(bf, smem_addr(kv_at(Vt, krow0 + ps * 16 + lane % 8 + ((lane / 8) % 2) * 8, dp * 2 + lane / 16)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<IN_DTYPE>(o_acc[mt][2 * dp], pa[mt], bf[0], bf[1]);
          mma16816<IN_DTYPE>(o_acc[mt][2 * dp + 1], pa[mt], bf[2], bf[3]);
        }
      }
    }
  }
#undef SLOT
  cp_async_wait<0>();
  __syncthreads();   // every warp is done with the K/V ring: it becomes the merge buffer

  // ---- merge the warps: per row, M = max of the warps' maxima, each warp's O scaled to M ----
  float* red_m = reinterpret_cast<float*>(Ks);          // [WARPS][ROWS]
  float* red_l = red_m + WARPS * ROWS;                  // [WARPS][ROWS]
  float* red_o = red_l + WARPS * ROWS;                  // [WARPS][ROWS][HEAD_DIM]
  float* split_o = red_o + WARPS * ROWS * HEAD_DIM;     // MERGE_CLUSTER: this split's O / l, [ROWS][HEAD_DIM]
  __shared__ float split_lse[MERGE_CLUSTER > 1 ? ROWS : 1];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lsum = group_sum<4>(l[mt][hh]);
      if (lane % 4 == 0) {
        const int r = mt * 16 + lane / 4 + hh * 8;
        red_m[warp * ROWS + r] = m[mt][hh];
        red_l[warp * ROWS + r] = lsum;
      }
    }
  __syncthreads();
  if (tid < ROWS) {   // the row's merged max and sum, in base-2 units of the scaled scores
    float mx = FT_NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, red_m[w * ROWS + tid]);
    const float mu = mx == FT_NEG_INF ? 0.f : mx * c;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += red_l[w * ROWS + tid] * fast_exp2(red_m[w * ROWS + tid] * c - mu);
    row_m[tid] = mu;
    row_l[tid] = sum;
  }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = mt * 16 + lane / 4 + hh * 8;
      const float f = fast_exp2(m[mt][hh] * c - row_m[r]);   // 0 for a warp that saw nothing of the row
#pragma unroll
      for (int dt = 0; dt < DTILES; ++dt)
        *reinterpret_cast<float2*>(red_o + (warp * ROWS + r) * HEAD_DIM + dt * 8 + 2 * (lane % 4)) =
            make_float2(o_acc[mt][dt][2 * hh] * f, o_acc[mt][dt][2 * hh + 1] * f);
    }
  __syncthreads();

  // ---- this split's rows: O / l and the LSE, final where there is one split ----
  const long long bhq0 = static_cast<long long>(b) * heads * nq;   // (b, 0, 0) in the (B, H, Nq) rows
  const long long all_rows = static_cast<long long>(gridDim.x / row_blocks / hkv) * heads * nq;
  // where a row's O and LSE go: (B, H, Nq), or (VARLEN) its packed row and the (H, total_q) LSE;
  // the splits' workspace keeps the (B, H, Nq) rows of the longest sequence either way
#if VARLEN
#define FT_O_ROW(h, qi) (o + seq.q0 * o_sn + (h) * o_sh + (qi) * o_sn)
#define FT_LSE_ROW(h, qi, grow) lse[static_cast<long long>(h) * total_q + seq.q0 + (qi)]
#else
#define FT_O_ROW(h, qi) (o + b * o_sb + (h) * o_sh + (qi) * o_sn)
#define FT_LSE_ROW(h, qi, grow) lse[grow]
#endif
  for (int idx = tid; idx < ROWS * (D_VALID / 4); idx += NT) {
    const int r = idx / (D_VALID / 4), c4 = idx % (D_VALID / 4) * 4, pr = r0 + r;
    if (pr >= packed) continue;
    const int qi = pr / kv_group, h = hk * kv_group + pr % kv_group;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(red_o + (w * ROWS + r) * HEAD_DIM + c4);
      acc[0] += x.x; acc[1] += x.y; acc[2] += x.z; acc[3] += x.w;
    }
    const float inv = inv_row_sum(row_l[r]);
    const float lse_row = row_l[r] > 0.f ? (row_m[r] + __log2f(row_l[r])) * FT_LN2 : FT_NEG_INF;
    const long long grow = bhq0 + static_cast<long long>(h) * nq + qi;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] *= inv;
    if (splits == 1) {
      store_n<IN_DTYPE, 4>(FT_O_ROW(h, qi) + c4, acc);
      if (c4 == 0) FT_LSE_ROW(h, qi, grow) = lse_row;
    } else if constexpr (MERGE_CLUSTER > 1) {
      *reinterpret_cast<float4*>(split_o + r * HEAD_DIM + c4) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      if (c4 == 0) split_lse[r] = lse_row;
    } else {
      *reinterpret_cast<float4*>(part_o + (split * all_rows + grow) * D_VALID + c4) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      if (c4 == 0) part_lse[split * all_rows + grow] = lse_row;
    }
  }
  if (splits == 1) return;

#if MERGE_CLUSTER > 1
  // ---- rank 0 of the cluster (the splits, along z) merges their rows from their shared memory ----
  cluster_sync();   // every split's rows are in its shared memory (a release / acquire at cluster scope)
  if (cluster_rank() == 0) {
    __shared__ float weight[MERGE_CLUSTER][ROWS];   // split s's share of row r: exp(its LSE - the merged)
    for (int r = tid; r < ROWS; r += NT) {
      const int pr = r0 + r;
      if (pr >= packed) continue;
      float ls[MERGE_CLUSTER], mx = FT_NEG_INF;
#pragma unroll
      for (int s = 0; s < MERGE_CLUSTER; ++s) {
        ls[s] = ld_cluster(cluster_map(&split_lse[r], s));
        mx = fmaxf(mx, ls[s]);
      }
      float sum = 0.f;
#pragma unroll
      for (int s = 0; s < MERGE_CLUSTER; ++s)
        if (ls[s] != FT_NEG_INF) sum += fast_exp2((ls[s] - mx) * (1.f / FT_LN2));
      const float merged = mx == FT_NEG_INF ? FT_NEG_INF : mx + __logf(sum);
#pragma unroll
      for (int s = 0; s < MERGE_CLUSTER; ++s)   // 0 for a split that saw no key of the row
        weight[s][r] = ls[s] == FT_NEG_INF ? 0.f : fast_exp2((ls[s] - merged) * (1.f / FT_LN2));
      const int h = hk * kv_group + pr % kv_group, qi = pr / kv_group;
      FT_LSE_ROW(h, qi, bhq0 + static_cast<long long>(h) * nq + qi) = merged;
    }
    __syncthreads();
    for (int idx = tid; idx < ROWS * (D_VALID / 4); idx += NT) {
      const int r = idx / (D_VALID / 4), c4 = idx % (D_VALID / 4) * 4, pr = r0 + r;
      if (pr >= packed) continue;
      float4 x[MERGE_CLUSTER];
#pragma unroll
      for (int s = 0; s < MERGE_CLUSTER; ++s) x[s] = ld_cluster4(cluster_map(split_o + r * HEAD_DIM + c4, s));
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < MERGE_CLUSTER; ++s) {
        const float w = weight[s][r];
        if (w == 0.f) continue;   // (its O is 0 / 0 there)
        acc[0] += w * x[s].x; acc[1] += w * x[s].y; acc[2] += w * x[s].z; acc[3] += w * x[s].w;
      }
      store_n<IN_DTYPE, 4>(FT_O_ROW(pr % kv_group + hk * kv_group, pr / kv_group) + c4, acc);
    }
  }
  cluster_sync();   // rank 0 has read every split's rows: no CTA's shared memory goes before that
  return;
#endif

  // ---- the last split of this (sequence, K/V head, row block) to arrive merges all of them ----
  __threadfence();   // this split's partials are visible device-wide before it counts itself in
  __syncthreads();
  int* arrival = arrivals + blockIdx.x;
  if (tid == 0) {
    const int before = atomicAdd(arrival, 1);
    last_flag = before == splits - 1;
    if (last_flag) *arrival = 0;   // ready for the next launch on this stream: no memset
  }
  __syncthreads();
  if (!last_flag) return;
  __threadfence();
  // per row: the merged LSE over the splits (a warp per row, lanes over splits)
  for (int r = warp; r < ROWS; r += WARPS) {
    const int pr = r0 + r;
    if (pr >= packed) break;
    const long long grow = bhq0 + static_cast<long long>(hk * kv_group + pr % kv_group) * nq + pr / kv_group;
    float mx = FT_NEG_INF;
    for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, __ldcg(part_lse + s * all_rows + grow));
    mx = group_max<32>(mx);
    float sum = 0.f;
    if (mx != FT_NEG_INF)
      for (int s = lane; s < splits; s += 32) sum += fast_exp2((__ldcg(part_lse + s * all_rows + grow) - mx) * (1.f / FT_LN2));
    sum = group_sum<32>(sum);
    if (lane == 0) {
      const float merged = mx == FT_NEG_INF ? FT_NEG_INF : mx + __logf(sum);
      row_m[r] = merged;
      FT_LSE_ROW(hk * kv_group + pr % kv_group, pr / kv_group, grow) = merged;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < ROWS * (D_VALID / 4); idx += NT) {
    const int r = idx / (D_VALID / 4), c4 = idx % (D_VALID / 4) * 4, pr = r0 + r;
    if (pr >= packed) continue;
    const int qi = pr / kv_group, h = hk * kv_group + pr % kv_group;
    const long long grow = bhq0 + static_cast<long long>(h) * nq + qi;
    const float merged = row_m[r];
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // MERGE_BATCH splits' LSEs and O rows are loaded before any is used: the loads are L2 round
    // trips, and one at a time (the LSE, then the O it gated) they made this CTA's tail 2 x splits
    // round trips long, the longest part of a small batch's call (B1 x 1k keys: 13 us, 8 splits)
    constexpr int MERGE_BATCH = 8;
    if (merged != FT_NEG_INF) {
      for (int s0 = 0; s0 < splits; s0 += MERGE_BATCH) {
        float ls[MERGE_BATCH];
        float4 x[MERGE_BATCH];
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j) {
          const int s = s0 + j < splits ? s0 + j : splits - 1;   // past the last: its row again, unused
          ls[j] = __ldcg(part_lse + s * all_rows + grow);
          x[j] = __ldcg(reinterpret_cast<const float4*>(part_o + (s * all_rows + grow) * D_VALID + c4));
        }
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j) {
          if (s0 + j >= splits || ls[j] == FT_NEG_INF) continue;   // a split that saw no key
          const float w = fast_exp2((ls[j] - merged) * (1.f / FT_LN2));
          acc[0] += w * x[j].x; acc[1] += w * x[j].y; acc[2] += w * x[j].z; acc[3] += w * x[j].w;
        }
      }
    }
    store_n<IN_DTYPE, 4>(FT_O_ROW(h, qi) + c4, acc);
  }
}
