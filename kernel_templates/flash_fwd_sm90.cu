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
// Roles: the producer (`produce`), the e4m3 V transposer (`transpose_v`) and the consumers
// (`consume`), each a loop over the CTA's work tiles as a TileScheduler (tile_scheduler.cuh) hands
// them out, meeting only at the mbarrier rings of `Barriers` (sm90_pipeline.cuh), whose slots and
// phases each role follows with its own PipeState. The steps of a work tile (S = Q K^T, its mask
// and softmax, O += P V, the epilogue) are the functions before the roles. The kernel carves shared
// memory, initialises the barriers and dispatches by warpgroup.
//
// Kept for ptxas's sake (the resource record, tests/fixtures/sm90_seed_resources.json): every role
// takes the scheduler and the tiles' addresses by value, and a step takes the state it reads by
// reference (a work tile, the accumulators), as the closures it replaces did; see also PipeState.
//
// Set by the family spec: BC HEAD_DIM STAGES CWG PRODUCER_REGS CONSUMER_REGS OVERLAP PINGPONG
// PERSISTENT TMA_STORE CHAIN IN_DTYPE IS_CAUSAL MASK_BR (causal: 0 top-left, 1 bottom-right);
// the wgmma wrappers Wgmma<N>::ss / ::rs for N in {BC, HEAD_DIM} are generated ahead of this file.
#include "sm90.cuh"
#include "sm90_epilogue.cuh"
#include "sm90_fp8.cuh"
#include "sm90_pipeline.cuh"
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
static_assert(!PINGPONG || CWG >= 2, "ping-pong takes turns between two or three consumers");

using KvState = PipeState<STAGES>;   // the K/V rings (and V^T's): a count of K/V tiles over the CTA's work tiles
using QState = PipeState<QBUF>;      // Q's buffers: the count of work tiles
using Scheduler = TileScheduler<BR, BC, IS_CAUSAL, FROM_END, PERSISTENT, IS_CAUSAL && MASK_BR>;

struct Barriers {
  MbarRing<QBUF> q;
  MbarRing<STAGES> k, v;
  TileRing ring;        // PERSISTENT: the producer's fetched tiles, handed to the other roles
  MbarRing<STAGES> vt;  // e4m3: V^T transposed / read by P V
};

// The CTA's shared memory: Q's buffers and each ring's stage 0, then the barriers.
struct Smem {
  T *q, *k, *v, *vt;   // vt: e4m3 only, V^T [HEAD_DIM x BC] per stage
  unsigned char* o;    // TMA_STORE: the consumer warps' O slabs
  Barriers* bar;
};

FT_DEVICE Smem carve_smem(unsigned char* raw) {
  // swizzle atoms repeat every 1024 bytes: the descriptors assume tiles start on that boundary
  unsigned char* base = raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
  Smem sm;
  sm.q = reinterpret_cast<T*>(base);
  sm.k = sm.q + QBUF * BR * HEAD_DIM;
  sm.v = sm.k + STAGES * BC * HEAD_DIM;
  sm.vt = sm.v + STAGES * BC * HEAD_DIM;
  sm.o = reinterpret_cast<unsigned char*>(FP8 ? sm.vt + STAGES * BC * HEAD_DIM : sm.vt);
  sm.bar = reinterpret_cast<Barriers*>(sm.o + (TMA_STORE ? O_STAGE_BYTES : 0));
  return sm;
}

// ---- the steps of a work tile, for one consumer warpgroup (16 rows per warp) ----

// O and the online softmax's running max m and sum l of a warp's 16 rows (softmax.cuh)
struct Acc {
  float o[DTILES][4], m[2], l[2];
};
// S of the current K/V tile, turned into P in place; P packed as P V's A operand; and alpha, what
// O's rows are rescaled by for the softmax's new max
struct Scores {
  float s[NTILES][4], alpha[2];
  unsigned p[PSTEPS][4];
};

