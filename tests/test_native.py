"""The C++ call path (tuner/native.py, tuner/csrc/fast_call.cpp), on the CPU: it builds against
the installed torch, and a plan replays the Python path's packed parameters exactly, with every
address of a new call written where the Python path writes it (plain pointers and a tensor-map
style address field), for fresh tensors, both layouts and the LSE asked for or not; whatever it
has not seen or cannot take comes back as None (the caller's Python path); a refused launch raises
LaunchError. The launch is a stand-in the extension carries, so nothing here needs a GPU; on the
GPU, tests/test_gpu_op.py runs the real one."""

from __future__ import annotations

import pytest
import torch

from tuner import native
from tuner.dispatch import out_layout
from tuner.launch import ATTENTION_PARAMS, AttentionArgs, Launch, LaunchError, Launcher

B, H, HK, N, NK, D = 2, 4, 2, 40, 24, 64
GRID = Launch((3, 8, 2), (384, 1, 1), 99000)
STREAM = 0x7F00_1234_5600
FIELD = (24, 4, 16)   # the synthetic map's address field: byte, shift, position


@pytest.fixture(scope="module")
def ext():
    mod = native.module(wait=True)
    assert mod is not None, f"the C++ call path did not build: {native.failure()}"
    return mod


class _MapArgs(AttentionArgs):
    """The shared parameters, then a 128-byte map of k whose address field is FIELD (the kind of
    word flash_fwd_sm90's tensor maps hold), then an integer the layout fixes."""

    def values(self, bound, pointers, q):
        byte, shift, position = FIELD
        word = (0x5A5A_0000_0000_00AB + ((pointers[1] >> shift) << position)) & (2**64 - 1)
        tmap = bytes(range(byte)) + word.to_bytes(8, "little") + bytes(128 - byte - 8)
        return pointers + bound + (tmap, q.shape[0] * 1000 + 7)

    def address_fields(self, bound):
        byte, shift, position = FIELD
        return super().address_fields(bound) + [(5 + len(bound), 1, byte, shift, position)]


KINDS = ATTENTION_PARAMS + ("tmap", "i32")


def _plan(ext, dtype=torch.bfloat16):
    launcher = Launcher(0, GRID, KINDS)
    make_args = _MapArgs()
    scratch = torch.empty(B, H, N, dtype=torch.float32)
    plan = ext.Plan(ext.probe_launch_address(), 0, [*GRID.grid, *GRID.block, GRID.smem_bytes], launcher.offsets,
                    launcher.size, torch.empty(0, dtype=dtype), scratch,
                    lambda q, k, v, o, lse, scale: make_args.native_form(launcher, q, k, v, o, lse, scale), out_layout)
    table = ext.Table(lambda: -1, lambda device: STREAM)
    return launcher, make_args, plan, table, scratch


def _inputs(layout: str, dtype=torch.bfloat16):
    def make(heads, n):
        if layout == "bnhd":
            return torch.randn(B, n, heads, D, dtype=dtype).transpose(1, 2)
        return torch.randn(B, heads, n, D, dtype=dtype)

    return make(H, N), make(HK, NK), make(HK, NK)


def test_it_builds_against_this_torch(ext):
    assert native.failure() is None
    assert native.built().exists()
    assert native.module() is ext   # loaded once, kept


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("need_lse", [False, True])
def test_a_plan_replays_the_python_parameters_for_new_tensors(ext, layout, need_lse):
    launcher, make_args, plan, table, scratch = _plan(ext)
    first = _inputs(layout)
    table.add(*first, 1, None, plan)
    for i in range(4):   # the first call binds the layout; the rest only patch addresses
        q, k, v = first if i == 0 else _inputs(layout)
        scale = 0.125
        out = table.run(q, k, v, 1, scale, None, need_lse)
        o, lse = out if need_lse else (out, scratch)
        size, stride = out_layout(q)
        assert o.shape == size and o.stride() == stride and o.dtype == torch.bfloat16
        if need_lse:
            assert lse.shape == (B, H, N) and lse.dtype == torch.float32 and lse.data_ptr() != scratch.data_ptr()
        want = launcher.pack(*make_args(q, k, v, o, lse, scale))
        assert plan.last_parameters()[:len(want)] == want, f"call {i}: parameters differ from the Python path's"
        assert ext.probe_last() == ([*GRID.grid, *GRID.block, GRID.smem_bytes], STREAM)
    assert plan.launches == 4


