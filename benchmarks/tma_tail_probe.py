"""The copy engine alone, streaming d=80 K/V rows (160 bytes) into shared memory as flash_decode's
ring takes them, box by box, in each form a tile's last panel could come: what each costs in time
and, under Nsight Compute, in L2 sectors and DRAM bytes. Why: a 64-column panel box whose row lies
mostly past the tensor's columns (d = 80: columns 64-127 of 80) is not free; the copy engine asked
L2 for 1.33x the sectors of a 64 + 16-column pair and streamed 0.95x as fast (PERF_NOTES "y2").

    python3 benchmarks/tma_tail_probe.py                      # time each form (TB/s of the rows)
    ncu --metrics dram__bytes_read.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_read_lookup_hit.sum \\
        python3 benchmarks/tma_tail_probe.py --once           # one launch of each, for the profiler

Each CTA (2048 of them, one thread issuing) streams its 16384 rows through a 4-slot ring of boxes of
TK rows; no math, so the figure is the copy engine's and the memory's alone. The forms (MODES):
two 64-column boxes of 128-byte rows (the 128-column tile), 64 + a 16-column tail of 32-byte rows
(flash_decode's ring at d = 72-80), one 80-column box unswizzled, one 1-D bulk copy of the rows,
five 16-column boxes, and a d = 64 tensor's single box for scale.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

MODES = {0: "2 x 64 columns, 128-byte swizzle (the 128-column tile)", 1: "64 + 16-column tail (32-byte swizzle)",
         2: "one 80-column box, no swizzle", 3: "1-D bulk copy of the rows", 4: "5 x 16 columns, 32-byte swizzle",
         5: "d=64 rows, one 64-column box"}

SOURCE = r'''
struct __align__(64) Map { unsigned long long o[16]; };
__device__ __forceinline__ unsigned s32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void expect(unsigned long long* b, unsigned n) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(s32(b)), "r"(n) : "memory"); }
__device__ __forceinline__ void wait_parity(unsigned long long* b, unsigned ph) {
  asm volatile("{\n.reg .pred d;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n@!d bra W_%=;\n}"
               ::"r"(s32(b)), "r"(ph) : "memory"); }
__device__ __forceinline__ void box(void* dst, const Map* m, unsigned long long* b, int col, int row) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
               ::"r"(s32(dst)), "l"(m), "r"(s32(b)), "r"(col), "r"(row) : "memory"); }
__device__ __forceinline__ void bulk(void* dst, const void* src, unsigned n, unsigned long long* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(s32(dst)), "l"(src), "r"(n), "r"(s32(b)) : "memory"); }
constexpr int SLOTS = 4, SLOT_BYTES = 256 * TK;
extern "C" __global__ void stream(const __grid_constant__ Map wide, const __grid_constant__ Map narrow,
                                  const char* rows, int rows_per_cta, float* sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* ring = raw + ((1024 - (s32(raw) & 1023)) & 1023);
  __shared__ unsigned long long full[SLOTS];
  if (threadIdx.x == 0) {
    for (int s = 0; s < SLOTS; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(s32(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int stages = rows_per_cta / TK, row0 = blockIdx.x * rows_per_cta;
  auto issue = [&](int t) {
    const int s = t % SLOTS, r = row0 + t * TK;
    unsigned char* d = ring + s * SLOT_BYTES;
#if MODE == 0
    expect(&full[s], 256 * TK); box(d, &wide, &full[s], 0, r); box(d + 128 * TK, &wide, &full[s], 64, r);
#elif MODE == 1
    expect(&full[s], 160 * TK); box(d, &wide, &full[s], 0, r); box(d + 128 * TK, &narrow, &full[s], 64, r);
#elif MODE == 2
    expect(&full[s], 160 * TK); box(d, &wide, &full[s], 0, r);
#elif MODE == 3
    expect(&full[s], 160 * TK); bulk(d, rows + (long long)r * 160, 160 * TK, &full[s]);
#elif MODE == 4
    expect(&full[s], 160 * TK); for (int p = 0; p < 5; ++p) box(d + p * 32 * TK, &narrow, &full[s], 16 * p, r);
#else
    expect(&full[s], 128 * TK); box(d, &wide, &full[s], 0, r);
#endif
  };
  float acc = 0.f;
  for (int t = 0; t < SLOTS && t < stages; ++t) issue(t);
  for (int t = 0; t < stages; ++t) {
    wait_parity(&full[t % SLOTS], (t / SLOTS) & 1);
    acc += (float)ring[(t % SLOTS) * SLOT_BYTES + (t & 63)];   // a read of each stage, as a consumer's
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (t + SLOTS < stages) issue(t + SLOTS);
  }
  if (acc == 1234567.f) sink[0] = acc;
}
'''


def _ok(result):
    """cuda.bindings' (error, value...) tuple: the value(s), or RuntimeError naming the error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else rest