FT_DEVICE void reset_acc(Acc& acc) {
#pragma unroll
  for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc.o[dt][e] = 0.f;
  acc.m[0] = acc.m[1] = FT_NEG_INF;
  acc.l[0] = acc.l[1] = 0.f;
}
// S = Q K^T from descriptors of Q's buffer and of K's stage: A and B K-major; a k step is 32 bytes
// into the swizzled row
FT_DEVICE void issue_s(float (&s)[NTILES][4], unsigned long long dq, unsigned long long dk) {
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const unsigned koff = (ks % PANEL_KSTEPS) * 32, panel = ks / PANEL_KSTEPS;
    Wgmma<BC>::ss(s, desc_advance(dq, panel * BR * ROW_BYTES + koff), desc_advance(dk, panel * BC * ROW_BYTES + koff),
                  ks > 0);   // the first step overwrites
  }
  wgmma_commit();
}
// O += P V from a descriptor of V's stage: V N-major (its rows are the k dim), panels of 64 columns
// LBO apart; or e4m3's V^T K-major like K, panels of 128 keys HEAD_DIM * 128 bytes apart
FT_DEVICE void issue_pv(float (&o)[DTILES][4], unsigned (&p)[PSTEPS][4], unsigned long long dv) {
#pragma unroll
  for (int ps = 0; ps < PSTEPS; ++ps)
    Wgmma<HEAD_DIM>::rs(o, p[ps], desc_advance(dv, FP8 ? (ps / 4) * HEAD_DIM * 128 + (ps % 4) * 32 : ps * 16 * 128), 1);
  wgmma_commit();
}
// S of K/V tile t: -inf past nk and, causal, past each row's diagonal (only tiles that reach either
// are masked); the warp's rows are w.q0 + wrow0 + [0, 16), row r's diagonal key r + w.diag
FT_DEVICE void mask_s(float (&s)[NTILES][4], const WorkTile& w, int lane, int wrow0, int t, int nk) {
  const int k0 = t * BC, diag0 = w.q0 + wrow0 + w.diag;
  if (k0 + BC > nk || (IS_CAUSAL && k0 + BC - 1 > diag0)) mask_slab<NTILES, IS_CAUSAL>(s, lane, diag0, k0, nk);
}
FT_DEVICE void make_p(unsigned (&p)[PSTEPS][4], float (&s)[NTILES][4]) {
#pragma unroll
  for (int ps = 0; ps < PSTEPS; ++ps) {
    if constexpr (FP8) p_fragment_e4m3(p[ps], s, ps);
    else p_fragment<IN_DTYPE>(p[ps], s, ps);
  }
}
// Where O goes: the output tensor and its strides, the LSE, the problem's sizes for their offsets
struct Out {
  T* o;
  long long sb, sh, sn;
  float* lse;
  int heads, nq;
  float scale_log2;
  const TmaMap* tmap;   // TMA_STORE: O's tensor map
};
// The epilogue of work tile w for the warp's 16 rows: O / l and the LSE, by TMA from the warp's slab
// of shared memory (TMA_STORE) or in 16-byte stores from registers
FT_DEVICE void store_o(const Acc& acc, WorkTile w, const Out& out, int lane, int wrow0, unsigned o_slab) {
  // b and h pinned to registers where the epilogue starts: without it ptxas spills 32 B in the
  // three-consumer seeds (d=64 causal); with it, one consumer at d=256 needs 5 more registers
  if constexpr (CWG > 1) asm volatile("" : "+r"(w.b), "+r"(w.h));
  float* lse_bh = out.lse + static_cast<long long>(w.b * out.heads + w.h) * out.nq;
  if constexpr (TMA_STORE) {
    store_slab_tma<OUT_DTYPE, DTILES>(o_slab, out.tmap, lse_bh, acc.o, acc.m, acc.l, lane, w.q0 + wrow0, out.nq, w.h, w.b,
                                      out.scale_log2);
  } else {
    store_slab<OUT_DTYPE>(reinterpret_cast<TO*>(out.o) + w.b * out.sb + w.h * out.sh, out.sn, lse_bh, acc.o, acc.m, acc.l,
                          lane, w.q0 + wrow0, out.nq, out.scale_log2);
  }
}

// Ping-pong (PINGPONG): the consumer warpgroups take turns issuing their products, in the order
// 0, 1, .., CWG-1, so each one's softmax runs under the others' matrix work. Named barrier 1 + c is
// consumer c's turn, opened by the consumer before it (256 threads: the two of them).
FT_DEVICE void turn_begin(int cw) { if constexpr (PINGPONG) named_sync(1 + cw, 256); }
FT_DEVICE void turn_end(int cw) { if constexpr (PINGPONG) named_arrive(1 + (cw + 1) % CWG, 256); }

