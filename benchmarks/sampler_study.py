"""How many trials a search needs, by sampler, against a sweep of the whole space.

A sweep (`bash benchmarks/gpu_session.sh sweep`, or `tuner search --sampler grid` with enough
trials) measures every valid point of a family on a problem; replayed (tuner.runner.ReplayRunner),
it answers any search offline, exactly as the GPU did. For each sampler and seed this runs the
search as `tuner search` configures it (its warm starts, default and seeds first) up to a budget
of counted trials, and reports the first trial whose best is within 1% and 2% of the sweep's best:

    python3 benchmarks/sampler_study.py tests/fixtures/h100_simt.db --seeds 10 --budget 60 [--json out.json]

"random" is Optuna's RandomSampler and "gp" its GPSampler (Gaussian process, categorical
parameters one-hot; at most GP_SEEDS seeds, it is slow), beside "tpe" as the search configures it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

SAMPLERS = ("tpe", "random", "gp")
WITHIN = (0.01, 0.02)
GP_SEEDS = 3   # the GP sampler refits its model every trial: minutes per seed on a CPU


def sweep_best(replay, family: str, problem) -> float:
    """The best ok TFLOP/s the recording holds for `family` on `problem`."""
    from tuner.db import queries

    with replay.sessions() as s:
        rows = queries.measurements(s, replay.gpu.key, family, problem.key)
    return max(r["tflops"] for r in rows if r["status"] == "ok" and r["tflops"])


def run(url: str, family_name: str, problem, sampler: str, seed: int, budget: int) -> list[float]:
    """The best TFLOP/s after each counted trial of one replayed search."""
    import optuna

    from tuner.db.engine import make_engine, session_factory
    from tuner.kernel_templates import get_family
    from tuner.runner import ReplayRunner
    from tuner.search import Search

    curve: list[float] = []

    def observe(ev) -> None:
        if ev.done > len(curve) and ev.best_tflops:
            curve.append(ev.best_tflops)

    with tempfile.TemporaryDirectory() as tmp:
        target = f"sqlite:///{Path(tmp) / 'study.db'}"
        runner = ReplayRunner(url)
        search = Search(runner, session_factory(make_engine(target)), target, seed=seed,
                        sampler="random" if sampler == "random" else "tpe", observer=observe)
        if sampler == "gp":
            search._sampler = lambda family, trials: optuna.samplers.GPSampler(seed=seed)
        try:
            search.tune(get_family(family_name), problem, budget)
        finally:
            runner.close()
    return curve


def first_within(curve: list[float], best: float, gap: float) -> int | None:
    """The 1-based trial whose best is within `gap` of `best` (None: not within the budget)."""
    return next((i + 1 for i, x in enumerate(curve) if x >= (1 - gap) * best), None)


def study(url: str, family: str, problem_key: str | None, samplers, seeds: int, budget: int,
          save=lambda report: None) -> dict:
    from tuner.problem import Problem
    from tuner.runner import ReplayRunner

    replay = ReplayRunner(url)
    try:
        keys = replay.recorded_problems()
        problem = Problem.from_key(problem_key or keys[0])
        best = sweep_best(replay, family, problem)
    finally:
        replay.close()
    out = {"replay": str(url), "family": family, "problem": problem.key, "sweep_best_tflops": best,
           "budget": budget, "seeds": seeds, "samplers": {}}
    for sampler in samplers:
        hits = {f"{int(g * 100)}%": [] for g in WITHIN}
        for seed in range(seeds if sampler != "gp" else min(seeds, GP_SEEDS)):
            curve = run(url, family, problem, sampler, seed, budget)
            for g in WITHIN:
                hits[f"{int(g * 100)}%"].append(first_within(curve, best, g))
        out["samplers"][sampler] = hits
        save(out)   # after each sampler: a long study interrupted keeps what it finished
    return out


def table(report: dict) -> str:
    lines = [f"{report['family']} on {report['problem']}: sweep best {report['sweep_best_tflops']:.1f} TFLOP/s, "
             f"budget {report['budget']} trials, {report['seeds']} seeds",
             "| sampler | within | median trials | worst | seeds within budget |", "|---|---|---|---|---|"]
    for sampler, hits in report["samplers"].items():
        for within, trials in hits.items():
            got = [t for t in trials if t is not None]
            median = f"{statistics.median(got):g}" if got else "-"
            lines.append(f"| {sampler} | {within} | {median} | {max(got) if got else '-'} | "
                         f"{len(got)} of {len(trials)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("replay", help="a sweep's database (file or URL)")
    ap.add_argument("--family", default="flash_fwd_simt")
    ap.add_argument("--problem", help="a problem key the sweep holds (default: its first)")
    ap.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--json", type=Path, help="also write the report here")
    a = ap.parse_args(argv)
    url = a.replay if "://" in a.replay else f"sqlite:///{Path(a.replay).resolve()}"
    save = (lambda report: a.json.write_text(json.dumps(report, indent=1))) if a.json else (lambda report: None)
    report = study(url, a.family, a.problem, a.samplers, a.seeds, a.budget, save)
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
