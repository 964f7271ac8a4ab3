// flash_fwd_sm90: FlashAttention forward for Hopper (sm_90a): TMA, wgmma, warp specialization.
//
// Three roles, each a device function below, meet in shared memory through mbarrier rings
// (sm90_pipeline.cuh: MbarRing, and PipelineState for where a role stands in one) and take their
// work tiles (one query block of one batch-head) from one TileScheduler (tile_scheduler.cuh):
// - the producer (warpgroup 0, one thread or, persistent with split=32, one warp) loads Q and
//   each K/V tile by TMA into 128-byte-swizzled rings, then gives most of its registers back
//   (setmaxnreg);
// - the V transposer (e4m3 only: warps 1-3 of warpgroup 0) turns each V tile into V^T, since fp8
//   wgmma takes only K-major operands (sm90_fp8.cuh);
// - a consumer (warpgroups 1..CWG, 64 query rows each) runs, per K/V tile, S = Q K^T by wgmma
//   with both operands in shared memory, the online softmax on the accumulators (softmax.cuh,
//   shared with flash_fwd_mma), O += P V by wgmma with P from registers and V read N-major from
//   its swizzled tile, and at the end of the work tile the epilogue (O / l and the LSE).
// K and V have separate rings: a consumer frees a K stage once S has landed and a V stage once
// P V has, so the next K streams in while the current P V still reads V.
//
// OVERLAP: S of tile t goes out with P V of tile t-1, and the softmax of t runs under that P V.
// PINGPONG: the consumers take turns issuing their products, one's softmax under the others'.
// PERSISTENT: one CTA per SM runs work tiles from the dynamic scheduler; the producer publishes
// each tile to the other roles and loads its first K, then its Q (freed once the last S of the
// previous tile has landed), under the previous tile's last products and epilogue.
// CHAIN (persistent, two consumers, overlap): Q is double-buffered and a consumer issues the next
// work tile's first S together with this tile's last P V, in the same ping-pong turn, so the tensor
// cores run that S while the consumer writes this tile's O; its softmax follows the epilogue.
// TMA_STORE: each consumer warp stages its 16 rows of O in shared memory and one lane stores them
// by TMA (sm90_epilogue.cuh), so the warp starts its next work tile without waiting on the stores;
// otherwise O goes from registers in 16-byte stores (store_slab).
//
// Head dims are handled in panels one swizzle atom wide (PANEL_COLS, set by the family from the
// tile's width: 128 bytes where the width is a multiple of them, else 64): Q, K and V tiles are
// PANELS boxes of [rows x PANEL_COLS] each, so one TMA box and one wgmma descriptor step per panel.
// The tile's width HEAD_DIM is the head dim D_VALID rounded up to 64 bytes (sm90_tma.tile_cols):
// the columns past D_VALID come in as zeros (the tensor maps end at D_VALID), add nothing to S,
// make zero columns of O, and are never stored. So d=96 runs in three 64-byte panels, d=80 padded
// to the same, d=40 in one 128-byte panel. The products run over the head dim rounded up to a k step
// only (PROD_COLS: 80 of d=80's 96, 48 of d=40's 64; the whole tile where O goes out by TMA): S's
// last k steps and O's last columns would only ever see those zeros, so they are not issued, and O
// has no registers for them.
// K_TAIL (d = 72-80, 136-144, 200-208 in 16 bits, where PROD_COLS ends 16 or 32 columns into the
// tile's last panel; not with TMA_STORE): K's ring holds PROD_COLS columns only, the whole panels as
// above and the last K_TAIL columns as a tail panel of their own (32- or 64-byte rows, swizzled as
// wide), brought by a map of its own (tmap_kt). A box of the tile's last panel is mostly past the
// tensor's columns, yet the copy engine asks L2 for those sectors too (flash_decode,
// benchmarks/PERF_NOTES.md "y2"); K's ring is 3/8 smaller at d=80. S's k steps in the tail run on
// the tail panel's descriptor. V keeps the tile: with a tail panel of its own, P V's last columns
// took a wgmma of their own (n16 beside n64, P from shared memory read by both), which read
// 0.95-0.98x at d=80 on the H200 (benchmarks/PERF_NOTES.md "y3"). Q keeps the whole tile too: it is
// read once a work tile.
//
// e4m3 (IN_DTYPE == FT_E4M3): the products are k32 QGMMA, O is bf16; the keys of V^T are permuted
// so that P packs straight from S's registers. V's stage is freed once transposed, V^T's once P V
// has read it.
//
// VARLEN (common.cuh): packed sequences of their own lengths, read through maps of the packed
// tensors at each sequence's first row; rows a tile reads past its sequence are the next one's,
// masked like the keys past N (K) or computed and never stored (Q); O by ordinary stores. Persistent
// (the producer's warp finds each drawn tile's sequence: TileScheduler) or a grid (one CTA per query
// block of each sequence and head: varlen_block), in the same order, sequence after sequence.
//
// SPLIT_KV (split_kv.cuh): a grid whose z splits each query block's K/V tiles; each split writes
// its share of O and the LSE to a workspace and the block's last split merges them. For calls whose
// work tiles leave SMs idle (few heads, a short chunk against a long cache).
// TAIL_SPLIT (persistent, unmasked): the last two rounds of work tiles are cut into one segment of
// equal work per CTA, Stream-K style (tile_scheduler.cuh); the two halves of a tile cut in two meet
// warp by warp, the later one folding the first's accumulators into its own (split_kv.cuh,
// join_halves). For launches whose last round would leave SMs idle.
//
// CLUSTER 2 (flash_fwd_sm90_pairs; persistent, unmasked, 16-bit): CTAs in clusters of two run
// neighbouring query blocks of one head, the cluster's work tiles from a static schedule
// (tile_scheduler.cuh, pair_tile), and the K/V tiles they share reach both CTAs by TMA multicast:
// CTA 0 brings each K tile, CTA 1 each V tile, so the pair reads each from L2 once. Both producers
// wait for the stage and post its bytes on their own barrier (bytes may land before the post: the
// phase cannot complete while the post's arrival is pending). A stage is refilled once both CTAs'
// consumers have freed it: each consumer thread frees it in its own CTA, and each consumer warp's
// lane 0 in the other CTA too (MULTICAST_FREES more arrivals there).
// PACK_GQA (16-bit, O by ordinary stores; a grid, split keys or not, or persistent): a work tile's rows are the
// queries of all the query heads that share one K/V head, interleaved as FlashAttention-3 packs
// them: row r is query r / g of head hk * g + r % g (g = kv_group), so a decode or speculative step
// of a few queries fills the tile's rows and each K/V head is read once for all g heads. Q comes by
// a 5-d map (columns, g heads, BR / g queries, K/V head, batch) whose box lands the rows in that order;
// a row's causal diagonal rises once every g rows (last_key); O and the LSE go out row by row through
// PackedRows (common.cuh). The tiles run over batch x K/V heads, g x Nq rows each, a block of them
// whole groups: BR / g x g rows (7 heads a group: 63 of 64), the tile's last rows idle (never loaded,
// computed on whatever the buffer holds, never stored).
// P_SMEM (three consumers on a 64-byte-panel tile, d = 72-96: FlashAttention-4's 192-row tiles
// there): P goes through shared memory, not registers. Each consumer writes its P (64 rows x BC keys,
// 16-bit, K-major in 128-byte panels of 64 keys) by stmatrix once its last P V has landed, and P V
// reads it as wgmma's A operand; the BC / 4 registers P held are what three consumers lack at
// Bc = 128 (O 48 + S 64 + P 32 + 32 of their 160 at d = 96).
//
// GATHER_KV (CACHE_PAGES, 16-bit; a K/V tile of several slots of a page, Bc <= 128; K's tail panel,
// where it has one, is a row's last 128-byte segment):
// the producer's whole warpgroup copies each K/V tile by cp.async (gather_tile) into the swizzled
// layout the boxes would give, each row from its page, and each thread's arrival on the stage's
// barrier lands with its copies (cp.async.mbarrier.arrive.noinc), so no thread waits for its own;
// the consumers fence the generic proxy's writes before their products read the stage. TMA took a
// box per slot and panel (two per 16 rows at d=128), and on pages of 16 the paged cache ran 1.15x
// the dense cache's time; the copies ran 1.07-1.10x faster than those boxes, at d=80 with the tail
// panel 1.15x on pages of 16 and 1.64-1.80x on pages of 8 (H200, benchmarks/PERF_NOTES.md, "x16",
// "x17", "x18").
//
// Set by the family spec: BC HEAD_DIM D_VALID PROD_COLS (flash_fwd_sm90.prod_cols) PANEL_COLS P_SMEM STAGES CWG PRODUCER_REGS CONSUMER_REGS OVERLAP PINGPONG
// PERSISTENT TMA_STORE CHAIN IN_DTYPE IS_CAUSAL MASK_BR (causal: 0 top-left, 1 bottom-right), VARLEN, SPLIT_KV, TAIL_SPLIT,
// CLUSTER (1 where unset), PACK_GQA (0 where unset), K_TAIL (0 where unset);
// the wgmma wrappers Wgmma<N>::ss / ::rs for N in {BC, PROD_COLS} are generated ahead of this file.
#include "sm90.cuh"
#include "sm90_epilogue.cuh"
#include "sm90_fp8.cuh"
#include "sm90_pipeline.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "split_kv.cuh"
// <wgmma wrappers>

