"""Loading a cubin and launching an attention kernel on torch's current stream.

Shared by the search's worker and the runtime dispatcher, so what was timed is what runs. The
launch is the hot path of every `attention` call, so its arguments are packed once per plan: a
`Launcher` lays the kernel's parameters out in one buffer (the layout checked against the
driver's own), and a call writes the new values there with one `struct.pack_into` and hands the
driver that buffer's pointer array. Nothing is boxed per argument, nothing is copied host to
device, nothing synchronizes.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading
from dataclasses import dataclass

from .gpu import GpuSpec, visible
from .records import CompiledKernel

LOG2E = 1.4426950408889634
# What a softmax scale of 0 runs as (kernel_scale): times log2(e) a normal fp32 number, and scores
# below 1e20 times it leave every exponential at 1 (to fp32's precision), as 0 would.
ZERO_SCALE = 1e-30


def kernel_scale(q, scale: float | None):
    """q and the softmax scale as every kernel takes them: the scale finite and not negative.

    A kernel keeps each row's max of the raw scores q k^T and exponentiates (s - max) * scale, which
    is the max of the scaled scores only where the scale is not negative; with a negative one the
    exponents turn positive and overflow. q with its sign flipped and the scale's magnitude give the
    same products (and the same LSE), so those calls cost one elementwise pass over q (a sign-bit
    flip for e4m3, which has no negation) and nothing else changes. A scale of 0 would make a masked
    key's -inf * 0 a NaN, so it runs as ZERO_SCALE, nonzero in fp32 and too small to move any
    exponential off 1. None (1/sqrt(d)) passes."""
    if scale is None or 0.0 < scale < math.inf:
        return q, scale
    if scale == 0.0:
        return q, ZERO_SCALE
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")
    if q.element_size() == 1:   # float8: flip the sign bit (its strides kept, as -q keeps them)
        import torch

        return (q.view(torch.uint8) ^ 0x80).view(q.dtype), -scale
    return -q, -scale


class LaunchError(RuntimeError):
    """The launch itself was refused (resources, arguments): the context is still usable."""


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int


# Kernel parameter kinds: struct format, size and alignment (the C ABI: each parameter at the next
# multiple of its alignment). A tensor map (CUtensorMap) is 128 opaque
# bytes, 64-byte aligned, passed by value as a `__grid_constant__` parameter.
PARAM_KINDS: dict[str, tuple[str, int, int]] = {
    "ptr": ("Q", 8, 8),
    "i32": ("i", 4, 4),
    "i64": ("q", 8, 8),
    "f32": ("f", 4, 4),
    "tmap": ("128s", 128, 64),
}
# The parameters every attention family shares (kernel_templates/common.cuh, FT_ATTENTION_PARAMS):
# q, k, v, o, lse; heads, kv_group, nq, nk; the B/H/N strides of q, k, v, o; softmax scale * log2 e.
ATTENTION_PARAMS: tuple[str, ...] = ("ptr",) * 5 + ("i32",) * 4 + ("i64",) * 12 + ("f32",)


def param_layout(kinds: tuple[str, ...]) -> tuple[list[int], int]:
    """Each parameter's offset in a host buffer laid out by the C ABI, and the buffer's size."""
    offsets, end = [], 0
    for kind in kinds:
        _, size, align = PARAM_KINDS[kind]
        end = -(-end // align) * align
        offsets.append(end)
        end += size
    return offsets, end


def _check(err, what: str) -> None:
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"{what}: {getattr(err, 'name', err)}")


def _driver_layout(handle, n: int) -> list[tuple[int, int]] | None:
    """(offset, size) of each parameter as the loaded kernel declares them, where the driver says."""
    from cuda.bindings import driver

    get = getattr(driver, "cuKernelGetParamInfo", None)
    if get is None or type(handle).__name__ != "CUkernel":
        return None
    out = []
    for i in range(n + 1):
        err, offset, size = get(handle, i)
        if i == n:  # one past the last must not exist: the kernel takes exactly n parameters
            if err == driver.CUresult.CUDA_SUCCESS:
                raise LaunchError(f"the kernel takes more than the {n} parameters its family passes")
            break
        _check(err, f"cuKernelGetParamInfo({i})")
        out.append((offset, size))
    return out


class Launcher:
    """One kernel, one launch geometry, one parameter list: a call packs the values into a host
    buffer made once (laid out by the C ABI; the driver reads each parameter through its pointer)
    and launches on the given stream. Thread-safe (the buffer is reused under a lock; the
    driver copies the parameters before cuLaunchKernel returns)."""

    def __init__(self, handle, launch: Launch, kinds: tuple[str, ...], kernel=None) -> None:
        """`handle`: what is launched (a CUfunction, or a CUkernel); `kernel`: the CUkernel whose
        parameter sizes are checked against `kinds` (default: `handle`)."""
        offsets, size = param_layout(kinds)
        # The driver copies each parameter from its own pointer, so only the sizes must agree with
        # the kernel's: the device-side offsets are the driver's (on sm_90 a 64-byte aligned map
        # sits at offsets that are 64-byte aligned in the constant bank, which starts at 0x210).
        declared = _driver_layout(handle if kernel is None else kernel, len(kinds))
        sizes = [PARAM_KINDS[k][1] for k in kinds]
        if declared is not None and [s for _, s in declared] != sizes:
            raise LaunchError(f"parameter sizes {sizes} are not the kernel's {[s for _, s in declared]}")
        fmt, pos = "<", 0
        for kind, offset in zip(kinds, offsets):
            fmt += "x" * (offset - pos) + PARAM_KINDS[kind][0]
            pos = offset + PARAM_KINDS[kind][1]
        self._struct = struct.Struct(fmt)
        self.offsets, self.size = offsets, size
        self._buf = ctypes.create_string_buffer(size + 64)
        self._base = -ctypes.addressof(self._buf) % 64   # 64-byte aligned, for the tensor maps
        start = ctypes.addressof(self._buf) + self._base
        self._ptrs = (ctypes.c_void_p * len(kinds))(*(start + o for o in offsets))
        self._params = ctypes.addressof(self._ptrs)
        self._handle = handle
        self._geometry = (*launch.grid, *launch.block, launch.smem_bytes)
        self._lock = threading.Lock()
        lib = driver_library()
        # cuLaunchKernel straight into the driver library (ctypes: about 2 us less per call than
        # cuda.bindings' wrapper on the H100's host), where it loads
        self._raw = (lib.cuLaunchKernel, int(handle)) if lib is not None else None

    def pack(self, *values) -> bytes:
        """The parameter buffer a launch with `values` hands the driver (from its start)."""
        try:
            return self._struct.pack(*values)
        except struct.error as exc:
            raise LaunchError(f"bad kernel arguments: {exc}") from None

    def native_plan(self, ext, out_proto, scratch_lse, bind, layout):
        """This launch as a plan of the C++ call path (tuner/native.py), or None where the driver
        library is not reachable through ctypes."""
        if self._raw is None:
            return None
        fn, handle = self._raw
        return ext.Plan(ctypes.cast(fn, ctypes.c_void_p).value, handle, list(self._geometry), self.offsets,
                        self.size, out_proto, scratch_lse, bind, layout)

    def __call__(self, stream: int, *values) -> None:
        with self._lock:
            try:
                self._struct.pack_into(self._buf, self._base, *values)
            except struct.error as exc:
                raise LaunchError(f"bad kernel arguments: {exc}") from None
            if self._raw is not None:
                fn, handle = self._raw
                err = fn(handle, *self._geometry, stream, self._params, None)
            else:
                from cuda.bindings import driver

                err = int(driver.cuLaunchKernel(self._handle, *self._geometry, _stream(stream), self._params, 0)[0])
        if err:
            from cuda.bindings import driver

            name = driver.CUresult(err).name
            if err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:   # a thread that never used CUDA
                raise NoContextError(name)
            raise LaunchError(f"cuLaunchKernel: {name}")


class NoContextError(LaunchError):
    """This thread has no current CUDA context yet (see `launch_on`)."""


_driver: list = []


def driver_library():
    """The CUDA driver library through ctypes, its hot-path functions typed (None where it does
    not load by name: then cuda.bindings' wrappers are used)."""
    if not _driver:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            u32, vp = ctypes.c_uint, ctypes.c_void_p
            lib.cuLaunchKernel.restype = ctypes.c_int
            lib.cuLaunchKernel.argtypes = [vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp]
        except (OSError, AttributeError):
            lib = None
        _driver.append(lib)
    return _driver[0]


_stream_objects: dict[int, object] = {}


def _stream(handle: int):
    s = _stream_objects.get(handle)
    if s is None:
        from cuda.bindings import driver

        s = _stream_objects.setdefault(handle, driver.CUstream(handle))
    return s


def raw_stream(device_index: int) -> int:
    """torch's current stream on a device, as the raw handle (what inductor's generated code uses)."""
    import torch

    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


_device_getter: list = []


def current_device() -> int:
    """torch's current CUDA device (its private getter where it has one: a fifth of the public
    function's cost, on every launch)."""
    if not _device_getter:
        import torch

        torch.cuda.init()
        _device_getter.append(getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device))
    return _device_getter[0]()


