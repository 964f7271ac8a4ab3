"""The job queue in the results database: (GPU model, family, problem) searches that workers claim.

Many `tuner worker` processes on many hosts share one database. A claim locks the oldest queued
job of the worker's GPU model (`FOR UPDATE SKIP LOCKED` on PostgreSQL, so claimers never wait on
each other; SQLite's write sessions start with BEGIN IMMEDIATE and take turns) and marks it
running in the same transaction: no job is handed out twice. Workers beat; a worker silent for
longer than the grace period is lost, and `reclaim` puts its job back in the queue. Every time
here is the database server's, so hosts with skewed clocks agree on who is silent.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from .db.models import JobRow, WorkerRow, utcnow
from .problem import Problem

JOB_STATES = ("queued", "running", "done", "failed")
MAX_ATTEMPTS = 10  # a job whose worker was lost this often is failed, not handed out again


@dataclass(frozen=True)
class JobSpec:
    """What to search: submitted by `tuner submit`, run by a worker of `gpu_key`."""

    gpu_key: str
    family: str
    problem: Problem
    trials: int = 30
    sampler: str = "tpe"
    seed: int | None = None
    peers: bool = True


@dataclass(frozen=True)
class Job:
    id: int
    spec: JobSpec
    attempts: int


@dataclass(frozen=True)
class WorkerInfo:
    id: int
    host: str
    pid: int
    gpu_index: int
    gpu_key: str
    state: str  # alive, stopped, lost; "alive" with a stale beat shows as lost to `status`
    silent_s: float
    jobs_done: int
    trials_done: int
    uptime_s: float
    job_id: int | None = None


@dataclass
class FleetStatus:
    """What `tuner status` and the dashboard show."""

    workers: list[WorkerInfo]
    jobs: dict[str, dict[str, int]]  # GPU key -> state -> count
    waiting: dict[str, str] = field(default_factory=dict)  # GPU key -> why its queued jobs wait
    failed: list[tuple[int, str, str]] = field(default_factory=list)  # (job id, what, message)

    @property
    def alive(self) -> list[WorkerInfo]:
        return [w for w in self.workers if w.state == "alive"]

    def trials_per_minute(self) -> float:
        """Trials told per minute by the live workers, each since it started."""
        return sum(60.0 * w.trials_done / w.uptime_s for w in self.alive if w.uptime_s > 0)


def db_now(s: Session) -> datetime:
    """The database server's time (UTC): the one clock every host agrees on. SQLite lives on one
    machine, whose own clock is that."""
    if s.get_bind().dialect.name == "sqlite":
        return utcnow()
    now = s.scalar(select(func.now()))
    return now.astimezone(timezone.utc) if now.tzinfo else now.replace(tzinfo=timezone.utc)


def _spec(row: JobRow) -> JobSpec:
    return JobSpec(row.gpu_key, row.family, Problem(**json.loads(row.problem_json)), row.trials, row.sampler,
                   row.seed, row.peers)


def submit(sessions: sessionmaker[Session], specs: Iterable[JobSpec]) -> tuple[list[int], list[JobSpec]]:
    """Queue the specs; one already queued or running (same GPU model, family, problem) is not
    queued again. Returns the new job ids and the specs skipped."""
    added, skipped = [], []
    with sessions.begin() as s:
        now = db_now(s)
        for spec in specs:
            active = s.scalar(select(JobRow.id).where(
                JobRow.gpu_key == spec.gpu_key, JobRow.family == spec.family,
                JobRow.problem_key == spec.problem.key, JobRow.state.in_(("queued", "running"))).limit(1))
            if active is not None:
                skipped.append(spec)
                continue
            row = JobRow(gpu_key=spec.gpu_key, family=spec.family, problem_key=spec.problem.key,
                         problem_json=json.dumps(spec.problem.to_dict(), sort_keys=True), trials=spec.trials,
                         sampler=spec.sampler, seed=spec.seed, peers=spec.peers, state="queued", attempts=0,
                         submitted_at=now, trials_done=0, message="")
            s.add(row)
            s.flush()
            added.append(row.id)
    return added, skipped


def register(sessions: sessionmaker[Session], gpu_index: int, gpu_key: str) -> int:
    """A new worker row for this process; its id."""
    with sessions.begin() as s:
        now = db_now(s)
        row = WorkerRow(host=socket.gethostname(), pid=os.getpid(), gpu_index=gpu_index, gpu_key=gpu_key,
                        state="alive", started_at=now, beat_at=now, jobs_done=0, trials_done=0)
        s.add(row)
        s.flush()
        return row.id


def beat(sessions: sessionmaker[Session], worker_id: int, job_id: int | None, trials_done: int,
         job_trials: int = 0) -> None:
    """The worker is alive: its beat, its count of trials, and the lease of the job it holds. The
    job's row is locked before the worker's, in the order `finish` takes them: the heartbeat thread
    beats while the worker finishes, and the other order deadlocked on PostgreSQL."""
    with sessions.begin() as s:
        now = db_now(s)
        if job_id is not None:
            s.execute(update(JobRow).where(JobRow.id == job_id, JobRow.worker_id == worker_id,
                                           JobRow.state == "running")
                      .values(lease_at=now, trials_done=job_trials))
        s.execute(update(WorkerRow).where(WorkerRow.id == worker_id)
                  .values(beat_at=now, trials_done=trials_done))


def claim(sessions: sessionmaker[Session], worker_id: int, gpu_key: str) -> Job | None:
    """The oldest queued job of `gpu_key`, now running under this worker; None if there is none."""
    with sessions.begin() as s:
        row = s.scalar(select(JobRow).where(JobRow.state == "queued", JobRow.gpu_key == gpu_key)
                       .order_by(JobRow.id).limit(1).with_for_update(skip_locked=True))
        if row is None:
            return None
        now = db_now(s)
        row.state, row.worker_id, row.started_at, row.lease_at = "running", worker_id, now, now
        row.attempts += 1
        return Job(row.id, _spec(row), row.attempts)


def finish(sessions: sessionmaker[Session], job: Job, worker_id: int, state: str, *,
           best_tflops: float | None = None, message: str = "", trials_done: int = 0) -> bool:
    """Close a job this worker holds (done or failed). False where it no longer holds it: it was
    silent too long and the job went back to the queue, so the row is another worker's now."""
    assert state in ("done", "failed")
    with sessions.begin() as s:
        now = db_now(s)
        held = s.execute(update(JobRow).where(JobRow.id == job.id, JobRow.worker_id == worker_id,
                                              JobRow.state == "running")
                         .values(state=state, finished_at=now, best_tflops=best_tflops, message=message[:2000],
                                 trials_done=trials_done)).rowcount
        if held:
            s.execute(update(WorkerRow).where(WorkerRow.id == worker_id)
                      .values(jobs_done=WorkerRow.jobs_done + 1))
        return bool(held)