#ifndef CLUSTER
#define CLUSTER 1
#endif
#ifndef PACK_GQA
#define PACK_GQA 0
#endif
// GQA_GROUP: PACK_GQA's query heads a K/V head as a constant (0: the kv_group argument). The packed
// rows' head and query (row % g, row / g) then divide by a constant, not a runtime integer: 1.02-1.06x
// on six packed steps on the H200 (benchmarks/PERF_NOTES.md, "y1").
#ifndef GQA_GROUP
#define GQA_GROUP 0
#endif
#ifndef K_TAIL
#define K_TAIL 0
#endif
#ifndef GATHER_KV
#define GATHER_KV 0
#endif

constexpr bool FP8 = IN_DTYPE == FT_E4M3;
using T = typename Elem<IN_DTYPE>::type;
constexpr int OUT_DTYPE = FP8 ? FT_BF16 : IN_DTYPE;   // e4m3 inputs give a bf16 O
// The online softmax keeps a row's max until it rises by 2^8 (softmax.cuh, FT_RESCALE_LOG2), so most
// K/V tiles skip O's rescale; e4m3's P (at most 448) keeps the exact max. Three consumers (their
// 128-160 registers) keep it too where products are wider than 64 columns (the vote's state spilled
// 24 B at d=96) and in a grid launch: at d=64 on the H100 the lazy max ran the persistent three
// (split 32) 2-7% faster and the grid's (split 24, ping-pong) 1-3% slower (benchmarks/PERF_NOTES.md, "e2").
constexpr bool LAZY_RESCALE = !FP8 && (CWG < 3 || (PROD_COLS <= 64 && PERSISTENT));
using TO = typename Elem<OUT_DTYPE>::type;
constexpr int BR = 64 * CWG;                 // query rows per block
constexpr int NT = 128 * (CWG + 1);          // threads: producer warpgroup + consumers
constexpr int ROW_BYTES = PANEL_COLS * sizeof(T);   // swizzle width: the bytes of a panel's row
constexpr int PANELS = HEAD_DIM / PANEL_COLS;
constexpr int PANEL_KSTEPS = ROW_BYTES / 32;        // k steps per panel
constexpr int NTILES = BC / 8;               // n8 column groups of S
constexpr int KSTEP = 32 / sizeof(T);        // k of one wgmma: 32 bytes of a row
constexpr int DTILES = PROD_COLS / 8;        // n8 column groups of O
constexpr int KSTEPS = PROD_COLS / KSTEP;    // k steps of Q K^T
constexpr int PSTEPS = BC / KSTEP;           // k steps of P V
constexpr unsigned Q_BYTES = BR * HEAD_DIM * sizeof(T);
constexpr int QBUF = CHAIN ? 2 : 1;          // Q buffers: CHAIN loads the next tile's Q under this one
// A ring row: HEAD_DIM columns in PANELS panels, or (K with K_TAIL) PROD_COLS in TAIL_PANELS whole
// panels and the tail panel (TAIL_BYTES a row, and its swizzle)
constexpr int TAIL_PANELS = (PROD_COLS - K_TAIL) / PANEL_COLS;
constexpr int TAIL_BYTES = K_TAIL ? K_TAIL * static_cast<int>(sizeof(T)) : 32;   // (32 where unused)
constexpr int TAIL_KSTEP0 = TAIL_PANELS * PANEL_KSTEPS;   // S's first k step in K's tail panel
// One ring's tiles (IS_K: K's, else V's): its columns, bytes as the copy engine brings them, and the
// bytes between its stages (each on the swizzle's 1 KB)
template <bool IS_K> struct Ring {
  static constexpr bool KEYS = IS_K;
  static constexpr int TAIL = IS_K ? K_TAIL : 0;
  static constexpr int COLS = TAIL ? PROD_COLS : HEAD_DIM;
  static constexpr unsigned BYTES = BC * COLS * sizeof(T);
  static constexpr unsigned STAGE = (BYTES + 1023) / 1024 * 1024;
  static constexpr int STAGE_ELEMS = STAGE / sizeof(T);
};
using KRing = Ring<true>;
using VRing = Ring<false>;   // (e4m3's V^T ring too: no tail there)
// The tail panel's descriptor: K's plus this, its fields for the whole panels' and its offset
constexpr unsigned long long K_TAIL_DESC = wgmma_fields<TAIL_BYTES>(16, 8 * TAIL_BYTES) -
                                           wgmma_fields<ROW_BYTES>(16, 8 * ROW_BYTES) + TAIL_PANELS * BC * ROW_BYTES / 16;
constexpr int TRANSPOSERS = 96;              // e4m3: producer warps 1-3 transpose V
constexpr bool WARP_PRODUCER = PERSISTENT && (PRODUCER_REGS == 32 || VARLEN);   // see producer()
// A consumer runs only the K/V tiles its own 64 rows need: causal ones stop at its own diagonal
// (192 x 128: 72 of 80 consumer-tiles at N=1024), and rows wholly outside [0, N) need none (a
// ragged block of 192 rows, a causal block that starts before row 0). Not with CHAIN, whose next
// S goes out with the last P V whatever the rows.
constexpr bool OWN_TILES = !CHAIN && CWG >= 2 && (IS_CAUSAL || CWG == 3);
// Causal blocks aligned to the end (tile_scheduler.cuh), but not where O goes out by TMA, whose
// store box cannot start before row 0 (sm90_epilogue.cuh)
constexpr bool FROM_END = IS_CAUSAL && !TMA_STORE && !PACK_GQA;   // (packed rows start at row 0)
// The overlapped schedule runs the K/V tiles that need no mask in a loop of their own (Consumer::
// overlapped_tile), except at d=256 causal persistent or with split keys, where O's 128 registers a
// thread and the persistent loop's state (or the split's bounds) left no room for the second loop's
// bounds (8 and 112 bytes spilled).
constexpr bool PEEL_MASKS = !(HEAD_DIM > 128 && IS_CAUSAL && (PERSISTENT || SPLIT_KV));
constexpr unsigned O_STAGE_BYTES = BR * HEAD_DIM * sizeof(TO);   // TMA_STORE: a 16-row slab per consumer warp
constexpr int P_PANELS = (BC + 63) / 64;          // P_SMEM: 128-byte panels of 64 keys
constexpr unsigned P_BYTES = 64 * 128 * P_PANELS;   // P_SMEM: one consumer's P
constexpr int PREGS = P_SMEM ? 1 : PSTEPS;        // P's A fragments in registers (none used with P_SMEM)
constexpr int P_BAR = 2 + CWG;                    // P_SMEM: consumer c's named barrier is P_BAR + c
constexpr bool MULTICAST = CLUSTER > 1;           // K/V tiles shared by a cluster's two CTAs (above)
constexpr int MULTICAST_FREES = MULTICAST ? CWG * 4 : 0;   // the other CTA's consumer warps, freeing a K/V stage

static_assert(HEAD_DIM % PANEL_COLS == 0 && (ROW_BYTES == 128 || ROW_BYTES == 64 || ROW_BYTES == 32),
              "the tile's width in whole 128-, 64- or 32-byte panels");
static_assert(D_VALID <= HEAD_DIM && D_VALID % 8 == 0, "the head dim, within the tile's width");
static_assert(!K_TAIL || (TAIL_PANELS * PANEL_COLS + K_TAIL == PROD_COLS && (TAIL_BYTES == 32 || TAIL_BYTES == 64) &&
                          TAIL_BYTES < ROW_BYTES && !FP8 && !TMA_STORE),
              "a K tail panel: the products' last 16 or 32 columns, short of a panel (16-bit, O by ordinary stores)");
static_assert(PROD_COLS % KSTEP == 0 && D_VALID <= PROD_COLS && PROD_COLS <= HEAD_DIM && (!TMA_STORE || PROD_COLS == HEAD_DIM),
              "the products: whole k steps over the head dim, within the tile (all of it where O goes out by TMA)");
static_assert(!FP8 || (D_VALID == HEAD_DIM && ROW_BYTES >= 64), "e4m3: whole 64- or 128-byte rows (d = 64, 128, 256)");
static_assert(!P_SMEM || !FP8, "P through shared memory: 16-bit inputs");
static_assert(BC % 16 == 0 && BC <= 256, "wgmma n: a multiple of 16 up to 256");
static_assert(IN_DTYPE == FT_F16 || IN_DTYPE == FT_BF16 || IN_DTYPE == FT_E4M3, "fp16, bf16 or e4m3 inputs");
static_assert(!FP8 || BC % 128 == 0, "e4m3: V^T in whole 128-key panels");
static_assert(!TMA_STORE || (QBUF * Q_BYTES + STAGES * (KRing::STAGE + (FP8 ? 2 : 1) * VRing::STAGE)) % 1024 == 0, "O slabs on the swizzle's 1024 B");
static_assert(!CHAIN || (PERSISTENT && OVERLAP && CWG == 2), "chaining work tiles: persistent, overlapped, two consumers");
static_assert(!VARLEN || (!TMA_STORE && !CHAIN && !FP8), "varlen: O by ordinary stores, unchained, 16-bit inputs");
static_assert(!PINGPONG || CWG >= 2, "ping-pong takes turns between two or three consumers");
static_assert(!SPLIT_KV || (!PERSISTENT && !VARLEN && !TMA_STORE && !FP8), "split keys: one work tile per CTA, 16-bit inputs, O by ordinary stores");
static_assert(!TAIL_SPLIT || (PERSISTENT && !IS_CAUSAL && !VARLEN && !CHAIN && !FP8 && !SPLIT_KV),
              "a cut tail: persistent, unmasked, unchained, 16-bit inputs");
static_assert(!MULTICAST || (CLUSTER == 2 && PERSISTENT && !IS_CAUSAL && !VARLEN && !CHAIN && !FP8 && !SPLIT_KV),
              "K/V multicast: pairs of persistent CTAs on the same K/V tiles (unmasked, unchained, 16-bit)");
