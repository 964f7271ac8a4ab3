"""flash_fwd_mma: the FlashAttention-2 class kernel on tensor cores (mma.sync), fp16/bf16.

Parameters: Br x Bc block tile, warps (splitting Br; each warp owns whole m16 tiles), and the
depth of the cp.async K/V ring (`stages`). Q lives in registers; P never leaves them.
"""

from __future__ import annotations

from tuner.family import KernelFamily, Launch, ceil_div
from tuner.gpu import GpuSpec
from tuner.problem import Problem

DTYPE_CODE = {"fp16": 1, "bf16": 2}
_MAX_REGS = 255


class FlashFwdMma(KernelFamily):
    name = "flash_fwd_mma"
    kernel_name = "flash_fwd_mma"
    source_file = "flash_fwd_mma.cu"
    min_cc = (8, 0)
    dtypes = ("fp16", "bf16")
    head_dims = (64, 128)
    space = {
        "Br": (64, 128),
        "Bc": (32, 64, 96, 128),
        "warps": (4, 8),
        "stages": (1, 2, 3),
        "q_regs": (0, 1),
    }

    @staticmethod
    def register_estimate(params: dict, problem: Problem) -> int:
        """Accumulators of S and O, Q's fragments if kept, plus ~80 that ptxas was seen to add
        (prefetched ldmatrix results, addresses, softmax state). Borderline points are kept: ptxas's
        report of the compiled kernel, not this guess, is what the search sees."""
        mt = params["Br"] // params["warps"] // 16
        d = problem.head_dim
        return mt * (params["Bc"] // 2 + d // 2 + (d // 4 if params["q_regs"] else 4)) + 48

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        br, bc, warps = params["Br"], params["Bc"], params["warps"]
        if br % (16 * warps):
            return f"Br={br} does not give each of {warps} warps whole 16-row mma tiles"
        regs = self.register_estimate(params, problem)
        if regs > _MAX_REGS:
            return f"needs about {regs} registers per thread (limit {_MAX_REGS}): it would spill"
        if regs * warps * 32 > gpu.regs_per_sm:
            return f"{warps} warps x ~{regs} registers exceed the {gpu.regs_per_sm} registers of an SM"
        if bc % 16:
            return f"Bc={bc} must be a multiple of 16"
        return None

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        # Near FlashAttention-2's own sm80 choices (BENCHMARKS.md), each seen compiling without
        # spills for sm_80 and sm_90a.
        if problem.head_dim <= 64:
            cands = [(128, 64, 8, 2, 1), (128, 64, 4, 2, 0), (64, 64, 4, 2, 1), (128, 96, 8, 2, 1)]
        else:
            cands = [(128, 64, 8, 2, 1), (128, 64, 8, 2, 0), (64, 64, 4, 2, 0), (128, 32, 8, 2, 0)]
        return [dict(Br=a, Bc=b, warps=c, stages=d, q_regs=e) for a, b, c, d, e in cands]

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        return {
            "BR": params["Br"],
            "BC": params["Bc"],
            "WARPS": params["warps"],
            "STAGES": params["stages"],
            "Q_REGS": params["q_regs"],
            "HEAD_DIM": problem.head_dim,
            "IN_DTYPE": DTYPE_CODE[problem.dtype],
            "IS_CAUSAL": int(problem.causal),
        }

    def smem_bytes(self, params: dict, problem: Problem) -> int:
        d = problem.head_dim
        return 2 * (params["Br"] * d + 2 * params["stages"] * params["Bc"] * d)

    def launch(self, params: dict, problem: Problem) -> Launch:
        return Launch(
            grid=(ceil_div(problem.seqlen_q, params["Br"]), problem.batch * problem.heads, 1),
            block=(params["warps"] * 32, 1, 1),
            smem_bytes=self.smem_bytes(params, problem),
        )


FAMILY = FlashFwdMma()
