"""`tuner`: gpus, search, bench, precompile, worker, submit, status, export, migrate, dashboard. Errors are one line and a
non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .choices import Dtype, Family, OneFamily, Sampler

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Autotune CUDA FlashAttention forward kernels.")
# Logs and CI are not terminals: give tables room instead of rich's default 80 columns.
console = Console(width=None if sys.stdout.isatty() else 180)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 180)


class UserError(Exception):
    """Anything the user can fix: printed as one line."""


def _error(message: object) -> None:
    """`error: message` on one line; the message is plain text (a path or a value from a database
    may hold brackets that rich would otherwise read as markup)."""
    text = " ".join(str(message).split()) or type(message).__name__
    err_console.print(Text.assemble(("error:", "bold red"), " ", text), highlight=False, soft_wrap=True)


def _warn(message: str) -> None:
    err_console.print(Text(f"warning: {message}"), highlight=False, soft_wrap=True)


def _db_url(db: Optional[str]) -> str:
    from .db.engine import default_url

    return db or default_url()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            console.print(f"flashtune {version('flashtune')}", highlight=False)
        except PackageNotFoundError:
            console.print("flashtune (not installed as a package)", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(_version_flag: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                             help="print flashtune's version and exit")) -> None:
    """Autotune CUDA FlashAttention forward kernels."""


DTYPE_HELP = "the inputs' dtype (fp8 = e4m3 inputs, bf16 output); default fp32"
MAX_ERROR_HELP = ("error allowed against float64 (relative, of O); default: the dtype's own, fp32 1e-4, "
                  "fp16 2e-3, bf16 1.2e-2, fp8 5e-2. Raising it for fp32 lets tf32 (>=1e-3) or bf16 (>=1e-2) "
                  "tensor-core kernels compete")


def _shape_help() -> str:
    from .problem import MASK_TOKENS, SHAPE_FORMAT

    def aliases(mask: str) -> str:
        return ", ".join(t for t, m in MASK_TOKENS.items() if m == mask and t != mask)

    return (f"{SHAPE_FORMAT}; repeatable. KVH: K/V heads (GQA/MQA; default H); NK: keys (default NQ); MASK: none "
            f"(default; also {aliases('none')}), causal (top-left, SDPA's is_causal; also {aliases('causal')}) or "
            f"causal_br (bottom-right: query i sees keys j <= i + NK - NQ, as a KV cache or a chunked prefill; also "
            f"{aliases('causal_br')}). E.g. 1,32:8,8192,128,causal (Llama-3-8B prefill), 4,32:8,512:8192,128,causal_br "
            f"(a 512-token chunk after 7680 cached)")


SHAPE_HELP = _shape_help()


def _value(choice) -> Optional[str]:
    """An option's Enum member as its plain string (None stays None)."""
    return None if choice is None else getattr(choice, "value", choice)


def _problems(shapes: list[str], dtype, max_error: Optional[float] = None, models: list[str] = (),
              seqlen: Optional[str] = None, batch: Optional[str] = None, gpu=None):
    """The --shape and --model problems; with neither, models.default_problems for `gpu`."""
    from dataclasses import replace

    from .models import default_problems, model_problems
    from .problem import DTYPES, Problem

    dtype = _value(dtype)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_error is not None and not 0 < max_error < 1:
        raise UserError(f"--max-error must be in (0, 1), got {max_error}")
    if (seqlen or batch) and not models:
        raise UserError("--seqlen and --batch go with --model")
    batches = None
    if batch:
        try:
            batches = [int(b) for b in batch.split(",")]
        except ValueError:
            raise UserError(f"--batch {batch!r} must be integers, comma-separated") from None
    if shapes or models:
        problems = [Problem.parse(s, dtype or "fp32") for s in shapes]
        problems += model_problems(models, dtype or _default_dtype(gpu), seqlen.split(",") if seqlen else None, batches)
    else:
        problems = default_problems(dtype, gpu)
    return [replace(p, max_error=max_error) for p in problems] if max_error is not None else problems


def _default_dtype(gpu) -> str:
    from .models import default_dtype

    return default_dtype(gpu)


def _model_help() -> str:
    from .models import MODELS

    return (f"a model's attention shapes (tuner/models.py's table): {', '.join(MODELS)}; repeatable. "
            f"Its dtype: --dtype, else bf16 (fp16 before sm_80)")


SEQLEN_HELP = ("with --model: lengths, comma-separated, each N (prefill, causal) or NQ:NK (NQ queries after NK - NQ "
               "cached keys: bottom-right causal); default the model's own (2048,8192 for the LLMs)")
BATCH_HELP = "with --model: batch sizes, comma-separated; default the model's (tuner/models.py)"