static_assert(!CACHE_LENS || (!PERSISTENT && !VARLEN && !TAIL_SPLIT && !MULTICAST && !FP8),
              "a KV cache's own lengths: one work tile per CTA (its sequence's length read once), 16-bit inputs");
static_assert(CACHE_PAGES % 8 == 0, "pages of whole 8-row swizzle atoms, so that a page's box lands on one");
static_assert(!GATHER_KV || (CACHE_PAGES && !FP8 && !MULTICAST), "K/V by cp.async: a paged cache's 16-bit tiles");
static_assert(!PACK_GQA || (!VARLEN && !TMA_STORE && !CHAIN && !FP8 && !TAIL_SPLIT && !MULTICAST),
              "packed GQA rows: 16-bit tiles of a dense batch, O by ordinary stores (a grid, split keys or not, or persistent)");
constexpr bool KEY_RANGES = SPLIT_KV || TAIL_SPLIT;   // a work tile may run a range of its K/V tiles
#if SPLIT_KV
constexpr int MERGE_BAR = 1 + CWG;   // the consumers' named barrier for the merge (ping-pong's are 1..CWG)
#endif

using Scheduler = TileScheduler<BR, BC, IS_CAUSAL, FROM_END, IS_CAUSAL && MASK_BR, PERSISTENT, VARLEN, TAIL_SPLIT, MULTICAST,
                                PACK_GQA>;
using KvState = PipelineState<STAGES>;   // a role's place in the K/V (and V^T) rings
using QState = PipelineState<QBUF>;      // in Q's buffers: the count of work tiles

// The rings, filled by `fills` arrivals and freed by `frees`:
struct Barriers {
  MbarRing<QBUF> q;          // Q: by TMA; freed by every consumer thread after its last S
  MbarRing<STAGES> k, v;     // K, V tiles: by TMA; freed by the consumers (e4m3 V: by the transposers)
  TileRing<VARLEN, TAIL_SPLIT> tiles;   // PERSISTENT: the producer's drawn tiles; taken by every other thread
  MbarRing<STAGES> vt;       // e4m3: V^T, by the transposers; freed by the consumers
#if SPLIT_KV
  int last_split;            // whether this CTA merges its work tile's splits
#endif
};

// Shared memory: Q's buffers, the K and V rings (e4m3: and V^T's), O's slabs (TMA_STORE), barriers.
// Swizzle atoms repeat every 1024 bytes: the descriptors assume tiles start on that boundary.
struct Tiles {
  T *q, *k, *v, *vt;   // vt: e4m3 only, [HEAD_DIM x BC] per stage
  unsigned char *p, *o;   // p: P_SMEM only, P_BYTES per consumer
  Barriers* bar;

  FT_DEVICE explicit Tiles(unsigned char* raw) {
    unsigned char* base = raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
    q = reinterpret_cast<T*>(base);
    k = q + QBUF * BR * HEAD_DIM;
    v = k + STAGES * KRing::STAGE_ELEMS;
    vt = v + STAGES * VRing::STAGE_ELEMS;
    p = reinterpret_cast<unsigned char*>(FP8 ? vt + STAGES * VRing::STAGE_ELEMS : vt);
    o = p + (P_SMEM ? CWG * P_BYTES : 0);
    bar = reinterpret_cast<Barriers*>(o + (TMA_STORE ? O_STAGE_BYTES : 0));
  }
};

// Where O and the LSE go: the kernel's parameters, for the epilogue.
struct Output {
  TO* o;
  float* lse;
  long long sb, sh, sn;
  int heads, nq;
  int lse_rows;         // VARLEN: the LSE is (H, total_q)
  const TmaMap* tmap;   // TMA_STORE
#if SPLIT_KV || TAIL_SPLIT
  SplitWorkspace split; // the splits' partials (split_kv.cuh; TAIL_SPLIT: the cut tiles' halves)
#endif
};

// A work tile as the roles run it: with split keys (SPLIT_KV) or a cut tail (TAIL_SPLIT), with its
// share of the K/V tiles (split_kv.cuh, tile_scheduler.cuh).
template <bool RANGE> struct RunTileOf { using type = WorkTile; };
template <> struct RunTileOf<true> { using type = SplitTile; };
using RunTile = typename RunTileOf<KEY_RANGES>::type;
FT_DEVICE RunTile work_of(const Scheduler& sched, const DrawnTile& d) {
#if SPLIT_KV
  return keep_split<BC>(sched.work(d), d.seq.nk, blockIdx.z, gridDim.z);
#elif TAIL_SPLIT
  SplitTile w;
  static_cast<WorkTile&>(w) = sched.work(d);
  w.t0 = d.lo;   // the producer's piece (tile_scheduler.cuh): a whole tile is [0, its K/V tiles)
  w.ntiles = d.hi - d.lo;
  w.kv_end = min(d.seq.nk, d.hi * BC);
  return w;
#else
  return sched.work(d);
#endif
}

// The K/V tile that run-relative tile t of w is, and the key its masking ends at: with split keys,
// the split's; else tile t and the sequence's last key.
template <class W> FT_DEVICE int kv_tile(const W& w, int t) {
  if constexpr (KEY_RANGES) return w.t0 + t;
  else return t;
}
template <class W> FT_DEVICE int kv_end(const W& w, const Sequence& seq) {
  if constexpr (KEY_RANGES) return w.kv_end;
  else return seq.nk;
}
// The first key of K/V tile t as loaded: the tile's own, but with CACHE_LENS a tile past the held
// keys ends at the last one (its first columns repeat the tile before's keys, which the consumers
// mask; before key 0, TMA's zeros), so no row past the sequence's length is read (common.cuh).
FT_DEVICE int loaded_key(int t, const Sequence& seq) {
  if constexpr (CACHE_LENS) return min(t * BC, seq.nk - BC);
  else return seq.k0 + t * BC;
}

// CACHE_PAGES: a K/V tile comes as BC / PAGE_BOX boxes ("slots") of PAGE_BOX rows, each within one
// page (PAGE_BOX divides the page and the tile). In the tile that holds the sequence's last key the
// slot holding it is loaded ending at that key, its first `shift` rows the page's rows before the
// slot (keys already run: masked) or, before the page, TMA's zeros; the slots after it are zeros
// (their page coordinate -1 lies outside the map). So no row past the length is read, no table
// entry past its pages either, and every row the tile's products read holds a finite value.
template <int A, int B> struct Gcd { static constexpr int value = Gcd<B, A % B>::value; };
template <int A> struct Gcd<A, 0> { static constexpr int value = A; };
constexpr int PAGE_BOX = Gcd<BC, CACHE_PAGES>::value;   // (BC where CACHE_PAGES is 0)
constexpr int PAGE_SLOTS = BC / PAGE_BOX;
// Slots smaller than the tile: the producer's whole warp loads them, a lane a slot, so their table
// reads go out together (one thread read 8 in turn, each a round trip to L2, and at pages of 16
// rows ran 1.15-1.89x the dense cache's time on the H200, 1.10-1.39x a lane a slot: PERF_NOTES "x15");
// lane 0 alone posts the stage's bytes.
constexpr bool WARP_PAGES = PAGE_SLOTS > 1;
struct PagedTail {
  int seg, shift;   // the slot holding the last key starts at column seg, `shift` rows early
};
// The last K/V tile's (k0: its first key; nk: the keys held, k0 < nk <= k0 + BC, or none: nk 0)
FT_DEVICE PagedTail paged_tail(int k0, int nk) {
  const int e = nk - k0, j = max(e - 1, 0) / PAGE_BOX;
  return PagedTail{j * PAGE_BOX, (j + 1) * PAGE_BOX - e};
}
// GATHER_KV: where K's or V's rows are, a (num_pages, Hk, page, D) view: its first element and strides
struct KvSource {
  const T* base;
  int page, head, row;   // (a page's rows x heads x head dim: far under 2^31 elements)
};
// The sequence's row of the block table (empty without CACHE_PAGES); GATHER_KV: K's and V's pages
struct Pages {
#if CACHE_PAGES
  const int* row;
#endif
#if GATHER_KV
  KvSource k, v;
#endif
};
static_assert(PAGE_SLOTS <= 32, "a lane of the producer's warp a slot");
// This lane's slot of a K/V tile (empty without CACHE_PAGES): its page (-1 past the held keys: TMA's
// zeros) and its first row there (PagedTail). The producer reads it a tile ahead of the load, so the
// table's round trip to L2 overlaps the wait for a free stage instead of following it, and V's load
// takes K's (the same pages: one read a tile, not two).
// GATHER_KV: producer warp w copies the tile's rows [w, w + 1) x GATHER_ROWS, and its lane l reads the
// place (page, row; page -1: zeros) of the warp's rows l, l + 32, ...
#if GATHER_KV
constexpr int GATHER_ROWS = BC / 4;
constexpr int GATHER_OWN = (GATHER_ROWS + 31) / 32;
#endif
struct SlotPlace {
#if GATHER_KV
  int page[GATHER_OWN], row[GATHER_OWN];
#elif CACHE_PAGES
  int page, row;
#endif
};
FT_DEVICE SlotPlace place_slot(int t, const RunTile& w, const Sequence& seq, const Pages& pages) {
#if CACHE_PAGES
#if SPLIT_KV || TAIL_SPLIT
  t += w.t0;   // (as load_kv)
#endif
#if GATHER_KV
  SlotPlace at;
#pragma unroll
  for (int o = 0; o < GATHER_OWN; ++o) {
    const int rw = o * 32 + threadIdx.x % 32, row = threadIdx.x / 32 * GATHER_ROWS + rw;
    const int ks = t * BC + row / PAGE_BOX * PAGE_BOX;   // its slot's first key
    const int r = ks % CACHE_PAGES - max(0, ks + PAGE_BOX - seq.nk) + row % PAGE_BOX;   // (< 0: before the page)
    const bool held = rw < GATHER_ROWS && ks < seq.nk && r >= 0;
    at.page[o] = held ? __ldg(pages.row + ks / CACHE_PAGES) : -1;
    at.row[o] = held ? r : 0;
  }
#else
  const int slot = WARP_PAGES ? threadIdx.x % 32 : 0, ks = t * BC + slot * PAGE_BOX;
  SlotPlace at{-1, 0};
  if (slot < PAGE_SLOTS && ks < seq.nk) {
    at.page = __ldg(pages.row + ks / CACHE_PAGES);
    at.row = ks % CACHE_PAGES - max(0, ks + PAGE_BOX - seq.nk);
  }
#endif
  return at;
#else
  return {};
#endif
}

