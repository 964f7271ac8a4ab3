"""Loading a cubin and launching an attention kernel on torch's current stream (cuda.core).

Shared by the search's worker and the runtime dispatcher, so what was timed is what runs.
"""

from __future__ import annotations

import math
import numpy as np

from .family import Launch
from .records import CompiledKernel

LOG2E = 1.4426950408889634


class LaunchError(RuntimeError):
    """The launch itself was refused (resources, arguments): the context is still usable."""


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


class LoadedKernel:
    """A kernel loaded once; launch configs are made once per geometry and kept."""

    def __init__(self, kernel, max_smem: int) -> None:
        self.kernel = kernel
        self.max_smem = max_smem
        self._configs: dict[Launch, object] = {}

    @classmethod
    def load(cls, ck: CompiledKernel, smem_bytes: int, device_index: int = 0) -> "LoadedKernel":
        from cuda.core import Device, ObjectCode

        Device(device_index).set_current()
        kernel = ObjectCode.from_cubin(ck.cubin).get_kernel(ck.kernel_name)
        if smem_bytes > 48 * 1024:
            _set_max_dynamic_smem(kernel, smem_bytes, device_index)
        return cls(kernel, smem_bytes)

    def __call__(self, stream, launch: Launch, *args) -> None:
        from cuda.core import LaunchConfig
        from cuda.core import launch as cuda_launch

        config = self._configs.get(launch)
        if config is None:
            if launch.smem_bytes > max(self.max_smem, 48 * 1024):
                raise LaunchError(f"launch asks {launch.smem_bytes} B of shared memory, kernel allows {self.max_smem} B")
            config = self._configs[launch] = LaunchConfig(
                grid=launch.grid, block=launch.block, shmem_size=launch.smem_bytes
            )
        try:
            cuda_launch(stream, config, self.kernel, *args)
        except Exception as exc:
            raise LaunchError(str(exc).splitlines()[0]) from None


_streams: dict[int, object] = {}


def current_stream():
    """torch's current stream as a cuda.core Stream (wrapped once per handle)."""
    import torch
    from cuda.core import Stream

    handle = torch.cuda.current_stream().cuda_stream
    s = _streams.get(handle)
    if s is None:  # threads racing here each make a wrapper of the same handle: harmless, one is kept
        s = _streams.setdefault(handle, Stream.from_handle(handle))
    return s


def attention_args(q, k, v, o, lse, scale: float | None) -> tuple:
    """The argument list every attention family shares: pointers, shape, strides (each tensor's
    in its own elements: O is bf16 where q, k, v are e4m3), and the softmax scale already
    multiplied by log2(e). Tensors are (B, H, N, D) views whose last dimension is contiguous; any
    B/H/N strides work, so (B, N, H, D) storage needs no copy."""
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    i64 = np.int64
    return (
        np.uint64(q.data_ptr()), np.uint64(k.data_ptr()), np.uint64(v.data_ptr()),
        np.uint64(o.data_ptr()), np.uint64(lse.data_ptr()),
        np.int32(h), np.int32(h // hk), np.int32(nq), np.int32(nk),
        i64(q.stride(0)), i64(q.stride(1)), i64(q.stride(2)),
        i64(k.stride(0)), i64(k.stride(1)), i64(k.stride(2)),
        i64(v.stride(0)), i64(v.stride(1)), i64(v.stride(2)),
        i64(o.stride(0)), i64(o.stride(1)), i64(o.stride(2)),
        np.float32(scale * LOG2E),
    )
