"""The search: one Optuna study per (GPU key, kernel family, problem), resumable, deduplicated.

Optuna proposes, the family's `check` filters (invalid points are recorded, never compiled), the
results DB answers anything already measured under the same versions, and only the rest reaches
the runner. Every outcome is a measurement row. Optuna sees TFLOP/s for what ran, a constraint
violation for what `check` refuses (TPE learns to avoid the region), and a failed trial for what
failed to compile, crashed or computed wrongly: never a made-up 0 TFLOP/s it would learn from.

A new study starts from the best configs of the nearest problems this family was tuned on
(tuner.nearest: same GPU, dtype, head dim, mask), then the family's default and seeds; those
compile ahead of the GPU (Runner.prefetch), and so does every later point: where the runner
compiles, the next trial is asked before this one is measured (TPE with a constant liar, so it
looks elsewhere), and its kernel compiles in the background meanwhile. Over several families,
`tune_all` measures every family's starts first and drops the ones far behind the best
(DROP_BELOW) for that problem.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

import optuna

optuna.logging.set_verbosity(optuna.logging.WARNING)

from . import interrupts
from .choices import SAMPLERS
from .db import queries
from .family import KernelFamily
from .bench import Bench
from .peers import PEERS_BY_DTYPE
from .nearest import nearest
from .problem import Problem
from .records import Measurement, ProblemResult, new_run_id, params_key, versions_key
from .runner import Runner

ASK_LIMIT_FACTOR = 20  # asks per wanted trial before giving up on a space that is mostly invalid
# A family whose starting configs reach less than this fraction of the best family's TFLOP/s on a
# problem is not searched further there (on the H100 flash_fwd_mma reaches ~0.47x of the Hopper
# kernel and flash_fwd_simt ~0.06x: half of a search's time went to them).
DROP_BELOW = 0.6
WARM_START = 3   # best configs of this many nearest tuned problems open a new study
# A trial in flight records a heartbeat every HEARTBEAT_S; one whose process died (kill -9, power)
# stops beating, and the next search of its study fails it once GRACE_S have passed.
HEARTBEAT_S = 10
GRACE_S = 60


@dataclass
class Progress:
    """What observers see after each trial."""

    problem: Problem
    trial: int
    params: dict
    measurement: Measurement
    source: str  # "measured", "database" or "invalid"
    best_tflops: float | None
    done: int
    wanted: int
    family: str = ""


def study_name(gpu_key: str, family: str, problem_key: str) -> str:
    """Optuna's name for one study. Only ever built from its three parts, never split again: the
    study's user attrs and the database's columns carry them separately (a GPU name may hold "|")."""
    return f"{gpu_key}|{family}|{problem_key}"


class Search:
    def __init__(self, runner: Runner, sessions, storage_url: str, *, seed: int | None = None, sampler: str = "tpe",
                 observer: Callable[[Progress], None] | None = None, run_id: str | None = None,
                 retry_failed: bool = False, storage: optuna.storages.RDBStorage | None = None,
                 drop_below: float = DROP_BELOW) -> None:
        self.runner, self.sessions = runner, sessions
        self.storage = storage or optuna_storage(storage_url)  # a worker passes its own, kept across jobs
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
        self.seed, self.sampler, self.observer = seed, sampler, observer or (lambda p: None)
        self.run_id = run_id or new_run_id()
        self.bench = Bench(runner, sessions, self.run_id)   # the peers, measured and stored under this run
        self.gpu = runner.gpu
        # A stored failure (crash, timeout, launch or compile error, wrong result) normally answers
        # for its point; after fixing its cause (a driver, a host-side bug) the user asks again.
        self.retry_failed = retry_failed
        self.drop_below = drop_below
        # Ask the next trial before measuring this one, so its kernel compiles meanwhile: only where
        # the runner compiles (not a replay, which would then differ from the search it replays)
        # and the sampler is not the grid (a sweep visits each point once, in order).
        self._ask_ahead = getattr(runner, "compiles", False) and sampler != "grid"

    # ---- several families on one problem ----
    def tune_all(self, families: list[KernelFamily], problem: Problem, trials: int, deadline: float | None = None,
                 on_drop: Callable[[KernelFamily, str], None] | None = None) -> list[ProblemResult]:
        """Every family's starting configs first; a family whose best is under `drop_below` of
        the best family's is dropped (`on_drop(family, why)`), the others searched to `trials`."""
        results = {f.name: self.tune(f, problem, min(trials, len(self.starts(f, problem))), deadline) for f in families}
        best = max((r.best.tflops for r in results.values() if r.best and r.best.tflops), default=None)
        for fam in families:
            r = results[fam.name]
            mine = r.best.tflops if r.best and r.best.tflops else 0.0
            if len(families) > 1 and best and mine < self.drop_below * best:
                r.dropped = (f"its {len(self.starts(fam, problem))} starting configs reach {mine:.1f} TFLOP/s, "
                             f"{mine / best:.2f}x the best family's {best:.1f} (under {self.drop_below:g}x)")
                if on_drop is not None:
                    on_drop(fam, r.dropped)
                continue
            results[fam.name] = self.tune(fam, problem, trials, deadline)
        return list(results.values())

    def starts(self, family: KernelFamily, problem: Problem) -> list[dict]:
        """What a new study is opened with, each valid once, in order: the best configs of the
        nearest problems this family was tuned on (this GPU); those of the same and nearest
        problems tuned on other GPUs of its architecture (an H100's winners open an H200's
        search); those of the lookups flashtune ships for GPUs of its architecture; for a varlen
        variant, the same of its family made varlen (what the varlen plan serves where the variant
        has no entry of its own, so its tuned entry is measured against it); its default; its seeds."""
        from .kernel_templates import VARLEN_VARIANTS

        near = self._near(family.name, problem)
        if family.packed:
            base = next(name for name, variant in VARLEN_VARIANTS.items() if variant is family)
            near += [family.from_tuned(p, problem) for p in self._near(base, problem, same=True)]
        points = near + [family.default(self.gpu, problem)] + family.seeds(self.gpu, problem)
        valid = {params_key(p): p for p in points if family.check(p, self.gpu, problem) is None}
        return list(valid.values())

    def _near(self, name: str, problem: Problem, same: bool = False) -> list[dict]:
        """Family `name`'s best configs for the problems nearest `problem`: this GPU's (`problem`'s
        own only if `same`: a study of it resumes from its own trials), its architecture's other
        GPUs', then the shipped lookups' of that architecture."""
        from .export import shipped_entries

        arch = self.gpu.key.rsplit("/", 1)[-1]
        with self.sessions() as s:
            rows = queries.best_rows(s, family=name)
        mine = [b for b in rows if b.gpu_key == self.gpu.key and (same or b.problem != problem)]
        kin = [b for b in rows if b.gpu_key != self.gpu.key and b.gpu_key.rsplit("/", 1)[-1] == arch]
        shipped = [b for b in shipped_entries(name) if b.gpu_key.rsplit("/", 1)[-1] == arch]
        return [b.params for tuned in (mine, kin, shipped) for _, b in nearest(problem, tuned, lambda b: b.problem, WARM_START)]

    # ---- one problem ----
    def tune(self, family: KernelFamily, problem: Problem, trials: int, deadline: float | None = None) -> ProblemResult:
        """SIGINT/SIGTERM (see tuner.interrupts) reach this only while a point is being measured, or
        between trials: the trial in flight is told FAIL, every stored row is whole."""
        with interrupts.deferred():
            return self._tune(family, problem, trials, deadline)

    def _tune(self, family: KernelFamily, problem: Problem, trials: int, deadline: float | None) -> ProblemResult:
        reason = family.supports(self.gpu, problem)
        if reason:
            raise ValueError(reason)
        name = study_name(self.gpu.key, family.name, problem.key)
        sampler = self._sampler(family, trials)
        study = optuna.create_study(study_name=name, storage=self.storage, direction="maximize",
                                    sampler=sampler, load_if_exists=True)
        with _quiet_heartbeat():  # trials left RUNNING by a killed search: FAIL, so none stays RUNNING forever
            optuna.storages.fail_stale_trials(study)
        study.set_user_attr("family", family.name)
        study.set_user_attr("problem", problem.to_dict())
        study.set_user_attr("gpu_key", self.gpu.key)
        finished = [t for t in study.trials if t.state in _DONE and t.user_attrs.get("counted")]
        finished = list({params_key(t.params): t for t in finished}.values())  # a point's latest trial speaks for it
        if self.retry_failed:  # the failed points are queued again and no longer count as done
            failed = [t for t in finished if t.user_attrs.get("status") not in ("ok", "invalid")]
            for t in failed:
                study.enqueue_trial(t.params)
            finished = [t for t in finished if t not in failed]
        seen = {params_key(t.params) for t in finished}  # a point re-proposed in this study counts once
        max_asks = trials * ASK_LIMIT_FACTOR
        sweep: Iterator[dict] | None = None   # a sweep's points still to queue, one an ask
        if self.sampler == "grid":   # a sweep: each valid point once, in the family's order, resumable
            max_asks, sweep = self._sweep_queue(study, family, problem, seen)   # and nothing else is asked
            trials = min(trials, len(finished) + max_asks)   # what progress counts towards: the space's size
        elif not study.trials:
            starts = self.starts(family, problem)
            for point in starts:
                study.enqueue_trial(point, skip_if_exists=True)
            self.runner.prefetch(family, starts[1:], problem)   # the first compiles now, in line
        dists = {k: optuna.distributions.CategoricalDistribution(list(v)) for k, v in family.space.items()}
        result = ProblemResult(problem, family.name, name)
        done, asks = len(finished), 0
        vkey = versions_key(self.runner.versions())
        ahead: optuna.Trial | None = None   # the next trial, asked before this one is measured
        beating = contextlib.ExitStack()       # its heartbeat while it waits (a killed search leaves it stale)
        try:
            while done < trials and asks < max_asks:
                if deadline is not None and time.monotonic() > deadline:
                    break
                interrupts.checkpoint()  # a signal held during the last trial's bookkeeping stops here
                asks += 1
                trial, ahead = ahead or self._ask(study, dists, sweep), None
                beating.close()
                if self._ask_ahead and done + 1 < trials:   # another trial follows: it compiles while this one runs
                    ahead = self._ask(study, dists, sweep)
                    beating.enter_context(_heartbeat(self.storage, ahead._trial_id))
                    self._prefetch(family, problem, ahead.params, vkey)
                done += self._trial(study, trial, family, problem, vkey, name, seen, result, done, trials)
        finally:
            beating.close()
            if ahead is not None:   # asked, never measured: failed, not counted, so no sampler learns from it
                ahead.set_user_attr("status", "unmeasured")
                ahead.set_user_attr("counted", False)
                study.tell(ahead, state=optuna.trial.TrialState.FAIL)
        self._fill_best(result, family, problem)
        return result

    def _sweep_queue(self, study: optuna.Study, family: KernelFamily, problem: Problem,
                     seen: set[str]) -> tuple[int, Iterator[dict]]:
        """How many valid points (family.valid_points: `check` passes) this study has not measured
        yet, and those of them not queued yet, for `_ask` to queue one at a time. Only valid points
        are asked, so a sweep costs no trial on the ~85% of the declared space a problem rules out,
        and a sweep cut short goes on where it stopped (its queued points first). Not all queued at
        once: Optuna's ask reads every waiting trial to pop one, which made a 217-point sweep spend
        more time asking than measuring on SQLite."""
        points = family.valid_points(self.gpu, problem)
        waiting = {params_key(t.params) for t in study.get_trials(deepcopy=False,
                                                                 states=(optuna.trial.TrialState.WAITING,))}
        left = [p for p in points if params_key(p) not in seen]
        self.runner.prefetch(family, left[:1], problem)
        return len(left), iter([p for p in left if params_key(p) not in waiting])

    @staticmethod
    def _ask(study: optuna.Study, dists: dict, sweep: Iterator[dict] | None = None) -> optuna.Trial:
        """The next trial; in a sweep, the next of its points queued first (the queue, oldest
        first, holds those a sweep cut short had queued, then this one's)."""
        point = next(sweep, None) if sweep is not None else None
        if point is not None:
            study.enqueue_trial(point)
        with _quiet_heartbeat():
            return study.ask(dists)

    def _prefetch(self, family: KernelFamily, problem: Problem, params: dict, vkey: str) -> None:
        """Compile a point asked ahead, unless `check` refuses it or the database already answers it."""
        if family.check(params, self.gpu, problem) is not None:
            return
        with self.sessions() as s:
            if self._reusable(queries.find_measurement(s, self.gpu.key, problem.key, family.name, params, vkey)):
                return
        self.runner.prefetch(family, [params], problem)

    def _trial(self, study: optuna.Study, trial: optuna.Trial, family: KernelFamily, problem: Problem, vkey: str,
               name: str, seen: set[str], result: ProblemResult, done: int, trials: int) -> bool:
        """Evaluate one asked trial, tell Optuna and the observer: whether the trial counts
        towards `trials`."""
        try:
            with _heartbeat(self.storage, trial._trial_id):
                m, source = self._evaluate(family, problem, trial.params, vkey, name, trial.number)
        except BaseException:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        if m is None:  # replay miss: nothing known about this point
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return False
        counted = source != "invalid" and params_key(trial.params) not in seen
        seen.add(params_key(trial.params))
        trial.set_user_attr("status", m.status)
        trial.set_user_attr("source", source)
        trial.set_user_attr("counted", counted)
        if m.ok and m.tflops:
            if _SET_CONSTRAINT:   # every complete trial carries the constraint (GPSampler requires it)
                trial.set_constraint("check", 0.0)
            study.tell(trial, m.tflops)
        elif m.status == "invalid":   # a constraint violation: its value (0) ranks nothing
            trial.set_user_attr("violation", 1.0)
            if _SET_CONSTRAINT:
                trial.set_constraint("check", 1.0)
            study.tell(trial, 0.0)
        else:   # it ran and failed: nothing to learn a speed from
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        result.counts[m.status] = result.counts.get(m.status, 0) + 1
        result.reused += source == "database"
        self.observer(Progress(problem, trial.number, trial.params, m, source,
                               self._best_tflops(family, problem), done + counted, trials, family.name))
        return counted

    def _sampler(self, family: KernelFamily, trials: int) -> optuna.samplers.BaseSampler:
        if self.sampler in ("grid", "random"):   # grid: only ever asks its queued points (_sweep_queue)
            return optuna.samplers.RandomSampler(seed=self.seed)
        older = {} if _SET_CONSTRAINT else {"constraints_func": _violation}   # Optuna 4 reads them so
        # constant_liar: the trial asked ahead (still running) counts as a poor one, so the next
        # proposal looks elsewhere instead of proposing the same point again
        return optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=min(10, max(1, trials // 3)),
                                          constant_liar=self._ask_ahead, **older)

    def _evaluate(self, family: KernelFamily, problem: Problem, params: dict, vkey: str,
                  name: str, number: int) -> tuple[Measurement | None, str]:
        gpu = self.gpu
        with self.sessions() as s:
            known = self._reusable(queries.find_measurement(s, gpu.key, problem.key, family.name, params, vkey))
        if known is not None:
            return known, "invalid" if known.status == "invalid" else "database"
        why = family.check(params, gpu, problem)
        if why:
            m = Measurement("invalid", message=why, versions=self.runner.versions())
            source = "invalid"
        else:
            with interrupts.allowed():
                m = self.runner.measure(family, params, problem)
            source = "measured"
            if m is None:
                return None, source
        with self.sessions.begin() as s:
            # Another search on this DB may have stored the point meanwhile. On SQLite the write
            # transaction starts with BEGIN IMMEDIATE (one writer at a time), so this check and the
            # insert are atomic: a point gets one row per versions however many searches race for it.
            again = self._reusable(queries.find_measurement(s, gpu.key, problem.key, family.name, params, vkey))
            if again is not None:
                return again, "invalid" if again.status == "invalid" else "database"
            queries.record_measurement(s, gpu, problem, family.name, params, m, study_name=name,
                                       trial_number=number, run_id=self.run_id)
            if m.ok:
                queries.update_best(s, gpu.key, problem.key, family.name)
        return m, source

    def _reusable(self, m: Measurement | None) -> Measurement | None:
        """A stored measurement that answers for its point, or None where it must be measured again."""
        if m is not None and self.retry_failed and m.status not in ("ok", "invalid"):
            return None
        return m

    def _best_entry(self, family: KernelFamily, problem: Problem) -> queries.BestEntry | None:
        with self.sessions() as s:
            return queries.best_row(s, self.gpu.key, family.name, problem.key)

    def _best_tflops(self, family: KernelFamily, problem: Problem) -> float | None:
        best = self._best_entry(family, problem)
        return best.tflops if best else None

    def _fill_best(self, result: ProblemResult, family: KernelFamily, problem: Problem) -> None:
        best = self._best_entry(family, problem)
        if best is not None:
            result.best_params = best.params
            result.best = Measurement("ok", median_ms=best.median_ms, tflops=best.tflops)

    # ---- the peers, measured in this run ----
    def measure_peers(self, problem: Problem, backends: tuple[str, ...] | None = None) -> dict[str, Measurement]:
        return self.bench.peers(problem, backends)


_DONE = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)   # a measured point, ok or not
_SET_CONSTRAINT = hasattr(optuna.trial.Trial, "set_constraint")   # Optuna 5; 4 takes a constraints_func