// a * b for a, b >= 0 as one widening multiply (IMAD.WIDE.U32), not a 64-bit one
FT_DEVICE unsigned long long wide_mul(int a, int b) {
  return static_cast<unsigned long long>(static_cast<unsigned>(a)) * static_cast<unsigned>(b);
}
// GATHER_KV: this producer warp's rows of a K/V tile into `stage` as the boxes would land them. Lane
// l copies chunk l % 8 (16 bytes) of each 128-byte segment of a row, four rows a step, each row's
// source a pointer shuffled from the lane that read its place (place_slot: bit 0 set where the row is
// not held, which then lands zeros, as TMA gives past a length or before a page). The destination's
// swizzle (chunk c of row r in b-byte rows at c ^ ((r * b / 128) % (b / 16))) repeats every 8 rows and
// flips by b / 32 every 4, so each lane's two offsets, its rows of even and odd steps, and the
// compile-time rows between its steps place every copy. Every copy costs a step's share of two
// shuffles, its address and the LDGSTS: the issue slots it takes are the consumers' (PERF_NOTES "x17").
template <class R>
FT_DEVICE void gather_tile(T* stage, const KvSource& src, int hk, const SlotPlace& at) {
#if GATHER_KV
  constexpr int ELEMS = 16 / static_cast<int>(sizeof(T));
  constexpr int CH = R::COLS / ELEMS;    // chunks a row
  constexpr int SEGS = (CH + 7) / 8;     // 128-byte segments a row
  constexpr int CPP = ROW_BYTES / 16;    // chunks a panel's row
  constexpr int STEPS = GATHER_ROWS / 4;
  // K's tail panel (R::TAIL): the segments from TAIL_SEG on land in it, TAIL_BYTES a row
  constexpr int TAIL_SEG = R::TAIL ? TAIL_PANELS * ROW_BYTES / 128 : SEGS;
  static_assert(GATHER_OWN == 1 && GATHER_ROWS % 4 == 0, "GATHER_KV: a lane's own row per tile (Bc <= 128), whole steps of four rows");
  static_assert(!R::TAIL || (TAIL_PANELS * ROW_BYTES % 128 == 0 && TAIL_SEG == SEGS - 1),
                "GATHER_KV with a K tail panel: the tail is a row's last 128-byte segment, from its start");
  const int lane = threadIdx.x % 32, c8 = lane % 8, sub = lane / 8;
  const int row0 = threadIdx.x / 32 * GATHER_ROWS + sub;   // this lane's row of step 0
  const T* own = src.base + wide_mul(hk, src.head) + wide_mul(max(at.page[0], 0), src.page) + wide_mul(at.row[0], src.row);
  const unsigned long long tagged = reinterpret_cast<unsigned long long>(own) | (at.page[0] < 0 ? 1ull : 0ull);
  // each segment's offset on even steps and on odd ones, which differ by the swizzle's flip; with a K
  // tail panel, or in the producer's 24 registers, both rings keep one and flip it by an XOR on odd
  // steps (a second spilled 8 B at d=80, and at d=64 under three consumers)
  constexpr bool ODD_XOR = K_TAIL > 0 || PRODUCER_REGS < 40;
  unsigned dst[SEGS][2];
  bool col_ok[SEGS];
#pragma unroll
  for (int s = 0; s < SEGS; ++s) {
    const int c = s * 8 + c8;
    if (s < TAIL_SEG) {
      const unsigned x0 = (row0 * ROW_BYTES >> 7) & (CPP - 1);
      const unsigned at_row = smem_u32(stage) + (c / CPP) * BC * ROW_BYTES + row0 * ROW_BYTES;
      dst[s][0] = at_row + (((c % CPP) ^ x0) << 4);
      dst[s][1] = ODD_XOR ? 0 : at_row + (((c % CPP) ^ x0 ^ (ROW_BYTES / 32)) << 4);
    } else {   // the tail panel's rows, in its own swizzle (TAIL_BYTES: 32 or 64)
      const unsigned x0 = (row0 * TAIL_BYTES >> 7) & (TAIL_BYTES / 16 - 1);
      dst[s][0] = smem_u32(stage) + TAIL_PANELS * BC * ROW_BYTES + row0 * TAIL_BYTES + ((c8 ^ x0) << 4);
      dst[s][1] = 0;
    }
    col_ok[s] = c < CH && c * ELEMS < D_VALID;
  }
#pragma unroll
  for (int j = 0; j < STEPS; ++j) {
    const unsigned long long p = __shfl_sync(0xffffffffu, tagged, j * 4 + sub);
    const bool held = !(p & 1);
    const char* from = reinterpret_cast<const char*>(p & ~1ull) + c8 * 16;
#pragma unroll
    for (int s = 0; s < SEGS; ++s) {
      if (s * 8 + 8 > CH && c8 >= CH - s * 8) continue;   // (lanes past a short last segment: none)
      const int b = s < TAIL_SEG ? ROW_BYTES : TAIL_BYTES;   // the segment's bytes a row in shared memory
      const unsigned to = ODD_XOR ? (dst[s][0] ^ (j & 1 ? b / 32 << 4 : 0)) + j * 4 * b : dst[s][j & 1] + j * 4 * b;
      cp_async16(to, from + s * 128, held && col_ok[s]);
    }
  }
#endif
}

// ---- the producer: each work tile's Q and K/V tiles, by TMA (GATHER_KV: K/V by cp.async) ----

// K/V tile t of work tile w (at `p` in its ring) into `ring`, once the consumers freed the stage
// (MULTICAST: the copy into both CTAs comes from cluster CTA `source`): its whole panels by `tmap`,
// its tail panel (KRing with K_TAIL) by `tail`. R: the ring (KRing, VRing).
template <class R>
FT_DEVICE void load_kv(T* ring, const TmaMap* tmap, const TmaMap* tail, MbarRing<STAGES>& bars, const KvState& p, int t,
                       const RunTile& w, const Sequence& seq, bool leader, unsigned source, const SlotPlace& at,
                       const Pages& pages) {
  bars.acquire(p);
#if GATHER_KV
  gather_tile<R>(ring + p.index() * R::STAGE_ELEMS, R::KEYS ? pages.k : pages.v, w.hk, at);
  bars.commit_copies(p);
#else
#if CACHE_PAGES
  if (leader) bars.expect(p, R::BYTES);
  if constexpr (WARP_PAGES) __syncwarp();   // (lanes' bytes may land before the post: its arrival is pending)
  else if (!leader) return;
#else
  if (!leader) return;
  bars.expect(p, R::BYTES);
#endif
  if (MULTICAST && cluster_rank() != source) return;   // the other CTA's copy brings the tile here too
#if SPLIT_KV || TAIL_SPLIT
  t += w.t0;   // the split's tile t (not through kv_tile: where that folds to t, ptxas still placed the
               // producer's address arithmetic differently, and flash_fwd_sm90's SASS moved)
#endif
  T* stage = ring + p.index() * R::STAGE_ELEMS;
  auto box = [&](T* dst, const TmaMap* map, int col) {
    if constexpr (MULTICAST) tma_load_4d_multicast(dst, map, bars.full_bar(p), col, seq.k0 + t * BC, w.hk, w.b, 0x3);
    else tma_load_4d(dst, map, bars.full_bar(p), col, loaded_key(t, seq), w.hk, VARLEN ? 0 : w.b);
  };
  constexpr int panels = R::TAIL ? TAIL_PANELS : PANELS;
#if CACHE_PAGES
  // this lane's slot from its page (`at`, place_slot): a box per panel
  const int slot = WARP_PAGES ? threadIdx.x % 32 : 0, rows = slot * PAGE_BOX;
  if (slot < PAGE_SLOTS) {
#pragma unroll
    for (int panel = 0; panel < panels; ++panel)
      tma_load_4d(stage + panel * BC * PANEL_COLS + rows * PANEL_COLS, tmap, bars.full_bar(p), panel * PANEL_COLS, at.row,
                  w.hk, at.page);
    if constexpr (R::TAIL > 0)
      tma_load_4d(stage + TAIL_PANELS * BC * PANEL_COLS + rows * K_TAIL, tail, bars.full_bar(p), TAIL_PANELS * PANEL_COLS,
                  at.row, w.hk, at.page);
  }
#else
#pragma unroll
  for (int panel = 0; panel < panels; ++panel) box(stage + panel * BC * PANEL_COLS, tmap, panel * PANEL_COLS);
  if constexpr (R::TAIL > 0) box(stage + TAIL_PANELS * BC * PANEL_COLS, tail, TAIL_PANELS * PANEL_COLS);
#endif
#endif   // GATHER_KV
}

