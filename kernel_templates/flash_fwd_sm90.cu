// flash_fwd_sm90: FlashAttention forward for Hopper (sm_90a): TMA, wgmma, warp specialization.
//
// Warpgroup 0 is the producer: one thread issues bulk tensor copies (TMA) of Q and of each K/V
// tile into a STAGES-deep ring of 128-byte-swizzled shared memory, completing on mbarriers; it
// then gives most of its registers back (setmaxnreg). Warpgroups 1..CWG are consumers, 64 query
// rows each: S = Q K^T by wgmma with both operands in shared memory, the online softmax on the
// accumulators (softmax.cuh, shared with flash_fwd_mma), then O += P V by wgmma with P from
// registers and V read N-major from the same swizzled tile. K and V have separate rings: a
// consumer frees a K stage once S is computed and a V stage once P V is, by arriving on its
// `empty` barrier, so the next K streams in while the current P V still reads V.
//
// PINGPONG: the consumers take turns issuing their products, one's softmax under the others'.
// PERSISTENT: one CTA per SM runs work tiles from the dynamic scheduler (tile_scheduler.cuh); the
// producer publishes each tile to the consumers and loads its first K, then its Q (released once
// the last S of the previous tile has landed) under the previous tile's last products and epilogue.
// CHAIN (persistent, two consumers, overlap): Q is double-buffered and a consumer issues the next
// work tile's first S together with this tile's last P V, in the same ping-pong turn, so the tensor
// cores run that S while the consumer writes this tile's O; its softmax follows the epilogue.
// TMA_STORE: each consumer warp stages its 16 rows of O in shared memory and one lane stores them
// by TMA (sm90_epilogue.cuh), so the warp starts its next work tile without waiting on the stores;
// otherwise O goes from registers in 16-byte stores (store_slab).
//
// Head dims are handled in panels of 128 bytes (one swizzle atom wide: 64 columns of fp16/bf16, 128
// of e4m3): Q, K and V tiles are PANELS boxes of [rows x PANEL_COLS] each, so one TMA box and one
// wgmma descriptor step per panel. e4m3 at d=64 has 64-byte rows, in the 64-byte swizzle.
//
// e4m3 (IN_DTYPE == FT_E4M3): the products are k32 QGMMA, O is bf16. fp8 wgmma takes only
// K-major operands, so warps 1-3 of the producer warpgroup transpose each V tile into a V^T ring
// (sm90_fp8.cuh), following the work tiles through the same ring as the consumers, with the keys
// permuted so that P packs straight from S's registers; V's stage is freed once transposed, V^T's
// once P V has read it.
//
// VARLEN (common.cuh): packed sequences of their own lengths, read through maps of the packed
// tensors at each sequence's first row; rows a tile reads past its sequence are the next one's,
// masked like the keys past N (K) or computed and never stored (Q). Grid schedule (one CTA per
// query block of each sequence, varlen_block), ordinary O stores.
//
// Set by the family spec: BC HEAD_DIM STAGES CWG PRODUCER_REGS CONSUMER_REGS OVERLAP PINGPONG
// PERSISTENT TMA_STORE CHAIN IN_DTYPE IS_CAUSAL MASK_BR (causal: 0 top-left, 1 bottom-right), VARLEN;
// the wgmma wrappers Wgmma<N>::ss / ::rs for N in {BC, HEAD_DIM} are generated ahead of this file.
#include "sm90.cuh"
#include "sm90_epilogue.cuh"
#include "sm90_fp8.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
// <wgmma wrappers>

