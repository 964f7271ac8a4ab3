"""The runtime dispatcher: the best measured kernel for a shape, tuned or torch's own.

`Dispatcher.forward(q, k, v, ...)` is what the `flashtune::attention` op runs (tuner/op.py). Its
hot path is a dictionary lookup, two allocations and a packed launch (tuner/launch.py). The first
call for a shape reads the lookups (once per process: the user's, then the ones flashtune ships
for common GPUs, tuner/lookups/, for buckets the user's lacks), picks the fastest measured entry
of the shape's bucket or of the nearest tuned one, and compiles or loads its cubin (disk cache)
into a plan. An entry is a tuned config or one of SDPA's backends, where that measured fastest
(peers.DISPATCHED_PEERS): SDPA then runs by choice, without a word. Where nothing measured fits,
torch answers with one warning: scaled_dot_product_attention, or, where the backward will need
the softmax's LSE, the fastest of torch's kernels that returns one (tuner/torch_attention.py).
With first-call autotuning on (tuner/autotune.py), a shape whose bucket the user never tuned has
its few best candidates timed on the exact shape instead, once, outside CUDA-graph capture.
"""

from __future__ import annotations

import itertools
import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import autotune, recording
from .gqa_packing import packed_gqa
from .launch import Launcher, kernel_scale, launch_on
from .borrowing import (fills_gpu, misfit, split_entry, split_runs_whole, split_tuned_where_idle,
                        three_consumers_untried, tuned_here, tuned_problem)
from .peer_choice import idle_peer, narrow_peer, short_peer
from .problem import DECODE_QUERIES, TORCH_DTYPES, Bucket, Problem, mask_of, torch_dtype
from .records import one_line
from .untuned import decode_default, one_consumer_default, prefill_default, split_default

TORCH_TO_DTYPE = {name: dtype for dtype, name in TORCH_DTYPES.items()}  # "float8_e4m3fn" -> "fp8"
# The C++ call path's mask codes (tuner/csrc/fast_call.cpp): a plan's `causal`, bool or mask name
MASK_CODES = {False: 0, True: 1, "none": 0, "causal": 1, "causal_br": 2}
# How far (tuner.nearest's octaves) a tuned bucket may be from an untuned one and still serve it:
# a length up to 4x off, or 2x off in both, or the work two classes off.
NEAREST_OCTAVES = 2.0

@dataclass
class Plan:
    """What a shape resolved to: a packed launch of a tuned kernel, or None for torch's attention."""

    launcher: Launcher | None
    family: str | None
    reason: str = ""
    dtype: str = ""
    make_args: Callable[..., tuple | None] | None = None  # KernelFamily.arg_maker's
    out: torch.dtype | None = None  # O's dtype (Problem.out_dtype: bf16 for fp8 inputs)
    device: int = 0
    scratch_lse: torch.Tensor | None = None  # what the kernel writes its LSE to where nobody reads it
    peer: str | None = None   # a measured SDPA peer (peers.DISPATCHED_PEERS) that runs instead of a kernel
    provisional: bool = False  # made during CUDA-graph capture where autotuning was due: made again after
    out_layouts: dict = field(default_factory=dict)   # q's strides -> out_layout(q): the hot path's, kept
    native: bool = False   # handed to the C++ call path (tuner/native.py)


def takes_head_dim(d: int) -> bool:
    """Whether some flashtune kernel runs head dim `d` (on some GPU: the families that pad take any
    multiple of 8 up to their widest, the others a list). SDPA takes any. Not cached: the routed SDPA
    call asks it inside torch.compile'd code, where Dynamo warns at a cache wrapper (and the answer
    is a few comparisons a family)."""
    from .kernel_templates import FAMILIES

    return any(f.takes_head_dim(d) for f in FAMILIES.values())