// WARP_PRODUCER: the whole warp runs the loop, so its values are warp-uniform and ptxas keeps them in
// uniform registers (the persistent loop then fits split=32; one thread needs 40), and (VARLEN) its
// lanes find each drawn tile's sequence together; lane 0 issues. Otherwise one thread does it all.
FT_DEVICE void producer(const Tiles& sm, Barriers& bar, const Scheduler& sched, const TmaMap* tq, const TmaMap* tk,
                        const TmaMap* tv, const TmaMap* tkt, int* tile_counter, bool leader, const Pages pages) {
  if (leader) {
    tmap_prefetch(*tq);
    tmap_prefetch(*tk);
    tmap_prefetch(*tv);
    if constexpr (K_TAIL > 0) tmap_prefetch(*tkt);
  }
  KvState kv{0};
  SeqCursor at = sched.walk();   // VARLEN, persistent: the walk over the sequences (varlen_find_longest)
  TailCursor cut;                // TAIL_SPLIT: the leader's place in a drawn segment
  for (int it = 0;; ++it) {
    const DrawnTile d = sched.draw<WARP_PRODUCER>(bar.tiles, tile_counter, it, leader, at, cut);
    if (sched.done(d)) break;
    const RunTile w = work_of(sched, d);
    const Sequence& seq = d.seq;
    // The first K goes ahead of Q: it only needs a free stage, while Q waits for the previous work
    // tile's last S. Then V runs one tile behind K, the order the consumers use them in.
    SlotPlace k_at = place_slot(0, w, seq, pages);
    load_kv<KRing>(sm.k, tk, tkt, bar.k, kv, 0, w, seq, leader, 0, k_at, pages);
    const QState q{it};
    bar.q.acquire(q);
    if (leader) {
      bar.q.expect(q, PACK_GQA ? packed_rows<BR>(sched.group) * HEAD_DIM * static_cast<unsigned>(sizeof(T)) : Q_BYTES);
#pragma unroll
      for (int panel = 0; panel < PANELS; ++panel) {
        T* dst = sm.q + q.index() * BR * HEAD_DIM + panel * BR * PANEL_COLS;
        if constexpr (PACK_GQA) tma_load_5d(dst, tq, bar.q.full_bar(q), panel * PANEL_COLS, 0, w.q0 / sched.group, w.hk, w.b);
        else tma_load_4d(dst, tq, bar.q.full_bar(q), panel * PANEL_COLS, seq.q0 + w.q0, w.h, VARLEN ? 0 : w.b);
      }
    }
    // Not unrolled: the producer keeps 24-40 registers, and the compiler's own unroll factor followed
    // the cost of this body (two configs spilled 108 B when it grew, others halved their unroll).
    SlotPlace v_at = k_at;
    if (w.ntiles > 1) k_at = place_slot(1, w, seq, pages);
#pragma unroll 1
    for (int t = 1; t < w.ntiles; ++t) {
      load_kv<KRing>(sm.k, tk, tkt, bar.k, kv + t, t, w, seq, leader, 0, k_at, pages);
      load_kv<VRing>(sm.v, tv, nullptr, bar.v, kv + (t - 1), t - 1, w, seq, leader, 1, v_at, pages);
      v_at = k_at;
      if (t + 1 < w.ntiles) k_at = place_slot(t + 1, w, seq, pages);
    }
    load_kv<VRing>(sm.v, tv, nullptr, bar.v, kv + (w.ntiles - 1), w.ntiles - 1, w, seq, leader, 1, v_at, pages);
    kv.advance(w.ntiles);
  }
}

// ---- e4m3: the V transposers (producer warps 1-3): each landed V tile -> V^T, once P V has freed
// V^T's stage; the work tiles come as the consumers get them ----
FT_DEVICE void transpose_v(const Tiles& sm, Barriers& bar, const Scheduler& sched, int warp) {
  KvState kv{0};
  for (int it = 0;; ++it) {
    const DrawnTile d = sched.take(bar.tiles, it);
    if (sched.done(d)) break;
    for (const int end = kv.count + work_of(sched, d).ntiles; kv.count < end; kv.advance()) {
      bar.v.wait(kv);
      bar.vt.acquire(kv);
      // (instantiated for 16-bit tiles too, never run there: their panels may be 32 bytes wide)
      transpose_v_e4m3<BC, HEAD_DIM, FP8 ? ROW_BYTES : 128>(reinterpret_cast<unsigned char*>(sm.vt + kv.index() * VRing::STAGE_ELEMS),
                                                reinterpret_cast<const unsigned char*>(sm.v + kv.index() * VRing::STAGE_ELEMS),
                                                warp, TRANSPOSERS / 32);
      fence_proxy_async_smem();
      bar.vt.commit(kv);
      bar.v.release(kv);
    }
  }
}

// ---- a consumer warpgroup: its 64 rows of each work tile ----

// What the consumer holds in registers: O, the rows' running max and sum, and S then P of the K/V
// tile in hand (alpha: how far O's rows must be scaled down for it).
struct Accumulators {
  float o[DTILES][4], m[2], l[2];
  float s[NTILES][4], alpha[2];
  unsigned p[PREGS][4];

  FT_DEVICE void reset() {
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
    m[0] = m[1] = FT_NEG_INF;
    l[0] = l[1] = 0.f;
  }
  // P (16- or 8-bit A fragments of P V) from S's registers
  FT_DEVICE void make_p() {
#pragma unroll
    for (int ps = 0; ps < PREGS; ++ps) {
      if constexpr (FP8) p_fragment_e4m3(p[ps], s, ps);
      else p_fragment<IN_DTYPE>(p[ps], s, ps);
    }
  }
};

// S = Q K^T, A and B K-major: a k step is 32 bytes into the swizzled row, a panel BR (BC) rows on;
// K's k steps from TAIL_KSTEP0 on in its tail panel (K_TAIL).
FT_DEVICE void issue_s(float (&s)[NTILES][4], unsigned long long dq, unsigned long long dk) {
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const unsigned koff = (ks % PANEL_KSTEPS) * 32, panel = ks / PANEL_KSTEPS;
    const unsigned long long b = K_TAIL && ks >= TAIL_KSTEP0 ? desc_advance(dk + K_TAIL_DESC, (ks - TAIL_KSTEP0) * 32)
                                                              : desc_advance(dk, panel * BC * ROW_BYTES + koff);
    Wgmma<BC>::ss(s, desc_advance(dq, panel * BR * ROW_BYTES + koff), b, ks > 0);   // the first step overwrites
  }
  wgmma_commit();
}

// O += P V: V N-major (its rows are the k dim: a k step is 16 rows), panels of PANEL_COLS columns
// LBO apart, its first PROD_COLS columns (the last panel's may be read in part); or e4m3's V^T
// K-major like K, panels of 128 keys HEAD_DIM * 128 bytes apart. P from registers, or (P_SMEM) from
// shared memory at `dp`: a k step is 32 bytes into a panel's row.
FT_DEVICE void issue_pv(float (&o)[DTILES][4], unsigned (&p)[PREGS][4], unsigned long long dp, unsigned long long dv) {
#pragma unroll
  for (int ps = 0; ps < PSTEPS; ++ps) {
    const unsigned long long db = desc_advance(dv, FP8 ? (ps / 4) * HEAD_DIM * 128 + (ps % 4) * 32 : ps * 16 * ROW_BYTES);
    if constexpr (P_SMEM) Wgmma<PROD_COLS>::ssn(o, desc_advance(dp, (ps / 4) * 8192 + (ps % 4) * 32), db, 1);
    else Wgmma<PROD_COLS>::rs(o, p[ps], db, 1);
  }
  wgmma_commit();
}

// P_SMEM: P (16-bit) from S's registers into a consumer's buffer `buf`, K-major in 128-byte-swizzled
// panels of 64 keys, 8 KB apart: this warp's 16 rows from `row16`, by stmatrix (matrices: rows 0-7 |
// 8-15 x n8 group j | j + 1, the accumulator's layout; chunk c of row r at c ^ (r % 8)).
FT_DEVICE void store_p(unsigned buf, const float (&s)[NTILES][4], int lane, int row16) {
  const int mat = lane / 8, r = row16 + lane % 8 + (mat & 1) * 8;
#pragma unroll
  for (int j = 0; j < NTILES; j += 2) {
    const int col8 = j + (mat >> 1);
    stmatrix_x4(buf + (col8 / 8) * 8192 + r * 128 + (((col8 % 8) ^ (r % 8)) << 4), pack2<IN_DTYPE>(s[j][0], s[j][1]),
                pack2<IN_DTYPE>(s[j][2], s[j][3]), pack2<IN_DTYPE>(s[j + 1][0], s[j + 1][1]),
                pack2<IN_DTYPE>(s[j + 1][2], s[j + 1][3]));
  }
}

// The last key row `row` of a work tile may see under the causal mask (before row 0: a negative
// one); PACK_GQA: a row is query row / group (seq.nq counts the rows, group x the queries).
FT_DEVICE int last_key(int row, const Sequence& seq, int group) {
  if constexpr (PACK_GQA) return row / group + (MASK_BR ? seq.nk - seq.nq / group : 0);
  return row + (MASK_BR ? seq.nk - seq.nq : 0);
}

// OWN_TILES: how many of work tile w's K/V tiles the rows [r0, r1) of consumer cw need
FT_DEVICE int own_tiles(const RunTile& w, const Sequence& seq, int cw, int group) {
  const int r0 = w.q0 + cw * 64, r1 = min(r0 + 64, PACK_GQA ? min(seq.nq, w.q0 + packed_rows<BR>(group)) : seq.nq);
  if (!OWN_TILES) return w.ntiles;
  if (r1 <= 0 || r0 >= (PACK_GQA ? r1 : seq.nq)) return 0;
  if constexpr (PACK_GQA && IS_CAUSAL)   // up to the last row's diagonal (from the split's first tile), one tile at least
    return max(1, min(w.ntiles, last_key(r1 - 1, seq, group) / BC + 1 - kv_tile(w, 0)));
  if constexpr (SPLIT_KV && IS_CAUSAL)   // up to the last row's diagonal, from the split's first tile
    return max(1, min(w.ntiles, (r1 - 1 + (MASK_BR ? seq.nk - seq.nq : 0)) / BC + 1 - kv_tile(w, 0)));
  if constexpr (IS_CAUSAL && MASK_BR) return max(1, min(w.ntiles, (r1 - 1 + seq.nk - seq.nq) / BC + 1));   // no key seen: one masked tile
  return IS_CAUSAL ? min(w.ntiles, (r1 - 1) / BC + 1) : w.ntiles;
}

