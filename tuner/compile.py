"""NVRTC compilation through cuda.core, with an on-disk cubin cache and ptxas's resource report."""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
import time
from dataclasses import asdict
from functools import cache
from pathlib import Path

from .family import KernelFamily
from .files import atomic_write, one_maker
from .problem import Problem
from .records import CompiledKernel, Resources, short_hash

# Flags that are part of every compile (and so of every cache key).
STD = "c++17"
PTXAS = "-v"
# A quick build (compile_kernel(quick=True)): NVRTC's -Ofast-compile=max. The same front end, NVVM
# and ptxas run, optimizing less: a Hopper point builds in 0.9 s instead of 2.4 on a CI core, an
# mma.sync one in 0.36 instead of 0.73. For the compile sweep (tests/test_compile.py), whose
# question is whether every valid point builds; registers and spills, which decide configs, come
# from production builds only. Its cubins are filed under their own cache keys: never served.
# NVRTC 13.0 keeps the option's effect in its process: after one quick build, a production build of
# the same source gives another cubin (another SASS), and a later --Ofast-compile=0 a third. So quick
# builds run in a process of their own (_quick_builder), which makes nothing else.
QUICK = "max"
_quick_process = False   # True in that process
_quick_pool = None


class CompileError(RuntimeError):
    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log

    def __reduce__(self):   # raised in the quick-build process, it crosses back whole
        return CompileError, (str(self), self.log)


@cache
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"NVRTC is not usable: {err}")
    return f"{major}.{minor}"


def cache_dir() -> Path:
    env = os.environ.get("TUNER_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("flashtune")) / "cubin"


def parse_ptxas(log: str) -> Resources:
    """Registers, spills, stack and static shared memory from `ptxas -v` output."""
    r = Resources()
    if m := re.search(r"Used (\d+) registers", log):
        r.registers = int(m.group(1))
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log):
        r.stack_bytes = int(m.group(1))
        r.spill_bytes = int(m.group(2)) + int(m.group(3))
    if m := re.search(r"(\d+) bytes smem", log):
        r.static_smem = int(m.group(1))
    return r


def cuobjdump() -> str | None:
    import shutil

    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("cuobjdump")
    except Exception:
        found = None
    return found or shutil.which("cuobjdump")


def disassemble(cubin: bytes) -> list[str]:
    """The SASS instructions of a cubin, in order, as nvdisasm prints them (without addresses and
    encodings)."""
    return [m.group(1) for line in sass_listing(cubin).splitlines() if (m := _SASS_INSN.search(line))]


def sass_listing(cubin: bytes) -> str:
    """nvdisasm's listing of a cubin, kept in the cache folder by the cubin's hash and nvdisasm's
    version: the seeds' SASS tests and benchmarks/seed_resources.py read the same cubins, and
    nvdisasm takes about as long on one as a warm compile cache takes on a whole test. nvdisasm
    comes with the test extra (nvidia-cuda-nvdisasm)."""
    tool, version = _nvdisasm()
    path = cache_dir() / "sass" / f"{short_hash(version + cubin.hex(), 32)}.sass"
    try:
        return path.read_text()
    except (OSError, ValueError):
        pass
    out = _run_on_cubin([tool], cubin, check=True, timeout=300)
    try:
        atomic_write(path, out.encode())
    except OSError:
        pass  # a read-only cache only costs another disassembly
    return out


