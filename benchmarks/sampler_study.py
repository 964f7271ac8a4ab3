"""How many trials a search needs, by sampler, against a sweep of the whole space.

A sweep (`bash benchmarks/gpu_session.sh sweep`, or `tuner search --sampler grid` with enough
trials) measures every valid point of a family on a problem; replayed (tuner.runner.ReplayRunner),
it answers any search offline, exactly as the GPU did. For each sampler and seed this runs the
search as `tuner search` configures it (its warm starts, default and seeds first) up to a budget
of counted trials, and reports the first trial whose best is within 1% and 2% of the sweep's best:

    python3 benchmarks/sampler_study.py tests/fixtures/h100_simt.db --seeds 10 --budget 60 [--json out.json]

"random" is Optuna's RandomSampler, "ga" its NSGAIISampler (a genetic algorithm, populations of
GA_POPULATION) and "gp" its GPSampler (Gaussian process, categorical parameters one-hot; at most
GP_SEEDS seeds, it is slow), beside "tpe" as the search configures it (in Optuna 5 TPE models the
parameters jointly: its `multivariate` argument is gone). `--problem all` studies every problem the sweep holds.

`--starts` says what opens each study: "warm" as `tuner search` runs (the nearest tuned configs,
flashtune's shipped lookups included, then the family's default and seeds), "cold" without the
shipped lookups (default and seeds: a GPU or problem nobody tuned), "none" the sampler alone
(what tells the samplers apart, where a start is already within 1%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

SAMPLERS = ("tpe", "random", "ga", "gp")
GA_POPULATION = 12   # Optuna's default of 50 would leave a 60-trial budget all but random
WITHIN = (0.01, 0.02)
GP_SEEDS = 3   # the GP sampler refits its model every trial: minutes per seed on a CPU


def sweep_best(replay, family: str, problem) -> float:
    """The best ok TFLOP/s the recording holds for `family` on `problem`."""
    from tuner.db import queries

    with replay.sessions() as s:
        rows = queries.measurements(s, replay.gpu.key, family, problem.key)
    return max(r["tflops"] for r in rows if r["status"] == "ok" and r["tflops"])


STARTS = ("warm", "cold", "none")


class _Reached(Exception):
    """The replayed search's best has reached `until`: the rest of its curve is not needed."""


def run(url: str, family_name: str, problem, sampler: str, seed: int, budget: int, starts: str = "warm",
        until: float | None = None) -> list[float]:
    """The best TFLOP/s after each counted trial of one replayed search, the whole budget's, or up
    to the first trial whose best reaches `until` (the trials asked follow from the budget alone:
    TPE's random start is a share of it)."""
    import os

    import optuna

    from tuner.db.engine import make_engine, session_factory
    from tuner.export import SHIPPED_ENV
    from tuner.kernel_templates import get_family
    from tuner.runner import ReplayRunner
    from tuner.search import Search

    curve: list[float] = []

    def observe(ev) -> None:
        if ev.done > len(curve) and ev.best_tflops:
            curve.append(ev.best_tflops)
            if until is not None and ev.best_tflops >= until:
                raise _Reached

    with tempfile.TemporaryDirectory() as tmp:
        target = f"sqlite:///{Path(tmp) / 'study.db'}"
        runner = ReplayRunner(url)
        search = Search(runner, session_factory(make_engine(target)), target, seed=seed,
                        sampler="random" if sampler == "random" else "tpe", observer=observe)
        if sampler == "gp":
            search._sampler = lambda family, trials: optuna.samplers.GPSampler(seed=seed)
        elif sampler == "ga":
            search._sampler = lambda family, trials: optuna.samplers.NSGAIISampler(population_size=GA_POPULATION, seed=seed)
        if starts == "none":
            search.starts = lambda family, problem: []
        shipped = os.environ.get(SHIPPED_ENV)
        os.environ[SHIPPED_ENV] = "1" if starts == "warm" else "0"
        try:
            search.tune(get_family(family_name), problem, budget)
        except _Reached:
            pass
        finally:
            runner.close()
            if shipped is None:
                del os.environ[SHIPPED_ENV]
            else:
                os.environ[SHIPPED_ENV] = shipped
    return curve


def first_within(curve: list[float], best: float, gap: float) -> int | None:
    """The 1-based trial whose best is within `gap` of `best` (None: not within the budget)."""
    return next((i + 1 for i, x in enumerate(curve) if x >= (1 - gap) * best), None)


def study(url: str, family: str, problem_key: str | None, samplers, seeds: int, budget: int,
          save=lambda report: None, starts: str = "warm") -> dict:
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
           "budget": budget, "seeds": seeds, "starts": starts, "samplers": {}}
    for sampler in samplers:
        hits = {f"{int(g * 100)}%": [] for g in WITHIN}
        for seed in range(seeds if sampler != "gp" else min(seeds, GP_SEEDS)):
            curve = run(url, family, problem, sampler, seed, budget, starts, until=(1 - min(WITHIN)) * best)
            for g in WITHIN:
                hits[f"{int(g * 100)}%"].append(first_within(curve, best, g))
        out["samplers"][sampler] = hits
        save(out)   # after each sampler: a long study interrupted keeps what it finished
    return out


def table(report: dict) -> str:
    lines = [f"{report['family']} on {report['problem']}: sweep best {report['sweep_best_tflops']:.1f} TFLOP/s, "
             f"budget {report['budget']} trials, {report['seeds']} seeds, starts {report.get('starts', 'warm')}",
             "| sampler | within | median trials | worst | seeds within budget |", "|---|---|---|---|---|"]
    for sampler, hits in report["samplers"].items():
        for within, trials in hits.items():
            got = [t for t in trials if t is not None]
            median = f"{statistics.median(got):g}" if got else "-"
            lines.append(f"| {sampler} | {within} | {median} | {max(got) if got else '-'} | "
                         f"{len(got)} of {len(trials)} |")
    return "\n".join(lines)


def problems(url: str) -> list[str]:
    """The problem keys a sweep's database holds."""
    from tuner.runner import ReplayRunner

    replay = ReplayRunner(url)
    try:
        return replay.recorded_problems()
    finally:
        replay.close()


def main(argv=None) -> int:
    import warnings

    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)   # gp
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("replay", help="a sweep's database (file or URL)")
    ap.add_argument("--family", default="flash_fwd_simt")
    ap.add_argument("--problem", help="a problem key the sweep holds, or all (default: its first)")
    ap.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--starts", choices=STARTS, default="warm", help="what opens each study (see above)")
    ap.add_argument("--json", type=Path, help="also write the report here (a list of reports with --problem all)")
    a = ap.parse_args(argv)
    url = a.replay if "://" in a.replay else f"sqlite:///{Path(a.replay).resolve()}"
    keys = problems(url) if a.problem == "all" else [a.problem]
    done: list[dict] = []

    def save(report: dict) -> None:
        if a.json:
            a.json.write_text(json.dumps(done + [report] if a.problem == "all" else report, indent=1))

    for key in keys:
        report = study(url, a.family, key, a.samplers, a.seeds, a.budget, save, a.starts)
        done.append(report)
        print(table(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