struct Consumer {
  Barriers& bar;
  const Scheduler& sched;
  const Output& out;
  float scale_log2;
  int cw, lane, wrow0;   // consumer index, lane, this warp's first row in the block
  // wgmma descriptors of this consumer's Q and of each ring's stage 0; a k step, panel or stage is
  // a desc_advance from these
  unsigned long long desc_q, desc_k, desc_v;
  unsigned o_slab;       // TMA_STORE: this warp's slab
  unsigned p_buf;        // P_SMEM: this consumer's P
  unsigned long long desc_p;
  // P V's operand B and its barriers: V itself (N-major), or for e4m3 the transposed V^T
  MbarRing<STAGES>& pv;
  Accumulators acc;
  // The work tile in hand (tile: its index, done() when none is left, and its sequence), how many of
  // its K/V tiles this consumer runs (OWN_TILES), its Q buffer, and the K/V rings at its first K/V tile.
  DrawnTile tile;
  RunTile w;
  int own;
  QState q{0};
  KvState kv{0};

  FT_DEVICE Consumer(Barriers& bar_, const Scheduler& sched_, const Output& out_, float scale_log2_,
                     int cw_, int lane_, int wrow0_, unsigned long long desc_q_, unsigned long long desc_k_,
                     unsigned long long desc_v_, unsigned o_slab_, unsigned p_buf_)
      : bar(bar_), sched(sched_), out(out_), scale_log2(scale_log2_), cw(cw_), lane(lane_), wrow0(wrow0_),
        desc_q(desc_q_), desc_k(desc_k_), desc_v(desc_v_), o_slab(o_slab_), p_buf(p_buf_),
        desc_p(wgmma_desc<128>(p_buf_, 16, 1024)), pv(FP8 ? bar_.vt : bar_.v) {}

  // P of the K/V tile in hand, for its P V: A fragments in registers, or (P_SMEM) this consumer's
  // buffer in shared memory, visible to the tensor cores and whole (all four warps) before the
  // product is issued. Its last P V has landed wherever this runs, so the buffer is free.
  FT_DEVICE void make_p() {
    if constexpr (P_SMEM) {
      store_p(p_buf, acc.s, lane, wrow0 - cw * 64);
      fence_proxy_async_smem();
      named_sync(P_BAR + cw, 128);
    } else {
      acc.make_p();
    }
  }

  // Ping-pong (PINGPONG): the consumer warpgroups take turns issuing their products, in the order
  // 0, 1, .., CWG-1, so each one's softmax runs under the others' matrix work. Named barrier 1 + c is
  // consumer c's turn, opened by the consumer before it (256 threads: the two of them).
  FT_DEVICE void turn_begin() { if constexpr (PINGPONG) named_sync(1 + cw, 256); }
  FT_DEVICE void turn_end() { if constexpr (PINGPONG) named_arrive(1 + (cw + 1) % CWG, 256); }

  FT_DEVICE unsigned long long q_desc(const QState& qb) const { return desc_advance(desc_q, qb.index() * Q_BYTES); }
  FT_DEVICE unsigned long long k_desc(const KvState& p) const { return desc_advance(desc_k, p.index() * KRing::STAGE); }
  FT_DEVICE unsigned long long v_desc(const KvState& p) const { return desc_advance(desc_v, p.index() * VRing::STAGE); }

  // -inf on the keys of K/V tile t that rows of this warp may not see: past N, or past the diagonal
  // (CACHE_LENS: and on the columns of a tile loaded ending at the last held key that repeat the keys
  // of the tile before, loaded_key)
  FT_DEVICE void mask(int t) {
    const int k0 = kv_tile(w, t) * BC, c0 = CACHE_LENS && !CACHE_PAGES ? loaded_key(kv_tile(w, t), tile.seq) : k0;
    if constexpr (CACHE_PAGES) {
      if (k0 + BC > tile.seq.nk) {   // the last tile: its slots as loaded (PagedTail)
        const PagedTail tail = paged_tail(k0, tile.seq.nk);
        const int end = kv_end(w, tile.seq), r = w.q0 + wrow0 + lane / 4;
        int last[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          last[hh] = end - 1;
          if constexpr (IS_CAUSAL) last[hh] = min(last[hh], last_key(r + 8 * hh, tile.seq, sched.group));
        }
        mask_paged_tail<NTILES>(acc.s, lane, last, k0, tail.seg, tail.shift);
        return;
      }
    }
    if constexpr (PACK_GQA) {   // each row half's own diagonal (the warp's first row's is the lowest)
      const int end = kv_end(w, tile.seq), r = w.q0 + wrow0 + lane / 4;
      if (k0 + BC > end || (IS_CAUSAL && k0 + BC - 1 > last_key(w.q0 + wrow0, tile.seq, sched.group))) {
        const int last[2] = {IS_CAUSAL ? last_key(r, tile.seq, sched.group) : end - 1,
                             IS_CAUSAL ? last_key(r + 8, tile.seq, sched.group) : end - 1};
        mask_slab_to<NTILES>(acc.s, lane, last, c0, end);
        if (CACHE_LENS && c0 < k0) mask_below<NTILES>(acc.s, lane, c0, k0);
      }
      return;
    }
    const int diag0 = w.q0 + wrow0 + (MASK_BR ? tile.seq.nk - tile.seq.nq : 0);   // the warp's first row's last key (the batch's: params, no register held)
    if (k0 + BC > kv_end(w, tile.seq) || (IS_CAUSAL && k0 + BC - 1 > diag0)) {
      mask_slab<NTILES, IS_CAUSAL>(acc.s, lane, diag0, c0, kv_end(w, tile.seq));
      if (CACHE_LENS && c0 < k0) mask_below<NTILES>(acc.s, lane, c0, k0);
    }
  }
  // Until a K/V stage has landed (GATHER_KV: its copies' writes then made visible to the tensor cores)
  FT_DEVICE void wait_kv(MbarRing<STAGES>& ring, const KvState& p) {
    ring.wait(p);
    if constexpr (GATHER_KV) fence_proxy_async_smem();
  }
  // This thread is done with a K/V stage (MULTICAST: and, from lane 0, this warp in the other CTA,
  // whose copy fills this stage's twin there).
  FT_DEVICE void free_kv(MbarRing<STAGES>& ring, const KvState& p) {
    ring.release(p);
    if (MULTICAST && lane == 0) mbar_arrive_remote(&ring.empty[p.index()], cluster_rank() ^ 1);
  }
  // S of tile t has landed: its K stage may be refilled and, after the last S, Q too, so the next
  // work tile's Q streams in under this one's last softmax, P V and epilogue.
  FT_DEVICE void release_k(int t) {
    free_kv(bar.k, kv + t);
    if (t == own - 1) bar.q.release(q);
  }
  // the first S of a work tile has landed: its softmax starts the tile's O
  FT_DEVICE void first_softmax() {
    wgmma_pin(acc.s);
    release_k(0);
    mask(0);
    softmax_advance(acc.s, acc.m, acc.l, acc.alpha, scale_log2);
    make_p();
  }
  // PACK_GQA: where the tile's rows go in O and the LSE, and where its rows end (packed_rows: whole groups)
  FT_DEVICE PackedRows packed_places() const { return PackedRows{out.sn, out.sh, sched.group, out.nq}; }
  FT_DEVICE int packed_end() const { return min(tile.seq.nq, w.q0 + packed_rows<BR>(sched.group)); }

  FT_DEVICE void epilogue() {
#if VARLEN
    float* lse_bh = out.lse + static_cast<long long>(w.h) * out.lse_rows + tile.seq.q0;
#else
    float* lse_bh = out.lse + static_cast<long long>(w.b * out.heads + (PACK_GQA ? w.h * sched.group : w.h)) * out.nq;
#endif
#if SPLIT_KV
    if (gridDim.z > 1) {   // this split's share: O / l in fp32 and the LSE, to the workspace (the tiles' rows)
      const long long rows = (static_cast<long long>(blockIdx.z) * out.split.bhs + w.b * (PACK_GQA ? out.heads / sched.group : out.heads) +
                              w.h) * (PACK_GQA ? tile.seq.nq : out.nq);
      store_slab<FT_F32, DTILES, D_VALID>(out.split.o + rows * D_VALID, D_VALID, out.split.lse + rows, acc.o, acc.m,
                                          acc.l, lane, w.q0 + wrow0, PACK_GQA ? packed_end() : out.nq, scale_log2);
      return;
    }
#elif TAIL_SPLIT
    // a slot per cut, cluster CTA (MULTICAST: each runs its own block of the cut pair) and consumer warp
    const int cut_slot = MULTICAST ? tile.cut * CLUSTER + static_cast<int>(cluster_rank()) : tile.cut;
    if (tile.cut >= 0 && !join_halves<DTILES>(out.split, cut_slot * (CWG * 4) + wrow0 / 16, acc.o, acc.m, acc.l, lane, scale_log2))
      return;   // the first half of its cut tile here: its partial waits in the workspace for the second
#endif
    if constexpr (TMA_STORE) {
      store_slab_tma<OUT_DTYPE, DTILES>(o_slab, out.tmap, lse_bh, acc.o, acc.m, acc.l, lane, w.q0 + wrow0, out.nq, w.h, w.b,
                                        scale_log2);
    } else if constexpr (PACK_GQA) {
      store_rows<OUT_DTYPE, DTILES, D_VALID>(out.o + w.b * out.sb + w.h * sched.group * out.sh, packed_places(), lse_bh, acc.o,
                                             acc.m, acc.l, lane, w.q0 + wrow0, packed_end(), scale_log2);
    } else {
      store_slab<OUT_DTYPE, DTILES, D_VALID>(out.o + (VARLEN ? tile.seq.q0 * out.sn : w.b * out.sb) + w.h * out.sh, out.sn,
                                             lse_bh, acc.o, acc.m, acc.l, lane, w.q0 + wrow0, tile.seq.nq, scale_log2);
    }
  }

