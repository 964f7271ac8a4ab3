"""Records that cross process and module boundaries: a compiled kernel and a measurement."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import asdict, dataclass, field

from .problem import Problem

# The status words of docs/architecture.md; every candidate ends in exactly one of them.
STATUSES = ("ok", "invalid", "compile_error", "wrong_result", "launch_error", "crash", "timeout")


def params_key(params: dict) -> str:
    """Canonical text of a parameter dict: the identity of a config across runs and databases."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def short_hash(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


@dataclass
class Resources:
    """What ptxas reported for one compiled kernel."""

    registers: int = 0
    spill_bytes: int = 0  # spill stores + spill loads
    stack_bytes: int = 0
    static_smem: int = 0
    dynamic_smem: int = 0


@dataclass
class CompiledKernel:
    key: str  # cache key: hash of source, params, arch, NVRTC version and flags
    family: str
    kernel_name: str
    arch: str
    cubin: bytes
    resources: Resources
    compile_seconds: float
    log: str
    nvrtc_version: str
    cached: bool = False


@dataclass
class Measurement:
    status: str
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    tflops: float | None = None
    max_abs_err: float | None = None
    rel_err: float | None = None
    lse_err: float | None = None
    resources: Resources = field(default_factory=Resources)
    compile_seconds: float | None = None
    versions: dict = field(default_factory=dict)
    message: str = ""
    reps: int = 0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown measurement status {self.status!r}")
        if isinstance(self.resources, dict):
            self.resources = Resources(**self.resources)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Measurement":
        return cls(**d)


@dataclass
class SideBySide:
    """A candidate and the SDPA peers timed in turns on the same inputs (`tuner bench`)."""

    kernel: Measurement
    peers: dict[str, Measurement] = field(default_factory=dict)


def versions_key(versions: dict) -> str:
    """Measurements are reused only under the same driver, NVRTC, torch, tuner and kernel-source versions
    (tuner/versions.py)."""
    return short_hash(params_key(versions))


@dataclass
class ProblemResult:
    """What a search or a bench found for one problem: the best config and its figure, the peers."""

    problem: Problem
    family: str
    study_name: str
    best_params: dict | None = None
    best: Measurement | None = None
    peers: dict[str, Measurement] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    reused: int = 0
    dropped: str = ""   # why the search stopped at this family's starting configs (Search.tune_all)


def one_line(exc: BaseException) -> str:
    """An exception as one line for a message: its first line, or its type where it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def new_run_id() -> str:
    """The id every row of one search or bench run is stored under."""
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
