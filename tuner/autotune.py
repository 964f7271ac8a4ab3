"""Opt-in first-call autotuning, as Triton's autotuner does per key: the first call of a shape
whose bucket the user never tuned times the few best candidates on that exact shape, once.

The candidates are what the dispatcher picks from (Dispatcher.candidates), reaching further
since each is measured: the configs of the nearest tuned buckets, the shipped lookups'
included, nearest first (after the packed default where the call packs: Dispatcher._autotune_candidates),
and the SDPA backends that take the case. Each is checked against the float64 reference and timed in
turns on the same fresh inputs (tuner.measure, as the search's worker does, here in the
caller's process). The measurements go to the results database (TUNER_DB) and the winners to
the user's lookup, so the next process starts from them; a failure to store them is one warning,
never a failed call. The dispatcher never calls this during CUDA-graph capture.

On with FLASHTUNE_AUTOTUNE=1, or `set_autotune(True)`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from .gpu import GpuSpec
from .peers import DISPATCHED_PEERS
from .problem import Problem
from .records import Measurement, one_line

ENV = "FLASHTUNE_AUTOTUNE"
MAX_CONFIGS = 3         # tuned configs timed per shape, besides the SDPA backends
OCTAVES = 8.0           # how far (tuner.nearest) a tuned bucket may be and still lend a candidate
TARGET_SECONDS = 0.05   # timing per candidate: enough for a ranking, short for a first call
_forced: bool | None = None


def enabled() -> bool:
    """Whether first calls autotune: set_autotune's word, else FLASHTUNE_AUTOTUNE."""
    if _forced is not None:
        return _forced
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def set_autotune(on: bool | None) -> None:
    """Turn first-call autotuning on or off for this process (None: as FLASHTUNE_AUTOTUNE says).
    Shapes already planned keep their plan; call tuner.dispatch.reset() to plan them again."""
    global _forced
    _forced = on


def shortlist(problem: Problem, gpu: GpuSpec, entries: list[dict]) -> list[dict]:
    """What to time: the first MAX_CONFIGS distinct tuned configs of `entries` (nearest first),
    and every SDPA backend the dispatcher can run that takes the case."""
    from .dispatch import served_params
    from .records import params_key
    from .torch_attention import takes_problem

    configs: dict[tuple[str, str], dict] = {}
    for e in entries:
        if e["family"] in DISPATCHED_PEERS or len(configs) >= MAX_CONFIGS:
            continue
        e = dict(e, params=served_params(e, problem))   # as the dispatcher would run it here
        configs.setdefault((e["family"], params_key(e["params"])), e)
    cc = (gpu.major, gpu.minor)
    peers = [{"family": f, "params": {}} for f, b in DISPATCHED_PEERS.items() if takes_problem(b, problem, cc)]
    return list(configs.values()) + peers


def measure(problem: Problem, gpu: GpuSpec, shortlist: list[dict], seed: int = 0) -> list[tuple[str, dict, Measurement]]:
    """(family, params, measurement) of each candidate on `problem`, checked and timed in turns."""
    from .compile import compile_kernel
    from .kernel_templates import FAMILIES
    from .measure import measure_prepared, prepare_kernel, prepare_peer
    from .timing import Timer
    from .versions import run_versions

    prepared = {}
    for i, e in enumerate(shortlist):
        name = f"{i}"
        if e["family"] in DISPATCHED_PEERS:
            prepared[name] = prepare_peer(e["family"], problem, seed)
            continue
        fam, params = FAMILIES[e["family"]].served_form(e["params"], gpu, problem)   # as the dispatcher runs it
        try:
            ck = compile_kernel(fam, params, problem, gpu.arch)
        except Exception as exc:
            prepared[name] = (None, Measurement("compile_error", message=one_line(exc)))
            continue
        prepared[name] = prepare_kernel(fam, params, problem, ck, seed, gpu)
    timed = measure_prepared(prepared, problem, Timer(target_seconds=TARGET_SECONDS, min_reps=5))
    versions = run_versions()
    out = []
    for i, e in enumerate(shortlist):
        m = timed[f"{i}"]
        m.versions = versions
        out.append((e["family"], dict(e["params"]), m))
    return out


def tune(problem: Problem, gpu: GpuSpec, entries: list[dict], lookup_path: str | Path | None = None) -> list[dict]:
    """Time the shortlist of `entries` on `problem` and store what was measured; returns the lookup
    entries it measured fastest per family for `problem`'s bucket (empty where none ran)."""
    from .export import lookup_of

    measured = measure(problem, gpu, shortlist(problem, gpu, entries))
    fastest: dict[str, tuple[Problem, str, dict, float]] = {}
    for family, params, m in measured:
        if m.ok and m.tflops and (family not in fastest or m.tflops > fastest[family][3]):
            fastest[family] = (problem, family, params, m.tflops)
    if not fastest:
        return []
    doc = lookup_of(gpu.key, list(fastest.values()))
    _store(problem, gpu, measured, doc, lookup_path)
    return doc["entries"]


def _store(problem: Problem, gpu: GpuSpec, measured: list[tuple[str, dict, Measurement]], doc: dict,
           lookup_path: str | Path | None) -> None:
    from .db import queries
    from .db.engine import default_url, make_engine, session_factory
    from .export import default_lookup_path, publish_lookup
    from .records import new_run_id

    try:
        engine = make_engine(default_url())
        try:
            run_id = f"autotune-{new_run_id()}"
            with session_factory(engine).begin() as s:
                for family, params, m in measured:
                    queries.record_measurement(s, gpu, problem, family, params, m, run_id=run_id)
                for family in {f for f, _, _ in measured if f not in DISPATCHED_PEERS}:
                    queries.update_best(s, gpu.key, problem.key, family)
        finally:
            engine.dispose()
        publish_lookup(doc, Path(lookup_path) if lookup_path else default_lookup_path(), "merge")
    except Exception as exc:
        warnings.warn(f"flashtune: the autotuned configs for {problem.key} are used but not stored: {one_line(exc)}",
                      stacklevel=4)
