"""wgmma m64nNk16 (fp16/bf16) and m64nNk32 (e4m3) wrappers, generated: one inline-PTX statement per
N names N/2 accumulator registers, which neither templates nor the preprocessor can spell.

Rendered ahead of a family's source (so the cache hashes exactly what was compiled), only for the
N values the point uses.
"""

from __future__ import annotations

PTX_TYPE = {"fp16": "f16", "bf16": "bf16", "fp8": "e4m3"}


def _regs(first: int, count: int) -> str:
    return ", ".join(f"%{i}" for i in range(first, first + count))


def wrapper(n: int, dtype: str) -> str:
    """Wgmma<n>::ss (A, B in shared memory, both K-major) and ::rs (A from registers; B N-major for
    16-bit types, K-major for e4m3, which has no transposed form), accumulating into fp32
    `float (&d)[n / 8][4]`. A k step is 16 elements (32 bytes) for 16-bit types, 32 for e4m3."""
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma n must be a multiple of 8 in [8, 256], not {n}")
    t = PTX_TYPE[dtype]
    nd = n // 2
    outs = ", ".join(f'"+f"(d[{i // 4}][{i % 4}])' for i in range(nd))
    k = 32 if dtype == "fp8" else 16
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{t}.{t}"
    # scale-d, then imm-scale-a/b (1: no negation), then for 16-bit types imm-trans-a/b
    ss_imm, rs_imm = ("1, 1", "1, 1") if dtype == "fp8" else ("1, 1, 0, 0", "1, 1, 1")
    ssn_imm = "1, 1" if dtype == "fp8" else "1, 1, 0, 1"   # e4m3 has no transposed form: never called
    pred = "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{i}, 0;\\n"
    return f"""template <> struct Wgmma<{n}> {{
  // scale_d = 0: D = A B (the old accumulators are ignored); 1: D += A B
  static FT_DEVICE void ss(float (&d)[{n // 8}][4], unsigned long long da, unsigned long long db, int scale_d) {{
    asm volatile("{pred.format(i=nd + 2)}{op} {{{_regs(0, nd)}}}, %{nd}, %{nd + 1}, p, {ss_imm};\\n}}\\n"
                 : {outs} : "l"(da), "l"(db), "r"(scale_d));
  }}
  // A K-major in shared memory, B N-major (16-bit types): P V with P staged in shared memory
  static FT_DEVICE void ssn(float (&d)[{n // 8}][4], unsigned long long da, unsigned long long db, int scale_d) {{
    asm volatile("{pred.format(i=nd + 2)}{op} {{{_regs(0, nd)}}}, %{nd}, %{nd + 1}, p, {ssn_imm};\\n}}\\n"
                 : {outs} : "l"(da), "l"(db), "r"(scale_d));
  }}
  static FT_DEVICE void rs(float (&d)[{n // 8}][4], const unsigned (&a)[4], unsigned long long db, int scale_d) {{
    asm volatile("{pred.format(i=nd + 5)}{op} {{{_regs(0, nd)}}}, {{{_regs(nd, 4)}}}, %{nd + 4}, p, {rs_imm};\\n}}\\n"
                 : {outs} : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
  }}
}};
"""


def wrappers(ns: list[int] | tuple[int, ...], dtype: str) -> str:
    body = "".join(wrapper(n, dtype) for n in sorted(set(ns)))
    return f"template <int N> struct Wgmma;\n{body}"