def launch_on(launcher: Launcher, device_index: int, *values) -> None:
    """Launch on `device_index`'s current stream. A thread whose current device is another one, or
    that has no CUDA context yet, gets the device's for the launch and its own back afterwards."""
    if current_device() == device_index:
        try:
            return launcher(raw_stream(device_index), *values)
        except NoContextError:
            pass
    import torch
    from cuda.core import Device

    with torch.cuda.device(device_index):
        Device(device_index).set_current()   # the primary context, which torch's guard may not make current
        launcher(raw_stream(device_index), *values)


def _context_function(handle):
    """The CUfunction of a library kernel in the current context (the handle itself if the driver
    has no cuKernelGetFunction)."""
    from cuda.bindings import driver

    get = getattr(driver, "cuKernelGetFunction", None)
    if get is None or type(handle).__name__ != "CUkernel":
        return handle
    err, function = get(handle)
    _check(err, "cuKernelGetFunction")
    return function


def _set_max_dynamic_smem(kernel, nbytes: int, device_index: int) -> None:
    from cuda.bindings import driver

    handle = kernel.handle
    if type(handle).__name__ == "CUkernel":
        (err,) = driver.cuKernelSetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes, handle, device_index
        )
    else:
        (err,) = driver.cuFuncSetAttribute(
            handle, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes
        )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"cannot allow {nbytes} B of dynamic shared memory: {err.name}")