def _violation(trial: optuna.trial.FrozenTrial) -> tuple[float]:
    """TPE's constraint: > 0 for a point `check` refused (set before it is told), 0 otherwise."""
    return (float(trial.user_attrs.get("violation", 0.0)),)


def optuna_storage(url: str, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S) -> optuna.storages.RDBStorage:
    """Optuna's storage in our DB, safe with several searches on one SQLite file: its first-time
    table creation and version stamp run one process at a time, and its transactions queue for the
    write lock (BEGIN IMMEDIATE, 60 s busy timeout) instead of failing with "database is locked"."""
    from sqlalchemy.exc import DatabaseError as SQLDatabaseError

    from .db.engine import DatabaseError, init_lock, masked, serialize_sqlite_writers

    sqlite = url.startswith("sqlite")
    try:
        with init_lock(url), _quiet_heartbeat():
            storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}} if sqlite else {},
                                                 heartbeat_interval=heartbeat_s, grace_period=grace_s)
    except SQLDatabaseError as e:  # e.g. a read-only file Optuna must stamp or add a table to
        raise DatabaseError(f"cannot open the database {masked(url)}: {e.orig}") from None
    serialize_sqlite_writers(storage.engine)
    return storage


def fail_dead_trials(storage: optuna.storages.RDBStorage, name: str) -> int:
    """Fail every RUNNING trial of study `name` whose process is known dead (its worker was lost;
    the caller has made sure no live process holds the study). Optuna's fail_stale_trials finds
    only trials with a stale heartbeat; a process killed between ask() and its trial's first beat
    leaves one with none, which this fails too. Returns how many were failed."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return 0
    running = [t._trial_id for t in storage.get_all_trials(study_id, deepcopy=False,
                                                           states=(optuna.trial.TrialState.RUNNING,))]
    for trial_id in running:
        with contextlib.suppress(RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
            storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
    return len(running)


@contextlib.contextmanager
def _quiet_heartbeat() -> Iterator[None]:
    """Optuna marks its heartbeat experimental and expects it under study.optimize (we ask and
    tell ourselves, and beat in _heartbeat): those warnings say nothing to a user."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        yield


@contextlib.contextmanager
def _heartbeat(storage: optuna.storages.RDBStorage, trial_id: int) -> Iterator[None]:
    """Record the trial's heartbeat now and at the storage's heartbeat interval until the block ends
    (a thread: a measurement can take minutes). A beat that fails (the database busy) is skipped."""
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):
                storage.record_heartbeat(trial_id)
            if stop.wait(storage.get_heartbeat_interval() or HEARTBEAT_S):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def ratio(ours: float | None, peer: float | None) -> float | None:
    return ours / peer if ours and peer else None


__all__ = ["Search", "ProblemResult", "Progress", "study_name", "params_key", "ratio", "PEERS_BY_DTYPE"]