def release(sessions: sessionmaker[Session], job: Job, worker_id: int) -> None:
    """Hand a job back to the queue untouched (the worker was told to stop)."""
    with sessions.begin() as s:
        s.execute(update(JobRow).where(JobRow.id == job.id, JobRow.worker_id == worker_id, JobRow.state == "running")
                  .values(state="queued", worker_id=None, lease_at=None, attempts=JobRow.attempts - 1))


def stop(sessions: sessionmaker[Session], worker_id: int, trials_done: int) -> None:
    """The worker left on its own (idle, or told to stop): not lost, nothing to reclaim."""
    with sessions.begin() as s:
        s.execute(update(WorkerRow).where(WorkerRow.id == worker_id)
                  .values(state="stopped", beat_at=db_now(s), trials_done=trials_done))


def reclaim(sessions: sessionmaker[Session], grace_s: float, before_requeue: Callable[[Job], None]) -> list[Job]:
    """Workers silent for more than `grace_s` are lost; the jobs they held go back to the queue
    (failed after MAX_ATTEMPTS). `before_requeue(job)` runs first, while the job is still the lost
    worker's and nobody can claim it: the caller fails its study's trials in flight there, so they
    can never be confused with the next holder's. Returns the jobs put back."""
    with sessions() as s:
        cutoff = db_now(s) - timedelta(seconds=grace_s)
        silent = select(WorkerRow.id).where(WorkerRow.state == "alive", WorkerRow.beat_at < cutoff)
        held = {row.id: (row.worker_id, Job(row.id, _spec(row), row.attempts)) for row in s.scalars(
            select(JobRow).where(JobRow.state == "running")
            .where(JobRow.worker_id.in_(silent) | (JobRow.lease_at < cutoff)))}
        lost = list(s.scalars(silent))
    for _, job in held.values():
        before_requeue(job)
    back = []
    with sessions.begin() as s:
        if lost:
            s.execute(update(WorkerRow).where(WorkerRow.id.in_(lost), WorkerRow.beat_at < cutoff).values(state="lost"))
        for row in s.scalars(select(JobRow).where(JobRow.id.in_(list(held)), JobRow.state == "running")
                             .with_for_update(skip_locked=True)):
            if row.worker_id != held[row.id][0]:
                continue  # another reclaimer was first, and the job has run on since
            back.append(held[row.id][1])
            if row.attempts >= MAX_ATTEMPTS:
                row.state, row.message = "failed", f"its worker was lost {row.attempts} times"
            else:
                row.state, row.message = "queued", f"requeued: worker {row.worker_id} was lost"
            row.worker_id, row.lease_at = None, None
    return back