// S of K/V tile t (of `own`, the first at kv) has landed: its K stage may be refilled and, after
// the last S, Q's buffer qs too, so the next work tile's Q streams in under this one's last softmax,
// P V and epilogue.
FT_DEVICE void release_k(Barriers& bar, const KvState& kv, int t, int own, int qs) {
  bar.k.release(kv + t);
  if (t == own - 1) bar.q.release(QState(qs));
}

// OWN_TILES: how many of work tile w's K/V tiles consumer cw's rows [r0, r1) need
FT_DEVICE int own_tiles(const WorkTile& w, int cw, int nq) {
  const int r0 = w.q0 + cw * 64, r1 = min(r0 + 64, nq);
  if (!OWN_TILES) return w.ntiles;
  if (r1 <= 0 || r0 >= nq) return 0;
  if constexpr (IS_CAUSAL && MASK_BR) return max(1, min(w.ntiles, (r1 - 1 + w.diag) / BC + 1));   // rows seeing no key: one masked tile
  return IS_CAUSAL ? min(w.ntiles, (r1 - 1) / BC + 1) : w.ntiles;
}
// OWN_TILES: tiles [from, ntiles) of work tile w are not consumer cw's. It computes nothing for
// them, but before each of its ping-pong turns it waits on the same K/V tiles a consumer running
// them would (so the others' barriers and turns meet as they do on the full path, and no new wait
// can deadlock), and frees each one as soon as it has landed, since it never reads them.
FT_DEVICE void skip_tile(MbarRing<STAGES>& ring, const KvState& s) {
  ring.wait(s);
  ring.release(s);
}
FT_DEVICE void pass_tiles(Barriers& bar, MbarRing<STAGES>& pv, const KvState& kv, int qs, const WorkTile& w, int from,
                          int cw) {
  if (from == 0) bar.q.release(QState(qs));   // Q unread: free it at once
  if constexpr (OVERLAP) {
    // a full consumer's turn t issues S of tile t and P V of tile t - 1 (t = ntiles: the last P V
    // alone); turns before `from`, and P V of from - 1, were this consumer's own
    for (int t = from; t <= w.ntiles; ++t) {
      if (t < w.ntiles) skip_tile(bar.k, kv + t);
      if (t > from) skip_tile(pv, kv + (t - 1));
      if (t > from || from == 0) {
        turn_begin(cw);
        turn_end(cw);
      }
    }
  } else {
    for (int t = from; t < w.ntiles; ++t) {   // turns: S of tile t, then P V of tile t
      skip_tile(bar.k, kv + t);
      turn_begin(cw);
      turn_end(cw);
      skip_tile(pv, kv + t);
      turn_begin(cw);
      turn_end(cw);
    }
  }
}

// ---- the producer: Q and each K/V tile by TMA ----

// A Q or K/V tile of ROWS rows at `row` of head h of batch b: one TMA box per 128-byte panel.
template <int ROWS>
FT_DEVICE void load_tile(T* dst, const TmaMap* tmap, unsigned long long* full, int row, int h, int b) {
#pragma unroll
  for (int p = 0; p < PANELS; ++p) tma_load_4d(dst + p * ROWS * PANEL_COLS, tmap, full, p * PANEL_COLS, row, h, b);
}
// K/V tile t of work tile w into its ring's stage s, once the stage is free
FT_DEVICE void load_kv(T* ring, const TmaMap* tmap, MbarRing<STAGES>& bar, const KvState& s, int t, const WorkTile& w,
                       bool leader) {
  bar.acquire(s);
  if (!leader) return;
  bar.expect(s, KV_BYTES);
  load_tile<BC>(ring + s.index() * BC * HEAD_DIM, tmap, bar.full_bar(s), t * BC, w.hk, w.b);
}