def check_inputs(q, k, v, max_error: float | None = None, *, cuda: bool = True) -> str:
    """Validate the inputs (every mistake a ValueError naming it) and return their dtype's name.
    Symbolic shapes are fine (the op's fake implementation calls this under torch.compile); `cuda=False`
    leaves the device to the operator's dispatch."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if cuda and t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; attention runs on CUDA tensors")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v have different dtypes: {q.dtype}, {k.dtype}, {v.dtype}")
    dtype = dtype_name(q)
    if dtype is None:
        raise ValueError(f"unsupported dtype {q.dtype}; use one of {', '.join(TORCH_TO_DTYPE)}")
    b, h, nq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head dim")
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"k/v heads ({k.shape[1]}) must divide q heads ({h})")
    if b == 0 or h == 0 or nq == 0 or k.shape[2] == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if max_error is not None and not (isinstance(max_error, (int, float)) and 0 < max_error < 1):
        raise ValueError(f"max_error must be a number in (0, 1), got {max_error!r}")
    return dtype


def dtype_name(t) -> str | None:
    """The problem dtype ("bf16", "fp8", ...) of tensor `t`, None where no kernel takes it."""
    return TORCH_TO_DTYPE.get(str(t.dtype).removeprefix("torch."))


def problem_of(q, k, v, causal: bool | str, max_error: float | None = None) -> Problem:
    """The Problem these inputs pose, after check_inputs; `causal` is a mask (problem.MASKS), or a
    bool as SDPA's is_causal (the top-left diagonal)."""
    dtype = check_inputs(q, k, v, max_error)
    b, h, nq, d = q.shape
    return Problem(b, h, nq, k.shape[2], d, dtype, mask_of(causal), k.shape[1], max_error or 0.0)


def out_layout(q) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Size and strides of O for q: (B, N, H, D) storage where q's heads are inner to its rows (a
    model's projections viewed with transpose(1, 2)), so the model's transpose back is free, as
    with SDPA; (B, H, N, D) otherwise. The op's fake implementation promises the same."""
    b, h, n, d = q.shape
    if q.stride(1) < q.stride(2):
        return (b, h, n, d), (n * h * d, d, h * d, 1)
    return (b, h, n, d), (h * n * d, n * d, d, 1)


