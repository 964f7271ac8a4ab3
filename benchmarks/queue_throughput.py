"""Jobs per minute against the number of replay workers on one PostgreSQL server: is the database
the bottleneck of the fleet?

    python3 benchmarks/queue_throughput.py [--workers 1,2,4,8] [--jobs 24] [--trials 8] [--delay 0.25]

A throwaway PostgreSQL cluster (tuner/pgcluster.py) on a loopback port; for each worker count a
fresh database, the same jobs queued, and `tuner worker --replay --workers N --exit-when-idle`
answering from the recorded H100 fixture (tests/replay_jobs.py), each measurement taking `--delay`
seconds as a GPU's would. The clock runs from the first claim to the last finish (the database's
own stamps), so process start-up is not counted. Beside it, the CPU seconds the PostgreSQL server
and the workers spent in the whole run: which of the two the host's cores went to. Where the database is not the bottleneck, jobs
per minute grow with the workers until the host's CPU cores (the replay workers' Python) run out.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from replay_jobs import GPU_KEY, recording  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402

from tuner import pgcluster, queue  # noqa: E402
from tuner.db.engine import make_engine, session_factory  # noqa: E402


def server_cpu_s(cluster: pgcluster.Cluster) -> float:
    """CPU seconds of the PostgreSQL server so far: the postmaster and the backends it has reaped
    (each connection is a backend process), from /proc."""
    pid = int((cluster.root / "data" / "postmaster.pid").read_text().split()[0])
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def workers_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)  # the launcher waits for its workers: theirs count
    return r.ru_utime + r.ru_stime


def one_run(cluster: pgcluster.Cluster, rec: Path, workers: int, jobs: int, trials: int, delay: float) -> dict:
    url = cluster.create_database("bench")
    engine = make_engine(url)
    problems = recording_problems(rec, jobs)
    queue.submit(session_factory(engine), [queue.JobSpec(GPU_KEY, "flash_fwd_simt", p, trials, "random", i, False)
                                           for i, p in enumerate(problems)])
    engine.dispose()
    env = dict(os.environ, TUNER_DB=url, CUDA_VISIBLE_DEVICES="", TUNER_REPLAY_DELAY=str(delay))
    wall, db0, w0 = time.monotonic(), server_cpu_s(cluster), workers_cpu_s()
    subprocess.run([sys.executable, "-m", "tuner.cli", "worker", "--replay", str(rec), "--workers", str(workers),
                    "--exit-when-idle", "--poll", "0.2"], env=env, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.monotonic() - wall
    db_cpu, w_cpu = server_cpu_s(cluster) - db0, workers_cpu_s() - w0
    e = create_engine(url)
    with e.connect() as c:
        first, last, done = c.execute(text("SELECT MIN(started_at), MAX(finished_at), COUNT(*) FROM ft_jobs "
                                           "WHERE state = 'done'")).one()
        told = c.execute(text("SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'")).scalar()
        dups = c.execute(text("SELECT COUNT(*) FROM (SELECT 1 FROM ft_measurements GROUP BY config_id, problem_id, "
                              "gpu_id, versions_key HAVING COUNT(*) > 1) d")).scalar()
    e.dispose()
    span = (last - first).total_seconds()
    return {"workers": workers, "done": done, "span_s": span, "wall_s": wall, "jobs_per_min": 60 * done / span,
            "trials_per_min": 60 * told / span, "dups": dups,
            "db_cpu": db_cpu, "workers_cpu": w_cpu}


_PROBLEMS: dict[int, list] = {}


def recording_problems(rec: Path, jobs: int) -> list:
    if jobs not in _PROBLEMS:
        _PROBLEMS[jobs] = recording(rec, jobs)
    return _PROBLEMS[jobs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--delay", type=float, default=0.25, help="seconds per replayed measurement (the GPU's share)")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp, pgcluster.running() as cluster:
        rec = Path(tmp) / "rec.db"
        rows = [one_run(cluster, rec, n, args.jobs, args.trials, args.delay) for n in counts]
    base = rows[0]["jobs_per_min"] / rows[0]["workers"]
    print(f"{args.jobs} jobs x {args.trials} trials, {args.delay} s per replayed measurement, PostgreSQL "
          f"(pgcluster), {os.cpu_count()} CPU cores")
    print("| workers | jobs done | first claim to last finish (s) | jobs/min | trials/min | vs ideal | duplicates "
          "| PostgreSQL CPU s | workers' CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workers']} | {r['done']} | {r['span_s']:.1f} | {r['jobs_per_min']:.1f} | "
              f"{r['trials_per_min']:.0f} | {r['jobs_per_min'] / (base * r['workers']):.2f} | {r['dups']} | "
              f"{r['db_cpu']:.1f} | {r['workers_cpu']:.1f} |")


if __name__ == "__main__":
    main()
