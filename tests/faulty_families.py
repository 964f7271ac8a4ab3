"""Deliberately faulty kernel families, for the reliability tests only.

Plugged in with TUNER_EXTRA_FAMILIES=faulty_families (the worker process, spawned with the same
environment and sys.path, finds them too). Each uses the common argument ABI of
tuner.launch.attention_args and a space of two points, {"x": (1, 2)}:

- test_oob:   every thread stores 4 TiB past `o`: an illegal address that poisons the context.
- test_spin:  spins on clock64() while a runtime flag (nq > 0) holds: never returns.
- test_wrong: writes NaN (x=1) or a finite but wrong value (x=2) into O; lse is written correctly
              enough to be finite, so the error figures are what marks it wrong.
"""

from __future__ import annotations

from tuner.family import KernelFamily, Launch, ceil_div
from tuner.gpu import GpuSpec
from tuner.problem import Problem

_SIGNATURE = """
extern "C" __global__ void {name}(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ o, float* __restrict__ lse, int heads, int kv_group, int nq, int nk,
    long long q_sb, long long q_sh, long long q_sn, long long k_sb, long long k_sh, long long k_sn,
    long long v_sb, long long v_sh, long long v_sn, long long o_sb, long long o_sh, long long o_sn,
    float scale_log2) {{
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  const int bh = blockIdx.y;
  const int b = bh / heads, h = bh % heads;
  if (row >= nq) return;
  float* out = o + b * o_sb + h * o_sh + row * o_sn;
{body}
}}
"""

_BODIES = {
    "test_oob": """
  // X is 1 or 2: both points fault. 4 TiB past the output is never mapped.
  out[(1LL << 40) * X + threadIdx.x] = 1.0f;
""",
    "test_spin": """
  // clock64() is volatile asm, so the loop stays; nq > 0 is only known at run time.
  long long spins = 0;
  while (nq > 0 && clock64() > 0) { ++spins; }
  out[0] = (float)spins;
""",
    "test_wrong": """
  const float value = X == 1 ? __int_as_float(0x7fc00000) : 12345.0f;  // NaN, or far off
  for (int d = 0; d < HEAD_DIM; ++d) out[d] = value;
  lse[bh * nq + row] = 0.0f;
""",
}


class FaultyFamily(KernelFamily):
    min_cc = (7, 0)
    dtypes = ("fp32",)
    head_dims = (64, 128)
    space = {"x": (1, 2)}
    source_file = ""  # the source is inline: render() is overridden
    block = 64

    def __init__(self, name: str) -> None:
        self.name = name
        self.kernel_name = "ft_" + name

    def _check(self, params: dict, gpu: GpuSpec, problem: Problem) -> str | None:
        return None

    def seeds(self, gpu: GpuSpec, problem: Problem) -> list[dict]:
        return [{"x": 1}]

    def defines(self, params: dict, problem: Problem) -> dict[str, int]:
        return {"X": params["x"], "HEAD_DIM": problem.head_dim}

    def smem_bytes(self, params: dict, problem: Problem) -> int:
        return 0

    def launch(self, params: dict, problem: Problem, gpu: GpuSpec) -> Launch:
        return Launch(grid=(ceil_div(problem.seqlen_q, self.block), problem.batch * problem.heads, 1),
                      block=(self.block, 1, 1), smem_bytes=0)

    def render(self, params: dict, problem: Problem) -> str:
        return f"// {self.name} {params}\n{self.define_lines(params, problem)}" + _SIGNATURE.format(name=self.kernel_name, body=_BODIES[self.name])


FAMILIES = [FaultyFamily(n) for n in _BODIES]