class Dispatcher:
    def __init__(self, lookup_path: str | Path | None = None, native: bool = True) -> None:
        """`native=False`: every call takes the Python path (tuner/native.py says what the other is)."""
        self._path = lookup_path
        self._native = native
        self._table: dict[tuple[str, str], list[dict]] | None = None
        self._plans: dict[tuple, Plan] = {}
        self._gpus: dict[int, object] = {}
        self._warned: set[str] = set()
        self._ignored = ""  # why the lookup file was ignored: the one warning its fallbacks give
        self._user_buckets: set[tuple[str, str]] = set()   # (GPU, bucket)s the user's own lookup serves (_load_table)
        self._lock = threading.Lock()
        self._warn_lock = threading.Lock()  # _warn runs under _lock (plan) and outside it (fallback)
        self._fast = None   # the C++ call path's table of plans (tuner/native.py), once it is built

    # ---- slow path, once per shape ----
    def _load_table(self) -> dict[tuple[str, str], list[dict]]:
        """The user's lookup, then each shipped one for the (GPU, bucket)s the user's lacks."""
        from .export import default_lookup_path, shipped_lookups

        table = self._read(Path(self._path) if self._path else default_lookup_path())
        self._user_buckets = set(table)
        for path in shipped_lookups():
            for slot, entries in self._read(path).items():
                table.setdefault(slot, entries)
        return table

    def _read(self, path: Path) -> dict[tuple[str, str], list[dict]]:
        from .export import read_lookup

        table: dict[tuple[str, str], list[dict]] = {}
        try:  # any lookup, however malformed, is one warning and the SDPA fallback, never a raise
            if not path.exists():
                return table
            for e in read_lookup(path)["entries"]:
                table.setdefault((e["gpu_key"], e["bucket"]), []).append(e)
        except Exception as exc:
            self._ignored = f"ignoring the best-config lookup: {one_line(exc)}"
            self._warn(self._ignored)
            return {}
        for entries in table.values():
            entries.sort(key=lambda e: -e["tflops"])
        return table

    def add_entries(self, gpu_key: str, entries: list[dict]) -> None:
        """Serve these lookup entries from now on (what a first-call autotune measured)."""
        if self._table is None:
            self._table = self._load_table()
        for e in entries:
            slot = self._table.setdefault((gpu_key, e["bucket"]), [])
            slot[:] = [x for x in slot if x["family"] != e["family"]] + [e]
            slot.sort(key=lambda x: -x["tflops"])
            self._user_buckets.add((gpu_key, e["bucket"]))
        self._plans.clear()   # shapes of these buckets choose again
        if self._fast is not None:
            self._fast.clear()

    def _gpu(self, index: int):
        g = self._gpus.get(index)
        if g is None:
            from .gpu import _from_torch

            g = self._gpus[index] = _from_torch(index)
        return g

    def select(self, problem: Problem, gpu) -> dict | None:
        """The lookup entry that serves `problem` on `gpu`: its bucket's fastest runnable entry
        (a tuned config, or an SDPA backend that measured faster); for a bucket nobody tuned,
        that of the nearest tuned bucket of the same GPU, dtype, head dim, mask and error budget
        (tuner.nearest: octaves of Nq, Nk and half the work), up to NEAREST_OCTAVES away; past
        that, for a prefill call that fills the GPU, the nearest at any distance (`fills_gpu`). A
        call that fills the GPU passes over borrowed entries that were tuned where query blocks left
        SMs idle (`borrowing.misfit`) to the nearest that was not, else flash_fwd_sm90's default; a
        borrowed split entry (`split_entry`) to the split default where it splits, else that
        default; and its own bucket's split entry, tuned where SMs idled, to those defaults where
        they take three consumers (`split_tuned_where_idle`). A call that leaves SMs idle passes over
        a split entry that would run it in one split (and does not give way) to those defaults
        (`split_runs_whole`); any call where flash_fwd_sm90's default takes three consumers passes
        over a two-consumer entry tuned where it took two (`three_consumers_untried`). An entry that
        gives way at this call (KernelFamily.gives_way) serves its bucket's entry of the family it
        names instead."""
        near, fills = next(self.candidates(problem, gpu), None), fills_gpu(problem, gpu)
        if near is None and fills:   # a prefill's far neighbours: prefill buckets only
            near = next(((dist, e) for dist, e in self.candidates(problem, gpu, math.inf)
                         if e.get("problem", {}).get("seqlen_q", 0) > DECODE_QUERIES), None)
        if near is None:
            return None
        if fills and misfit(*near, problem, gpu):
            if split_entry(near[1]):   # its keys' split weighed afresh: the split default, else the plain one
                fit = split_default(problem, gpu)
            else:
                fit = next((e for dist, e in self.candidates(problem, gpu) if not misfit(dist, e, problem, gpu)), None)
            near = (0, fit or prefill_default(problem, gpu) or near[1])
        elif fills and split_tuned_where_idle(near[1], gpu):
            fresh = split_default(problem, gpu) or prefill_default(problem, gpu)
            if fresh is not None and fresh["params"]["cwg"] == 3:
                near = (0, fresh)
        entry = self._given_way(near[1], problem, gpu)
        if split_runs_whole(entry, problem, gpu) or three_consumers_untried(entry, problem, gpu):
            entry = split_default(problem, gpu) or prefill_default(problem, gpu) or entry
        entry = self._split_where_idle(entry, problem, gpu)
        return _served_form(_two_consumers_where_idle(entry, problem, gpu), problem, gpu)

    def _given_way(self, entry: dict, problem: Problem, gpu) -> dict:
        """`entry`, or the runnable entry of its bucket of the family it gives way to at this call:
        a split entry tuned at B1, where few query blocks left SMs idle, served to B7, whose blocks
        fill them, runs one split, i.e. the plain Hopper kernel with a config chosen for splitting."""
        from .kernel_templates import FAMILIES

        fam = FAMILIES.get(entry["family"])
        if fam is None or fam.gives_way_to is None or "bucket" not in entry:   # a default: no bucket
            return entry
        params = served_params(entry, problem)
        return next((e for e in self._table.get((gpu.key, entry["bucket"]), [])
                     if e["family"] == fam.gives_way_to and self._runs(e, problem, gpu)
                     and fam.gives_way(params, served_params(e, problem), gpu, problem)), entry)

    def _split_where_idle(self, entry: dict, problem: Problem, gpu) -> dict:
        """`entry`, or where it is a flash_fwd_sm90 config serving a call whose few query blocks
        leave SMs idle, that config with the keys split across CTAs (flash_fwd_sm90_split.split_form)
        where the estimate gains by splitting. Not where the entry was tuned in this bucket on a
        shape that left SMs idle too: a search there weighed the split family against it."""
        from .kernel_templates import FAMILIES

        split = FAMILIES.get("flash_fwd_sm90_split")
        tuned = tuned_problem(entry)
        if split is None or entry["family"] != split.gives_way_to or tuned is None:
            return entry
        if tuned_here(entry, problem) is not None and split.tune_skip(gpu, tuned) is None:
            return entry
        params = split.split_form(served_params(entry, problem), gpu, problem)
        return entry if params is None else {**entry, "family": split.name, "params": params}

    def serving_entry(self, problem: Problem, gpu) -> dict | None:
        """What a plan for `problem` runs: the lookup's entry (select), else, for a decode call,
        flash_decode's default, for a prefill call that leaves SMs idle, flash_fwd_sm90_split's
        where it splits the keys, else flash_fwd_sm90's; None where no kernel of ours runs it (a
        dtype, head dim or GPU they do not take: SDPA then does). A prefill whose 64-row blocks make a
        wave or less runs flash_fwd_sm90's default at one consumer where a plain entry of two or three
        would (_one_consumer_where_idle). A GQA decode step of many packed rows runs flash_fwd_sm90_gqa
        where flash_decode would, and so does a GQA prefill of short query rows where the Hopper
        prefill kernels would, or of few blocks where the split kernel would (packed_gqa)."""
        entry = self.select(problem, gpu) or _served_form(decode_default(problem, gpu) or split_default(problem, gpu)
                                                          or prefill_default(problem, gpu), problem, gpu)
        entry = _one_consumer_where_idle(entry, problem, gpu)
        return packed_gqa(entry, problem, gpu, self._timed_packed(entry, gpu))

    def _timed_packed(self, entry: dict | None, gpu) -> bool:
        """Whether `entry`'s bucket holds a flash_fwd_sm90_gqa entry: its search timed the packed family
        beside the winner (tune_skip lets it in where the call packs, under the rule of that day)."""
        if entry is None or "bucket" not in entry:
            return False
        return any(e["family"] == "flash_fwd_sm90_gqa"
                   for e in (self._table or {}).get((entry.get("gpu_key", gpu.key), entry["bucket"]), []))

    def candidates(self, problem: Problem, gpu, octaves: float = NEAREST_OCTAVES):
        """(octaves away, entry) for every runnable entry that could serve `problem`: its own
        bucket's first (distance 0), fastest first; then those of tuned buckets up to `octaves`
        away, nearer first. Among the entries of one distance, a measured peer too short for its
        host time at this call (`short_peer`), measured on fewer query blocks than SMs and serving
        more (`idle_peer`), or borrowed from another bucket where it led that bucket's kernels by
        less than PEER_MARGIN (`narrow_peer`), comes after the kernels."""
        for dist, group in itertools.groupby(self._entries_near(problem, gpu, octaves), key=lambda de: de[0]):
            runnable = [e for _, e in group if self._runs(e, problem, gpu)]
            def after(e: dict) -> bool:
                return short_peer(e, problem) or idle_peer(e, gpu, problem) or (dist > 0 and narrow_peer(e, runnable, problem))

            for e in sorted(runnable, key=after):   # stable: fastest first otherwise
                yield dist, e

    def packed_candidates(self, problem: Problem, gpu, octaves: float = NEAREST_OCTAVES):
        """(octaves away, variant, entry) for each entry a varlen variant was tuned to (a search of
        it by name, on a length mix) that serves the padded `problem`, as `candidates` orders
        them. A dense call never runs these: `candidates` knows only FAMILIES."""
        from .kernel_templates import VARIANTS_BY_NAME

        for dist, e in self._entries_near(problem, gpu, octaves):
            variant = VARIANTS_BY_NAME.get(e["family"])
            if variant is not None and variant.check(e["params"], gpu, problem) is None:
                yield dist, variant, e

    def _entries_near(self, problem: Problem, gpu, octaves: float):
        """(octaves away, entry) of every entry of `problem`'s bucket (distance 0, fastest first),
        then of the tuned buckets up to `octaves` away, nearer first: `gpu`'s own, then those of
        the other GPUs of its architecture (`kin`), where its own have none that near."""
        if self._table is None:
            self._table = self._load_table()
        for key in (gpu.key, *self.kin(gpu)):
            yield from self._entries_of(key, problem, octaves)

    def _entries_of(self, gpu_key: str, problem: Problem, octaves: float):
        from .nearest import nearest
        from .problem import Bucket

        bucket = problem.bucket()
        for e in self._table.get((gpu_key, bucket.key), []):
            yield 0.0, e
        tuned = [Bucket.from_key(key) for g, key in self._table if g == gpu_key and key != bucket.key]
        for dist, other in nearest(bucket, tuned, lambda b: b):
            if dist > octaves:
                break
            for e in self._table[(gpu_key, other.key)]:
                yield dist, e

    def kin(self, gpu) -> list[str]:
        """The other GPUs of `gpu`'s architecture that the lookups hold: where `gpu` has no entry
        for a shape (an H200 on a tensor-parallel shard's chunk; an H100 PCIe, which flashtune ships
        no lookup for, on any shape), theirs serve, with one warning naming them (`_plan`). Their
        configs ran 0.94-1.04x the H200's own there (PERF_NOTES, issue 21), far ahead of SDPA."""
        if self._table is None:
            self._table = self._load_table()
        arch = gpu.key.rsplit("/", 1)[-1]
        return sorted({g for g, _ in self._table if g != gpu.key and g.rsplit("/", 1)[-1] == arch})

    @staticmethod
    def _runs(e: dict, problem: Problem, gpu) -> bool:
        """Whether entry `e` can run `problem` on `gpu`: its family's check, or its SDPA backend's."""
        from .kernel_templates import FAMILIES
        from .peers import DISPATCHED_PEERS
        from .torch_attention import takes_problem

        if (backend := DISPATCHED_PEERS.get(e["family"])) is not None:
            return takes_problem(backend, problem, (gpu.major, gpu.minor))
        fam = FAMILIES.get(e["family"])
        return fam is not None and fam.check(served_params(e, problem), gpu, problem) is None

    def _plan(self, problem: Problem, device_index: int) -> Plan:
        from .compile import compile_kernel
        from .kernel_templates import FAMILIES
        from .launch import LoadedKernel
        from .peers import DISPATCHED_PEERS

        gpu = self._gpu(device_index)
        out = torch_dtype(problem.out_dtype)
        provisional = False
        if autotune.enabled() and not self._user_tuned(gpu, problem):
            if torch.cuda.is_current_stream_capturing():   # no timing inside a capture: the next eager call tunes
                provisional = True
            elif winners := autotune.tune(problem, gpu, self._autotune_candidates(problem, gpu), self._path):
                self.add_entries(gpu.key, winners)
        entry = self.serving_entry(problem, gpu)
        if entry is not None and entry.get("gpu_key", gpu.key) != gpu.key:
            self._warn_once(f"flashtune: serving configs tuned on {entry['gpu_key']} (the same architecture) for "
                            f"shapes {gpu.key}'s lookups do not cover, e.g. {problem.key}; `tuner search --gpu auto` "
                            "tunes this GPU", key=f"kin {gpu.key} {entry['gpu_key']}")
        if entry is None:
            why = self._ignored or f"no tuned config for {problem.bucket().key} on {gpu.key}"
            if not takes_head_dim(problem.head_dim):   # SDPA takes any head dim; our kernels do not
                why = f"no flashtune kernel takes head dim {problem.head_dim}"
            return Plan(None, None, why, problem.dtype, out=out, device=device_index, provisional=provisional)
        if entry["family"] in DISPATCHED_PEERS:
            return Plan(None, entry["family"], dtype=problem.dtype, out=out, device=device_index,
                        peer=entry["family"], provisional=provisional)
        fam, params = FAMILIES[entry["family"]], served_params(entry, problem)
        try:  # a looked-up config that fails to compile or load falls back like a missing one
            ck = compile_kernel(fam, params, problem, gpu.arch)
            launch = fam.launch(params, problem, gpu)
            launcher = LoadedKernel.load(ck, launch.smem_bytes, device_index).launcher(launch, fam.param_kinds(params))
        except Exception as exc:
            what = "tuned" if "bucket" in entry else "default"
            return Plan(None, None, f"the {what} {fam.name} config for {problem.bucket().key} on {gpu.key} "
                                    f"cannot be used ({one_line(exc)})", problem.dtype, out=out, device=device_index,
                        provisional=provisional)
        scratch = torch.empty(problem.batch, problem.heads, problem.seqlen_q, dtype=torch.float32,
                              device=torch.device("cuda", device_index))
        return Plan(launcher, fam.name, dtype=problem.dtype, make_args=fam.arg_maker(params), out=out,
                    device=device_index, scratch_lse=scratch, provisional=provisional)

    def _autotune_candidates(self, problem: Problem, gpu) -> list[dict]:
        """What a first call times (autotune.shortlist picks from these): the entries of the nearest
        tuned buckets; where the call packs, flash_fwd_sm90_gqa's default first, which would otherwise
        replace every plain winner unweighed (packed_gqa); timed, it leaves a packed entry in the
        bucket, against which a faster plain one then stands (_timed_packed)."""
        near = [e for _, e in self.candidates(problem, gpu, autotune.OCTAVES)]
        served = self.serving_entry(problem, gpu)
        if served is not None and served["family"] == "flash_fwd_sm90_gqa" and "bucket" not in served:
            return [served, *near]
        return near

    def _user_tuned(self, gpu, problem: Problem) -> bool:
        """Whether the user's own lookup (or an autotune of this process) serves `problem`'s bucket;
        the shipped lookups do not count: their entries are candidates to time, not answers."""
        if self._table is None:
            self._table = self._load_table()
        return (gpu.key, problem.bucket().key) in self._user_buckets

    def plan(self, q, k, v, causal: bool | str = False, max_error: float | None = None) -> Plan:
        """The plan for these inputs (made on the first call for their shapes, dtypes, devices and mask)."""
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device(),
               causal, max_error)
        plan = self._plans.get(key)
        if plan is None or (plan.provisional and not torch.cuda.is_current_stream_capturing()):
            problem = problem_of(q, k, v, causal, max_error)
            recording.note(problem)   # FLASHTUNE_RECORD: once per shape, off the hot path
            with self._lock:
                plan = self._plans.get(key)
                if plan is None or plan.provisional:
                    plan = self._plans[key] = self._plan(problem, q.device.index or 0)
        return plan

    def _warn_once(self, message: str, key: str | None = None, stacklevel: int = 4) -> None:
        """`message` as a warning, once per `key` (default: the message), even with threads
        falling back at the same time; `stacklevel` counts from here."""
        with self._warn_lock:
            if (key or message) in self._warned:
                return
            self._warned.add(key or message)
        warnings.warn(message, stacklevel=stacklevel)

    def _warn(self, message: str) -> None:
        """That SDPA answers, and why (`message`), once per reason."""
        self._warn_once(f"flashtune: {message}; using torch scaled_dot_product_attention", key=message, stacklevel=4)

    # ---- hot path ----
    def forward(self, q, k, v, causal: bool | str = False, scale: float | None = None, max_error: float | None = None,
                need_lse: bool = True):
        """O (laid out as out_layout(q) says) and the natural-log LSE (B, H, Nq) in float32. `causal`
        is a mask (problem.MASKS: "causal_br" for the bottom-right diagonal), or a bool as SDPA's
        is_causal. Without a tuned kernel the LSE is computed only where `need_lse` asks (else it
        is NaN). Rows that see no key (bottom-right, Nq > Nk) are O = 0 and LSE = -inf either way."""
        q, scale = kernel_scale(q, scale)
        if self._fast is not None and (out := self._fast.run(q, k, v, MASK_CODES.get(causal, -1), scale, max_error,
                                                             True)) is not None:
            return out
        plan = self.plan(q, k, v, causal, max_error)
        if plan.launcher is None:
            return self._fallback(q, k, v, causal, scale, plan, need_lse)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        return self._launch(plan, q, k, v, causal, scale, max_error, lse), lse

    def output(self, q, k, v, causal: bool | str = False, scale: float | None = None, max_error: float | None = None):
        """O alone (no gradient will be asked for): the kernel's LSE goes to a buffer of the plan."""
        q, scale = kernel_scale(q, scale)
        if self._fast is not None and (o := self._fast.run(q, k, v, MASK_CODES.get(causal, -1), scale, max_error,
                                                           False)) is not None:
            return o
        plan = self.plan(q, k, v, causal, max_error)
        if plan.launcher is None:
            return self._fallback(q, k, v, causal, scale, plan, False)[0]
        return self._launch(plan, q, k, v, causal, scale, max_error, plan.scratch_lse)

    def _launch(self, plan: Plan, q, k, v, causal, scale, max_error, lse):
        strides = q.stride()
        layout = plan.out_layouts.get(strides)
        if layout is None:
            layout = plan.out_layouts[strides] = out_layout(q)
        o = torch.empty_strided(*layout, dtype=plan.out, device=q.device)
        args = plan.make_args(q, k, v, o, lse, scale)
        if args is None:   # not laid out as the kernel reads (misaligned rows, a strided last dim)
            args = plan.make_args(q.contiguous(), k.contiguous(), v.contiguous(), o, lse, scale)
        launch_on(plan.launcher, plan.device, *args)
        if not plan.native and not plan.provisional and self._native:
            self._go_native(plan, q, k, v, causal, max_error)
        return o

    def _go_native(self, plan: Plan, q, k, v, causal, max_error) -> None:
        """Hand `plan` to the C++ call path, where its extension is built (the first call starts
        the build; until it is done calls stay here)."""
        from . import native

        ext = native.module()
        code = MASK_CODES.get(causal)
        if ext is None or code is None:
            # no extension to wait for, or a mask the table has no code for: stop asking
            plan.native = code is None or native.failure() is not None
            return
        with self._lock:
            if self._fast is None:
                from .launch import current_device, raw_stream

                self._fast = ext.Table(current_device, raw_stream)
            make_args, launcher = plan.make_args, plan.launcher
            fast = launcher.native_plan(
                ext, torch.empty(0, dtype=plan.out, device=q.device), plan.scratch_lse,
                lambda q, k, v, o, lse, scale: make_args.native_form(launcher, q, k, v, o, lse, scale), out_layout)
            if fast is not None:
                self._fast.add(q, k, v, code, max_error, fast)
            plan.native = True

    def __call__(self, q, k, v, causal: bool | str = False, scale: float | None = None, return_lse: bool = False,
                 max_error: float | None = None):
        """O, or (O, LSE) with `return_lse`; no autograd (that is tuner.attention's)."""
        o, lse = self.forward(q, k, v, causal, scale, max_error, need_lse=return_lse)
        return (o, lse) if return_lse else o

    def _fallback(self, q, k, v, causal: bool | str, scale, plan: Plan, need_lse: bool):
        """torch's attention, on inputs in O's dtype: it takes no fp8, so e4m3 inputs go up to bf16
        (exactly). A measured peer (plan.peer) runs pinned to its backend: SDPA itself, or with
        `need_lse` that backend's kernel which returns the LSE. Otherwise, after the plan's one
        warning: with `need_lse`, the fastest of torch's kernels that returns the LSE and takes the
        case; without, scaled_dot_product_attention, which picks its own backend (the bottom-right
        mask as torch's causal_lower_right where Nq < Nk; where Nq > Nk, the rows that see keys
        alone, top-left)."""
        import torch.nn.functional as F

        from .backward import choose
        from .peers import DISPATCHED_PEERS
        from .torch_attention import BACKENDS, Case, no_key_rows, sdpa_mask_kwargs

        if empty := no_key_rows(q, k, causal):
            # Rows that see no key are O = 0, LSE -inf; the rest see keys j <= i - empty, a square
            # causal problem on which every backend's diagonal agrees (torch's memory-efficient
            # kernel gets the bottom-right one wrong where Nq > Nk: tests/test_gpu_shipped.py).
            o_seen, lse_seen = self._fallback(q[:, :, empty:], k, v, "causal", scale, plan, need_lse)
            size, stride = out_layout(q)
            o = torch.empty_strided(size, stride, dtype=o_seen.dtype, device=q.device)
            o[:, :, :empty] = 0
            o[:, :, empty:] = o_seen
            lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
            lse[:, :, empty:] = lse_seen
            return o, lse
        if plan.peer is None:
            self._warn(plan.reason)
        if q.dtype != plan.out:
            q, k, v = (t.to(plan.out) for t in (q, k, v))
        backend = BACKENDS[DISPATCHED_PEERS[plan.peer]] if plan.peer else None
        o = None
        if not need_lse:
            kw = sdpa_mask_kwargs(causal, q.shape[2], k.shape[2])
            if k.shape[1] != q.shape[1]:
                kw["enable_gqa"] = True
            if plan.peer is None:
                o = F.scaled_dot_product_attention(q, k, v, scale=scale, **kw)
            else:
                try:   # a shape of the bucket the pinned backend refuses (GQA, say): its own kernel below
                    with _pinned(plan.peer):
                        o = F.scaled_dot_product_attention(q, k, v, scale=scale, **kw)
                except RuntimeError:
                    o = None
            lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
        if o is None:
            o, lse = (backend or choose(Case.of(q, k, causal))).forward(q, k, v, causal, scale)
        size, stride = out_layout(q)
        if o.stride() != stride:
            o = torch.empty_strided(size, stride, dtype=o.dtype, device=o.device).copy_(o)
        return o, lse.contiguous()


