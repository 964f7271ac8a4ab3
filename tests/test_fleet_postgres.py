"""The fleet on a real PostgreSQL server (started by the test session on a loopback port), with
replay workers standing in for GPUs: they answer from the recorded H100 fixture (tests/replay_jobs.py).

4 workers over 20 jobs lose and duplicate nothing; a worker killed with SIGKILL at random moments
(10 times) leaves no job stuck and no trial RUNNING; a job for a GPU model no worker has stays
queued and `tuner status` says why; claims under contention hand each job out once."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from replay_jobs import GPU_KEY, recording
from tuner import queue
from tuner.db.engine import make_engine, session_factory
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parents[1]


def _env(url: str, delay: float) -> dict:
    return dict(os.environ, TUNER_DB=url, CUDA_VISIBLE_DEVICES="", NO_COLOR="1", COLUMNS="200",
                TUNER_REPLAY_DELAY=str(delay))


def tuner(url: str, *args: str, delay: float = 0.0, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], env=_env(url, delay), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def _shapes(problems: list[Problem]) -> list[str]:
    return [a for p in problems for a in ("--shape", f"{p.batch},{p.heads},{p.seqlen_q},{p.head_dim},causal")]


def _submit(url: str, problems: list[Problem], trials: int) -> None:
    out = tuner(url, "submit", *_shapes(problems), "--gpu-key", GPU_KEY, "--family", "flash_fwd_simt",
                "--trials", str(trials), "--sampler", "random", "--no-peers")
    assert out.returncode == 0, out.stderr
    assert f"{len(problems)} job(s) queued" in out.stdout, out.stdout


def _facts(url: str) -> dict:
    """What the database holds: jobs by state, duplicate measurements, RUNNING and FAIL trials."""
    engine = create_engine(url)
    with engine.connect() as c:
        facts = {
            "jobs": dict(c.execute(text("SELECT state, COUNT(*) FROM ft_jobs GROUP BY state")).all()),
            "dups": c.execute(text(
                "SELECT config_id, problem_id, gpu_id, versions_key, COUNT(*) FROM ft_measurements "
                "GROUP BY config_id, problem_id, gpu_id, versions_key HAVING COUNT(*) > 1")).all(),
            "running": c.execute(text("SELECT COUNT(*) FROM trials WHERE state = 'RUNNING'")).scalar(),
            "fail": c.execute(text("SELECT COUNT(*) FROM trials WHERE state = 'FAIL'")).scalar(),
            "rows": c.execute(text("SELECT COUNT(*) FROM ft_measurements")).scalar(),
            # every COMPLETE trial's point has its row: no measurement lost
            "unrecorded": c.execute(text(
                "SELECT COUNT(*) FROM trials t JOIN studies s ON s.study_id = t.study_id WHERE t.state = 'COMPLETE' "
                "AND NOT EXISTS (SELECT 1 FROM ft_measurements m WHERE m.study_name = s.study_name)")).scalar(),
            "counted": dict(c.execute(text(
                "SELECT s.study_name, COUNT(*) FROM trials t JOIN studies s ON s.study_id = t.study_id "
                "JOIN trial_user_attributes a ON a.trial_id = t.trial_id AND a.key = 'counted' AND a.value_json = 'true' "
                "WHERE t.state IN ('COMPLETE', 'FAIL') GROUP BY s.study_name")).all()),   # measured points, ok or not
            "workers_per_job": c.execute(text("SELECT COUNT(DISTINCT worker_id) FROM ft_jobs WHERE state = 'done'"))
                                .scalar(),
        }
    engine.dispose()
    return facts


def test_four_workers_twenty_jobs(pg_url, tmp_path):
    problems = recording(tmp_path / "rec.db", 20)
    _submit(pg_url, problems, trials=6)
    out = tuner(pg_url, "worker", "--replay", str(tmp_path / "rec.db"), "--workers", "4", "--exit-when-idle",
                "--poll", "0.2", delay=0.02, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    f = _facts(pg_url)
    assert f["jobs"] == {"done": 20}, f["jobs"]
    assert f["dups"] == [] and f["running"] == 0 and f["unrecorded"] == 0
    assert len(f["counted"]) == 20 and all(n >= 6 for n in f["counted"].values()), f["counted"]
    assert f["workers_per_job"] > 1, "one worker took every job: the others never claimed"
    engine = create_engine(pg_url)
    with engine.connect() as c:
        attempts = c.execute(text("SELECT MAX(attempts), MIN(attempts) FROM ft_jobs")).one()
        started = [ln for ln in out.stdout.splitlines() if ": started (attempt" in ln]
        # each job handed out once: one start line per job, attempt 1 everywhere
        assert tuple(attempts) == (1, 1) and len(started) == 20, (attempts, started)
        per_problem = dict(c.execute(text(
            "SELECT p.key, COUNT(*) FROM ft_measurements m JOIN ft_problems p ON p.id = m.problem_id GROUP BY p.key")).all())
    engine.dispose()
    assert set(per_problem) == {p.key for p in problems}
    status = tuner(pg_url, "status")
    assert status.returncode == 0 and "| 0      | 0       | 20   | 0      |" in status.stdout.replace("│", "|"), status.stdout
    print(f"\n4 workers, 20 jobs: {f['rows']} measurements, 0 duplicates, jobs spread over "
          f"{f['workers_per_job']} workers")


# A worker silent this long is lost. Short, so a test sees lost workers soon, but several beats long:
# on a loaded CI machine (2 cores, other tests beside) a live worker's beat can be a second late,
# and a live worker taken for lost runs its job twice.
GRACE = "6"


def _worker(url: str, rec: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tuner.cli", "worker", "--replay", str(rec), "--heartbeat", "1",
                             "--grace", GRACE, "--poll", "0.2"], env=_env(url, 0.1), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _holds_a_job(url: str, pid: int) -> bool:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return c.execute(text("SELECT 1 FROM ft_jobs j JOIN ft_workers w ON w.id = j.worker_id "
                                  "WHERE j.state = 'running' AND w.pid = :pid"), {"pid": pid}).first() is not None
    finally:
        engine.dispose()


def test_kill_9_at_random_moments_leaves_nothing_stuck(pg_url, tmp_path):
    rec = tmp_path / "rec.db"
    problems = recording(rec, 20)
    _submit(pg_url, problems, trials=12)
    rng = random.Random(25)
    pool = [_worker(pg_url, rec) for _ in range(2)]
    kills = 0
    try:
        while kills < 10:
            victim = pool.pop(rng.randrange(len(pool)))
            deadline = time.monotonic() + 60
            while not _holds_a_job(pg_url, victim.pid):  # it has claimed: the kill lands inside a job
                assert victim.poll() is None, victim.stderr.read()
                assert time.monotonic() < deadline, "the worker never claimed a job"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.05, 1.5))
            victim.kill()
            victim.wait(timeout=30)
            kills += 1
            pool.append(_worker(pg_url, rec))
    finally:
        for p in pool:
            p.kill()
            p.wait(timeout=30)
    mid = _facts(pg_url)
    assert mid["jobs"].get("done", 0) < 20, "the queue drained before the kills: nothing was tested"
    # restarted workers resume: every job finishes, the lost workers' jobs after the grace period
    out = tuner(pg_url, "worker", "--replay", str(rec), "--workers", "2", "--exit-when-idle", "--heartbeat", "1",
                "--grace", GRACE, "--poll", "0.2", timeout=600)
    assert out.returncode == 0, out.stderr
    f = _facts(pg_url)
    assert f["jobs"] == {"done": 20}, f["jobs"]
    assert f["running"] == 0, "a trial was left RUNNING"
    assert f["dups"] == [] and f["unrecorded"] == 0
    assert len(f["counted"]) == 20 and all(n >= 12 for n in f["counted"].values()), f["counted"]
    assert f["fail"] >= 1, "no kill landed inside a trial"
    engine = create_engine(pg_url)
    with engine.connect() as c:
        lost = c.execute(text("SELECT COUNT(*) FROM ft_workers WHERE state = 'lost'")).scalar()
        retried = c.execute(text("SELECT COUNT(*) FROM ft_jobs WHERE attempts > 1")).scalar()
    engine.dispose()
    assert lost >= 1 and retried >= 1, (lost, retried)
    print(f"\n{kills} kill -9s: {mid['jobs']} when the last one landed; {f['fail']} trials FAIL, 0 RUNNING; "
          f"{lost} workers lost, {retried} jobs run again; all 20 done, {f['rows']} rows, 0 duplicates")


def test_a_job_for_a_gpu_model_no_worker_has_stays_queued(pg_url, tmp_path):
    problems = recording(tmp_path / "rec.db", 1)
    _submit(pg_url, problems, trials=3)
    a100 = "NVIDIA-A100-SXM4-80GB/sm_80"
    out = tuner(pg_url, "submit", "--shape", "2,4,512,64,causal", "--gpu-key", a100, "--trials", "3")
    assert out.returncode == 0 and "1 job(s) queued" in out.stdout, out.stderr
    out = tuner(pg_url, "worker", "--replay", str(tmp_path / "rec.db"), "--exit-when-idle", "--poll", "0.2")
    assert out.returncode == 0, out.stderr
    jobs = _facts(pg_url)["jobs"]
    assert jobs == {"done": 1, "queued": 1}, jobs
    status = tuner(pg_url, "status")
    assert status.returncode == 0, status.stderr
    said = " ".join(status.stdout.split())
    assert f"queued jobs for {a100} wait: no live worker has the GPU model {a100}" in said, status.stdout


def test_claims_under_contention_hand_each_job_out_once(pg_url):
    sessions = session_factory(make_engine(pg_url))
    specs = [queue.JobSpec(GPU_KEY, "flash_fwd_simt", Problem(b, 4, 512, 512, 64, "fp32", True), 1)
             for b in range(1, 121)]
    added, skipped = queue.submit(sessions, specs)
    assert len(added) == 120 and skipped == []
    assert queue.submit(sessions, specs[:5]) == ([], specs[:5])  # already queued: not again
    workers = [queue.register(sessions, i, GPU_KEY) for i in range(8)]
    claimed: dict[int, list[int]] = {w: [] for w in workers}

    def take(w: int) -> None:
        while (job := queue.claim(sessions, w, GPU_KEY)) is not None:
            claimed[w].append(job.id)

    threads = [threading.Thread(target=take, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [j for got in claimed.values() for j in got]
    assert sorted(ids) == sorted(added), "a job was claimed twice or never"
    assert sum(bool(got) for got in claimed.values()) > 1
    assert queue.claim(sessions, workers[0], "other/sm_80") is None


def test_a_lost_workers_job_goes_back_to_the_queue(pg_url):
    sessions = session_factory(make_engine(pg_url))
    spec = queue.JobSpec(GPU_KEY, "flash_fwd_simt", Problem(2, 4, 512, 512, 64, "fp32", True), 1)
    (job_id,), _ = queue.submit(sessions, [spec])
    dead, live = queue.register(sessions, 0, GPU_KEY), queue.register(sessions, 1, GPU_KEY)
    job = queue.claim(sessions, dead, GPU_KEY)
    assert job is not None and job.id == job_id
    seen: list[int] = []
    assert queue.reclaim(sessions, 60, lambda j: seen.append(j.id)) == [] and seen == []  # it beat just now
    time.sleep(1.2)
    queue.beat(sessions, live, None, 0)

    def before(j: queue.Job) -> None:  # the job is still the lost worker's here: nobody can claim it
        seen.append(j.id)
        assert queue.claim(sessions, live, GPU_KEY) is None

    (back,) = queue.reclaim(sessions, 1, before)
    assert back.id == job_id and seen == [job_id]
    with sessions() as s:
        st = queue.status(s, grace_s=1)
    assert {w.id: w.state for w in st.workers} == {dead: "lost", live: "alive"}
    assert st.jobs[GPU_KEY]["queued"] == 1
    assert not queue.finish(sessions, job, dead, "done")  # the lost worker no longer holds it
    again = queue.claim(sessions, live, GPU_KEY)
    assert again is not None and again.id == job_id and again.attempts == 2
    assert queue.finish(sessions, again, live, "done", best_tflops=1.0)


def test_a_beat_while_the_worker_finishes_its_job_does_not_deadlock(pg_url):
    """The heartbeat thread beats while the worker closes its job: `finish` updates the job's row,
    then the worker's; a beat that locked the worker's row first would wait on the job's while
    `finish` waits on the worker's (PostgreSQL: deadlock detected, one of them fails)."""
    engine = make_engine(pg_url)
    sessions = session_factory(engine)
    spec = queue.JobSpec(GPU_KEY, "flash_fwd_simt", Problem(3, 4, 512, 512, 64, "fp32", True), 1)
    queue.submit(sessions, [spec])
    worker = queue.register(sessions, 0, GPU_KEY)
    job = queue.claim(sessions, worker, GPU_KEY)
    assert job is not None
    errors: list[BaseException] = []

    def beat() -> None:
        try:
            queue.beat(sessions, worker, job.id, 5, job_trials=3)
        except BaseException as exc:   # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    with engine.connect() as c, c.begin():   # finish's two statements, with a beat between them
        c.execute(text("UPDATE ft_jobs SET state = 'done' WHERE id = :j"), dict(j=job.id))
        t = threading.Thread(target=beat)
        t.start()
        time.sleep(0.5)   # the beat is waiting on the job's row now
        c.execute(text("UPDATE ft_workers SET jobs_done = jobs_done + 1 WHERE id = :w"), dict(w=worker))
    t.join(timeout=30)
    assert not t.is_alive() and errors == []
    with engine.connect() as c:
        row = c.execute(text("SELECT jobs_done, trials_done FROM ft_workers WHERE id = :w"), dict(w=worker)).one()
    assert tuple(row) == (1, 5)


def test_status_and_the_dashboard_call_lost_what_a_worker_does():
    from tuner.cli import STATUS_GRACE_S
    from tuner.dashboard.data import FLEET_GRACE_S
    from tuner.fleet import WorkerOptions

    assert STATUS_GRACE_S == FLEET_GRACE_S == WorkerOptions().lost_after_s