def pending(sessions: sessionmaker[Session], gpu_key: str) -> tuple[int, int]:
    """(queued, running) jobs of one GPU model."""
    with sessions() as s:
        counts = dict(s.execute(select(JobRow.state, func.count(JobRow.id)).where(JobRow.gpu_key == gpu_key)
                                .group_by(JobRow.state)).all())
    return counts.get("queued", 0), counts.get("running", 0)


def status(s: Session, grace_s: float) -> FleetStatus:
    """The fleet as the database sees it; a worker silent past `grace_s` counts as lost even
    before another worker reclaims its job (a reader writes nothing)."""
    now = db_now(s)
    holding = dict(s.execute(select(JobRow.worker_id, JobRow.id).where(JobRow.state == "running")).all())
    workers = []
    for w in s.scalars(select(WorkerRow).order_by(WorkerRow.id)):
        silent = (now - w.beat_at).total_seconds()
        state = "lost" if w.state == "alive" and silent > grace_s else w.state
        if state != "alive" and silent > 24 * 3600:
            continue  # yesterday's stopped workers are history, not the fleet
        workers.append(WorkerInfo(w.id, w.host, w.pid, w.gpu_index, w.gpu_key, state, silent, w.jobs_done,
                                  w.trials_done, (w.beat_at - w.started_at).total_seconds(), holding.get(w.id)))
    jobs: dict[str, dict[str, int]] = {}
    for key, state, n in s.execute(select(JobRow.gpu_key, JobRow.state, func.count(JobRow.id))
                                   .group_by(JobRow.gpu_key, JobRow.state)):
        jobs.setdefault(key, dict.fromkeys(JOB_STATES, 0))[state] = n
    out = FleetStatus(workers, dict(sorted(jobs.items())))
    live = {w.gpu_key for w in out.alive}
    for key, counts in out.jobs.items():
        if counts["queued"] and key not in live:
            has = ", ".join(sorted(live)) or "none"
            out.waiting[key] = (f"no live worker has the GPU model {key} (live workers' models: {has}); start "
                                f"`tuner worker` on a host with that GPU")
    out.failed = [(j.id, f"{j.problem_key} {j.family} on {j.gpu_key}", j.message)
                  for j in s.scalars(select(JobRow).where(JobRow.state == "failed").order_by(JobRow.id.desc())
                                     .limit(10))]
    return out
