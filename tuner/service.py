"""The fleet's front ends, behind `tuner worker`, `tuner submit` and `tuner status`: which processes
to start and where, which jobs a submission means, and how the fleet is shown.

Bad input raises ValueError with one line (the CLI prints it as an error).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.table import Table
from rich.text import Text

from .problem import Problem
from .queue import JOB_STATES, FleetStatus

# SQLite's locking needs one machine's kernel: on these filesystems several processes (or hosts)
# writing one file can corrupt it.
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "9p", "ceph", "fuse.ceph", "glusterfs",
              "fuse.glusterfs", "lustre", "gpfs", "afs", "fuse.s3fs", "fuse.gcsfuse", "davfs", "fuse.rclone"}
TOKENS_PER_BATCH = 16384  # a model's problems keep B x N at this, as docs/benchmarks.md's grid does


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path` (/proc/mounts, the longest mount point above it)."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target, best, kind = path.resolve(), -1, None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = Path(parts[1].replace("\\040", " "))
        if (target == mount or mount in target.parents) and len(mount.parts) > best:
            best, kind = len(mount.parts), parts[2]
    return kind


def sqlite_fleet_problem(url: str) -> str | None:
    """Why workers must not share this SQLite file (it lies on a network filesystem, where SQLite's
    locks do not hold across processes or hosts), or None. PostgreSQL has no such limit."""
    from .db.engine import sqlite_path

    path = sqlite_path(url)
    if path is None:
        return None
    kind = filesystem_type(path.parent if not path.exists() else path)
    if kind in NETWORK_FS:
        return (f"{path} is on a {kind} filesystem, where SQLite's locks do not hold between workers: use "
                f"PostgreSQL (pip install 'flashtune[postgres]', --db postgresql+psycopg://user@host/db)")
    return None


def slots(gpus: str, replay: str | None, workers: int) -> list[int]:
    """The worker slots to start: GPU indices (`all`, or `0,2`), or with --replay one per worker."""
    if replay:
        return list(range(workers))
    from .gpu import visible

    seen = len(visible())
    if gpus.strip() == "all":
        if not seen:
            from .gpu import NoGpuError, why_none

            raise NoGpuError(f"no CUDA GPU is visible ({why_none()}): a worker needs an "
                             "NVIDIA GPU (or --replay DB to answer from a recording)")
        return list(range(seen))
    try:
        chosen = [int(x) for x in gpus.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--gpus must be 'all' or GPU indices like 0,1,3, got {gpus!r}") from None
    if not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"--gpus must name each GPU once, got {gpus!r}")
    if bad := [i for i in chosen if not 0 <= i < seen]:
        raise ValueError(f"--gpus {bad[0]}: only {seen} GPU(s) visible (indices 0..{seen - 1})" if seen
                         else "no CUDA GPU is visible: a worker needs one (or --replay DB)")
    return chosen


def launch(slot_ids: list[int], child_args: Callable[[int], list[str]], child_env: Callable[[int], dict],
           say: Callable[[str], None]) -> int:
    """One `tuner worker --slot i` process per slot, supervised: SIGINT/SIGTERM here is passed on as
    SIGTERM (each hands its job back); returns the worst exit code."""
    from . import interrupts

    procs = {i: subprocess.Popen([sys.executable, "-m", "tuner.cli", *child_args(i)], env=child_env(i))
             for i in slot_ids}
    say(f"started {len(procs)} worker processes: " + ", ".join(f"slot {i} pid {p.pid}" for i, p in procs.items()))
    codes: dict[int, int] = {}
    try:
        while len(codes) < len(procs):
            for i, p in procs.items():
                if i not in codes and p.poll() is not None:
                    codes[i] = p.returncode
                    say(f"worker of slot {i} (pid {p.pid}) exited with code {p.returncode}")
            with interrupts.allowed():
                time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    return max(codes.values(), key=abs, default=0)


def child_env(url: str, slot: int, pin_gpu: bool) -> dict:
    """A child worker's environment: the database through TUNER_DB (a password never shows in
    `ps`), and on a GPU host that one GPU alone visible."""
    env = dict(os.environ, TUNER_DB=url)
    if pin_gpu:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [x for x in visible.split(",") if x.strip()] if visible else None
        env["CUDA_VISIBLE_DEVICES"] = ids[slot] if ids else str(slot)
    return env


# ---- what a submission means ----

def config_problems(path: Path, seqlens: list[int], dtype: str, max_error: float | None = None) -> list[Problem]:
    """The attention problems of a model from its Hugging Face config.json: its heads, KV heads and
    head dim, causal, at each sequence length with B x N = 16k tokens."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path}: cannot read a JSON model config ({e})") from None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    try:
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ValueError(f"--model {path}: expected a Hugging Face config with num_attention_heads and hidden_size "
                         f"(or head_dim)") from None
    return [Problem(max(1, TOKENS_PER_BATCH // n), heads, n, n, head_dim, dtype, True, kv, max_error or 0.0)
            for n in seqlens]


def recorded_problems(source: str) -> list[Problem]:
    """The problems a results database (a URL or a file) holds: tune on another GPU model what was
    tuned on one."""
    from .db import queries
    from .db.engine import open_readonly, session_factory

    url = source if "://" in source else f"sqlite:///{Path(source).resolve()}"
    engine = open_readonly(url)
    try:
        with session_factory(engine)() as s:
            return queries.list_problems(s)
    finally:
        engine.dispose()


def known_gpus(session) -> dict:
    """GPU key -> GpuSpec for every model the database has seen (workers record theirs) and the
    reference specs."""
    from .db import queries
    from .gpu import A100_SXM, H100_SXM, GpuSpec

    known = {g.key: g for g in (H100_SXM, A100_SXM)}
    for info in queries.list_gpus(session):
        known[info.key] = GpuSpec(**info.spec)
    return known


# ---- how the fleet is shown ----

def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def status_tables(st: FleetStatus) -> list[Table | Text]:
    out: list[Table | Text] = []
    w = Table("worker", "host", "pid", "gpu", "GPU model", "state", "last beat", "job", "jobs done", "trials",
              "trials/min", title="workers")
    for x in st.workers:
        rate = 60.0 * x.trials_done / x.uptime_s if x.uptime_s > 0 and x.state == "alive" else None
        w.add_row(str(x.id), Text(x.host), str(x.pid), str(x.gpu_index), Text(x.gpu_key), x.state, _ago(x.silent_s),
                  str(x.job_id) if x.job_id else "-", str(x.jobs_done), str(x.trials_done),
                  f"{rate:.1f}" if rate is not None else "-")
    out.append(w)
    j = Table("GPU model", *JOB_STATES, title="jobs")
    for key, counts in st.jobs.items():
        j.add_row(Text(key), *(str(counts[s]) for s in JOB_STATES))
    out.append(j)
    out.append(Text(f"{len(st.alive)} worker(s) alive, {st.trials_per_minute():.1f} trials/min"))
    for key, why in st.waiting.items():
        out.append(Text(f"queued jobs for {key} wait: {why}"))
    for job_id, what, message in st.failed:
        out.append(Text(f"failed job {job_id} ({what}): {' '.join(message.split())[:200]}"))
    return out