@app.command()
def gpus() -> None:
    """List the visible GPUs."""
    from .gpu import visible, why_none

    found = visible()
    if not found:
        console.print(f"no CUDA GPU is visible ({why_none()})")
        raise typer.Exit(1)
    t = Table("index", "name", "cc", "arch", "SMs", "smem/block", "L2", "memory", "key")
    for g in found:
        t.add_row(str(g.index), g.name, g.cc, g.arch, str(g.sm_count), f"{g.smem_per_block_optin // 1024} KiB",
                  f"{g.l2_bytes >> 20} MiB", f"{g.memory_bytes / 2**30:.0f} GiB", g.key)
    console.print(t)


def _families(name: str, gpu, problem):
    """The families to tune for one problem: the one named, or (auto) every one that fits."""
    from .kernel_templates import FAMILIES, get_family

    if name != "auto":
        fam = get_family(name)
        reason = fam.supports(gpu, problem)
        if reason:
            raise UserError(f"{problem.key}: {reason}")
        return [fam]
    # test-only families (plugged in through TUNER_EXTRA_FAMILIES) are tuned only when named
    fits = [f for f in FAMILIES.values() if not f.name.startswith("test_") and f.supports(gpu, problem) is None
            and f.tune_skip(gpu, problem) is None]
    if not fits:
        reasons = "; ".join(f.supports(gpu, problem) for f in FAMILIES.values())
        raise UserError(f"{problem.key}: no kernel family fits ({reasons})")
    return fits


def _summary_table(results, title: str) -> Table:
    from .peers import peer_dtype
    from .search import ratio

    t = Table(title=escape(title))
    for col in ("problem", "family", "best config", "ms", "TFLOP/s", "peers TFLOP/s", "vs best peer"):
        t.add_column(col, justify="right" if col in ("ms", "TFLOP/s", "vs best peer") else "left")
    for r in results:
        peers = {k: m.tflops for k, m in r.peers.items() if m.ok and m.tflops}
        best_peer = max(peers.values(), default=None)
        tf = r.best.tflops if r.best else None
        ratio_v = ratio(tf, best_peer)
        peer_text = ", ".join(f"{k.removeprefix('sdpa_')} {v:.1f}"
                              for k, v in sorted(peers.items(), key=lambda kv: -kv[1]))
        if peer_text and peer_dtype(r.problem) != r.problem.dtype:  # fp8: SDPA ran on bf16 copies
            peer_text += f" ({peer_dtype(r.problem)} inputs)"
        t.add_row(  # Text: params from a database are shown, never read as rich markup
            r.problem.key,
            Text(r.family + (" (dropped)" if getattr(r, "dropped", "") else "")),
            Text(json.dumps(r.best_params, separators=(",", ":")) if r.best_params else "-"),
            f"{r.best.median_ms:.3f}" if r.best else "-",
            f"{tf:.1f}" if tf else "-",
            peer_text or "-",
            f"{ratio_v:.2f}x" if ratio_v else "-",
        )
    return t


def _search_help() -> str:
    from .models import DEFAULT_HELP

    return ("Tune the kernels for the detected GPU and store every measurement: the --shape and --model problems. "
            + DEFAULT_HELP + ".")