def cubin(mode: int, tk: int) -> bytes:
    """The probe kernel of form `mode` with stages of `tk` rows, for sm_90a (NVRTC: no GPU needed)."""
    from cuda.bindings import nvrtc

    prog = _ok(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"tma_tail_probe.cu", 0, [], []))
    opts = [b"--gpu-architecture=sm_90a", f"-DMODE={mode}".encode(), f"-DTK={tk}".encode(), b"-std=c++17"]
    if int(nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]) != 0:
        log = b" " * _ok(nvrtc.nvrtcGetProgramLogSize(prog))
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.decode())
    out = b" " * _ok(nvrtc.nvrtcGetCUBINSize(prog))
    _ok(nvrtc.nvrtcGetCUBIN(prog, out))
    return out


def _kernel(mode: int, tk: int):
    from cuda.bindings import driver

    return _ok(driver.cuModuleGetFunction(_ok(driver.cuModuleLoadData(cubin(mode, tk))), b"stream"))


def _map(t, cols: int, box_cols: int, box_rows: int):
    """A 2-d map of the (rows, cols) bf16 tensor t, boxes of box_rows x box_cols, swizzled as wide
    as a box row where that is 32, 64 or 128 bytes."""
    from cuda.bindings import driver as dr

    sw = dr.CUtensorMapSwizzle
    swizzle = {128: sw.CU_TENSOR_MAP_SWIZZLE_128B, 64: sw.CU_TENSOR_MAP_SWIZZLE_64B,
               32: sw.CU_TENSOR_MAP_SWIZZLE_32B}.get(box_cols * 2, sw.CU_TENSOR_MAP_SWIZZLE_NONE)
    m = _ok(dr.cuTensorMapEncodeTiled(
        dr.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(),
        [dr.cuuint64_t(cols), dr.cuuint64_t(t.shape[0])], [dr.cuuint64_t(cols * 2)],
        [dr.cuuint32_t(box_cols), dr.cuuint32_t(box_rows)], [dr.cuuint32_t(1)] * 2,
        dr.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        dr.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE, dr.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    return (ctypes.c_uint64 * 16)(*[int(w) for w in m.opaque])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--once", action="store_true", help="one launch of each form (for ncu), nothing timed")
    ap.add_argument("--rows-per-cta", type=int, default=16384)
    a = ap.parse_args(argv)
    import torch
    from cuda.bindings import driver as dr

    if not torch.cuda.is_available():
        print("tma_tail_probe needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability() < (9, 0):
        print("tma_tail_probe needs sm_90 or later (the copy engine's tensor maps)", file=sys.stderr)
        return 2
    ctas = 2048
    rows = torch.randn(ctas * a.rows_per_cta, 80, device="cuda", dtype=torch.bfloat16)
    rows64 = torch.randn(ctas * a.rows_per_cta, 64, device="cuda", dtype=torch.bfloat16)
    sink = torch.zeros(1, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for tk in (64, 128):
        for mode, what in MODES.items():
            fn = _kernel(mode, tk)
            t = rows64 if mode == 5 else rows
            wide = _map(t, t.shape[1], {2: 80}.get(mode, 64), tk)
            narrow = _map(t, t.shape[1], 16, tk)
            smem = 4 * 256 * tk + 1024
            _ok(dr.cuFuncSetAttribute(fn, dr.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
            values = [wide, narrow, ctypes.c_uint64(t.data_ptr()), ctypes.c_int(a.rows_per_cta), ctypes.c_uint64(sink.data_ptr())]
            params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])

            def launch() -> None:
                _ok(dr.cuLaunchKernel(fn, ctas, 1, 1, 32, 1, 1, smem, stream, ctypes.addressof(params), 0))
            launch()
            torch.cuda.synchronize()
            if a.once:
                print(f"TK={tk} mode {mode}: {what}", flush=True)
                continue
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            ms = min(times)
            print(f"TK={tk:3d} mode {mode} {what:55s} {ms:7.3f} ms {t.numel() * 2 / ms / 1e9:6.3f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