# An empty kernel the driver compiles itself (no NVRTC), to ask it how clusters pack the SMs.
_PROBE_PTX = b""".version 7.8
.target sm_90
.address_size 64
.visible .entry flashtune_one_sm_probe() { ret; }
"""


@functools.cache
def one_sm_clusters(gpu: GpuSpec, size: int) -> int | None:
    """Clusters of `size` CTAs that each fill an SM (all the shared memory a block may take) which
    the GpuSpec `gpu` runs at once, as the driver of the device at gpu.index counts them; None where
    it has no clusters (before sm_90), where that device is not this GPU (a reference spec) or where
    the driver cannot say. A cluster's CTAs share one GPC, and a GPU's GPCs keep different numbers
    of SMs, so this is not sm_count // size: PERF_NOTES "s3"."""
    import torch

    try:
        if gpu.major < 9 or gpu not in visible():
            return None
        from cuda.core import Device, LaunchConfig, ObjectCode

        with torch.cuda.device(gpu.index):
            dev = Device(gpu.index)
            dev.set_current()
            kernel = ObjectCode.from_ptx(_PROBE_PTX).get_kernel("flashtune_one_sm_probe")
            _set_max_dynamic_smem(kernel, gpu.smem_per_block_optin, gpu.index)
            # with a cluster size, cuda.core's grid counts clusters
            config = LaunchConfig(grid=1, cluster=size, block=32, shmem_size=gpu.smem_per_block_optin)
            return int(kernel.occupancy.max_active_clusters(config, stream=dev.default_stream))
    except Exception:   # an old driver or cuda.core: the caller's estimate stands
        return None