@cache
def _nvdisasm() -> tuple[str, str]:
    import subprocess

    from cuda.pathfinder import find_nvidia_binary_utility

    tool = find_nvidia_binary_utility("nvdisasm")
    if not tool:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (in flashtune's test extra)")
    return tool, subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout


def _run_on_cubin(command: list[str], cubin: bytes, **run) -> str:
    """A binary utility's stdout on `cubin` (written to a temporary file, its path last on the line)."""
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([*command, f.name], capture_output=True, text=True, **run).stdout


_SASS_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_SASS_RENAMES = [
    (re.compile(r"\bU?R\d+\b"), "R"), (re.compile(r"\bU?P\d\b"), "P"), (re.compile(r"\bB\d+\b"), "B"),
    (re.compile(r"`?\(?\.L_x_\d+\)?"), "L"), (re.compile(r"0x[0-9a-f]+"), "#"), (re.compile(r"\b\d+\b"), "#"),
    (re.compile(r"\+#\]"), "]"),   # an address's offset, absent where it is 0
]


def sass_shape(insn: str) -> str:
    """An instruction with its registers, predicates, labels and immediates renamed away: two
    instruction streams of the same shapes are the same work in the same order (ptxas's register
    allocation and a shared-memory layout aside)."""
    for pattern, name in _SASS_RENAMES:
        insn = pattern.sub(name, insn)
    return insn


def resources_from_cubin(cubin: bytes, arch: str = "") -> Resources | None:
    """Registers, local and static shared memory read back from the cubin (of `arch`), for
    compiles whose log was empty."""
    tool = cuobjdump()
    if tool is None:
        return None
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", _run_on_cubin([tool, "--dump-resource-usage"], cubin))
    if not m:
        return None
    regs, stack, shared, local = map(int, m.groups())
    # ptxas's own split into spill stores/loads is not in the cubin; local memory is what spills use.
    # The static shared memory (ptxas's "bytes smem") decides whether a launch must opt in past
    # 48 KB (LoadedKernel.load). An sm_90 cubin counts the 1 KB the driver reserves per block in
    # it too (cuobjdump 13: SHARED 1024 for a kernel with none, 1040 for ptxas's 16 B), which no
    # launch asks for.
    if arch.startswith("sm_9") and shared >= 1024:
        shared -= 1024
    return Resources(registers=regs, spill_bytes=local, stack_bytes=stack, static_smem=shared)


_KPARAM = re.compile(r"EIATTR_KPARAM_INFO.*?Ordinal\s*:\s*0x([0-9a-f]+).*?Size\s*:\s*0x([0-9a-f]+)", re.S)


def param_sizes_from_cubin(cubin: bytes, kernel_name: str) -> list[int] | None:
    """The byte size of each parameter `kernel_name` takes, in order, as the cubin declares them
    (cuobjdump -elf's EIATTR_KPARAM_INFO): what a family's param_kinds must match, checked here
    without a GPU (the driver checks it again at load, LoadedKernel). None without cuobjdump."""
    tool = cuobjdump()
    if tool is None:
        return None
    elf = _run_on_cubin([tool, "-elf"], cubin)
    start = elf.find(f"\n.nv.info.{kernel_name}\n")   # the section itself (its header-table line is indented)
    if start < 0:
        return []
    end = elf.find("\n.nv.", start + 1)
    section = elf[start:end if end > 0 else len(elf)]
    return [size for _, size in sorted((int(o, 16), int(z, 16)) for o, z in _KPARAM.findall(section))]


def cache_key(source: str, arch: str, quick: bool = False) -> str:
    return short_hash("\n".join((source, arch, nvrtc_version(), STD, PTXAS) + ((f"ofast={QUICK}",) if quick else ())), 32)


def compile_kernel(family: KernelFamily, params: dict, problem: Problem, arch: str, *, quick: bool = False) -> CompiledKernel:
    """Compile one point of a family for `arch` (e.g. sm_90a), or answer from the disk cache.
    `quick`: a build that only shows the point compiles (QUICK), never one to launch; made in the
    quick-build process."""
    if _quick_process and not quick:
        raise CompileError("the quick-build process makes no production build (NVRTC would carry -Ofast-compile into it)")
    source = family.render(params, problem)
    key = cache_key(source, arch, quick)
    smem = family.smem_bytes(params, problem)
    hit = _read_cache(key, family, arch)
    if hit is None and quick and not _quick_process:
        return _quick_builder().submit(_quick_build, family, params, problem, arch, str(cache_dir())).result()
    if hit is None:
        with one_maker(_paths(key)[0].with_suffix(".lock")):   # another process building it: wait for it
            hit = _read_cache(key, family, arch)
            if hit is None:
                return _build(family, params, problem, arch, source, key, smem, quick)
    hit.resources.dynamic_smem = smem
    return hit


def _build(family: KernelFamily, params: dict, problem: Problem, arch: str, source: str, key: str, smem: int,
           quick: bool) -> CompiledKernel:
    """NVRTC's build of `source` (compile_kernel's miss), written to the cache."""
    from cuda.core import Program, ProgramOptions

    options = ProgramOptions(name=f"{family.name}.cu", arch=arch, std=STD, ptxas_options=PTXAS,
                             **({"ofast_compile": QUICK} if quick else {}))
    log = io.StringIO()
    start = time.perf_counter()
    try:
        obj = Program(source, "c++", options=options).compile("cubin", logs=log)
    except Exception as exc:  # cuda.core raises NVRTCError with the log in its message
        text = f"{exc}\n{log.getvalue()}".strip()
        first = next((ln for ln in text.splitlines() if "error" in ln), text.splitlines()[0] if text else "")
        raise CompileError(f"NVRTC failed for {family.name} {params}: {first.strip()}", text) from None
    seconds = time.perf_counter() - start
    text = log.getvalue()
    res = parse_ptxas(text)
    if res.registers == 0:  # NVRTC sometimes returns no ptxas report: ask the cubin instead
        res = resources_from_cubin(bytes(obj.code), arch) or res
    res.dynamic_smem = smem
    ck = CompiledKernel(
        key=key,
        family=family.name,
        kernel_name=family.kernel_name,
        arch=arch,
        cubin=bytes(obj.code),
        resources=res,
        compile_seconds=seconds,
        log=text,
        nvrtc_version=nvrtc_version(),
    )
    _write_cache(ck)
    return ck


def _quick_builder():
    """The one process (spawned on first use, kept) that this process's quick builds run in."""
    global _quick_pool
    if _quick_pool is None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _quick_pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_be_quick_process)
    return _quick_pool


