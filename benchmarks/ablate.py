"""Time chosen configs of one family on one shape, side by side: for perf-notes ablations
(does overlap help? which Bc?) without a search, with SDPA flash and cuDNN timed in the same run.
Same timer and launch path as the search; the output is checked against SDPA's flash backend once
per config (a wrong kernel is not timed).

    python3 benchmarks/ablate.py flash_fwd_sm90 4,16,4096,128 bf16 \
        '{"Bc":128,"stages":2,"cwg":2,"split":24,"overlap":1,"pingpong":1}' ...
    python3 benchmarks/ablate.py flash_fwd_sm90 4,16,4096,128 bf16 --vary overlap,pingpong '{...base...}'

--launch-only (first argument): launch each config and each peer twice, untimed and unchecked, for a
profiler to read (`ncu --clock-control none -k regex:'flash_fwd_sm90|sdpa|fmha|flash_fwd' ...`).
"""

from __future__ import annotations

import itertools
import json
import math
import sys


def main(argv: list[str]) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.launch import LoadedKernel, current_stream
    from tuner.measure import peer_dtype, poisoned_outputs, random_inputs, torch_dtype
    from tuner.problem import Problem
    from tuner.timing import Timer

    launch_only = argv[0] == "--launch-only"
    if launch_only:
        argv = argv[1:]
    fam = get_family(argv[0])
    problem = Problem.parse(argv[1], argv[2])
    rest = argv[3:]
    configs = []
    if rest and rest[0] == "--vary":
        keys, base = rest[1].split(","), json.loads(rest[2])
        for combo in itertools.product(*(fam.space[k] for k in keys)):
            configs.append({**base, **dict(zip(keys, combo))})
    else:
        configs = [json.loads(c) for c in rest]
    gpu = detect()
    timer = Timer(gpu.l2_bytes)
    q, k, v = random_inputs(problem, 0)
    qp, kp, vp = (t.to(torch_dtype(peer_dtype(problem))) for t in (q, k, v))  # SDPA takes no fp8: bf16 copies
    if launch_only:
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            with sdpa_kernel(backend):
                for _ in range(2):
                    F.scaled_dot_product_attention(qp, kp, vp, is_causal=problem.causal)
        torch.cuda.synchronize()
    else:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = F.scaled_dot_product_attention(qp, kp, vp, is_causal=problem.causal).float()
            t_ref = timer(lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=problem.causal))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = timer(lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=problem.causal))
        print(f"{problem.key} on {gpu.name}: sdpa_flash {problem.tflops(t_ref.median_ms):.1f} TFLOP/s, "
              f"sdpa_cudnn {problem.tflops(t_cudnn.median_ms):.1f} TFLOP/s")
    for params in configs:
        why = fam.check(params, gpu, problem)
        if why:
            print(f"{json.dumps(params, sort_keys=True)}  invalid: {why}")
            continue
        ck = compile_kernel(fam, params, problem, gpu.arch)
        launch = fam.launch(params, problem)
        kernel = LoadedKernel.load(ck, launch.smem_bytes, gpu.index)
        o, lse = poisoned_outputs(problem, q)
        args = fam.kernel_args(params, q, k, v, o, lse, 1.0 / math.sqrt(problem.head_dim))
        stream = current_stream()
        kernel(stream, launch, *args)
        torch.cuda.synchronize()
        if launch_only:
            kernel(stream, launch, *args)
            torch.cuda.synchronize()
            print(f"{json.dumps(params, sort_keys=True)}  launched twice  regs {ck.resources.registers}")
            continue
        err = ((o.float() - ref).abs().max() / ref.abs().max()).item()
        if not math.isfinite(err) or err > 0.05:
            print(f"{json.dumps(params, sort_keys=True)}  WRONG: rel {err:.3g}")
            continue
        t = timer(lambda: kernel(stream, launch, *args))
        print(f"{json.dumps(params, sort_keys=True)}  {problem.tflops(t.median_ms):7.1f} TFLOP/s  "
              f"{t.median_ms:.3f} ms  regs {ck.resources.registers}")


if __name__ == "__main__":
    main(sys.argv[1:])