GPC_SMS = 16   # a Hopper GPC's SMs in clusters_at_once's estimate (the H100 SXM's driver counts fewer: s3)


def clusters_at_once(gpu: GpuSpec, size: int) -> int:
    """Clusters of `size` one-SM CTAs the GpuSpec `gpu` runs at once: on a device, its driver's count
    (one_sm_clusters: the H100 SXM measured holds 66 of 2 but 30 of 4 and 15 of 8, PERF_NOTES "s3");
    for a reference spec, an estimate: every SM in pairs, larger ones within whole 16-SM groups."""
    if (measured := one_sm_clusters(gpu, size)) is not None:
        return measured
    return gpu.sm_count // 2 if size == 2 else (gpu.sm_count // GPC_SMS) * (GPC_SMS // size)


class LoadedKernel:
    """A kernel loaded once on one device; `launcher` makes its packed launches."""

    def __init__(self, kernel, max_smem: int, device_index: int = 0, function=None) -> None:
        self.kernel = kernel
        self.max_smem = max_smem
        self.device_index = device_index
        # the kernel as a function of the device's context: launching a context-free library
        # kernel makes the driver find that function on every launch
        self.function = function if function is not None else kernel.handle

    @classmethod
    def load(cls, ck: CompiledKernel, smem_bytes: int, device_index: int = 0) -> "LoadedKernel":
        import torch
        from cuda.core import Device, ObjectCode

        with torch.cuda.device(device_index):   # the caller's current device is left as it was
            Device(device_index).set_current()
            kernel = ObjectCode.from_cubin(ck.cubin).get_kernel(ck.kernel_name)
            # past 48 KB in all (the kernel's static shared memory too: a varlen kernel's 16 B
            # beside 48 KB of dynamic is refused without it) a kernel must opt in. Every kernel
            # with dynamic shared memory opts in, once per load: the static part is not always
            # known (compile cache entries read back from a cubin before it was kept say 0)
            if smem_bytes:
                _set_max_dynamic_smem(kernel, smem_bytes, device_index)
            function = _context_function(kernel.handle)
        return cls(kernel, smem_bytes, device_index, function)

    def launcher(self, launch: Launch, kinds: tuple[str, ...]) -> Launcher:
        if launch.smem_bytes > max(self.max_smem, 48 * 1024):
            raise LaunchError(f"launch asks {launch.smem_bytes} B of shared memory, kernel allows {self.max_smem} B")
        return Launcher(self.function, launch, kinds, self.kernel.handle)


def attention_args(q, k, v, o, lse, scale: float | None) -> tuple | None:
    """The values of ATTENTION_PARAMS: pointers, shape, strides (each tensor's in its own elements:
    O is bf16 where q, k, v are e4m3), and the softmax scale already multiplied by log2(e); None
    where q, k or v is not as the kernels read it: 16-byte chunks, so the last dim contiguous and
    the pointer and the other strides 16-byte aligned. Tensors are (B, H, N, D) views; any B/H/N
    strides work, so (B, N, H, D) storage needs no copy."""
    fixed = layout_args(q, k, v, o, scale)
    if fixed is None or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return None
    return (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr()) + fixed