def served_params(entry: dict, problem: Problem) -> dict:
    """A lookup entry's config as it serves `problem` (KernelFamily.adapt, from the shape it was
    tuned on; an SDPA backend's entry, or one that does not say, as it is)."""
    from .kernel_templates import FAMILIES

    fam, tuned = FAMILIES.get(entry["family"]), tuned_problem(entry)
    if fam is None or tuned is None:   # an SDPA backend's entry (no config), or one that does not say
        return entry["params"]
    return fam.adapt(entry["params"], tuned, problem)


def _served_form(entry: dict | None, problem: Problem, gpu) -> dict | None:
    """`entry` in the form a call of `problem` runs it (KernelFamily.served_form, as a search timed
    it): a persistent flash_fwd_sm90 config on an unmasked call whose last round of work tiles would
    leave SMs idle runs its last two rounds cut into one segment of equal work per SM
    (flash_fwd_sm90_tail), the same tile and schedule; a persistent flash_fwd_sm90_gqa config runs on
    the grid where that form would split the keys (the same family, other params)."""
    from .kernel_templates import FAMILIES

    fam = FAMILIES.get(entry["family"]) if entry else None
    if fam is None:   # none, or an SDPA backend's entry
        return entry
    served = served_params(entry, problem)
    runs, params = fam.served_form(served, gpu, problem)
    return entry if runs is fam and params is served else {**entry, "family": runs.name, "params": params}