  // OWN_TILES: tiles [from, ntiles) are not this consumer's. It computes nothing for them, but
  // before each of its ping-pong turns it waits on the same K/V tiles a consumer running them
  // would (so the others' barriers and turns meet as they do on the full path, and no new wait
  // can deadlock), and frees each one as soon as it has landed, since it never reads them.
  FT_DEVICE void pass(int from) {
    auto skip = [&](MbarRing<STAGES>& ring, int t) {
      ring.wait(kv + t);
      free_kv(ring, kv + t);
    };
    if (from == 0) bar.q.release(q);   // Q unread: free it at once
    if constexpr (OVERLAP) {
      // a full consumer's turn t issues S of tile t and P V of tile t - 1 (t = ntiles: the last
      // P V alone); turns before `from`, and P V of from - 1, were this consumer's own
      for (int t = from; t <= w.ntiles; ++t) {
        if (t < w.ntiles) skip(bar.k, t);
        if (t > from) skip(pv, t - 1);
        if (t > from || from == 0) {
          turn_begin();
          turn_end();
        }
      }
    } else {
      for (int t = from; t < w.ntiles; ++t) {   // turns: S of tile t, then P V of tile t
        skip(bar.k, t);
        turn_begin();
        turn_end();
        skip(pv, t);
        turn_begin();
        turn_end();
      }
    }
  }

  // on to work tile it + 1 (`next`, already taken), this one's K/V tiles done
  FT_DEVICE void advance(int it, const DrawnTile& next) {
    kv.advance(w.ntiles);
    tile = next;
    w = work_of(sched, tile);
    own = w.ntiles;
    q = QState{it + 1};
  }

  // K/V tiles [0, clean_tiles()) need no mask on any of this consumer's 64 rows: whole tiles of
  // keys, all at or before its first row's diagonal.
  FT_DEVICE int clean_tiles() const {
    int n = kv_end(w, tile.seq) / BC;
    if constexpr (PACK_GQA && IS_CAUSAL) n = min(n, max(0, last_key(w.q0 + cw * 64, tile.seq, sched.group) + 1) / BC);
    else if constexpr (IS_CAUSAL) n = min(n, max(0, w.q0 + cw * 64 + (MASK_BR ? tile.seq.nk - tile.seq.nq : 0) + 1) / BC);
    return n - kv_tile(w, 0);   // run-relative (a split's first tile is kv_tile(w, 0))
  }

  // One overlapped K/V tile t >= 1: S of tile t goes out with P V of tile t-1, and the softmax of
  // tile t runs while P V is still in flight; O is rescaled only once that has landed. MASKED: the
  // tile may need keys masked. The tiles that never do run without the mask's test, so the loop body
  // is one block for ptxas, which then waits for P V after the row maxima and the first exp2s; with
  // the test's branch it hoisted that wait to the top of the softmax's block, and the softmax no
  // longer ran under P V (ncu on the H100: 13% of the consumers' stall samples on that wait, and
  // 0.1% on FA4's, whose loop has no mask either; benchmarks/PERF_NOTES.md, "m1").
  template <bool MASKED> FT_DEVICE void overlapped_tile(int t) {
    wait_kv(bar.k, kv + t);
    wait_kv(pv, kv + (t - 1));
    turn_begin();
    wgmma_pin(acc.o);
    wgmma_fence();
    issue_s(acc.s, q_desc(q), k_desc(kv + t));      // S of tile t
    issue_pv(acc.o, acc.p, desc_p, v_desc(kv + (t - 1)));   // O += P V of tile t-1
    turn_end();
    wgmma_wait<1>();                                // S of tile t has landed; P V may still run
    wgmma_pin(acc.s);
    release_k(t);
    if constexpr (MASKED) mask(t);
    const bool move = softmax_advance<NTILES, LAZY_RESCALE>(acc.s, acc.m, acc.l, acc.alpha, scale_log2);
    wgmma_wait<0>();                                // P V of tile t-1 has landed
    wgmma_pin(acc.o);
    free_kv(pv, kv + (t - 1));
    make_p();                                       // before the branch: its packs run under the exp2s
    if (move) rescale_rows(acc.o, acc.alpha);
  }

  // The schedule of one work tile, overlapped: its first S and softmax, then overlapped_tile for
  // the rest, the tiles that need no mask first. `chained`: its first S and softmax ran at the last
  // work tile's end. CHAIN: the next work tile's first S goes out with this one's last P V, which
  // `next` (taken here) names.
  FT_DEVICE void overlapped(int it, bool chained, DrawnTile& next) {
    if (!chained) {
      wait_kv(bar.k, kv);
      turn_begin();
      wgmma_fence();
      issue_s(acc.s, q_desc(q), k_desc(kv));          // S of tile 0
      turn_end();
      wgmma_wait<0>();
      first_softmax();
    }
    int t = 1;
    if constexpr (PEEL_MASKS)
      for (const int clean = min(own, clean_tiles()); t < clean; ++t) overlapped_tile<false>(t);
    for (; t < own; ++t) overlapped_tile<true>(t);
    // The last P V (CHAIN: and the next tile's first S). After the CTA's last tile that S is
    // issued all the same, on whatever the buffers hold, and dropped: a test between the wgmma
    // instructions would make ptxas serialize them (C7519).
    const int n = own;
    const QState q_next{it + 1};
    if (CHAIN) next = sched.take(bar.tiles, it + 1);
    if (CHAIN && !sched.done(next)) {
      bar.q.wait(q_next);
      wait_kv(bar.k, kv + n);
    }
    wait_kv(pv, kv + (n - 1));
    turn_begin();
    wgmma_pin(acc.o);
    wgmma_fence();
    issue_pv(acc.o, acc.p, desc_p, v_desc(kv + (n - 1)));
    if constexpr (CHAIN) issue_s(acc.s, q_desc(q_next), k_desc(kv + n));
    turn_end();
    wgmma_wait<CHAIN ? 1 : 0>();                      // this tile's last P V has landed
    wgmma_pin(acc.o);
    free_kv(pv, kv + (n - 1));
  }

  // The schedule of one work tile without overlap: per K/V tile, S, its softmax, then P V.
  FT_DEVICE void serial() {
    for (int t = 0; t < own; ++t) {
      wait_kv(bar.k, kv + t);
      turn_begin();
      wgmma_fence();
      issue_s(acc.s, q_desc(q), k_desc(kv + t));
      turn_end();
      wgmma_wait<0>();
      wgmma_pin(acc.s);
      release_k(t);
      mask(t);
      const bool move = softmax_advance<NTILES, LAZY_RESCALE>(acc.s, acc.m, acc.l, acc.alpha, scale_log2);
      make_p();
      if (move) rescale_rows(acc.o, acc.alpha);
      wait_kv(pv, kv + t);
      turn_begin();
      wgmma_pin(acc.o);
      wgmma_fence();
      issue_pv(acc.o, acc.p, desc_p, v_desc(kv + t));
      turn_end();
      wgmma_wait<0>();
      wgmma_pin(acc.o);
      free_kv(pv, kv + t);
    }
  }

#if SPLIT_KV
  // SPLIT_KV: once every consumer's share is out, the work tile's last split to arrive merges all
  // of them into its rows of O and the LSE (split_kv.cuh). `w` is still the CTA's one work tile.
  FT_DEVICE void merge() {
    const int ctid = threadIdx.x - 128;
    if (!last_split(out.split, sched.qblk + sched.n_qblk * sched.bh, gridDim.z, MERGE_BAR, CWG * 128, ctid == 0,
                    bar.last_split))
      return;
    if constexpr (PACK_GQA) {   // the workspace holds the tiles' rows; O and the LSE the heads' queries
      const int h0 = w.h * sched.group;
      merge_rows<D_VALID, OUT_DTYPE>(out.split, gridDim.z, w.b * (out.heads / sched.group) + w.h, tile.seq.nq, w.q0,
                                     packed_end() - w.q0, out.o + w.b * out.sb + h0 * out.sh, packed_places(),
                                     out.lse + static_cast<long long>(w.b * out.heads + h0) * out.nq, ctid / 32, CWG * 4, lane);
      return;
    }
    const int bh = w.b * out.heads + w.h;
    merge_splits<D_VALID, OUT_DTYPE>(out.split, gridDim.z, bh, out.nq, w.q0, BR, out.o + w.b * out.sb + w.h * out.sh, out.sn,
                                      out.lse + static_cast<long long>(bh) * out.nq, ctid / 32, CWG * 4, lane);
  }
#endif