// WARP_PRODUCER: the whole warp runs the loop, so its values are warp-uniform and ptxas keeps them
// in uniform registers (the persistent loop then fits split=32; one thread needs 40); the leader,
// lane 0, issues. Otherwise one thread does it all.
FT_DEVICE void produce(Smem sm, Scheduler sched, const TmaMap* tq, const TmaMap* tk, const TmaMap* tv, int* tile_counter,
                       bool leader) {
  Barriers& bar = *sm.bar;
  if (leader) {
    tmap_prefetch(*tq);
    tmap_prefetch(*tk);
    tmap_prefetch(*tv);
  }
  KvState kv(0);   // the work tile's first K/V tile
  for (int it = 0;; ++it) {
    const int tile = sched.fetch<WARP_PRODUCER>(bar.ring, tile_counter, it, leader);
    if (sched.done(tile)) break;
    const WorkTile w = sched.work(tile);
    // The first K goes ahead of Q: it only needs a free ring slot, while Q waits for the last work
    // tile's final S.
    load_kv(sm.k, tk, bar.k, kv, 0, w, leader);
    const QState q(it);
    bar.q.acquire(q);
    if (leader) {
      bar.q.expect(q, Q_BYTES);
      load_tile<BR>(sm.q + q.index() * BR * HEAD_DIM, tq, bar.q.full_bar(q), w.q0, w.h, w.b);
    }
    // K and V have their own rings and their own releases (K is free once S is computed, V only
    // after P V), and V runs one tile behind K, the order the consumers use them in.
    for (int t = 1; t < w.ntiles; ++t) {
      load_kv(sm.k, tk, bar.k, kv + t, t, w, leader);
      load_kv(sm.v, tv, bar.v, kv + (t - 1), t - 1, w, leader);
    }
    load_kv(sm.v, tv, bar.v, kv + (w.ntiles - 1), w.ntiles - 1, w, leader);
    kv.advance(w.ntiles);
  }
}

// ---- the V transposer (e4m3): warps 1-3 of the producer warpgroup ----
// Each landed V tile -> V^T, once P V has freed V^T's stage; the work tiles come as the consumers
// get them. `warp`: this one's rank among the transposers.
FT_DEVICE void transpose_v(Smem sm, Scheduler sched, int warp) {
  Barriers& bar = *sm.bar;
  KvState kv(0);
  for (int it = 0;; ++it) {
    const int tile = sched.next(bar.ring, it);
    if (sched.done(tile)) break;
    for (const int end = kv.count + sched.work(tile).ntiles; kv.count < end; kv.advance(1)) {
      bar.v.wait(kv);
      bar.vt.acquire(kv);
      transpose_v_e4m3<BC, HEAD_DIM, ROW_BYTES>(reinterpret_cast<unsigned char*>(sm.vt + kv.index() * BC * HEAD_DIM),
                                                reinterpret_cast<const unsigned char*>(sm.v + kv.index() * BC * HEAD_DIM),
                                                warp, TRANSPOSERS / 32);
      fence_proxy_async_smem();
      bar.vt.commit(kv);
      bar.v.release(kv);
    }
  }
}

// ---- a consumer warpgroup: 64 query rows of each work tile ----

// wgmma descriptors of the consumer's rows of Q and of each ring's stage 0; a buffer or stage is a
// desc_advance from these, as is a k step or a panel (issue_s, issue_pv)
struct Descs {
  unsigned long long q0, k0, v0;
  FT_DEVICE unsigned long long q(int buf) const { return desc_advance(q0, buf * Q_BYTES); }
  FT_DEVICE unsigned long long k(const KvState& s) const { return desc_advance(k0, s.index() * KV_BYTES); }
  FT_DEVICE unsigned long long v(const KvState& s) const { return desc_advance(v0, s.index() * KV_BYTES); }
};

// Where a consumer is in the CTA's work: the work tile (`tile`, done: none left; `w`), its Q buffer
// `qs`, its first K/V tile's position in the rings `kv`, and how many of its K/V tiles are this
// consumer's (`own`, OWN_TILES).
struct Place {
  KvState kv;
  int qs, tile;
  WorkTile w;
  int own;
};
// on to the CTA's (it+1)-th work tile `next` (already fetched), this one's K/V tiles done
FT_DEVICE void advance(Place& at, const Scheduler& sched, int it, int next) {
  at.kv.advance(at.w.ntiles);
  at.tile = next;
  at.w = sched.work(at.tile);
  at.own = at.w.ntiles;
  at.qs = QState(it + 1).index();
}
// S of K/V tile t has landed: free its K stage (and after the last S, Q's buffer), mask it, and run
// the online softmax on it: m and l advance, S becomes P, sc.alpha is what O's rows are rescaled by.
FT_DEVICE void softmax_s(Scores& sc, Acc& acc, Barriers& bar, const Place& at, int t, int lane, int wrow0, int nk,
                         float scale_log2) {
  wgmma_pin(sc.s);
  release_k(bar, at.kv, t, at.own, at.qs);
  mask_s(sc.s, at.w, lane, wrow0, t, nk);
  softmax_advance(sc.s, acc.m, acc.l, sc.alpha, scale_log2);
}