@app.command(help=_search_help())
def search(
    gpu: str = typer.Option("auto", "--gpu", help="'auto' (the current device) or a GPU index"),
    shape: list[str] = typer.Option([], "--shape", help=SHAPE_HELP),
    model: list[str] = typer.Option([], "--model", help=_model_help()),
    seqlen: Optional[str] = typer.Option(None, "--seqlen", help=SEQLEN_HELP),
    batch: Optional[str] = typer.Option(None, "--batch", help=BATCH_HELP),
    recorded: Optional[Path] = typer.Option(None, "--recorded", help="tune the problems a program met under "
                                            "`tuner record` (its JSON-lines file), with their own dtypes"),
    dtype: Optional[Dtype] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    max_error: Optional[float] = typer.Option(None, "--max-error", help=MAX_ERROR_HELP),
    trials: int = typer.Option(30, "--trials", min=1, help="measured trials per problem (a study resumes up to this)"),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=1,
                                            help="stop asking for trials after this many seconds (the whole search, all its problems)"),
    db: Optional[str] = typer.Option(None, "--db", help="SQLAlchemy URL (default: $TUNER_DB or the user data dir)"),
    family: Family = typer.Option("auto", "--family", help="a kernel family, or auto: every family that fits"),
    replay: Optional[str] = typer.Option(None, "--replay", help="answer from this recorded DB (URL or file) instead of a GPU"),
    candidate_timeout: float = typer.Option(60.0, "--candidate-timeout", min=1, help="seconds per candidate"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampler seed"),
    sampler: Sampler = typer.Option("tpe", "--sampler", help="tpe, random, or grid (every valid point once, in order: a sweep)"),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="measure the SDPA peers in the same run"),
    lookup: Optional[Path] = typer.Option(
        None, "--lookup", help="merge the new best configs into this lookup. Default: the default lookup "
                               "($TUNER_LOOKUP or the user data dir), and only for a search of the default database "
                               "that is not a replay"),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="measure again points whose stored result is a failure"),
) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .db.engine import make_engine, masked, session_factory
    from .export import existing_lookup, lookup_from_db, publish_lookup
    from .kernel_templates import FAMILIES  # noqa: F401  (a bad TUNER_EXTRA_FAMILIES is one line here, first)
    from .runner import ReplayRunner
    from .search import Search

    problems = _problems(shape, dtype, max_error, model, seqlen, batch)   # bad input: one line, before any GPU
    if recorded is not None:
        from .recording import read_recorded

        problems = (problems if shape or model else []) + read_recorded(recorded)
    url = _db_url(db)
    target = _search_lookup(lookup, db, replay, url)
    if target is not None:
        existing_lookup(target)  # a file that is no lookup (the database, say) is refused before any trial
    runner = _runner(gpu, replay, candidate_timeout)
    try:
        if not (shape or model or recorded):   # the defaults depend on what the GPU runs best
            problems = _problems([], dtype, max_error, gpu=runner.gpu)
        plan = [(p, f) for p in problems for f in _families(_value(family), runner.gpu, p)]
        if isinstance(runner, ReplayRunner):
            plan = _replayable(runner, plan, _value(family))
        sessions = session_factory(make_engine(url))
        s = Search(runner, sessions, url, seed=seed, sampler=_value(sampler), retry_failed=retry_failed)
    except BaseException:
        runner.close()
        raise
    deadline = time.monotonic() + timeout if timeout else None
    names = sorted({f.name for _, f in plan})
    console.print(f"tuning [bold]{escape(', '.join(names))}[/] on {escape(runner.gpu.name)} ({escape(runner.gpu.key)}) "
                  f"for {len(problems)} problem(s), {trials} trials each; results in {escape(masked(url))}",
                  highlight=False)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[best]}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        tasks = {(p.key, f.name): bar.add_task(escape(f"{p.key} {f.name}"), total=trials, best="") for p, f in plan}

        def observe(ev) -> None:
            best = f"best {ev.best_tflops:.1f} TFLOP/s" if ev.best_tflops else ""
            bar.update(tasks[(ev.problem.key, ev.family)], completed=min(ev.done, trials), best=best)

        def dropped(fam, why: str) -> None:
            bar.console.print(Text(f"{p.key}: {fam.name} dropped: {why}"), highlight=False)

        s.observer = observe
        unreached = []   # problems the deadline left without a trial
        try:
            for p in problems:
                if deadline is not None and time.monotonic() > deadline:
                    unreached.append(p.key)
                    continue
                # a varlen variant runs its length mix, which no dense peer runs: no peers for it alone
                measured_peers = s.measure_peers(p) if peers and any(not f.packed for q, f in plan if q == p) else {}
                for r in s.tune_all([f for q, f in plan if q == p], p, trials, deadline, on_drop=dropped):
                    bar.update(tasks[(p.key, r.family)], completed=trials)
                    r.peers = measured_peers
                    results.append(r)
        finally:
            runner.close()
    console.print(_summary_table(results, f"{', '.join(names)} on {runner.gpu.name}, run {s.run_id}"))
    unreached += [r.problem.key for r in results if r.best is None and not r.counts and not r.dropped]
    if unreached:
        console.print(f"--timeout {timeout:g} s (for the whole search) ran out before {len(unreached)} problem(s) had a "
                      f"trial: {', '.join(dict.fromkeys(unreached))}. Run the same command again to go on: each "
                      "study resumes where it stopped", highlight=False, markup=False)
    if target is None:
        console.print(f"best-config lookup not changed (a {'replay' if replay else 'search of another database'}): "
                      f"pass --lookup PATH, or run `tuner export -o PATH --db {masked(url)}`", highlight=False,
                      markup=False)
        return
    with sessions() as session:
        new = lookup_from_db(session, runner.gpu.key)
    merged = publish_lookup(new, target, "merge")
    console.print(f"best-config lookup: {len(new['entries'])} entries written to {target} "
                  f"(merged: {len(merged['entries'])} in all)", highlight=False, markup=False)


def _runner(gpu: str, replay: Optional[str], candidate_timeout: float = 60.0):
    """The GPU runner of `--gpu`, or a replay of the recording `--replay` names (a URL or a file)."""
    from .runner import GpuRunner, ReplayRunner

    if replay:
        return ReplayRunner(replay if "://" in replay else f"sqlite:///{Path(replay).resolve()}")
    from .gpu import detect

    return GpuRunner(detect(gpu), candidate_timeout)


def _search_lookup(lookup: Optional[Path], db: Optional[str], replay: Optional[str], url: str) -> Optional[Path]:
    """Where a search merges its best configs: --lookup if given; else the default lookup, but only
    for a search of the default database that is not a replay (a trial run never touches it)."""
    from .db.engine import default_url, sqlite_path
    from .export import default_lookup_path

    if lookup is not None:
        db_file = sqlite_path(url)
        if db_file is not None and lookup.resolve() == db_file.resolve():
            raise UserError(f"--lookup {lookup} is the results database itself: pass another path")
        return lookup
    if replay or (db is not None and db != default_url()):
        return None
    return default_lookup_path()