  FT_DEVICE void run() {
    if constexpr (PINGPONG) { if (cw == CWG - 1) named_arrive(1, 256); }   // consumer 0 goes first
    tile = sched.take(bar.tiles, 0);
    w = work_of(sched, tile);
    own = w.ntiles;
    for (int it = 0; !sched.done(tile); ++it) {
      const bool chained = CHAIN && it > 0;   // this tile's first S and softmax ran at the last one's end
      if (!chained) {
        acc.reset();
        bar.q.wait(q);
      }
      own = own_tiles(w, tile.seq, cw, sched.group);
      if (OWN_TILES && own == 0) {
        pass(0);
        advance(it, sched.take(bar.tiles, it + 1));
        continue;
      }
      if constexpr (OVERLAP) {
        DrawnTile next{};
        overlapped(it, chained, next);
        if constexpr (CHAIN) {   // O goes out while the next tile's first S runs, then its softmax
          epilogue();
          wgmma_wait<0>();
          advance(it, next);
          if (sched.done(tile)) break;
          acc.reset();
          first_softmax();
          continue;
        }
      } else {
        serial();
      }
      if (OWN_TILES) pass(own);   // the tiles past this consumer's diagonal, before its epilogue
      epilogue();
      advance(it, sched.take(bar.tiles, it + 1));
    }
    if constexpr (PINGPONG) { if (cw == 0) named_sync(1, 256); }   // the last consumer's final hand-over
    if (TMA_STORE && lane == 0) bulk_wait<0>();   // the slab stays until its last store is done
#if SPLIT_KV
    if (gridDim.z > 1) merge();
#endif
  }
};

// The tensor maps of Q, K, V and O (read only with TMA_STORE), then K's tail panel's (read only with
// K_TAIL), come by value (kernel_templates/sm90_tma.py).
#if CLUSTER > 1
#define FT_CLUSTER_DIMS __cluster_dims__(CLUSTER, 1, 1)
#else
#define FT_CLUSTER_DIMS
#endif
extern "C" __global__ void __launch_bounds__(NT, 1) FT_CLUSTER_DIMS
    flash_fwd_sm90(FT_ATTENTION_PARAMS(T), const __grid_constant__ TmaMap tmap_q, const __grid_constant__ TmaMap tmap_k,
                   const __grid_constant__ TmaMap tmap_v, const __grid_constant__ TmaMap tmap_o,
                   const __grid_constant__ TmaMap tmap_kt, int batch,
                   int* __restrict__ tile_counter FT_VARLEN_PARAMS FT_SPLIT_PARAMS FT_CACHE_PARAMS) {
  extern __shared__ unsigned char smem_raw[];
  const Tiles sm(smem_raw);
  Barriers& bar = *sm.bar;
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0);   // warp-uniform
  // The batch's lengths, or (VARLEN on the grid: one work tile per CTA) this CTA's sequence's; a
  // persistent VARLEN CTA gets each tile's sequence from the producer (TileScheduler). VARLEN's order
  // (the launch's, x fastest, or the persistent tiles'): sequence after sequence, each one's query
  // blocks heaviest first (qblk 0, work_tile's last rows), the heads fastest (a K/V group's heads
  // together, one sequence's K/V in L2). Head after head over every sequence's blocks left the last
  // head's long sequences' heavy blocks to the end: 1.12-1.18 of the ideal time at d=64 and d=256 in
  // a list-scheduling model, 1.02-1.04 this way (benchmarks/PERF_NOTES.md, "v5, v6").
  // PACK_GQA: the tiles' rows are a K/V head's g query heads x its queries, their heads the K/V heads
  const int group = PACK_GQA ? (GQA_GROUP ? GQA_GROUP : kv_group) : 1;
  const int tile_heads = heads / group;
#if VARLEN
  int2 blk = make_int2(0, 0);
  if constexpr (!PERSISTENT) blk = varlen_block<BR>(cu_q, nseq, blockIdx.x + blockIdx.y * gridDim.x, heads);
  if (blk.x < 0) return;
  const int qblk = blk.y / heads, bh = blk.x * heads + blk.y % heads;
  const bool sections = false;   // varlen's own order, above
  const int bhs = 0, sec = 0, last = 0;
  // persistent: none of its own; the longest lengths, where the producer's walk starts
  const Sequence seq = PERSISTENT ? Sequence{nq, 0, 0, 0} : FT_SEQUENCE(blk.x);
  const int n_qblk = 1, total = 1;   // persistent: the producer finds where the tiles end (TileScheduler)
  const int *offsets_q = cu_q, *offsets_k = cu_k, packed = nseq;
#else
  // causal work in sections of `sec` heads where batch x heads (the grid's y) is at most the SM
  // count, worked out once here: on the grid the block the hardware hands out in this place of its
  // order (x fastest) is the scheduler's in that place (causal_tile); else (query block, batch-head)
  const int bhs = batch * tile_heads, rows = nq * group;
  const bool sections = IS_CAUSAL && causal_sections(bhs);
  // PERSISTENT: the work tiles are n_qblk x batch-heads (MULTICAST: pairs of query blocks)
  const int block_rows = PACK_GQA ? packed_rows<BR>(group) : CLUSTER * BR;
  const int n_qblk = (rows + block_rows - 1) / block_rows;
  const int sec = sections ? section_heads(bhs, kv_group / group, nk, D_VALID * static_cast<int>(sizeof(T))) : 0;
  const int last = sections ? last_section(bhs, sec) : 0;
  const int2 grid_at = IS_CAUSAL && !PERSISTENT && sections
                           ? causal_tile(blockIdx.x + blockIdx.y * gridDim.x, gridDim.x, bhs, sec, last)
                           : make_int2(blockIdx.x, blockIdx.y);
  const int qblk = grid_at.x, bh = grid_at.y;
  const Sequence seq{rows, FT_HELD_KEYS(bh / tile_heads), 0, 0};   // CACHE_LENS: the keys batch b holds
  const int total = PERSISTENT ? n_qblk * bhs : 1;
  const int *offsets_q = nullptr, *offsets_k = nullptr, packed = 0;
#endif
#if TAIL_SPLIT
  const int from = tail_from, segs = tail_from < total ? static_cast<int>(gridDim.x) / CLUSTER : 0;   // a segment a cluster
#else
  const int from = total, segs = 0;
#endif
  const Scheduler sched{qblk, bh, n_qblk, total, tile_heads, kv_group / group, seq, bhs, sec, last, sections, offsets_q,
                        offsets_k, packed, from, segs, group};

  if (tid == 0) {
    bar.q.init(1, CWG * 128);
    bar.tiles.init(1, CWG * 128 + (FP8 ? TRANSPOSERS : 0));
    bar.k.init(GATHER_KV ? 128 : 1, CWG * 128 + MULTICAST_FREES);
    bar.v.init(GATHER_KV ? 128 : 1, FP8 ? TRANSPOSERS : CWG * 128 + MULTICAST_FREES);
    if constexpr (FP8) bar.vt.init(TRANSPOSERS, CWG * 128);
    mbar_fence_init();
  }
  if constexpr (MULTICAST) cluster_sync();   // both CTAs' barriers set up before either copies into the other
  else __syncthreads();

  if (wg == 0) {
    if constexpr (PRODUCER_REGS > 0) regs_shrink<PRODUCER_REGS>();
    // the producer's threads: its warpgroup (GATHER_KV), a warp, or one thread; thread 0 leads
    constexpr int PRODUCERS = GATHER_KV ? 128 : WARP_PRODUCER || WARP_PAGES ? 32 : 1;
    if (PRODUCERS == 1 ? tid == 0 : tid < PRODUCERS) {   // (tid < 1 cost ptxas its proof of one thread)
#if GATHER_KV
      const Pages pages{block_table + static_cast<long long>(bh / tile_heads) * bt_stride,
                        KvSource{k, static_cast<int>(k_sb), static_cast<int>(k_sh), static_cast<int>(k_sn)},
                        KvSource{v, static_cast<int>(v_sb), static_cast<int>(v_sh), static_cast<int>(v_sn)}};
#elif CACHE_PAGES
      const Pages pages{block_table + static_cast<long long>(bh / tile_heads) * bt_stride};
#else
      const Pages pages{};
#endif
      producer(sm, bar, sched, &tmap_q, &tmap_k, &tmap_v, &tmap_kt, tile_counter, PRODUCERS == 1 || tid == 0, pages);
    } else if (FP8 && tid >= 128 - TRANSPOSERS) {
      transpose_v(sm, bar, sched, tid / 32 - (4 - TRANSPOSERS / 32));
    }
  } else {
    if constexpr (CONSUMER_REGS > 0) regs_grow<CONSUMER_REGS>();
    const int cw = wg - 1, lane = tid % 32;
    const int wrow0 = cw * 64 + ((tid / 32) % 4) * 16;
    const Output out{reinterpret_cast<TO*>(o), lse, o_sb, o_sh, o_sn, heads, nq,
#if VARLEN
                     total_q,
#else
                     0,
#endif
                     &tmap_o
#if SPLIT_KV || TAIL_SPLIT
                     , SplitWorkspace{part_o, part_lse, split_counter, batch * tile_heads}
#endif
    };
    if (TMA_STORE && lane == 0) tmap_prefetch(tmap_o);   // this warp's slabs go out through O's map
    Consumer c(bar, sched, out, scale_log2, cw, lane, wrow0,
               wgmma_desc<ROW_BYTES>(smem_u32(sm.q) + cw * 64 * ROW_BYTES, 16, 8 * ROW_BYTES),
               wgmma_desc<ROW_BYTES>(smem_u32(sm.k), 16, 8 * ROW_BYTES),
               FP8 ? wgmma_desc(smem_u32(sm.vt), 16, 1024) : wgmma_desc<ROW_BYTES>(smem_u32(sm.v), BC * ROW_BYTES, 8 * ROW_BYTES),
               smem_u32(sm.o) + (wrow0 / 16) * 16 * HEAD_DIM * static_cast<unsigned>(sizeof(TO)),
               smem_u32(sm.p) + cw * P_BYTES);
    c.run();
  }
  // MULTICAST: the other CTA's consumers free stages here and its copies land here until it is done
  if constexpr (MULTICAST) cluster_sync();
}