constexpr bool FP8 = IN_DTYPE == FT_E4M3;
using T = typename Elem<IN_DTYPE>::type;
constexpr int OUT_DTYPE = FP8 ? FT_BF16 : IN_DTYPE;   // e4m3 inputs give a bf16 O
using TO = typename Elem<OUT_DTYPE>::type;
constexpr int BR = 64 * CWG;                 // query rows per block
constexpr int NT = 128 * (CWG + 1);          // threads: producer warpgroup + consumers
constexpr int ROW_BYTES = HEAD_DIM * sizeof(T) < 128 ? HEAD_DIM * sizeof(T) : 128;   // swizzle width
constexpr int PANEL_COLS = ROW_BYTES / sizeof(T);   // columns per panel (one swizzled row)
constexpr int PANELS = HEAD_DIM / PANEL_COLS;
constexpr int PANEL_KSTEPS = ROW_BYTES / 32;        // k steps per panel
constexpr int NTILES = BC / 8;               // n8 column groups of S
constexpr int DTILES = HEAD_DIM / 8;         // n8 column groups of O
constexpr int KSTEP = 32 / sizeof(T);        // k of one wgmma: 32 bytes of a row
constexpr int KSTEPS = HEAD_DIM / KSTEP;     // k steps of Q K^T
constexpr int PSTEPS = BC / KSTEP;           // k steps of P V
constexpr unsigned Q_BYTES = BR * HEAD_DIM * sizeof(T);
constexpr int QBUF = CHAIN ? 2 : 1;          // Q buffers: CHAIN loads the next tile's Q under this one
constexpr unsigned KV_BYTES = BC * HEAD_DIM * sizeof(T);
constexpr int TRANSPOSERS = 96;              // e4m3: producer warps 1-3 transpose V
constexpr bool WARP_PRODUCER = PERSISTENT && PRODUCER_REGS == 32;   // see the producer
// A consumer runs only the K/V tiles its own 64 rows need: causal ones stop at its own diagonal
// (192 x 128: 72 of 80 consumer-tiles at N=1024), and rows wholly outside [0, N) need none (a
// ragged block of 192 rows, a causal block that starts before row 0). Not with CHAIN, whose next
// S goes out with the last P V whatever the rows.
constexpr bool OWN_TILES = !CHAIN && CWG >= 2 && (IS_CAUSAL || CWG == 3);
// Causal blocks aligned to the end (tile_scheduler.cuh), but not where O goes out by TMA, whose
// store box cannot start before row 0 (sm90_epilogue.cuh)
constexpr bool FROM_END = IS_CAUSAL && !TMA_STORE;
constexpr unsigned O_STAGE_BYTES = BR * HEAD_DIM * sizeof(TO);   // TMA_STORE: a 16-row slab per consumer warp

static_assert(HEAD_DIM % PANEL_COLS == 0 && ROW_BYTES % 64 == 0, "head dim in whole 64- or 128-byte panels");
static_assert(FP8 || ROW_BYTES == 128, "fp16/bf16: 128-byte panels");
static_assert(BC % 16 == 0 && BC <= 256, "wgmma n: a multiple of 16 up to 256");
static_assert(IN_DTYPE == FT_F16 || IN_DTYPE == FT_BF16 || IN_DTYPE == FT_E4M3, "fp16, bf16 or e4m3 inputs");
static_assert(!FP8 || BC % 128 == 0, "e4m3: V^T in whole 128-key panels");
static_assert(!TMA_STORE || (QBUF * Q_BYTES + (FP8 ? 3 : 2) * STAGES * KV_BYTES) % 1024 == 0, "O slabs on the swizzle's 1024 B");
static_assert(!CHAIN || (PERSISTENT && OVERLAP && CWG == 2), "chaining work tiles: persistent, overlapped, two consumers");
static_assert(!VARLEN || (!PERSISTENT && !TMA_STORE && !FP8), "varlen: a grid of work tiles, O by ordinary stores, 16-bit inputs");
static_assert(!PINGPONG || CWG >= 2, "ping-pong takes turns between two or three consumers");

struct Barriers {
  unsigned long long q_full[QBUF], q_empty[QBUF];
  unsigned long long k_full[STAGES], v_full[STAGES], k_empty[STAGES], v_empty[STAGES];
  TileRing ring;   // PERSISTENT: the producer's fetched tiles, handed to the consumers
  unsigned long long vt_full[STAGES], vt_empty[STAGES];   // e4m3: V^T transposed / read by P V
};