def test_what_it_has_not_seen_goes_back_to_python(ext):
    _, _, plan, table, _ = _plan(ext)
    q, k, v = _inputs("bhnd")
    table.add(q, k, v, 1, None, plan)
    assert table.run(q, k, v, 1, None, None, False) is not None
    assert table.run(q, k, v, 2, None, None, False) is None           # another mask
    assert table.run(q, k, v, 1, None, 0.01, False) is None           # another error budget
    assert table.run(q[:, :, :-1], k, v, 1, None, None, False) is None   # another shape
    assert table.run(q, k.float(), v, 1, None, None, False) is None   # mixed dtypes
    assert table.run(q, k, v, -1, None, None, False) is None          # a mask without a code
    assert table.run(q, "k", v, 1, None, None, False) is None         # not a tensor
    assert table.run(q[0], k[0], v[0], 1, None, None, False) is None  # 3-D
    assert plan.launches == 1


def test_inputs_the_kernel_cannot_read_go_back_to_python(ext):
    _, _, plan, table, _ = _plan(ext)
    q, k, v = _inputs("bhnd")
    table.add(q, k, v, 1, None, plan)
    flat = torch.randn(B * H * N * D + 1, dtype=torch.bfloat16)
    misaligned = flat[1:].view(B, H, N, D)   # 2-byte offset: the kernels read 16-byte chunks
    assert table.run(misaligned, k, v, 1, None, None, False) is None
    strided = torch.randn(B, H, N, 2 * D, dtype=torch.bfloat16)[..., ::2]   # last dim not contiguous
    assert table.run(strided, k, v, 1, None, None, False) is None
    assert table.run(q, k, v, 1, None, None, False) is not None
    assert plan.launches == 1


def test_another_current_device_goes_back_to_python(ext):
    _, _, plan, _, _ = _plan(ext)
    table = ext.Table(lambda: 3, lambda device: STREAM)
    q, k, v = _inputs("bhnd")
    table.add(q, k, v, 1, None, plan)
    assert table.run(q, k, v, 1, None, None, False) is None
    assert plan.launches == 0


def test_each_stream_binds_its_own_parameters(ext):
    """A layout's parameters hold per-stream buffers (tile counters, split workspaces), so a new
    stream binds anew."""
    launcher = Launcher(0, GRID, ATTENTION_PARAMS + ("i64",))
    streams = iter([11, 11, 22, 22])
    binds = []

    class PerStream(AttentionArgs):
        def values(self, bound, pointers, q):
            return pointers + bound + (len(binds),)

    make_args = PerStream()

    def bind(q, k, v, o, lse, scale):
        binds.append(scale)
        return make_args.native_form(launcher, q, k, v, o, lse, scale)

    plan = ext.Plan(ext.probe_launch_address(), 0, [1] * 7, launcher.offsets, launcher.size,
                    torch.empty(0, dtype=torch.bfloat16), torch.empty(B, H, N), bind, out_layout)
    table = ext.Table(lambda: -1, lambda device: next(streams))
    q, k, v = _inputs("bhnd")
    table.add(q, k, v, 0, None, plan)
    for _ in range(4):
        assert table.run(q, k, v, 0, None, None, False) is not None
    assert len(binds) == 2
    assert ext.probe_last()[1] == 22


def test_a_refused_launch_raises_launch_error(ext):
    _, _, plan, table, _ = _plan(ext)
    q, k, v = _inputs("bhnd")
    table.add(q, k, v, 1, None, plan)
    try:
        ext.set_probe_result(1)   # CUDA_ERROR_INVALID_VALUE
        with pytest.raises(LaunchError, match="CUDA_ERROR_INVALID_VALUE"):
            table.run(q, k, v, 1, None, None, False)
        ext.set_probe_result(201)   # no context on this thread: the Python path makes one current
        assert table.run(q, k, v, 1, None, None, False) is None
    finally:
        ext.set_probe_result(0)
    assert table.run(q, k, v, 1, None, None, False) is not None


def test_clearing_the_table_forgets_its_plans(ext):
    _, _, plan, table, _ = _plan(ext)
    q, k, v = _inputs("bhnd")
    table.add(q, k, v, 1, None, plan)
    assert len(table) == 1
    table.clear()
    assert len(table) == 0 and table.run(q, k, v, 1, None, None, False) is None


def test_switched_off_it_is_never_built(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_thread", None)
    assert native.module(wait=True) is None
    assert native.failure() == f"{native.ENV}=0"
    assert native._thread is None
