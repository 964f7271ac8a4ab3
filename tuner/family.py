"""What a kernel family must tell the tuner: its space, its constraints, its launch geometry.

Each family lives in kernel_templates/<name>.py beside its CUDA source and subclasses
KernelFamily. Everything here is pure Python, so CI can enumerate, check and compile every point
of every space without a GPU.
"""

from __future__ import annotations

import itertools
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import cache
from importlib import resources

from .gpu import GpuSpec
from .launch import ATTENTION_PARAMS, Launch
from .problem import MASKS, Problem
from .records import params_key

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)


# The element-type codes of kernel_templates/common.cuh (FT_F32, FT_F16, FT_BF16, FT_TF32, FT_E4M3),
# as the families pass them to their templates (IN_DTYPE, COMPUTE).
ELEM_CODE = {"fp32": 0, "fp16": 1, "bf16": 2, "tf32": 3, "fp8": 4}


MAX_PADDED_HEAD_DIM = 256


def padded_head_dim(d: int, step: int = 32) -> int:
    """The tile width of a family that pads (pads_head_dim): d rounded up to `step` columns. On
    mma.sync 32, whole k16 steps of S = Q K^T, n8 pairs of O and rows of 4k 16-byte chunks (the `swz`
    layout); the Hopper kernel's 64 bytes (sm90_tma.tile_cols) are the same 32 in 16 bits. The
    columns past d are loaded as zeros and never stored: memory traffic stays d's."""
    return -(-d // step) * step


def in_space(value: object, choices: tuple) -> bool:
    """Type-exact membership: `True` is not the int 1 and `128.0` is not the int 128 here, and a
    string is a member only where the space lists that very string. Stored params (a results
    database, a lookup file) reach CUDA source through `#define NAME value`, so nothing but a
    listed value may ever pass."""
    return any(type(value) is type(c) and value == c for c in choices)


@cache
def template_text(filename: str) -> str:
    """A file of kernel_templates/, with our own `#include "x.cuh"` lines inlined, each header once
    (as `#pragma once` would).

    Inlining makes the rendered text the whole truth about what NVRTC compiled: it is what the
    compile cache hashes, and NVRTC needs no include path.
    """
    return _inline(filename, set())


def _inline(filename: str, seen: set[str]) -> str:
    seen.add(filename)
    text = resources.files("tuner.kernel_templates").joinpath(filename).read_text()
    return _INCLUDE.sub(lambda m: "" if m.group(1) in seen else _inline(m.group(1), seen), text)


class KernelFamily(ABC):
    name: str
    kernel_name: str
    source_file: str
    min_cc: tuple[int, int] = (7, 5)
    dtypes: tuple[str, ...] = ()
    head_dims: tuple[int, ...] = ()
    # Whether the kernel pads its tile to the head dim (padded_head_dim) and so takes any multiple
    # of 8 up to max_padded_head_dim, not only head_dims (which then lists the ones tuned and shipped).
    pads_head_dim: bool = False
    max_padded_head_dim: int = MAX_PADDED_HEAD_DIM   # the widest head dim it pads to (head_dims aside)
    # The masks its kernel runs (problem.MASKS): IS_CAUSAL, and MASK_BR for the bottom-right diagonal.
    masks: tuple[str, ...] = MASKS
    max_queries: int = 0   # the most queries per sequence it serves (a decode family); 0: any
    space: dict[str, tuple] = {}
    # Parameters that only shape the launch (flash_decode's splits): points differing in them alone
    # share one cubin.
    launch_params: tuple[str, ...] = ()
    # The family whose entry of the same bucket may serve in this one's place (gives_way), or None.
    gives_way_to: str | None = None
    # The family whose configs this one runs in another form, served by rule (served_form: the cut
    # tail, pairs, a decode's splits in a cluster), or None: its own.
    configs_of: str | None = None
    # A varlen variant (VarlenVariant): it runs packed sequences, timed on a representative mix of
    # them (tuner/length_mix.py), never a dense call.
    packed: bool = False

    # ---- what the search explores ----
    def points(self) -> list[dict]:
        """Every point of the space, valid or not."""
        keys = list(self.space)
        return [dict(zip(keys, combo)) for combo in itertools.product(*self.space.values())]

    def valid_points(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        """The points `check` accepts. The space's own points need neither its type check nor the
        per-problem `supports` again for each of them (the compile sweep asks this of every family
        and variant at collection: a few seconds per pytest worker)."""
        if self.supports(gpu, problem) is not None:
            return []
        return [p for p in self.points() if self._rule_error(p, gpu, problem) is None]

    def supports(self, gpu: GpuSpec, problem: Problem) -> str | None:
        """Why this family cannot serve (gpu, problem) at all, or None."""
        if (gpu.major, gpu.minor) < self.min_cc:
            return f"{self.name} needs compute capability {self.min_cc[0]}.{self.min_cc[1]}+, {gpu.name} is {gpu.cc}"
        if problem.dtype not in self.dtypes:
            return f"{self.name} takes {'/'.join(self.dtypes)} inputs, not {problem.dtype}"
        if not self.takes_head_dim(problem.head_dim):
            return f"{self.name} supports head dim {self.head_dims_text()}, not {problem.head_dim}"
        if problem.mask not in self.masks:
            return f"{self.name} runs the masks {', '.join(self.masks)}, not {problem.mask}"
        if self.max_queries and problem.seqlen_q > self.max_queries:
            return f"{self.name} serves at most {self.max_queries} queries per sequence (decode), not {problem.seqlen_q}"
        return None

    def takes_head_dim(self, d: int) -> bool:
        """Whether the kernel runs head dim `d`: one of `head_dims`, or any multiple of 8 up to
        max_padded_head_dim where the family pads its tile (pads_head_dim)."""
        return d in self.head_dims or (self.pads_head_dim and 8 <= d <= self.max_padded_head_dim and d % 8 == 0)

    def head_dims_text(self) -> str:
        if not self.pads_head_dim:
            return ", ".join(map(str, self.head_dims))
        wider = [d for d in self.head_dims if d > self.max_padded_head_dim]
        return f"8 to {self.max_padded_head_dim} in steps of 8" + "".join(f", {d}" for d in wider)

    def tune_skip(self, gpu: GpuSpec, problem: Problem) -> str | None:
        """Why a search of every family (`--family auto`) passes this one over for `problem` though
        it runs it: where what it adds cannot show (flash_fwd_sm90_split where the query blocks
        already fill the GPU), or None."""
        return None

    def served_form(self, params: dict, gpu: GpuSpec, problem: Problem) -> tuple[KernelFamily, dict]:
        """The family and config a call of `problem` runs this point as: the dispatcher serves it so
        and a search times it so, so that what a search ranks is what runs (flash_fwd_sm90's
        persistent configs with their last rounds cut, flash_fwd_sm90_tail). Most run as they are."""
        return self, params

    def gives_way(self, params: dict, other: dict, gpu: GpuSpec, problem: Problem) -> bool:
        """Whether this config, its bucket's fastest where tuned, serves `problem` worse than
        `other`, the same bucket's entry of the family `gives_way_to` names: where what it adds
        cannot show at this call (flash_fwd_sm90_split running one split)."""
        return False

    @staticmethod
    def mask_defines(problem: Problem) -> dict[str, int]:
        """The kernels' mask contract: IS_CAUSAL (either diagonal) and MASK_BR (1: bottom-right,
        the diagonal shifted by nk - nq, computed in the kernel from its runtime nq and nk)."""
        return {"IS_CAUSAL": int(problem.causal), "MASK_BR": int(problem.bottom_right)}

    def compiled(self, params: dict) -> dict:
        """`params` as its cubin is built: each launch parameter at the space's first value, so that
        a count outside the space (an occupancy's 3 splits, fixed) compiles what it launches."""
        return {**params, **{k: self.space[k][0] for k in self.launch_params}}

    def space_error(self, params: object) -> str | None:
        """Why `params` is not a point of the space (names, and each value by type), or None."""
        if not isinstance(params, dict) or set(params) != set(self.space):
            return f"parameters must be exactly {sorted(self.space)}"
        for k, v in params.items():
            if not in_space(v, self.space[k]):
                return f"{k}={v!r} is not one of {self.space[k]}"
        return None

    def check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        """Why `params` is invalid for (gpu, problem), or None: decided before anything compiles."""
        reason = self.space_error(params)
        if reason:
            return reason
        return self.supports(gpu, problem) or self._rule_error(params, gpu, problem)

    def _rule_error(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        """check's rules past the space and `supports`: the family's own, then shared memory."""
        reason = self._check(params, gpu, problem)
        if reason:
            return reason
        smem = self.smem_bytes(params, problem)
        if smem > gpu.smem_per_block_optin:
            return f"needs {smem} B of shared memory, {gpu.name} allows {gpu.smem_per_block_optin} B per block"
        return None

    def work(self, problem: Problem):
        """What a measurement of `problem` counts its TFLOP/s by (`.tflops(ms)`): the problem's
        FLOPs, or a packed variant's representative mixes' useful ones."""
        return problem

    def adapt(self, params: dict, tuned: Problem, problem: Problem) -> dict:
        """A config tuned on `tuned`, as it should serve `problem` (a shape of the same or a nearby
        bucket). Most configs hold across a bucket as they are; a family with launch parameters
        sized to the tuned shape (flash_decode's splits) re-derives them."""
        return params

    def default(self, gpu: GpuSpec, problem: Problem) -> dict:
        """The known-good config the search is seeded with: the first seed that passes check."""
        for p in self.seeds(gpu, problem):
            if self.check(p, gpu, problem) is None:
                return p
        valid = self.valid_points(gpu, problem)
        if not valid:
            raise ValueError(f"{self.name} has no valid config for {problem.key} on {gpu.name}")
        return valid[0]

    # ---- what each family provides ----
    @abstractmethod
    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None: ...

    @abstractmethod
    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        """Hand-picked configs, best guess first."""

    @abstractmethod
    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        """Compile-time constants: everything that makes one cubin differ from another."""

    @abstractmethod
    def smem_bytes(self, params: dict, problem: Problem) -> int: ...

    @abstractmethod
    def launch(self, params: dict, problem: Problem, gpu: GpuSpec) -> Launch:
        """Grid, block and dynamic shared memory of one point on `gpu` (a persistent grid is sized
        by its SM count)."""

    def param_kinds(self, params: dict) -> tuple[str, ...]:
        """The kernel's parameters by kind (launch.PARAM_KINDS): the shared attention ABI; a family
        whose kernel takes more appends them here and in `kernel_args`."""
        return ATTENTION_PARAMS

    def arg_maker(self, params: dict) -> Callable[..., tuple | None]:
        """Made once per plan: (q, k, v, o, lse, scale) -> the values of `param_kinds`, in order, as
        plain Python ints, floats and bytes; or None where q, k or v is not laid out as the kernels
        read it (16-byte aligned rows, the last dim contiguous), for the caller to copy and ask again.
        What a layout fixes is worked out once per layout (launch.AttentionArgs)."""
        from .launch import AttentionArgs

        return AttentionArgs()

    def kernel_args(self, params: dict, q, k, v, o, lse, scale: float | None) -> tuple:
        """`arg_maker`'s values for one call (inputs that are not kernel-ready raise ValueError)."""
        args = self.arg_maker(params)(q, k, v, o, lse, scale)
        if args is None:
            raise ValueError("q, k and v need a contiguous last dim and 16-byte aligned rows")
        return args

    def define_lines(self, params: dict, problem: Problem) -> str:
        """`#define NAME value` lines for one point: the one way params reach source text.

        Refuses (ValueError) a point outside the space, and any define that is not a plain int,
        so no stored value (a crafted database or lookup) can put text into the source.
        """
        why = self.space_error(params)
        if why:
            raise ValueError(f"refusing to render {self.name}: {why}")
        defines = self.defines(params, problem)
        for k, v in defines.items():
            if not (isinstance(k, str) and k.isidentifier() and type(v) is int):
                raise ValueError(f"refusing to render {self.name}: #define {k!r} {v!r} is not a name and an int")
        return "".join(f"#define {k} {v}\n" for k, v in sorted(defines.items()))

    def render(self, params: dict, problem: Problem) -> str:
        """The full CUDA source NVRTC compiles for one point."""
        defs = self.define_lines(params, problem)
        return f"// {self.name} {params}\n{defs}{template_text(self.source_file)}"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def log2_int(n: int) -> int:
    return int(math.log2(n))


class VarlenVariant:
    """A family's kernel on packed sequences (VARLEN, kernel_templates/common.cuh: FlashAttention's
    varlen layout, each sequence its own lengths, the LSE (H, total_q)). Mixed in before the family
    it varies; built from that family's tuned configs (`from_tuned`) unless it was tuned itself.
    Its launch takes the family's arguments for (1, H, total, D) views of the packed tensors, then
    the longest lengths in place of nq and nk and the sequences' offsets (`packed_args`). A search
    may tune it by name (`tuner search --family flash_fwd_sm90_varlen`) on representative length
    mixes of each padded problem; the varlen plan prefers such an entry to one made from its family's."""

    dtypes: tuple[str, ...] = ("fp16", "bf16")
    packed = True

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        return {**super().defines(params, problem), "VARLEN": 1}

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        """The family's seeds as this variant's points (from_tuned), each once."""
        points = (self.from_tuned(p, problem) for p in super().seeds(gpu, problem))
        return list({params_key(p): p for p in points}.values())

    def work(self, problem: Problem):
        """The representative mixes of `problem` (the padded problem of a bucket), which a search of
        this variant times (tuner/length_mix.py)."""
        from .length_mix import representative_mixes

        return representative_mixes(problem)

    def param_kinds(self, params: dict) -> tuple[str, ...]:
        return super().param_kinds(params) + ("ptr", "ptr", "i32", "i32")   # cu_seqlens_q, cu_seqlens_k, total_q, nseq

    def from_tuned(self, params: dict, problem: Problem) -> dict:
        """The point of this variant closest to a tuned config of its family for `problem`."""
        return dict(params)

    @abstractmethod
    def block_rows(self, params: dict) -> int:
        """Query rows per block."""

    def packed_launch(self, params: dict, problem: Problem, gpu: GpuSpec, total_q: int, total_k: int) -> Launch:
        """The launch for `problem.batch` sequences of `total_q` queries (`total_k` keys) in all: a grid of at most
        total_q / rows + batch query blocks (each block finds its sequence, kernel_templates/
        common.cuh), rounded up to 32 so that batches of nearby sizes share a launch, by head."""
        base = self.launch(params, problem, gpu)
        blocks = ceil_div(total_q, self.block_rows(params)) + problem.batch
        return Launch(grid=(-(-blocks // 32) * 32, problem.heads, 1), block=base.block, smem_bytes=base.smem_bytes)

    def varlen_values(self, make_args, params: dict, problem: Problem, grid: tuple[int, int, int], views: list, lse,
                      scale, cu_q, cu_k, max_q: int, max_k: int) -> tuple | None:
        """The kernel's values for a varlen call: `make_args` (this variant's arg_maker for the plan)
        on the (1, H, total, D) views of q, k, v, O, then packed_args; None where the views are not
        as the kernel reads them. `problem` is the padded one (the batch, the longest lengths);
        `grid` the call's launch (packed_launch), which a variant may size a workspace by."""
        args = make_args(*views, lse, scale)
        if args is None:
            return None
        return self.packed_args(args, max_q, max_k, cu_q.data_ptr(), cu_k.data_ptr(), views[0].shape[2], problem.batch)

    @staticmethod
    def packed_args(args: tuple, max_q: int, max_k: int, cu_q: int, cu_k: int, total_q: int, nseq: int) -> tuple:
        """The family's argument values for the packed views, made the varlen kernel's: the longest
        lengths as nq and nk (ATTENTION_PARAMS' 8th and 9th), then the offsets, total_q and the
        number of sequences."""
        return args[:7] + (max_q, max_k) + args[9:] + (cu_q, cu_k, total_q, nseq)