// The tensor maps of Q, K, V and O (read only with TMA_STORE) come by value (kernel_templates/sm90_tma.py).
extern "C" __global__ void __launch_bounds__(NT, 1)
    flash_fwd_sm90(FT_ATTENTION_PARAMS(T), const __grid_constant__ TmaMap tmap_q, const __grid_constant__ TmaMap tmap_k,
                   const __grid_constant__ TmaMap tmap_v, const __grid_constant__ TmaMap tmap_o, int batch,
                   int* __restrict__ tile_counter FT_VARLEN_PARAMS) {
  extern __shared__ unsigned char smem_raw[];
  // swizzle atoms repeat every 1024 bytes: the descriptors assume tiles start on that boundary
  unsigned char* base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* Qs = reinterpret_cast<T*>(base);
  T* Ks = Qs + QBUF * BR * HEAD_DIM;
  T* Vs = Ks + STAGES * BC * HEAD_DIM;
  T* Vts = Vs + STAGES * BC * HEAD_DIM;   // e4m3 only: V^T, [HEAD_DIM x BC] per stage
  unsigned char* Os = reinterpret_cast<unsigned char*>(FP8 ? Vts + STAGES * BC * HEAD_DIM : Vts);   // TMA_STORE: O slabs
  Barriers& bar = *reinterpret_cast<Barriers*>(Os + (TMA_STORE ? O_STAGE_BYTES : 0));

  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;
  const int n_qblk = (nq + BR - 1) / BR, n_bh = batch * heads;
  // the batch's lengths, or (VARLEN: one work tile per CTA, blockIdx (x, y) = (block of all the
  // sequences' query blocks, head)) this CTA's sequence's
#if VARLEN
  const int2 blk = varlen_block<BR>(cu_q, nseq, blockIdx.x);
  if (blk.x < 0) return;
#else
  const int2 blk = make_int2(0, 0);
#endif
  const Sequence seq = FT_SEQUENCE(blk.x);

  // PERSISTENT: one CTA per SM takes work tiles from the dynamic scheduler (tile_scheduler.cuh)
  // until it runs out; otherwise the grid has one CTA per work tile and this loop runs once.
  const int total = PERSISTENT ? n_qblk * n_bh : 1;
  auto work = [&](int tile) {
    WorkTile w = work_tile<BR, BC, IS_CAUSAL, FROM_END, IS_CAUSAL && MASK_BR>(
        VARLEN ? blk.y : (PERSISTENT ? tile % n_qblk : blockIdx.x),
        VARLEN ? blk.x * heads + blockIdx.y : (PERSISTENT ? tile / n_qblk : blockIdx.y), heads, kv_group, seq.nq, seq.nk);
    if constexpr (VARLEN) w.ntiles = max(1, w.ntiles);   // a sequence with no keys: one masked tile (O 0, LSE -inf)
    return w;
  };

  if (tid == 0) {
    for (int s = 0; s < QBUF; ++s) {
      mbar_init(&bar.q_full[s], 1);
      mbar_init(&bar.q_empty[s], CWG * 128);
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(&bar.ring.full[s], 1);
      mbar_init(&bar.ring.empty[s], CWG * 128 + (FP8 ? TRANSPOSERS : 0));
    }
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&bar.k_full[s], 1);
      mbar_init(&bar.v_full[s], 1);
      mbar_init(&bar.k_empty[s], CWG * 128);
      mbar_init(&bar.v_empty[s], FP8 ? TRANSPOSERS : CWG * 128);
      if constexpr (FP8) {
        mbar_init(&bar.vt_full[s], TRANSPOSERS);
        mbar_init(&bar.vt_empty[s], CWG * 128);
      }
    }
    mbar_fence_init();
  }
  __syncthreads();

  // K/V ring slots and phases follow a running count of K/V tiles over all of the CTA's work
  // tiles (g), Q's buffer the count of work tiles (it).
  if (wg == 0) {
    // ---- producer ----
    if constexpr (PRODUCER_REGS > 0) regs_shrink<PRODUCER_REGS>();
    if (WARP_PRODUCER ? tid < 32 : tid == 0) {
      // WARP_PRODUCER: the whole warp runs the loop, so its values are warp-uniform and ptxas keeps
      // them in uniform registers (the persistent loop then fits split=32; one thread needs 40);
      // lane 0 issues. Otherwise one thread does it all.
      const bool leader = !WARP_PRODUCER || tid == 0;
      const TmaMap *tq = &tmap_q, *tk = &tmap_k, *tv = &tmap_v;
      if (leader) {
        tmap_prefetch(tmap_q);
        tmap_prefetch(tmap_k);
        tmap_prefetch(tmap_v);
      }
      int g0 = 0;
      for (int it = 0;; ++it) {
        int tile = it;
        if constexpr (PERSISTENT) {
          const int s = it & 1;
          if (it >= 2) mbar_wait(&bar.ring.empty[s], ((it >> 1) - 1) & 1);
          if (leader) {
            tile = next_tile_dynamic(tile_counter, it, total);
            bar.ring.tile[s] = tile;
            mbar_arrive(&bar.ring.full[s]);
          }
          if constexpr (WARP_PRODUCER) tile = __shfl_sync(0xffffffffu, tile, 0);
        }
        if (tile >= total) break;
        const WorkTile w = work(tile);
        // K and V have their own rings and their own releases (K is free once S is computed, V
        // only after P V), and V runs one tile behind K, the order the consumers use them in.
        auto load = [&](T* ring, const TmaMap* tmap, unsigned long long* full, unsigned long long* empty, int t) {
          const int g = g0 + t, s = g % STAGES;
          if (g >= STAGES) mbar_wait(&empty[s], ((g / STAGES) - 1) & 1);
          if (!leader) return;
          mbar_expect_tx(&full[s], KV_BYTES);
#pragma unroll
          for (int p = 0; p < PANELS; ++p)
            tma_load_4d(ring + s * BC * HEAD_DIM + p * BC * PANEL_COLS, tmap, &full[s], p * PANEL_COLS, seq.k0 + t * BC, w.hk,
                        VARLEN ? 0 : w.b);
        };
        // The first K goes ahead of Q: it only needs a free ring slot, while Q waits for the last
        // work tile's final S.
        load(Ks, tk, bar.k_full, bar.k_empty, 0);
        const int qs = it % QBUF;
        if (it >= QBUF) mbar_wait(&bar.q_empty[qs], ((it / QBUF) - 1) & 1);
        if (leader) {
          mbar_expect_tx(&bar.q_full[qs], Q_BYTES);
#pragma unroll
          for (int p = 0; p < PANELS; ++p)
            tma_load_4d(Qs + qs * BR * HEAD_DIM + p * BR * PANEL_COLS, tq, &bar.q_full[qs], p * PANEL_COLS, seq.q0 + w.q0, w.h,
                        VARLEN ? 0 : w.b);
        }
        for (int t = 1; t < w.ntiles; ++t) {
          load(Ks, tk, bar.k_full, bar.k_empty, t);
          load(Vs, tv, bar.v_full, bar.v_empty, t - 1);
        }
        load(Vs, tv, bar.v_full, bar.v_empty, w.ntiles - 1);
        g0 += w.ntiles;
      }
    } else if (FP8 && tid >= 128 - TRANSPOSERS) {
      // e4m3: each landed V tile -> V^T, once P V has freed V^T's stage; the work tiles come as
      // the consumers get them (from the producer's ring when PERSISTENT)
      int g = 0;
      // The ring read below is the consumers' too, written twice on purpose: as one shared
      // function or lambda, ptxas spills 8-16 B in 176 x 128 persistent at d=128 (fp16/bf16).
      for (int it = 0;; ++it) {
        int tile = it == 0 ? 0 : total;
        if constexpr (PERSISTENT) {
          const int s = it & 1;
          mbar_wait(&bar.ring.full[s], (it >> 1) & 1);
          tile = bar.ring.tile[s];
          mbar_arrive(&bar.ring.empty[s]);
        }
        if (tile >= total) break;
        for (const int end = g + work(tile).ntiles; g < end; ++g) {
          const int s = g % STAGES;
          mbar_wait(&bar.v_full[s], (g / STAGES) & 1);
          if (g >= STAGES) mbar_wait(&bar.vt_empty[s], ((g / STAGES) - 1) & 1);
          transpose_v_e4m3<BC, HEAD_DIM, ROW_BYTES>(reinterpret_cast<unsigned char*>(Vts + s * BC * HEAD_DIM),
                                         reinterpret_cast<const unsigned char*>(Vs + s * BC * HEAD_DIM),
                                         tid / 32 - (4 - TRANSPOSERS / 32), TRANSPOSERS / 32);
          fence_proxy_async_smem();
          mbar_arrive(&bar.vt_full[s]);
          mbar_arrive(&bar.v_empty[s]);
        }
      }
    }
  } else {
    // ---- consumers ----
    if constexpr (CONSUMER_REGS > 0) regs_grow<CONSUMER_REGS>();
    const int cw = wg - 1;
    const int wrow0 = cw * 64 + ((tid / 32) % 4) * 16;   // this warp's first row in the block
    // wgmma descriptors of this consumer's Q and of each ring's stage 0; a k step, panel or stage
    // is a desc_advance from these
    const auto desc_q = wgmma_desc<ROW_BYTES>(smem_u32(Qs) + cw * 64 * ROW_BYTES, 16, 8 * ROW_BYTES);
    const auto desc_k = wgmma_desc<ROW_BYTES>(smem_u32(Ks), 16, 8 * ROW_BYTES);
    const auto desc_v = FP8 ? wgmma_desc(smem_u32(Vts), 16, 1024) : wgmma_desc(smem_u32(Vs), BC * 128, 1024);
    const unsigned o_slab = smem_u32(Os) + (wrow0 / 16) * 16 * HEAD_DIM * sizeof(TO);
    if (TMA_STORE && lane == 0) tmap_prefetch(tmap_o);   // this warp's slabs go out through O's map

    // Ping-pong (PINGPONG): the consumer warpgroups take turns issuing their products, in the order
    // 0, 1, .., CWG-1, so each one's softmax runs under the others' matrix work. Named barrier
    // 1 + c is consumer c's turn, opened by the consumer before it (256 threads: the two of them).
    auto turn_begin = [&] { if constexpr (PINGPONG) named_sync(1 + cw, 256); };
    auto turn_end = [&] { if constexpr (PINGPONG) named_arrive(1 + (cw + 1) % CWG, 256); };
    if constexpr (PINGPONG) { if (cw == CWG - 1) named_arrive(1, 256); }   // consumer 0 goes first

    float o_acc[DTILES][4], m[2], l[2];
    float sacc[NTILES][4], alpha[2];
    unsigned pa[PSTEPS][4];
    // P V's operand B and its barriers: V itself (N-major), or for e4m3 the transposed V^T
    unsigned long long* pv_full = FP8 ? bar.vt_full : bar.v_full;
    unsigned long long* pv_empty = FP8 ? bar.vt_empty : bar.v_empty;
    // The CTA's work tiles in turn: `it` counts them, `tile` is the current one (>= total: none
    // left), `qs` its Q buffer; K/V ring slots and phases follow a running count of K/V tiles (g0
    // at this tile's first).
    auto fetch = [&](int it) {
      int tile = it;
      if constexpr (PERSISTENT) {
        const int s = it & 1;
        mbar_wait(&bar.ring.full[s], (it >> 1) & 1);
        tile = bar.ring.tile[s];
        mbar_arrive(&bar.ring.empty[s]);
      }
      return tile;
    };
    int g0 = 0, qs = 0, tile = fetch(0);
    WorkTile w = work(tile);
    int own = w.ntiles;   // of them this consumer's (OWN_TILES, below)
    auto reset = [&] {
#pragma unroll
      for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[dt][e] = 0.f;
      m[0] = m[1] = FT_NEG_INF;
      l[0] = l[1] = 0.f;
    };

    // K/V ring slot and phase of K/V tile t of this work tile (t = ntiles: the next one's first)
    auto slot = [&](int t) { return (g0 + t) % STAGES; };
    auto parity = [&](int t) { return static_cast<unsigned>(((g0 + t) / STAGES) & 1); };
    auto q_desc = [&](int buf) { return desc_advance(desc_q, buf * Q_BYTES); };
    // ---- S = Q K^T: A and B K-major; a k step is 32 bytes into the swizzled row ----
    auto issue_s = [&](int t, unsigned long long dq) {
      const auto dk = desc_advance(desc_k, slot(t) * KV_BYTES);
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const unsigned koff = (ks % PANEL_KSTEPS) * 32, panel = ks / PANEL_KSTEPS;
        Wgmma<BC>::ss(sacc, desc_advance(dq, panel * BR * ROW_BYTES + koff), desc_advance(dk, panel * BC * ROW_BYTES + koff),
                      ks > 0);   // the first step overwrites
      }
      wgmma_commit();
    };
    // ---- O += P V: V N-major (its rows are the k dim), panels of 64 columns LBO apart; or
    // e4m3's V^T K-major like K, panels of 128 keys HEAD_DIM * 128 bytes apart ----
    auto issue_pv = [&](int t) {
      const auto dv = desc_advance(desc_v, slot(t) * KV_BYTES);
#pragma unroll
      for (int ps = 0; ps < PSTEPS; ++ps)
        Wgmma<HEAD_DIM>::rs(o_acc, pa[ps], desc_advance(dv, FP8 ? (ps / 4) * HEAD_DIM * 128 + (ps % 4) * 32 : ps * 16 * 128), 1);
      wgmma_commit();
    };
    auto mask = [&](int t) {
      const int k0 = t * BC;
      const int diag0 = w.q0 + wrow0 + (MASK_BR ? seq.nk - seq.nq : 0);   // the warp's first row's last key (params: no register held)
      if (k0 + BC > seq.nk || (IS_CAUSAL && k0 + BC - 1 > diag0)) mask_slab<NTILES, IS_CAUSAL>(sacc, lane, diag0, k0, seq.nk);
    };
    // S of tile t has landed: its K stage may be refilled and, after the last S, Q too, so the
    // next work tile's Q streams in under this one's last softmax, P V and epilogue.
    auto release_k = [&](int t) {
      mbar_arrive(&bar.k_empty[slot(t)]);
      if (t == own - 1) mbar_arrive(&bar.q_empty[qs]);
    };
    auto make_p = [&] {
#pragma unroll
      for (int ps = 0; ps < PSTEPS; ++ps) {
        if constexpr (FP8) p_fragment_e4m3(pa[ps], sacc, ps);
        else p_fragment<IN_DTYPE>(pa[ps], sacc, ps);
      }
    };
    // the first S of a work tile has landed: its softmax starts the tile's O
    auto first_softmax = [&] {
      wgmma_pin(sacc);
      release_k(0);
      mask(0);
      softmax_advance(sacc, m, l, alpha, scale_log2);
      make_p();
    };
    auto write_o = [&] {
#if VARLEN
      float* lse_bh = lse + static_cast<long long>(w.h) * total_q + seq.q0;
#else
      float* lse_bh = lse + static_cast<long long>(w.b * heads + w.h) * nq;
#endif
      if constexpr (TMA_STORE) {
        store_slab_tma<OUT_DTYPE, DTILES>(o_slab, &tmap_o, lse_bh, o_acc, m, l, lane, w.q0 + wrow0, nq, w.h, w.b, scale_log2);
      } else {
        store_slab<OUT_DTYPE>(reinterpret_cast<TO*>(o) + (VARLEN ? seq.q0 * o_sn : w.b * o_sb) + w.h * o_sh, o_sn, lse_bh,
                              o_acc, m, l, lane, w.q0 + wrow0, seq.nq, scale_log2);
      }
    };

    // OWN_TILES: how many of the work tile's K/V tiles this consumer's rows [r0, r1) need
    auto own_tiles = [&] {
      const int r0 = w.q0 + cw * 64, r1 = min(r0 + 64, seq.nq);
      if (!OWN_TILES) return w.ntiles;
      if (r1 <= 0 || r0 >= seq.nq) return 0;
      if constexpr (IS_CAUSAL && MASK_BR) return max(1, min(w.ntiles, (r1 - 1 + seq.nk - seq.nq) / BC + 1));   // no key seen: one masked tile
      return IS_CAUSAL ? min(w.ntiles, (r1 - 1) / BC + 1) : w.ntiles;
    };
    // OWN_TILES: tiles [from, ntiles) are not this consumer's. It computes nothing for them, but
    // before each of its ping-pong turns it waits on the same K/V tiles a consumer running them
    // would (so the others' barriers and turns meet as they do on the full path, and no new wait
    // can deadlock), and frees each one as soon as it has landed, since it never reads them.
    auto pass = [&](int from) {
      auto skip = [&](unsigned long long* full, unsigned long long* empty, int t) {
        mbar_wait(&full[slot(t)], parity(t));
        mbar_arrive(&empty[slot(t)]);
      };
      auto turn = [&] { turn_begin(); turn_end(); };
      if (from == 0) mbar_arrive(&bar.q_empty[qs]);   // Q unread: free it at once
      if constexpr (OVERLAP) {
        // a full consumer's turn t issues S of tile t and P V of tile t - 1 (t = ntiles: the last
        // P V alone); turns before `from`, and P V of from - 1, were this consumer's own
        for (int t = from; t <= w.ntiles; ++t) {
          if (t < w.ntiles) skip(bar.k_full, bar.k_empty, t);
          if (t > from) skip(pv_full, pv_empty, t - 1);
          if (t > from || from == 0) turn();
        }
      } else {
        for (int t = from; t < w.ntiles; ++t) {   // turns: S of tile t, then P V of tile t
          skip(bar.k_full, bar.k_empty, t);
          turn();
          skip(pv_full, pv_empty, t);
          turn();
        }
      }
    };

    // on to work tile it + 1 (`next`, already fetched), this one's K/V tiles done
    auto advance = [&](int it, int next) {
      g0 += w.ntiles;
      tile = next;
      w = work(tile);
      own = w.ntiles;
      qs = (it + 1) % QBUF;
    };

    for (int it = 0; tile < total; ++it) {
      const bool chained = CHAIN && it > 0;   // this tile's first S and softmax ran at the last one's end
      if (!chained) {
        reset();
        mbar_wait(&bar.q_full[qs], (it / QBUF) & 1);
      }
      own = own_tiles();
      if (OWN_TILES && own == 0) {
        pass(0);
        advance(it, fetch(it + 1));
        continue;
      }
      if constexpr (OVERLAP) {
        // Software-pipelined: S of tile t is issued together with P V of tile t-1, and the softmax
        // of tile t runs while P V is still in flight; O is rescaled only once that has landed.
        if (!chained) {
          mbar_wait(&bar.k_full[slot(0)], parity(0));
          turn_begin();
          wgmma_fence();
          issue_s(0, q_desc(qs));
          turn_end();
          wgmma_wait<0>();
          first_softmax();
        }
        for (int t = 1; t < own; ++t) {
          mbar_wait(&bar.k_full[slot(t)], parity(t));
          mbar_wait(&pv_full[slot(t - 1)], parity(t - 1));
          turn_begin();
          wgmma_pin(o_acc);
          wgmma_fence();
          issue_s(t, q_desc(qs));
          issue_pv(t - 1);
          turn_end();
          wgmma_wait<1>();   // S of tile t has landed; P V of tile t-1 may still run
          wgmma_pin(sacc);
          release_k(t);
          mask(t);
          softmax_advance(sacc, m, l, alpha, scale_log2);
          wgmma_wait<0>();
          wgmma_pin(o_acc);
          mbar_arrive(&pv_empty[slot(t - 1)]);
          rescale_rows(o_acc, alpha);
          make_p();
        }
        // CHAIN: the next work tile's first S goes with this one's last P V. After the CTA's last
        // tile it is issued all the same, on whatever the buffers hold, and dropped: a test between
        // the wgmma instructions would make ptxas serialize them (C7519).
        const int n = own, next = CHAIN ? fetch(it + 1) : total;
        if (CHAIN && next < total) {
          mbar_wait(&bar.q_full[(it + 1) % QBUF], ((it + 1) / QBUF) & 1);
          mbar_wait(&bar.k_full[slot(n)], parity(n));
        }
        mbar_wait(&pv_full[slot(n - 1)], parity(n - 1));
        turn_begin();
        wgmma_pin(o_acc);
        wgmma_fence();
        issue_pv(n - 1);
        if constexpr (CHAIN) issue_s(n, q_desc((it + 1) % QBUF));
        turn_end();
        wgmma_wait<CHAIN ? 1 : 0>();   // this tile's last P V has landed
        wgmma_pin(o_acc);
        mbar_arrive(&pv_empty[slot(n - 1)]);
        if constexpr (CHAIN) {
          write_o();
          wgmma_wait<0>();
          advance(it, next);
          if (tile >= total) break;
          reset();
          first_softmax();
          continue;
        }
      } else {
        for (int t = 0; t < own; ++t) {
          mbar_wait(&bar.k_full[slot(t)], parity(t));
          turn_begin();
          wgmma_fence();
          issue_s(t, q_desc(qs));
          turn_end();
          wgmma_wait<0>();
          wgmma_pin(sacc);
          release_k(t);
          mask(t);
          softmax_step(sacc, o_acc, m, l, scale_log2);
          make_p();
          mbar_wait(&pv_full[slot(t)], parity(t));
          turn_begin();
          wgmma_pin(o_acc);
          wgmma_fence();
          issue_pv(t);
          turn_end();
          wgmma_wait<0>();
          wgmma_pin(o_acc);
          mbar_arrive(&pv_empty[slot(t)]);
        }
      }
      if (OWN_TILES) pass(own);   // the tiles past this consumer's diagonal, before its epilogue
      write_o();
      advance(it, fetch(it + 1));
    }
    if constexpr (PINGPONG) { if (wg == 1) named_sync(1, 256); }   // the last consumer's final hand-over
    if (TMA_STORE && lane == 0) bulk_wait<0>();   // the slab stays until its last store is done
  }
}
