"""The peers: torch's SDPA backends, measured beside our kernels as configs of these families
(params {}), in the dtype they run in."""

from __future__ import annotations

from .problem import Problem

# peer family name -> torch.nn.attention.SDPBackend member that pins it
SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}
# Peers that no SDPA backend runs, recorded (params {}) by the tool that measured them where they
# were installed: FlashAttention-4 (docs/benchmarks.md). Stored rows of these families are peers too.
OTHER_PEERS = ("fa4",)
PEER_FAMILIES = (*SDPA_BACKENDS, *OTHER_PEERS)
# The peers the dispatcher may choose, where one measured fastest (the lookup carries them as
# entries of these families): SDPA pinned to that backend, or its LSE-returning kernel
# (tuner/torch_attention.BACKENDS) where the backward needs one. The math backend never wins;
# FlashAttention-4 is a peer to measure against, not a kernel the dispatcher runs.
DISPATCHED_PEERS = {"sdpa_cudnn": "cudnn", "sdpa_flash": "flash", "sdpa_efficient": "efficient"}

# What each problem dtype is measured against. SDPA takes no fp8: an fp8 problem's peers are the
# bf16 backends on bf16 copies of the same inputs (peer_dtype), what a user without an fp8 kernel
# would run. They keep their names.
PEERS_BY_DTYPE = {
    "fp32": ("sdpa_efficient", "sdpa_math"),
    "fp16": ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"),
    "bf16": ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"),
}
PEERS_BY_DTYPE["fp8"] = PEERS_BY_DTYPE["bf16"]


def peer_dtype(problem: Problem) -> str:
    """The dtype the SDPA peers run in: O's (Problem.out_dtype), so bf16 copies of e4m3 inputs
    (e4m3 values are exact in bf16)."""
    return problem.out_dtype
