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
# Peers that no SDPA backend runs: FlashAttention-4 (the flash-attn-4 package, `flash_attn.cute`;
# its Hopper forward runs on sm90), measured where it is installed (`pip install 'flashtune[fa4]'`).
FA4 = "fa4"
OTHER_PEERS = (FA4,)
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
MEASURED_PEERS = (*SDPA_BACKENDS, FA4)   # what `tuner bench --peer` and a search can measure


def fa4_missing() -> str | None:
    """Why FlashAttention-4 cannot be measured in this environment, or None where it can: a cheap
    check (its kernels compile on first use, in the worker)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "FlashAttention-4 is not installed (pip install 'flashtune[fa4]')"


def fa4_why_not(problem: Problem, cc: tuple[int, int]) -> str | None:
    """Why FA4 does not run `problem` on a GPU of compute capability `cc` (None: it does)."""
    if cc[0] not in (9, 10):
        return f"FlashAttention-4 runs on sm90 and sm100, not sm{cc[0]}{cc[1]}"
    if peer_dtype(problem) not in ("fp16", "bf16"):
        return f"FlashAttention-4 takes fp16/bf16, not {problem.dtype}"
    if problem.mask == "causal" and problem.seqlen_q != problem.seqlen_k:
        return "FlashAttention-4's causal mask is the bottom-right diagonal; this problem's is the top-left (Nq != Nk)"
    if problem.head_dim % 8 or problem.head_dim > 256:
        return f"FlashAttention-4 takes head dims that are multiples of 8 up to 256, not {problem.head_dim}"
    return None


def peers_for(problem: Problem, cc: tuple[int, int]) -> tuple[str, ...]:
    """The peers a search or bench measures by default: SDPA's backends for the dtype, and FA4
    where it is installed and runs the problem."""
    extra = (FA4,) if fa4_missing() is None and fa4_why_not(problem, cc) is None else ()
    return PEERS_BY_DTYPE[problem.dtype] + extra


def peer_dtype(problem: Problem) -> str:
    """The dtype the SDPA peers run in: O's (Problem.out_dtype), so bf16 copies of e4m3 inputs
    (e4m3 values are exact in bf16)."""
    return problem.out_dtype