def _two_consumers_where_idle(entry: dict, problem: Problem, gpu) -> dict:
    """`entry`, or where it is a flash_fwd_sm90 config of three consumers serving a call whose
    192-row blocks make under a wave of CTAs and where two consumers pay
    (flash_fwd_sm90.two_consumers_pay) or a mask spreads the wave's work (rows_spread_idle),
    flash_fwd_sm90's default, which takes two there. Not where it was tuned in this bucket on a call
    of under a wave too: a search there weighed two consumers against it. On the H200 a d=64 causal
    call of 548 queries, 36 CTAs, served the n1024/medium bucket's config (tuned on 1200 blocks) at
    28.6 TFLOP/s and read 35.1 at two (PERF_NOTES "j3"); 41 such random calls read 1.06-1.35x ("b1");
    B1-H4 5837 causal at d=96, 124 blocks, served the n8192/medium bucket's grid config at 299 and
    read 401 at two ("x2")."""
    from .kernel_templates import FAMILIES
    from .kernel_templates.flash_fwd_sm90 import rows_spread_idle, two_consumers_pay

    fam = FAMILIES.get("flash_fwd_sm90")
    if (fam is None or entry["family"] != fam.name or problem.query_blocks(192) >= gpu.sm_count
            or not (two_consumers_pay(gpu, problem) or rows_spread_idle(gpu, problem))):
        return entry
    here = tuned_here(entry, problem)
    if served_params(entry, problem).get("cwg") != 3 or (here is not None and here.query_blocks(192) < gpu.sm_count):
        return entry
    default = fam.default(gpu, problem)
    return {**entry, "params": default} if default["cwg"] == 2 else entry


