"""flash_fwd_mma: the FlashAttention-2 class kernel on tensor cores (mma.sync).

Parameters: Br x Bc block tile, warps (splitting Br; each warp owns whole m16 tiles), the depth
of the cp.async K/V ring (`stages`), whether Q's fragments stay in registers, and `compute`: fp16
and bf16 inputs compute in their own type ("in"); fp32 inputs compute in "tf32" (mma m16n8k8) or
"bf16" (converted while loaded), which the problem must allow: its error budget (`--max-error`)
has to reach what that precision costs, so that the default fp32 budget keeps fp32 on CUDA cores.
"""

from __future__ import annotations

from tuner.family import ELEM_CODE, KernelFamily, Launch, VarlenVariant, ceil_div, padded_head_dim
from tuner.gpu import GpuSpec
from tuner.problem import Problem

# Error against float64 each compute precision needs allowed before the search may use it for fp32
# inputs: a little above what it was measured to cost on random normal inputs (benchmarks/PERF_NOTES.md).
COMPUTE_MIN_BUDGET = {"tf32": 1e-3, "bf16": 1e-2}
_MAX_REGS = 255


class FlashFwdMma(KernelFamily):
    name = "flash_fwd_mma"
    kernel_name = "flash_fwd_mma"
    source_file = "flash_fwd_mma.cu"
    min_cc = (8, 0)
    dtypes = ("fp32", "fp16", "bf16")
    head_dims = (32, 64, 96, 128, 256)   # tuned and shipped; it pads to any other multiple of 8
    pads_head_dim = True
    # past 192 only 256 itself: at 248 (a 256-column tile) the columns' bounds cost the registers
    # that d=256 has spare, and every seed spills 32-96 B (sm_80 and sm_90a)
    max_padded_head_dim = 192
    space = {
        "Br": (64, 128),
        "Bc": (32, 64, 96, 128),
        "warps": (4, 8),
        "stages": (1, 2, 3),
        "q_regs": (0, 1),
        "compute": ("in", "tf32", "bf16"),
    }

    def supports(self, gpu: GpuSpec, problem: Problem) -> str | None:
        if problem.dtype == "fp32" and problem.rel_budget < min(COMPUTE_MIN_BUDGET.values()):
            return (f"{self.name} computes fp32 inputs in tf32 or bf16, whose error needs a budget of at least "
                    f"{COMPUTE_MIN_BUDGET['tf32']:g} (tf32) or {COMPUTE_MIN_BUDGET['bf16']:g} (bf16); "
                    f"this problem allows {problem.rel_budget:g} (raise it with --max-error)")
        return super().supports(gpu, problem)

    @staticmethod
    def compute_dtype(params: dict, problem: Problem) -> str:
        return problem.dtype if params["compute"] == "in" else params["compute"]

    @staticmethod
    def register_estimate(params: dict, problem: Problem) -> int:
        """Accumulators of S and O, Q's fragments if kept, plus ~80 that ptxas was seen to add
        (prefetched ldmatrix results, addresses, softmax state). Borderline points are kept: ptxas's
        report of the compiled kernel, not this guess, is what the search sees."""
        mt = params["Br"] // params["warps"] // 16
        d = padded_head_dim(problem.head_dim)
        q_words = d // 2 if params["compute"] == "tf32" else d // 4   # Q's fragments: one word per 1 or 2 elements
        return mt * (params["Bc"] // 2 + d // 2 + (q_words if params["q_regs"] else 4)) + 48

    @staticmethod
    def spill_reach(params: dict, problem: Problem) -> int | None:
        """The Bc + d past which every point of this warp shape and compute spilled, where this point
        is past it; else None. register_estimate keeps borderline points; these are beyond the border.
        From ptxas's reports of the compile sweep's 432 points (sm_80 and sm_90a, stages 1-3, Q in
        registers or not; PERF_NOTES "ci3"): at 32 query rows a warp, 16-bit tiles spilled wherever
        Bc + d > 160 and tf32 ones wherever Bc + d > 96; at 16 rows, tf32 ones from Bc + d = 224 on,
        16-bit ones from 256 on up to d=128 and past 320 beyond (d=256 at Bc 96 and 128). None of
        those compiled without spills; the borders themselves are kept (some of them spill)."""
        d = padded_head_dim(problem.head_dim)
        reach = params["Bc"] + d
        tf32 = params["compute"] == "tf32"
        if params["Br"] // params["warps"] > 16:
            limit = 96 if tf32 else 160
        elif tf32:
            limit = 223
        else:
            limit = 255 if d <= 128 else 320
        return limit if reach > limit else None

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        br, bc, warps, compute = params["Br"], params["Bc"], params["warps"], params["compute"]
        if problem.dtype == "fp32":
            if compute == "in":
                return "tensor cores take no fp32 operands: compute in tf32 or bf16"
            if compute == "tf32" and padded_head_dim(problem.head_dim) > 128:
                return "tf32 at d=256: fp32 tiles and their fragments spill (~1 KB per thread at compile time)"
            if problem.rel_budget < COMPUTE_MIN_BUDGET[compute]:
                return f"{compute} compute needs an error budget of {COMPUTE_MIN_BUDGET[compute]:g}, the problem allows {problem.rel_budget:g}"
        elif compute != "in":
            return f"{problem.dtype} inputs compute in {problem.dtype} (compute='in')"
        if br % (16 * warps):
            return f"Br={br} does not give each of {warps} warps whole 16-row mma tiles"
        regs = self.register_estimate(params, problem)
        if regs > _MAX_REGS:
            return f"needs about {regs} registers per thread (limit {_MAX_REGS}): it would spill"
        if regs * warps * 32 > gpu.regs_per_sm:
            return f"{warps} warps x ~{regs} registers exceed the {gpu.regs_per_sm} registers of an SM"
        reach = self.spill_reach(params, problem)
        if reach is not None:
            return (f"{br // warps} query rows a warp at Bc + d = {bc + padded_head_dim(problem.head_dim)} (past {reach}"
                    f"{' in tf32' if compute == 'tf32' else ''}) spill: ptxas put 48 B to 7 KB a thread in local memory there")
        if bc % 16:
            return f"Bc={bc} must be a multiple of 16"
        return None

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        # Near FlashAttention-2's own sm80 choices (docs/benchmarks.md), each seen compiling without
        # spills for sm_80 and sm_90a.
        d = problem.head_dim
        if d <= 64:
            cands = [(128, 64, 8, 2, 1), (128, 64, 4, 2, 0), (64, 64, 4, 2, 1), (128, 96, 8, 2, 1)]
        elif d <= 128:
            cands = [(128, 64, 8, 2, 1), (128, 64, 8, 2, 0), (64, 64, 4, 2, 0), (128, 32, 8, 2, 0)]
        else:  # d=256: O alone takes 128 registers per m16 tile, so one tile per warp and Q re-read
            cands = [(128, 64, 8, 2, 0), (64, 64, 4, 2, 0), (128, 32, 8, 2, 0), (64, 32, 4, 2, 0)]
        if problem.dtype != "fp32":
            return [dict(Br=a, Bc=b, warps=c, stages=d, q_regs=e, compute="in") for a, b, c, d, e in cands]
        # fp32 inputs: tf32 first (the more accurate), its fp32 tiles leave Q in shared memory at
        # d=128; then bf16 where the budget allows it, on the 16-bit seeds
        tf32 = {64: [(128, 64, 8, 2, 1), (64, 64, 4, 2, 1), (128, 96, 8, 2, 0)],
                128: [(128, 64, 8, 2, 0), (64, 64, 4, 2, 0), (128, 32, 8, 2, 0)],
                256: []}[64 if d <= 64 else (128 if d <= 128 else 256)]
        out = [dict(Br=a, Bc=b, warps=c, stages=d, q_regs=e, compute="tf32") for a, b, c, d, e in tf32]
        out += [dict(Br=a, Bc=b, warps=c, stages=d, q_regs=e, compute="bf16") for a, b, c, d, e in cands]
        return [p for p in out if problem.rel_budget >= COMPUTE_MIN_BUDGET[p["compute"]]]

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        return {
            "BR": params["Br"],
            "BC": params["Bc"],
            "WARPS": params["warps"],
            "STAGES": params["stages"],
            "Q_REGS": params["q_regs"],
            "HEAD_DIM": padded_head_dim(problem.head_dim),
            "D_VALID": problem.head_dim,
            "IN_DTYPE": ELEM_CODE[problem.dtype],
            "COMPUTE": ELEM_CODE[self.compute_dtype(params, problem)],
            **self.mask_defines(problem),
        }

    def smem_bytes(self, params: dict, problem: Problem) -> int:
        d = padded_head_dim(problem.head_dim)
        elem = 4 if params["compute"] == "tf32" else 2
        return elem * (params["Br"] * d + 2 * params["stages"] * params["Bc"] * d)

    def launch(self, params: dict, problem: Problem, gpu: GpuSpec) -> Launch:
        return Launch(
            grid=(ceil_div(problem.seqlen_q, params["Br"]), problem.batch * problem.heads, 1),
            block=(params["warps"] * 32, 1, 1),
            smem_bytes=self.smem_bytes(params, problem),
        )


class VarlenFlashFwdMma(VarlenVariant, FlashFwdMma):
    """flash_fwd_mma on packed sequences: a grid of every sequence's query blocks by head."""

    name = "flash_fwd_mma_varlen"

    def block_rows(self, params: dict) -> int:
        return params["Br"]

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        if padded_head_dim(problem.head_dim) == 256 and (gpu.major, gpu.minor) >= (9, 0):
            # at d=256 the family sits at 255 registers on sm_90a, and the sequence's offsets
            # spill 16-48 B there; flash_fwd_sm90_varlen serves Hopper
            return "at d=256 on Hopper the varlen offsets spill: flash_fwd_sm90_varlen serves it"
        return super()._check(params, gpu, problem)


FAMILY = FlashFwdMma()
VARLEN_FAMILY = VarlenFlashFwdMma()
