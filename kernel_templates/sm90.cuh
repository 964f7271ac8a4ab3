// flashtune: Hopper building blocks (sm_90a) as inline PTX: mbarriers, bulk tensor copies (TMA),
// wgmma descriptors and fences, register reallocation between warpgroups.
#pragma once
#include "common.cuh"

FT_DEVICE unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// ---- mbarriers (one 8-byte word of shared memory each) ----
FT_DEVICE void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
// Makes the initialised barriers visible to the async proxy (TMA's complete_tx) before use.
FT_DEVICE void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
FT_DEVICE void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
FT_DEVICE void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// An arrival on `bar` once this thread's cp.async copies issued so far have landed (.noinc: it is one
// of the arrivals the barrier was initialised to count), so a filler posts a stage without waiting.
FT_DEVICE void mbar_arrive_on_copies(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Blocks until the phase with this parity has completed.
FT_DEVICE void mbar_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}

// ---- clusters (thread block clusters of sm_90) ----
// This CTA's rank in its cluster.
FT_DEVICE unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// An arrival on the mbarrier at `bar`'s offset in the shared memory of cluster CTA `rank`, with
// mbarrier.arrive's default ordering (release at CTA scope): what it signals is that this warp's
// wgmma reads of a stage are done, which their wait already saw; a cluster-scope release made each
// warp wait for its own earlier memory accesses first (0.79x on the H100, PERF_NOTES "c1").
FT_DEVICE void mbar_arrive_remote(unsigned long long* bar, unsigned rank) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_u32(bar)), "r"(rank)
      : "memory");
}
// Every thread of every CTA of the cluster, until all have arrived: the cluster's barriers are then
// initialised (before the first copy into another CTA), or no longer used (before a CTA exits).
FT_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// `p` (in this CTA's shared memory) as the same offset in cluster CTA `rank`'s, for ld_cluster.
FT_DEVICE unsigned cluster_map(const void* p, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
  return r;
}
// Loads from another CTA's shared memory (an address from cluster_map), after a cluster_sync that
// followed the owner's stores.
FT_DEVICE float ld_cluster(unsigned addr) {
  float x;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(addr) : "memory");
  return x;
}
FT_DEVICE float4 ld_cluster4(unsigned addr) {
  float4 x;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(addr) : "memory");
  return x;
}

// ---- TMA: a 4-d box (d, n, h, b) of a tensor map ----
// A map is a kernel parameter passed by value (`const __grid_constant__ TmaMap`), so it lives in
// parameter space: the launch carries it, and no fence is needed before the copy engine reads it.
struct alignas(64) TmaMap {
  unsigned long long opaque[16];   // a CUtensorMap, encoded on the host (kernel_templates/sm90_tma.py)
};
// Brings a map into the copy engine's descriptor cache ahead of its first use.
FT_DEVICE void tmap_prefetch(const TmaMap& tmap) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(&tmap) : "memory");
}
FT_DEVICE void tma_load_4d(void* dst, const void* tmap, unsigned long long* bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
      ::"r"(smem_u32(dst)), "l"(tmap), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// A 5-d box (flash_fwd_sm90's packed GQA Q: columns, a K/V head's query heads, queries, K/V head, batch).
FT_DEVICE void tma_load_5d(void* dst, const void* tmap, unsigned long long* bar, int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
      ::"r"(smem_u32(dst)), "l"(tmap), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4) : "memory");
}
// The same box into this shared-memory offset of every CTA of the cluster in `ctas` (a bit per CTA
// rank), each CTA's mbarrier at `bar`'s offset counting the bytes it receives.
FT_DEVICE void tma_load_4d_multicast(void* dst, const void* tmap, unsigned long long* bar, int c0, int c1, int c2, int c3,
                                     unsigned short ctas) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n"
      ::"r"(smem_u32(dst)), "l"(tmap), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "h"(ctas) : "memory");
}
// Bulk tensor store of a shared-memory box to global memory (rows past the map's bounds are not
// written); completion is tracked per thread in bulk groups.
FT_DEVICE void tma_store_4d(const void* tmap, unsigned src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
               ::"l"(tmap), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
FT_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's bulk groups are still reading their shared memory source.
template <int N> FT_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
// Until at most N of this thread's bulk groups are still incomplete (writes done).
template <int N> FT_DEVICE void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy writes to shared memory made visible to the async proxy (wgmma, TMA stores).
FT_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- wgmma ----
// Shared-memory matrix descriptor for a swizzled operand: atoms of 8 rows x SWIZZLE bytes (128, 64
// or 32), the tile aligned to 8 x SWIZZLE bytes (the kernels align to 1024). K-major: `sbo` is the
// step between 8-row groups (8 rows x the swizzle width), `lbo` unused. MN-major: `lbo` is the step
// between column panels (one swizzle width each), `sbo` the step between 8-row groups.
// wgmma_fields: all of a descriptor but its start address (so that the descriptor of another
// operand laid out otherwise is this one's plus a constant: the fields' difference and the offset).
template <int SWIZZLE = 128>
__host__ __device__ constexpr unsigned long long wgmma_fields(unsigned lbo, unsigned sbo) {
  static_assert(SWIZZLE == 128 || SWIZZLE == 64 || SWIZZLE == 32, "128-, 64- or 32-byte swizzle");
  constexpr unsigned long long layout = SWIZZLE == 128 ? 1 : SWIZZLE == 64 ? 2 : 3;
  return (static_cast<unsigned long long>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<unsigned long long>((sbo & 0x3FFFF) >> 4) << 32) | (layout << 62);
}
template <int SWIZZLE = 128>
FT_DEVICE unsigned long long wgmma_desc(unsigned saddr, unsigned lbo, unsigned sbo) {
  return static_cast<unsigned long long>((saddr & 0x3FFFF) >> 4) | wgmma_fields<SWIZZLE>(lbo, sbo);
}
// The descriptor of the same operand `bytes` further on. Only the low word's 14-bit start address
// (in 16-byte units) moves, and it cannot carry out of the low word while the address stays in
// shared memory, so a plain 64-bit add: with the descriptor warp-uniform (the kernel keeps it so:
// the tile index and the warpgroup are shuffled from lane 0) it is one UIADD3.64 per wgmma. A
// split 32-bit add on the low word alone made ptxas rebuild the high word around every wgmma
// (R2UR and UMOV: 73 of a d=64 consumer's 476 instructions a K/V tile, SASS counts).
FT_DEVICE unsigned long long desc_advance(unsigned long long desc, unsigned bytes) {
  return desc + (bytes >> 4);
}
FT_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FT_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> FT_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keeps the compiler from moving reads or writes of accumulators across the async wgmma.
template <int R, int C> FT_DEVICE void wgmma_pin(float (&acc)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) asm volatile("" : "+f"(acc[i][j])::"memory");
}

// ---- register reallocation between warpgroups (needs a register cap at entry) ----
template <int N> FT_DEVICE void regs_grow() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> FT_DEVICE void regs_shrink() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Four 8 x 8 matrices of 16-bit elements to shared memory (sm_90): lanes 8m..8m+7 give the row
// addresses of matrix m, and each thread's register r_m holds its (row t/4, columns 2(t%4), +1).
FT_DEVICE void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1), "r"(r2),
               "r"(r3) : "memory");
}

// Named barrier among `count` threads (a multiple of 32); id 0 is __syncthreads'.
FT_DEVICE void named_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
FT_DEVICE void named_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