FT_DEVICE void consume(Smem sm, Scheduler sched, const Out& out, int tid, int wg, int lane) {
  Barriers& bar = *sm.bar;
  if constexpr (CONSUMER_REGS > 0) regs_grow<CONSUMER_REGS>();
  const int cw = wg - 1;
  const int wrow0 = cw * 64 + ((tid / 32) % 4) * 16;   // this warp's first row in the block
  const Descs desc{wgmma_desc<ROW_BYTES>(smem_u32(sm.q) + cw * 64 * ROW_BYTES, 16, 8 * ROW_BYTES),
                   wgmma_desc<ROW_BYTES>(smem_u32(sm.k), 16, 8 * ROW_BYTES),
                   FP8 ? wgmma_desc(smem_u32(sm.vt), 16, 1024) : wgmma_desc(smem_u32(sm.v), BC * 128, 1024)};
  const unsigned o_slab = smem_u32(sm.o) + (wrow0 / 16) * 16 * HEAD_DIM * sizeof(TO);   // TMA_STORE: the warp's O slab
  if (TMA_STORE && lane == 0) tmap_prefetch(*out.tmap);   // this warp's slabs go out through O's map
  if constexpr (PINGPONG) { if (cw == CWG - 1) named_arrive(1, 256); }   // consumer 0 goes first

  Acc acc;
  Scores sc;
  MbarRing<STAGES>& pv = FP8 ? bar.vt : bar.v;   // P V's operand B: V itself (N-major), or e4m3's V^T
  Place at{KvState(0), 0, sched.next(bar.ring, 0)};
  at.w = sched.work(at.tile);
  at.own = at.w.ntiles;
  for (int it = 0; !sched.done(at.tile); ++it) {
    const bool chained = CHAIN && it > 0;   // this tile's first S and softmax ran at the last one's end
    if (!chained) {
      reset_acc(acc);
      bar.q.wait(QState(it));
    }
    at.own = own_tiles(at.w, cw, sched.nq);
    if (OWN_TILES && at.own == 0) {
      pass_tiles(bar, pv, at.kv, at.qs, at.w, 0, cw);
      advance(at, sched, it, sched.next(bar.ring, it + 1));
      continue;
    }
    const KvState kv = at.kv;
    const int own = at.own;
    if constexpr (OVERLAP) {
      // Software-pipelined: S of tile t is issued together with P V of tile t-1, and the softmax of
      // tile t runs while P V is still in flight; O is rescaled only once that has landed.
      if (!chained) {
        bar.k.wait(kv);
        turn_begin(cw);
        wgmma_fence();
        issue_s(sc.s, desc.q(at.qs), desc.k(kv));
        turn_end(cw);
        wgmma_wait<0>();
        softmax_s(sc, acc, bar, at, 0, lane, wrow0, sched.nk, out.scale_log2);   // the tile's first: O starts here
        make_p(sc.p, sc.s);
      }
      for (int t = 1; t < own; ++t) {
        bar.k.wait(kv + t);
        pv.wait(kv + (t - 1));
        turn_begin(cw);
        wgmma_pin(acc.o);
        wgmma_fence();
        issue_s(sc.s, desc.q(at.qs), desc.k(kv + t));
        issue_pv(acc.o, sc.p, desc.v(kv + (t - 1)));
        turn_end(cw);
        wgmma_wait<1>();   // S of tile t has landed; P V of tile t-1 may still run
        softmax_s(sc, acc, bar, at, t, lane, wrow0, sched.nk, out.scale_log2);
        wgmma_wait<0>();
        wgmma_pin(acc.o);
        pv.release(kv + (t - 1));
        rescale_rows(acc.o, sc.alpha);
        make_p(sc.p, sc.s);
      }
      // CHAIN: the next work tile's first S goes with this one's last P V. After the CTA's last
      // tile it is issued all the same, on whatever the buffers hold, and dropped: a test between
      // the wgmma instructions would make ptxas serialize them (C7519).
      const int n = own, next = CHAIN ? sched.next(bar.ring, it + 1) : sched.total();
      if (CHAIN && !sched.done(next)) {
        bar.q.wait(QState(it + 1));
        bar.k.wait(kv + n);
      }
      pv.wait(kv + (n - 1));
      turn_begin(cw);
      wgmma_pin(acc.o);
      wgmma_fence();
      issue_pv(acc.o, sc.p, desc.v(kv + (n - 1)));
      if constexpr (CHAIN) {
        issue_s(sc.s, desc.q(QState(it + 1).index()), desc.k(kv + n));
      }
      turn_end(cw);
      wgmma_wait<CHAIN ? 1 : 0>();   // this tile's last P V has landed
      wgmma_pin(acc.o);
      pv.release(kv + (n - 1));
      if constexpr (CHAIN) {
        store_o(acc, at.w, out, lane, wrow0, o_slab);
        wgmma_wait<0>();
        advance(at, sched, it, next);
        if (sched.done(at.tile)) break;
        reset_acc(acc);
        softmax_s(sc, acc, bar, at, 0, lane, wrow0, sched.nk, out.scale_log2);   // the tile's first: O starts here
        make_p(sc.p, sc.s);
        continue;
      }
    } else {
      for (int t = 0; t < own; ++t) {   // one K/V tile at a time: S, its softmax, then P V
        bar.k.wait(kv + t);
        turn_begin(cw);
        wgmma_fence();
        issue_s(sc.s, desc.q(at.qs), desc.k(kv + t));
        turn_end(cw);
        wgmma_wait<0>();
        wgmma_pin(sc.s);
        release_k(bar, kv, t, own, at.qs);
        mask_s(sc.s, at.w, lane, wrow0, t, sched.nk);
        softmax_step(sc.s, acc.o, acc.m, acc.l, out.scale_log2);   // O is idle: rescale it at once
        make_p(sc.p, sc.s);
        pv.wait(kv + t);
        turn_begin(cw);
        wgmma_pin(acc.o);
        wgmma_fence();
        issue_pv(acc.o, sc.p, desc.v(kv + t));
        turn_end(cw);
        wgmma_wait<0>();
        wgmma_pin(acc.o);
        pv.release(kv + t);
      }
    }
    if (OWN_TILES) pass_tiles(bar, pv, kv, at.qs, at.w, own, cw);   // the tiles past this consumer's diagonal
    store_o(acc, at.w, out, lane, wrow0, o_slab);
    advance(at, sched, it, sched.next(bar.ring, it + 1));
  }
  if constexpr (PINGPONG) { if (wg == 1) named_sync(1, 256); }   // the last consumer's final hand-over
  if (TMA_STORE && lane == 0) bulk_wait<0>();   // the slab stays until its last store is done
}

