"""One worker of the fleet: a process bound to one GPU (or one replay slot) that takes jobs from
the queue in the database and runs the ordinary search on each, until told to stop.

A beat thread keeps the worker's row and its job's lease fresh; the Optuna trial in flight has its
own heartbeat (tuner.search). Before each claim the worker reclaims the jobs of workers silent
past the grace period and fails their trials in flight, so a worker lost to SIGKILL or a dead node
leaves nothing stuck: its job runs again elsewhere and resumes its study.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import interrupts, queue
from .db import queries
from .runner import ReplayRunner, Runner
from .search import HEARTBEAT_S, GRACE_S, Progress, Search, fail_dead_trials, optuna_storage, study_name


@dataclass(frozen=True)
class WorkerOptions:
    heartbeat_s: int = HEARTBEAT_S
    grace_s: int = GRACE_S   # silent this long: a trial is stale; a worker is lost after grace + heartbeat
    poll_s: float = 5.0      # how often an idle worker looks for work
    exit_when_idle: bool = False  # leave once no job of this GPU model is queued or running anywhere

    @property
    def lost_after_s(self) -> float:
        """A worker's last beat may be one interval older than its trial's: waiting that much longer
        means its trial's heartbeat is stale too by the time its job is taken back."""
        return self.grace_s + self.heartbeat_s


class FleetWorker:
    def __init__(self, runner: Runner, sessions, url: str, gpu_index: int, options: WorkerOptions,
                 say: Callable[[str], None] = print) -> None:
        self.runner, self.sessions, self.url, self.options, self.say = runner, sessions, url, options, say
        self.storage = optuna_storage(url, options.heartbeat_s, options.grace_s)
        with sessions.begin() as s:  # its spec, for `tuner submit --family auto` on another host
            queries.upsert_gpu(s, runner.gpu)
        self.id = queue.register(sessions, gpu_index, runner.gpu.key)
        self.gpu_index = gpu_index
        self.trials = 0        # trials told by this worker, all jobs
        self.job_trials = 0    # of the job in hand
        self.job: queue.Job | None = None
        self._stop = threading.Event()
        self._beat_thread = threading.Thread(target=self._beat_loop, name="fleet-beat", daemon=True)

    # ---- the beat ----
    def _beat_loop(self) -> None:
        while not self._stop.wait(self.options.heartbeat_s):
            job = self.job
            try:
                queue.beat(self.sessions, self.id, job.id if job else None, self.trials, self.job_trials)
            except Exception:  # the database away for a moment: the next beat tries again
                pass

    def _observe(self, ev: Progress) -> None:
        self.trials += 1
        self.job_trials = ev.done

    # ---- the loop ----
    def run(self) -> int:
        """Take and run jobs until interrupted (or idle, with exit_when_idle); the jobs done."""
        self._beat_thread.start()
        done = 0
        try:
            while True:
                interrupts.checkpoint()
                self.reclaim()
                job = queue.claim(self.sessions, self.id, self.runner.gpu.key)
                if job is None:
                    if self.options.exit_when_idle and queue.pending(self.sessions, self.runner.gpu.key) == (0, 0):
                        return done
                    with interrupts.allowed():
                        time.sleep(self.options.poll_s)
                    continue
                done += self._run(job)
        finally:
            self._stop.set()
            self._beat_thread.join()
            queue.stop(self.sessions, self.id, self.trials)

    def reclaim(self) -> None:
        failed: dict[int, int] = {}

        def fail_trials(job: queue.Job) -> None:
            s = job.spec
            failed[job.id] = fail_dead_trials(self.storage, study_name(s.gpu_key, s.family, s.problem.key))

        for job in queue.reclaim(self.sessions, self.options.lost_after_s, fail_trials):
            self.say(f"job {job.id} ({job.spec.problem.key} {job.spec.family}) taken back from a lost worker; "
                     f"{failed.get(job.id, 0)} trial(s) in flight failed")

    def _run(self, job: queue.Job) -> int:
        from .kernel_templates import get_family

        s = job.spec
        self.job, self.job_trials = job, 0
        what = f"job {job.id} ({s.problem.key} {s.family})"
        self.say(f"{what}: started (attempt {job.attempts})")
        start = time.monotonic()
        try:
            family = get_family(s.family)
            why = self._cannot(family, s)
            if why:
                queue.finish(self.sessions, job, self.id, "failed", message=why)
                self.say(f"{what}: failed: {why}")
                return 0
            search = Search(self.runner, self.sessions, self.url, seed=s.seed, sampler=s.sampler,
                            observer=self._observe, storage=self.storage)
            if s.peers:
                search.measure_peers(s.problem)
            r = search.tune(family, s.problem, s.trials)
        except KeyboardInterrupt:
            queue.release(self.sessions, job, self.id)  # its finished trials are stored: the next run resumes
            raise
        except (ValueError, KeyError) as exc:  # a job this worker cannot run (a family unknown here, say)
            queue.finish(self.sessions, job, self.id, "failed", message=str(exc), trials_done=self.job_trials)
            self.say(f"{what}: failed: {exc}")
            return 0
        finally:
            self.job = None
        best = r.best.tflops if r.best else None
        held = queue.finish(self.sessions, job, self.id, "done", best_tflops=best, trials_done=self.job_trials)
        best_text = f"best {best:.1f} TFLOP/s" if best else "no ok config"
        self.say(f"{what}: done in {time.monotonic() - start:.1f} s, {best_text}"
                 + ("" if held else " (it had been taken back meanwhile)"))
        return int(held)

    def _cannot(self, family, spec: queue.JobSpec) -> str | None:
        """Why this worker cannot run the job at all (the family does not fit the GPU, or a replay
        recording never measured the problem), or None."""
        why = family.supports(self.runner.gpu, spec.problem)
        if why:
            return why
        if isinstance(self.runner, ReplayRunner) and family.name not in self.runner.recorded(spec.problem):
            return f"the replay recording {self.runner.source} has no {family.name} measurements of {spec.problem.key}"
        return None