def _one_consumer_where_idle(entry: dict | None, problem: Problem, gpu) -> dict | None:
    """`entry`, or where it runs a flash_fwd_sm90 config of two or three consumers on a 16-bit prefill
    whose 64-row blocks make a wave of CTAs or less, flash_fwd_sm90's default at one consumer
    (untuned.one_consumer_default): twice the CTAs, each with half the rows, on SMs that would idle.
    Not where the entry was tuned in this bucket on such a call too (a search there weighed one
    consumer against it), nor in another form (split keys, packed rows, pairs): only the plain kernel
    was timed so. On the H200 26 calls of 8-128 such blocks read 1.03-1.39x what served, and 144-336
    blocks 0.56-1.03x (PERF_NOTES "x10")."""
    from .kernel_templates.flash_fwd_sm90 import one_consumer_pays

    if (entry is None or entry["family"] != "flash_fwd_sm90" or not one_consumer_pays(gpu, problem)
            or served_params(entry, problem).get("cwg", 1) < 2):
        return entry
    here = tuned_here(entry, problem)
    return entry if here is not None and one_consumer_pays(gpu, here) else (one_consumer_default(problem, gpu) or entry)


def _pinned(peer: str):
    """SDPA pinned to one backend, as the peer `peer` (peers.SDPA_BACKENDS) was measured."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .peers import SDPA_BACKENDS

    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[peer]))


_default: Dispatcher | None = None
_default_lock = threading.Lock()


def default() -> Dispatcher:
    """The process's dispatcher (threads racing on the first call share one, with one plan cache)."""
    global _default
    d = _default
    if d is None:
        with _default_lock:
            if _default is None:
                _default = Dispatcher()
            d = _default
    return d


def reset(lookup_path: str | Path | None = None) -> Dispatcher:
    """Drop cached plans and re-read the lookup (after a new search, or to point elsewhere)."""
    global _default
    _default = Dispatcher(lookup_path)
    return _default
