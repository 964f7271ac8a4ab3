"""flash_fwd_simt: the fp32 CUDA-core FlashAttention-2 forward kernel, made parametric.

Parameters: Br x Bc block tile, TM x TN per-thread patch of S, and K/V `stages` (1: plain tiles;
2: cp.async staging of the next tile, sm_80+). fp16/bf16 inputs are loaded and computed in fp32.
"""

from __future__ import annotations

from tuner.family import ELEM_CODE, KernelFamily, Launch, ceil_div, is_pow2
from tuner.gpu import GpuSpec
from tuner.problem import Problem

_MAX_REGS = 255  # per thread, what the hardware can address


class FlashFwdSimt(KernelFamily):
    name = "flash_fwd_simt"
    kernel_name = "flash_fwd_simt"
    source_file = "flash_fwd_simt.cu"
    min_cc = (7, 5)
    dtypes = ("fp32", "fp16", "bf16")
    head_dims = (64, 128)
    space = {
        "Br": (32, 64, 128),
        "Bc": (32, 64, 128),
        "TM": (2, 4, 8),
        "TN": (2, 4, 8),
        "stages": (1, 2),
        "min_blocks": (1, 2),  # __launch_bounds__ occupancy hint: 2 caps registers at 32K / threads
    }

    @staticmethod
    def threads(params: dict) -> int:
        return (params["Bc"] // params["TN"]) * (params["Br"] // params["TM"])

    @staticmethod
    def register_estimate(params: dict, problem: Problem) -> int:
        """Live fp32 values per thread in the inner loops, plus ~40 for addresses and loop state."""
        tm, tn = params["TM"], params["TN"]
        dn = problem.head_dim // (params["Bc"] // tn)
        return tm * tn + tm * dn + 3 * tm + max(tn, dn) + 40

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        br, bc, tm, tn, stages = (params[k] for k in ("Br", "Bc", "TM", "TN", "stages"))
        if br % tm:
            return f"TM={tm} must divide Br={br}"
        if bc % tn:
            return f"TN={tn} must divide Bc={bc}"
        tx, ty = bc // tn, br // tm
        if not is_pow2(tx) or 32 % tx:
            return f"Bc/TN={tx} threads share a row; it must be a power of two up to 32 (one warp)"
        nt = tx * ty
        if nt % 32:
            return f"{nt} threads per block is not a whole number of warps"
        if nt > 1024:
            return f"{nt} threads per block is over the limit of 1024"
        if problem.head_dim % tx:
            return f"head dim {problem.head_dim} does not split across Bc/TN={tx} threads"
        if stages == 2 and (gpu.major, gpu.minor) < (8, 0):
            return "stages=2 uses cp.async, which needs sm_80+"
        regs = self.register_estimate(params, problem)
        if regs > _MAX_REGS:
            return f"needs about {regs} registers per thread (limit {_MAX_REGS}): it would spill"
        if regs * nt > gpu.regs_per_sm:
            return f"{nt} threads x ~{regs} registers exceed the {gpu.regs_per_sm} registers of an SM"
        blocks = params["min_blocks"]
        if blocks > 1 and regs * nt * blocks > gpu.regs_per_sm * 1.25:
            return f"{blocks} blocks of {nt} threads x ~{regs} registers cannot share an SM without spilling"
        if blocks > 1 and blocks * self.smem_bytes(params, problem) > gpu.smem_per_sm > 0:
            return f"{blocks} blocks do not fit the shared memory of one SM"
        return None

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        cands = [(128, 64, 8, 4, 1, 1), (64, 64, 4, 4, 1, 2), (64, 64, 4, 4, 2, 1), (64, 32, 4, 2, 1, 2), (32, 32, 2, 2, 1, 2)]
        return [dict(Br=a, Bc=b, TM=c, TN=d, stages=e, min_blocks=f) for a, b, c, d, e, f in cands]

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        return {
            "BR": params["Br"],
            "BC": params["Bc"],
            "TM": params["TM"],
            "TN": params["TN"],
            "STAGES": params["stages"],
            "MIN_BLOCKS": params["min_blocks"],
            "HEAD_DIM": problem.head_dim,
            "IN_DTYPE": ELEM_CODE[problem.dtype],
            **self.mask_defines(problem),
        }

    def smem_bytes(self, params: dict, problem: Problem) -> int:
        br, bc, d = params["Br"], params["Bc"], problem.head_dim
        floats = d * (br + 4) + d * (bc + 4) + bc * d + bc * br
        staging = 0
        if params["stages"] == 2:
            elt = 4 if problem.dtype == "fp32" else 2
            ld = d + (4 if elt == 4 else 8)
            staging = 2 * bc * ld * elt
        return 4 * floats + staging

    def launch(self, params: dict, problem: Problem, gpu: GpuSpec) -> Launch:
        return Launch(
            grid=(ceil_div(problem.seqlen_q, params["Br"]), problem.batch * problem.heads, 1),
            block=(self.threads(params), 1, 1),
            smem_bytes=self.smem_bytes(params, problem),
        )


FAMILY = FlashFwdSimt()
