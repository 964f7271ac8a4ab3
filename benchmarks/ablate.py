"""Time chosen configs of one family on one shape beside SDPA flash and cuDNN, in turns on the same
inputs (as `tuner bench` does): for perf-notes ablations (does overlap help? which Bc?) without a
search. Same timer, launch path and check as the search (each entry once against the fp64
reference, within the dtype's budget: a wrong kernel is not timed).

    python3 benchmarks/ablate.py flash_fwd_sm90 4,16,4096,128 bf16 \
        '{"Bc":128,"stages":2,"cwg":2,"split":24,"overlap":1,"pingpong":1}' ...
    python3 benchmarks/ablate.py flash_fwd_sm90 4,16,4096,128 bf16 --vary overlap,pingpong '{...base...}'

--launch-only (first argument): launch each config and each peer twice more, untimed, for a
profiler to read (`ncu --clock-control none -k regex:'flash_fwd_sm90|sdpa|fmha|flash_fwd' ...`).
--clocks (first argument): then time each one alone for about 2 s while nvidia-smi samples the SM
clock, power and throttle reasons every 20 ms, and print their means per entry: does one kernel
run at a lower clock than another for the same work?
--settle S,S,... (first argument): time the entries in turns once per settle time (seconds of
untimed runs before each turn, `Timer.settle_seconds`), in the order given: how much of a turn's
figure is the clock its predecessor left?
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import time


def smi_fields() -> str:
    """Newer drivers name the throttle reasons clock event reasons; older ones only the old way."""
    new = "clocks_event_reasons.active"
    ok = subprocess.run(["nvidia-smi", f"--query-gpu={new}", "--format=csv,noheader"], capture_output=True).returncode == 0
    return "timestamp,clocks.sm,power.draw," + (new if ok else "clocks_throttle_reasons.active")


def parse_sample(line: str) -> tuple[float, float, float, int] | None:
    """(epoch seconds, SM MHz, W, reason bits) from one nvidia-smi csv line; None where a field is N/A."""
    try:
        stamp, clock, power, reasons = (x.strip() for x in line.split(","))
        day, frac = stamp.split(".")
        when = time.mktime(time.strptime(day, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
        return when, float(clock), float(power), int(reasons, 16)
    except ValueError:
        return None


def sampled_clocks(runs: dict, timer) -> None:
    """Time each entry alone under an nvidia-smi sampler; print mean SM clock, power, and the share
    of samples with a reason other than idle (bit 0) set, from the samples inside its timing."""
    import torch

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={smi_fields()}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=subprocess.PIPE, text=True)
    spans = {}
    try:
        time.sleep(0.5)
        for name, fn in runs.items():
            torch.cuda.synchronize()
            start = time.time()
            t = timer(fn)
            spans[name] = (start, time.time(), t)
            time.sleep(0.3)
    finally:
        smi.terminate()
    samples = [x for x in map(parse_sample, smi.stdout.read().splitlines()) if x is not None]
    for name, (start, end, t) in spans.items():
        inside = [s for s in samples if start <= s[0] <= end]
        if not inside:
            print(f"{name}: no nvidia-smi sample inside its {end - start:.2f} s")
            continue
        print(f"{name}: alone {t.median_ms:.3f} ms median ({t.min_ms:.3f} min), {len(inside)} samples: "
              f"SM {statistics.mean(s[1] for s in inside):.0f} MHz, {statistics.mean(s[2] for s in inside):.0f} W, "
              f"throttled {sum(s[3] & ~1 != 0 for s in inside) / len(inside):.0%} (reasons {sorted({hex(s[3]) for s in inside})})")


def main(argv: list[str]) -> None:
    import torch

    from tuner.compile import compile_kernel
    from tuner.gpu import detect
    from tuner.kernel_templates import get_family
    from tuner.measure import measure_prepared, prepare_kernel, prepare_peer
    from tuner.problem import Problem
    from tuner.timing import Timer

    mode = argv[0] if argv[0] in ("--launch-only", "--clocks", "--settle") else ""
    settles = [None]
    if mode:
        argv = argv[1:]
    if mode == "--settle":
        settles, argv = [float(x) for x in argv[0].split(",")], argv[1:]
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
    # one seed: every entry runs on the same inputs (the peers on bf16 copies for fp8)
    prepared = {b: prepare_peer(b, problem, 0) for b in ("sdpa_flash", "sdpa_cudnn")}
    for params in configs:
        name = json.dumps(params, sort_keys=True)
        why = fam.check(params, gpu, problem)
        if why:
            print(f"{name}  invalid: {why}")
            continue
        prepared[name] = prepare_kernel(fam, params, problem, compile_kernel(fam, params, problem, gpu.arch), 0, gpu)
    for name, (run, m) in prepared.items():
        if run is None:
            print(f"{name}  {m.status}: {m.message}")
    runs = {name: run for name, (run, _) in prepared.items() if run is not None}
    if mode == "--launch-only":
        for fn in runs.values():
            fn()
            fn()
        torch.cuda.synchronize()
        print(f"{problem.key}: launched twice each: {', '.join(runs)}")
        return
    for settle in settles:
        timer = Timer(gpu.l2_bytes) if settle is None else Timer(gpu.l2_bytes, settle_seconds=settle)
        print(f"{problem.key} on {gpu.name}, in turns (settle {timer.settle_seconds * 1e3:g} ms), "
              "TFLOP/s of the median, then min / median / max ms:")
        for name, m in measure_prepared(prepared, problem, timer).items():
            if m.ok:
                regs = f"  regs {m.resources.registers}" if m.resources.registers else ""
                print(f"{name}  {m.tflops:7.1f} TFLOP/s  {m.min_ms:.3f} / {m.median_ms:.3f} / {m.max_ms:.3f} ms{regs}")
    if mode == "--clocks":
        sampled_clocks(runs, Timer(gpu.l2_bytes, target_seconds=2.0, max_reps=5000))


if __name__ == "__main__":
    main(sys.argv[1:])