def _be_quick_process() -> None:
    global _quick_process
    _quick_process = True


def _quick_build(family: KernelFamily, params: dict, problem: Problem, arch: str, cache: str) -> CompiledKernel:
    """compile_kernel(quick=True), run in the quick-build process, in the caller's cache (`cache`: the
    process was spawned with the environment of its first caller, whose TUNER_CACHE_DIR may since
    have changed)."""
    os.environ["TUNER_CACHE_DIR"] = cache
    return compile_kernel(family, params, problem, arch, quick=True)


def compile_job(args: tuple[str, dict, Problem, str]) -> tuple[str, str]:
    """(family name, params, problem, arch) -> ("compiled" | "cached" | "error", what): one job of
    a process pool filling the cache (`tuner precompile`, GpuRunner.prefetch)."""
    from .kernel_templates import get_family

    family, params, problem, arch = args
    try:
        ck = compile_kernel(get_family(family), params, problem, arch)
    except CompileError as exc:
        return "error", str(exc)
    return ("cached" if ck.cached else "compiled"), f"{ck.resources.registers} regs, {ck.resources.spill_bytes} B spilled"


def _paths(key: str) -> tuple[Path, Path]:
    d = cache_dir() / key[:2]
    return d / f"{key}.cubin", d / f"{key}.json"


_META_TYPES: dict[str, tuple[type, ...]] = {
    "key": (str,), "family": (str,), "kernel_name": (str,), "arch": (str,), "resources": (dict,),
    "compile_seconds": (int, float), "log": (str,), "nvrtc_version": (str,), "cubin_sha": (str,),
}


def _entry_meta(meta: object, key: str, family: KernelFamily, arch: str) -> dict | None:
    """The metadata of the entry filed under `key`, or None if it is not exactly what
    _write_cache writes for this key, family and arch (any other shape is a miss)."""
    if not isinstance(meta, dict) or set(meta) != set(_META_TYPES):
        return None
    for name, types in _META_TYPES.items():
        if not isinstance(meta[name], types) or isinstance(meta[name], bool):
            return None
    if (meta["key"], meta["family"], meta["kernel_name"], meta["arch"]) != (key, family.name, family.kernel_name, arch):
        return None  # an entry copied or planted under another key is never served
    res = meta["resources"]
    fields = Resources.__dataclass_fields__
    if set(res) != set(fields) or not all(type(v) is int for v in res.values()):
        return None
    return meta


def _read_cache(key: str, family: KernelFamily, arch: str) -> CompiledKernel | None:
    """The cached kernel for `key`, or None (a miss) for anything missing, damaged or mismatched."""
    cubin_path, meta_path = _paths(key)
    try:
        meta = _entry_meta(json.loads(meta_path.read_text()), key, family, arch)
        cubin = cubin_path.read_bytes() if meta is not None else b""
    except (OSError, ValueError, RecursionError):
        return None
    if meta is None or short_hash(cubin.hex(), 32) != meta.pop("cubin_sha"):  # truncated, corrupted: rebuild
        return None
    meta["resources"] = Resources(**meta["resources"])
    return CompiledKernel(cubin=cubin, cached=True, **meta)


def _write_cache(ck: CompiledKernel) -> None:
    """cubin first, metadata (with the cubin's hash) last: a reader never sees a half entry."""
    cubin_path, meta_path = _paths(ck.key)
    meta = asdict(ck)
    meta.pop("cubin")
    meta.pop("cached")
    meta["cubin_sha"] = short_hash(ck.cubin.hex(), 32)
    try:
        atomic_write(cubin_path, ck.cubin)
        atomic_write(meta_path, json.dumps(meta).encode())
    except OSError:
        pass  # a read-only cache only costs a recompile next time