def layout_args(q, k, v, o, scale: float | None, nk: int | None = None) -> tuple | None:
    """ATTENTION_PARAMS' values after the five pointers (what a layout and a scale fix), or None
    where the strides are not as the kernels read them (attention_args). `nk`: the keys a sequence
    has where k's rows are not them (a paged KV cache's pages); else k's rows."""
    _, h, nq, d = q.shape
    hk = k.shape[1]
    nk = k.shape[2] if nk is None else nk
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), o.stride()
    chunk = 16 // q.element_size() - 1
    if ((qs[0] | qs[1] | qs[2] | ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]) & chunk
            or qs[3] != 1 or ks[3] != 1 or vs[3] != 1):
        return None
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return (h, h // hk, nq, nk,
            qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2], scale * LOG2E)


_UNSEEN = object()


class AttentionArgs:
    """A plan's maker of its kernel's argument values, `(q, k, v, o, lse, scale) -> tuple | None`
    as attention_args: what a layout fixes (shapes, strides, the scale; a family's tensor-map
    geometries) is worked out on the first call of each layout and kept, so a call with new
    tensors costs their pointers and little else. Families whose kernels take more parameters
    subclass it: `bind` adds what a layout fixes, `values` what each call brings. One per plan:
    its batch, heads and head dim are the plan's, so a layout is keyed on the sequence lengths
    (a varlen plan's packed views change them call to call), the strides and the scale."""

    _LAYOUTS = 64   # a plan sees a handful (layouts, scales); more are worked out again
    held: int | None = None   # a paged KV cache's keys a sequence can hold (k and v are its pages)

    def __init__(self) -> None:
        self._layouts: dict[tuple, object] = {}

    def __call__(self, q, k, v, o, lse, scale: float | None) -> tuple | None:
        bound = self._bound(q, k, v, o, scale)
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if bound is None or (qp | kp | vp) & 15:
            return None
        return self.values(bound, (qp, kp, vp, o.data_ptr(), lse.data_ptr()), q)

    def _bound(self, q, k, v, o, scale: float | None):
        key = (q.shape[2], k.shape[2], q.stride(), k.stride(), v.stride(), o.stride(), scale)
        bound = self._layouts.get(key, _UNSEEN)
        if bound is _UNSEEN:
            if len(self._layouts) >= self._LAYOUTS:
                self._layouts.clear()
            bound = self._layouts[key] = self.bind(q, k, v, o, scale)
        return bound

    def native_form(self, launcher: Launcher, q, k, v, o, lse, scale: float | None) -> tuple[bytes, list] | None:
        """What the C++ call path (tuner/native.py) replays for this layout on the current stream:
        the packed parameters of this call, and where each of its five addresses (q, k, v, o, lse)
        went, as (byte offset, source, shift, position, address): a later call's address A makes
        the 64-bit word there gain ((A >> shift) - (address >> shift)) << position. None where the
        call takes the Python path (inputs to copy; an address the arguments do not place)."""
        values = self(q, k, v, o, lse, scale)
        fields = None if values is None else self.address_fields(self._bound(q, k, v, o, scale))
        if fields is None:
            return None
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr())
        offsets = launcher.offsets
        return launcher.pack(*values), [(offsets[param] + byte, source, shift, position, addresses[source])
                                        for param, source, byte, shift, position in fields]

    def address_fields(self, bound) -> list[tuple[int, int, int, int, int]] | None:
        """Every place `values` puts an address of the call's tensors, as (parameter, source
        (0-4: q, k, v, o, lse), byte within the parameter, shift, position): here the five pointers
        that lead ATTENTION_PARAMS. A family whose values hold more (a tensor map's address field)
        adds them; None where it cannot say (values that depend on an address otherwise)."""
        return [(i, i, 0, 0, 0) for i in range(5)]

    def bind(self, q, k, v, o, scale: float | None):
        """What a layout fixes (None: not as the kernel reads it); layout_args' values here."""
        return layout_args(q, k, v, o, scale, self.held)

    def values(self, bound, pointers: tuple[int, int, int, int, int], q) -> tuple:
        """One call's values from its layout's `bound` and its five pointers (q, k, v, o, lse)."""
        return pointers + bound