def _replayable(runner, plan: list, family: str) -> list:
    """The plan cut to what the recording measured; a problem (or a named family) it never
    measured is refused at once, before a trial or a table."""
    kept = []
    for p in dict.fromkeys(p for p, _ in plan):
        recorded = runner.recorded(p)
        fams = [f for q, f in plan if q == p and f.name in recorded]
        if not fams:
            what = f"{family} measurements" if family != "auto" else "measurements"
            has = ", ".join(runner.recorded_problems()) or "nothing"
            raise UserError(f"the replay recording {runner.source} has no {what} of {p.key} on {runner.gpu.key} "
                            f"(it has {has})")
        kept += [(p, f) for f in fams]
    return kept


@app.command()
def bench(
    gpu: str = typer.Option("auto", "--gpu"),
    shape: list[str] = typer.Option([], "--shape", help=SHAPE_HELP),
    dtype: Optional[Dtype] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    db: Optional[str] = typer.Option(None, "--db"),
    family: Family = typer.Option("auto", "--family", help="a kernel family, or auto: the best of all"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write the rows as JSON here"),
    max_error: Optional[float] = typer.Option(None, "--max-error", help=MAX_ERROR_HELP),
    peer: list[str] = typer.Option([], "--peer", help="only these peers: sdpa_flash, sdpa_cudnn, sdpa_efficient, "
                                                      "sdpa_math, fa4 (FlashAttention-4, where installed); repeatable. "
                                                      "Default: SDPA's backends, and fa4 where installed"),
    replay: Optional[str] = typer.Option(None, "--replay", help="answer from this recorded DB (URL or file), its "
                                                                "stored bests included, instead of a GPU"),
    model: list[str] = typer.Option([], "--model", help=_model_help()),
    seqlen: Optional[str] = typer.Option(None, "--seqlen", help="with --model: N or NQ:NK lengths, comma-separated"),
    batch: Optional[str] = typer.Option(None, "--batch", help="with --model: batch sizes, comma-separated"),
    lookup: Optional[Path] = typer.Option(None, "--lookup", help="time what the dispatcher serves from this lookup "
                                                                 "(and the shipped ones) for each problem: a tuned "
                                                                 "config, a nearer bucket's, or an SDPA backend"),
) -> None:
    """Re-time the tuned best of each problem and the SDPA peers in turns, on the same inputs."""
    from .bench import Bench
    from .db import queries
    from .db.engine import make_engine, session_factory
    from .kernel_templates import times_a_length_mix
    from .peers import FA4, MEASURED_PEERS, fa4_missing

    family = _value(family)
    if times_a_length_mix(family):
        raise typer.BadParameter(f"{family} runs packed sequences, which `tuner bench` does not time: "
                                 "benchmarks/varlen_bench.py times packed calls beside the padded batch and the "
                                 "peers' varlen kernels", param_hint="--family")
    if unknown := [x for x in peer if x not in MEASURED_PEERS]:
        raise typer.BadParameter(f"unknown peer {unknown[0]!r}; known: {', '.join(MEASURED_PEERS)}", param_hint="--peer")
    if FA4 in peer and (why := fa4_missing()) and not replay:
        console.print(f"--peer fa4 skipped: {why}", highlight=False, markup=False)
        peer = [x for x in peer if x != FA4]   # none left: the default peers
    problems = _problems(shape, dtype, max_error, model, seqlen, batch)
    if lookup is not None:
        from .export import read_lookup

        read_lookup(lookup)   # a missing or unreadable lookup is one line, before any GPU
    runner = _runner(gpu, replay)
    g = runner.gpu
    sessions = session_factory(make_engine(_db_url(db)))
    bests = runner.sessions if replay else sessions   # a replay's bests are the recording's
    results = []
    try:
        b = Bench(runner, sessions)
        if lookup is None:
            with bests() as session:
                best = _runnable_best(queries.best_rows(session, g.key), g, family)
        else:
            best = _served(lookup, problems, g)
        for p in problems:
            r = b.best(p, best.get(p.key), tuple(peer) or None)
            results.append(r)
            console.print(f"{p.key}: {r.best.tflops if r.best and r.best.tflops else float('nan'):.1f} TFLOP/s")
            if json_out:   # after every problem: a run cut short keeps what it measured
                _write_bench_json(json_out, g, results)
    finally:
        runner.close()
    console.print(_summary_table(results, f"bench: tuned best vs torch SDPA on {g.name} ({time.strftime('%Y-%m-%d')})"))


def _write_bench_json(path: Path, gpu, results) -> None:
    """The bench's rows so far as JSON, replacing `path` whole (a reader never sees half a file)."""
    from .files import atomic_write
    from .peers import peer_dtype

    rows = [{**r.problem.to_dict(), "family": r.family, "config": r.best_params,
             "tuned_tflops": r.best.tflops if r.best else None, "peer_dtype": peer_dtype(r.problem),
             **{f"{k}_tflops": m.tflops for k, m in r.peers.items()},
             "tuned_ms": _spread(r.best), **{f"{k}_ms": _spread(m) for k, m in r.peers.items()}}
            for r in results]
    doc = {"gpu": gpu.name, "gpu_key": gpu.key, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    atomic_write(path, json.dumps(doc, indent=1).encode(), suffix=".part")


def _served(lookup: Path, problems, gpu) -> dict:
    """What the dispatcher serves each problem from `lookup` on `gpu`, as the stored best bench
    times: a tuned config as it runs that problem (dispatch.served_params: a split count tuned at
    another batch gives way to the occupancy's), an untuned family's default where the dispatcher
    runs one (a decode call, a prefill that leaves SMs idle: Dispatcher.serving_entry), an SDPA
    backend as a config {} of that peer's family."""
    from .db.queries import BestEntry
    from .dispatch import Dispatcher, served_params

    d = Dispatcher(lookup)
    served = {}
    for p in problems:
        e = d.serving_entry(p, gpu)
        if e is not None:
            served[p.key] = BestEntry(gpu.key, e["family"], p, p.bucket().key, served_params(e, p), e.get("tflops", 0.0),
                                      e.get("median_ms", 0.0), 0)
    return served


def _runnable_best(rows, gpu, family: str) -> dict:
    """The fastest stored best per problem key that `family` allows and whose params pass its
    family's `check` (by type, before anything is rendered): a row that does not, from a
    crafted or foreign database, is skipped with one line and never compiled."""
    from .kernel_templates import FAMILIES, times_a_length_mix

    best: dict = {}
    for b in rows:
        if family not in ("auto", b.family) or times_a_length_mix(b.family):   # timed on a mix: not a dense best
            continue
        fam = FAMILIES.get(b.family)
        why = f"unknown kernel family {b.family!r}" if fam is None else fam.check(b.params, gpu, b.problem)
        if why:
            err_console.print(f"warning: skipping the stored best of {b.problem.key} ({b.family}): {why}",
                              highlight=False, soft_wrap=True, markup=False)
            continue
        if b.problem.key not in best or b.tflops > best[b.problem.key].tflops:
            best[b.problem.key] = b
    return best


def _spread(m) -> list | None:
    """[min, median, max] ms: docs/benchmarks.md's method reports the spread beside the median."""
    return [m.min_ms, m.median_ms, m.max_ms] if m is not None else None


@app.command()
def precompile(
    gpu: str = typer.Option("auto", "--gpu", help="'auto' or an index; without a GPU give --arch"),
    arch: Optional[str] = typer.Option(None, "--arch", help="sm_80 or sm_90a: compile for this target with no GPU"),
    shape: list[str] = typer.Option([], "--shape", help=SHAPE_HELP),
    dtype: Optional[Dtype] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    family: OneFamily = typer.Option("flash_fwd_simt", "--family"),
    jobs: int = typer.Option(os.cpu_count() or 1, "--jobs", "-j", min=1),
    max_error: Optional[float] = typer.Option(None, "--max-error", help=MAX_ERROR_HELP),
) -> None:
    """Fill the compile cache with every valid point, in parallel, before a search; and build the
    C++ call path of `attention` (tuner/native.py), which a process would otherwise build in the
    background on its first tuned call."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    from rich.progress import track

    from .compile import compile_job
    from .gpu import A100_SXM, H100_SXM, detect
    from .kernel_templates import get_family

    fam = get_family(_value(family))
    if arch is None:
        g = detect(gpu)
        arch = g.arch
    else:
        known = {"sm_90a": H100_SXM, "sm_80": A100_SXM}
        if arch not in known:
            raise UserError(f"--arch must be one of {', '.join(known)} without a GPU")
        g = known[arch]
    work = [(runs.name, ps, p, arch) for p in _problems(shape, dtype, max_error) for params in fam.valid_points(g, p)
            for runs, ps in [fam.served_form(params, g, p)]]   # what the search compiles: the points as served
    counts: dict[str, int] = {}
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        for status, _ in track(pool.map(compile_job, work), total=len(work), description=f"compiling for {arch}"):
            counts[status] = counts.get(status, 0) + 1
    console.print(f"{len(work)} kernels for {arch}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    from . import native

    if native.module(wait=True) is not None:
        console.print(f"the C++ call path: {native.built()}")
    else:   # optional: calls take the Python path
        console.print(f"the C++ call path is not available ({native.failure()}); calls take the Python path")
    if counts.get("error"):
        raise typer.Exit(1)


HEARTBEAT_HELP = "seconds between a worker's beats (and its trials' heartbeats)"
STATUS_GRACE_S = 70  # tuner.fleet.WorkerOptions().lost_after_s: a worker silent longer is lost
GRACE_HELP = "seconds of silence after which a trial is failed and a worker lost (its job requeued)"


@app.command()
def worker(
    db: Optional[str] = typer.Option(None, "--db", help="the shared database: postgresql+psycopg://user@host/db "
                                                        "(several hosts), or a SQLite file (one machine)"),
    gpus: str = typer.Option("all", "--gpus", help="'all' the visible GPUs, or indices such as 0,1,3: one worker "
                                                   "process per GPU"),
    replay: Optional[str] = typer.Option(None, "--replay", help="answer from this recorded DB instead of GPUs "
                                                                "(tests, benchmarks)"),
    workers: int = typer.Option(1, "--workers", min=1, help="with --replay: how many replay workers"),
    heartbeat: int = typer.Option(10, "--heartbeat", min=1, help=HEARTBEAT_HELP),
    grace: int = typer.Option(60, "--grace", min=1, help=GRACE_HELP),
    poll: float = typer.Option(5.0, "--poll", min=0.05, help="seconds between looks at an empty queue"),
    exit_when_idle: bool = typer.Option(False, "--exit-when-idle", help="leave once no job of this GPU model is "
                                                                        "queued or running"),
    candidate_timeout: float = typer.Option(60.0, "--candidate-timeout", min=1, help="seconds per candidate"),
    slot: Optional[int] = typer.Option(None, "--slot", hidden=True),
) -> None:
    """Take (problem, family) jobs from the database's queue and tune them: one process per GPU."""
    from .db.engine import make_engine, masked, session_factory
    from .fleet import FleetWorker, WorkerOptions
    from .search import optuna_storage

    url = _db_url(db)
    options = WorkerOptions(heartbeat, grace, poll, exit_when_idle)
    if slot is None:
        from . import service

        why = service.sqlite_fleet_problem(url)
        if why:
            raise UserError(why)
        slot_ids = service.slots(gpus, replay, workers)
        make_engine(url).dispose()    # tables made once, before the workers race to open them
        optuna_storage(url).engine.dispose()
        console.print(f"workers for {len(slot_ids)} {'replay slot' if replay else 'GPU'}(s) on {masked(url)}",
                      highlight=False, markup=False)
        if len(slot_ids) > 1:
            args = ["worker", "--heartbeat", str(heartbeat), "--grace", str(grace), "--poll", str(poll),
                    "--candidate-timeout", str(candidate_timeout), *(["--replay", replay] if replay else []),
                    *(["--exit-when-idle"] if exit_when_idle else [])]
            code = service.launch(slot_ids, lambda i: [*args, "--slot", str(i)],
                                  lambda i: service.child_env(url, i, pin_gpu=not replay), _say)
            raise typer.Exit(code)
        slot = slot_ids[0]
        gpu_arg = str(slot)
    else:
        gpu_arg = "0"  # the launcher made this slot's GPU the only one visible
    runner = _runner(gpu_arg, replay, candidate_timeout)
    try:
        sessions = session_factory(make_engine(url))
        w = FleetWorker(runner, sessions, url, slot, options, say=lambda m: _say(f"[worker {w.id} slot {slot}] {m}"))
        _say(f"[worker {w.id} slot {slot}] {runner.gpu.key}: waiting for jobs")
        done = w.run()
    finally:
        runner.close()
    _say(f"[worker {w.id} slot {slot}] no job left for {runner.gpu.key}: {done} job(s) done")


def _say(message: str) -> None:
    console.print(message, highlight=False, markup=False, soft_wrap=True)


@app.command()
def submit(
    shape: list[str] = typer.Option([], "--shape", help=SHAPE_HELP),
    model: list[str] = typer.Option([], "--model", help=_model_help() + " Or a Hugging Face config.json: its "
                                    "attention problems (causal, B x N = 16k tokens)."),
    seqlen: Optional[str] = typer.Option(None, "--seqlen", help=SEQLEN_HELP),
    batch: Optional[str] = typer.Option(None, "--batch", help=BATCH_HELP),
    recorded: Optional[Path] = typer.Option(None, "--recorded", help="the problems a program met under `tuner "
                                            "record` (its JSON-lines file)"),
    from_db: Optional[str] = typer.Option(None, "--from", help="the problems of a recorded results database "
                                                               "(URL or file)"),
    dtype: Optional[Dtype] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    max_error: Optional[float] = typer.Option(None, "--max-error", help=MAX_ERROR_HELP),
    gpu_key: list[str] = typer.Option([], "--gpu-key", help="the GPU model(s) to tune for, as `tuner gpus` names "
                                                           "them; repeatable. Default: the live workers' models"),
    family: Family = typer.Option("auto", "--family", help="a kernel family, or auto: every family that fits"),
    trials: int = typer.Option(30, "--trials", min=1, help="measured trials per job"),
    sampler: Sampler = typer.Option("tpe", "--sampler"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampler seed"),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="measure the SDPA peers of each problem"),
    db: Optional[str] = typer.Option(None, "--db", help="the shared database"),
) -> None:
    """Queue (problem, family) jobs for the workers of one or more GPU models."""
    from . import queue, service
    from .db.engine import make_engine, masked, session_factory

    names = [m for m in model if not m.endswith(".json")]   # the model table's, as `tuner search --model`
    configs = [Path(m) for m in model if m.endswith(".json")]
    if shape or names or not (configs or recorded or from_db):
        problems = _problems(shape, dtype, max_error, names, seqlen if names else None, batch if names else None)
    else:
        problems = []
    if configs:
        try:
            lengths = [int(n) for n in seqlen.split(",")] if seqlen else [1024, 4096]
        except ValueError:
            raise UserError(f"--seqlen {seqlen!r} for a config.json must be lengths N, comma-separated") from None
        for c in configs:
            problems += service.config_problems(c, lengths, _value(dtype) or _default_dtype(None), max_error)
    if recorded is not None:
        from .recording import read_recorded

        problems += read_recorded(recorded)
    if from_db is not None:
        problems += service.recorded_problems(from_db)
    url = _db_url(db)
    sessions = session_factory(make_engine(url))
    with sessions() as s:
        known = service.known_gpus(s)
        keys = list(dict.fromkeys(gpu_key)) or sorted({w.gpu_key for w in queue.status(s, STATUS_GRACE_S).alive})
    if not keys:
        raise UserError("no GPU model to tune for: pass --gpu-key KEY (repeatable; `tuner gpus` prints a GPU's key), "
                        "or start `tuner worker` first")
    specs = []
    for key in keys:
        gpu = known.get(key)
        if gpu is None and _value(family) == "auto":
            raise UserError(f"the database has never seen the GPU model {key!r}: name a --family, or start a "
                            f"worker of it first")
        for p in dict.fromkeys(problems):
            names = [f.name for f in _families(_value(family), gpu, p)] if gpu else [_value(family)]
            specs += [queue.JobSpec(key, n, p, trials, _value(sampler), seed, peers) for n in names]
    added, skipped = queue.submit(sessions, specs)
    console.print(f"{len(added)} job(s) queued in {masked(url)} for {', '.join(keys)}"
                  + (f"; {len(skipped)} already queued or running" if skipped else ""),
                  highlight=False, markup=False, soft_wrap=True)


@app.command()
def status(
    db: Optional[str] = typer.Option(None, "--db", help="the shared database (opened read-only)"),
    grace: int = typer.Option(STATUS_GRACE_S, "--grace", min=1, help="seconds without a beat after which a worker "
                                                                     "counts as lost"),
) -> None:
    """The fleet: workers alive, jobs queued, running, done and failed, trials per minute."""
    from . import queue, service
    from .db.engine import open_readonly, session_factory

    with session_factory(open_readonly(_db_url(db)))() as s:
        st = queue.status(s, grace)
    for part in service.status_tables(st):
        console.print(part)
@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def record(
    ctx: typer.Context,
    output: Path = typer.Option(Path("flashtune-record.jsonl"), "-o", "--output", help="the recording (JSON lines; "
                                "appended to, each problem once)"),
) -> None:
    """Run a program (`tuner record -- python train.py`) and record every distinct attention problem
    flashtune's dispatcher meets in it (FLASHTUNE_RECORD=FILE does the same for any process); then
    `tuner search --recorded FILE` tunes exactly those."""
    import subprocess

    from .recording import ENV, read_recorded

    if not ctx.args:
        raise UserError("give the program to run after --: tuner record -- python train.py")
    output = output.resolve()
    before = len(read_recorded(output, missing_ok=True))
    try:
        code = subprocess.call(ctx.args, env={**os.environ, ENV: str(output)})
    except OSError as e:
        raise UserError(f"cannot run {ctx.args[0]}: {e.strerror or e}") from None
    found = read_recorded(output, missing_ok=True)
    console.print(f"{len(found) - before} new problem(s) recorded, {len(found)} in {output}; tune them with "
                  f"`tuner search --recorded {output}`", highlight=False, markup=False)
    raise typer.Exit(code)


@app.command()
def export(
    output: Path = typer.Option(..., "-o", "--output", help="where to write the lookup JSON"),
    db: Optional[str] = typer.Option(None, "--db", help="an existing results database (opened read-only)"),
    gpu_key: Optional[str] = typer.Option(None, "--gpu-key", help="only this GPU's entries"),
    merge: bool = typer.Option(False, "--merge", help="add the entries to the lookup at OUTPUT, keeping its others"),
    force: bool = typer.Option(False, "--force", help="replace the lookup at OUTPUT even where it serves more"),
) -> None:
    """Write the best-config lookup the dispatcher reads.

    The database is only read (never created, migrated or switched to WAL). A lookup at OUTPUT is
    replaced only by one that serves everything it serves, unless --merge or --force; a file there
    that is not a lookup is never overwritten.
    """
    from .db import queries
    from .db.engine import open_readonly, session_factory
    from .export import existing_lookup, export_from_db

    if merge and force:
        raise UserError("--merge and --force exclude each other: merge keeps the lookup's other entries, force drops them")
    existing_lookup(output, force=force)  # nothing is opened for a target that would be refused anyway
    sessions = session_factory(open_readonly(_db_url(db)))
    with sessions() as s:
        if gpu_key is not None and gpu_key not in (known := [g.key for g in queries.list_gpus(s)]):
            raise UserError(f"the database has no GPU {gpu_key!r}; it has: {', '.join(known) or 'none'}")
        n = export_from_db(s, output, gpu_key, "merge" if merge else "force" if force else "complete")
    if n == 0:
        _warn("the database holds no tuned configs yet (run `tuner search` first)")
    console.print(f"{n} entries written to {output}", highlight=False, markup=False)


@app.command()
def migrate(db: Optional[str] = typer.Option(None, "--db", help="an existing results database")) -> None:
    """Bring an existing results database to this flashtune's schema (reading commands never write)."""
    from .db.engine import make_engine, masked, require_existing

    url = _db_url(db)
    require_existing(url)
    make_engine(url).dispose()
    console.print(f"{masked(url)} is at this flashtune's schema", highlight=False, markup=False)


@app.command()
def dashboard(
    db: Optional[str] = typer.Option(None, "--db", help="database URL (default: $TUNER_DB or the user data dir)"),
    port: int = typer.Option(8501, "--port", help="port to serve on"),
    address: str = typer.Option("127.0.0.1", "--address", help="address to bind (0.0.0.0 to share)"),
) -> None:
    """Open the results dashboard (Streamlit; read-only) in the browser."""
    import subprocess

    try:
        import streamlit  # noqa: F401
    except ImportError:
        raise UserError("the dashboard needs streamlit: pip install 'flashtune[dashboard]'") from None
    from .dashboard.launch import streamlit_command

    cmd = streamlit_command(_db_url(db), port, address)
    console.print(f"dashboard on http://{address}:{port}/ (Ctrl-C stops it)")
    try:
        code = subprocess.call(cmd)
    except KeyboardInterrupt:
        code = 0
    raise typer.Exit(code)


def _click_classes(name: str) -> tuple[type, ...]:
    """click's exception class `name`, and typer's vendored copy of it (typer >= 0.20 ships its own
    and needs no click installed)."""
    classes: list[type] = []
    try:
        import click
    except ImportError:
        pass
    else:
        classes.append(getattr(click.exceptions, name))
    try:
        from typer._click import exceptions as vendored
    except ImportError:
        pass
    else:
        if hasattr(vendored, name):  # typer versions differ in what they vendor
            classes.append(getattr(vendored, name))
    return tuple(classes)


def _usage_line(exc) -> str:
    """A click usage error as one line, with where help is."""
    ctx = getattr(exc, "ctx", None)
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    return f"{exc.format_message()}{where}"


def _interrupted(exc: BaseException | None) -> int:
    """One line for SIGINT/SIGTERM; the exit code is 128 + the signal (130, 143)."""
    name = f" ({exc})" if isinstance(exc, KeyboardInterrupt) and str(exc) else ""
    err_console.print(f"interrupted{name}: finished measurements are stored; run the same command to resume",
                      highlight=False, soft_wrap=True)
    return getattr(exc, "exit_code", 130)


def main() -> None:
    """Entry point: user errors become one red line and exit code 2."""
    from . import interrupts

    interrupts.install()  # SIGINT and SIGTERM both arrive as interrupts.Interrupted (a KeyboardInterrupt)
    try:
        _run_app()
    except KeyboardInterrupt as exc:   # arrived after the command's own handling, before finish()
        sys.exit(_interrupted(exc))
    finally:
        interrupts.finish()


def _run_app() -> None:
    from . import interrupts
    from .db.engine import DatabaseError
    from .gpu import NoGpuError

    try:
        code = app(standalone_mode=False)  # typer.Exit(n) comes back as the return value here
    except NoGpuError as exc:
        _error(exc)
        sys.exit(1)
    except (UserError, ValueError, DatabaseError, OSError) as exc:
        _error(exc)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        sys.exit(_interrupted(exc))
    except typer.Exit as exc:
        sys.exit(_interrupted(interrupts.last) if exc.exit_code == 130 else exc.exit_code)
    except Exception as exc:  # click's usage errors and aborts
        if isinstance(exc, _click_classes("ClickException")):
            _error(_usage_line(exc) if isinstance(exc, _click_classes("UsageError")) else exc.format_message())
            sys.exit(exc.exit_code)
        if isinstance(exc, _click_classes("Abort")):  # Ctrl-C arrives as click's Abort
            sys.exit(_interrupted(exc.__cause__ or exc.__context__))
        raise
    if code == 130:  # typer turns a KeyboardInterrupt into Exit(130), returned here
        sys.exit(_interrupted(interrupts.last))
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