// The tensor maps of Q, K, V and O (read only with TMA_STORE) come by value (kernel_templates/sm90_tma.py).
extern "C" __global__ void __launch_bounds__(NT, 1)
    flash_fwd_sm90(FT_ATTENTION_PARAMS(T), const __grid_constant__ TmaMap tmap_q, const __grid_constant__ TmaMap tmap_k,
                   const __grid_constant__ TmaMap tmap_v, const __grid_constant__ TmaMap tmap_o, int batch,
                   int* __restrict__ tile_counter) {
  extern __shared__ unsigned char smem_raw[];
  const Smem sm = carve_smem(smem_raw);
  Barriers& bar = *sm.bar;
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;
  // PERSISTENT: one CTA per SM takes work tiles from the dynamic scheduler (tile_scheduler.cuh)
  // until it runs out; otherwise the grid has one CTA per work tile and the roles' loops run once.
  const Scheduler sched{batch, heads, kv_group, nq, nk};

  if (tid == 0) {
    bar.q.init(1, CWG * 128);
    bar.ring.init(CWG * 128 + (FP8 ? TRANSPOSERS : 0));
    bar.k.init(1, CWG * 128);
    bar.v.init(1, FP8 ? TRANSPOSERS : CWG * 128);
    if constexpr (FP8) bar.vt.init(TRANSPOSERS, CWG * 128);
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 0) {
    if constexpr (PRODUCER_REGS > 0) regs_shrink<PRODUCER_REGS>();
    if (WARP_PRODUCER ? tid < 32 : tid == 0) {
      produce(sm, sched, &tmap_q, &tmap_k, &tmap_v, tile_counter, !WARP_PRODUCER || tid == 0);
    } else if (FP8 && tid >= 128 - TRANSPOSERS) {
      transpose_v(sm, sched, tid / 32 - (4 - TRANSPOSERS / 32));
    }
  } else {
    consume(sm, sched, Out{o, o_sb, o_sh, o_sn, lse, heads, nq, scale_log2, &tmap_o}, tid, wg, lane);
  }
}
