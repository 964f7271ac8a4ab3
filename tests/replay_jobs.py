"""Replay recordings with many problems, made from the recorded H100 fixture: enough (problem,
family) jobs to keep a fleet of replay workers busy.

The fixture measured every valid flash_fwd_simt point of one problem (B2-H4-N512-D64, causal,
fp32) on an H100. The same problem at batch b does b/2 times the work in b/2 times the time (the
grid grows, the tile work does not), so each recorded row is copied to batch b with its times
scaled by b/2 and its TFLOP/s kept: every answer a worker gives is a real H100 measurement.
"""

from __future__ import annotations

import shutil
import sqlite3
from dataclasses import replace
from pathlib import Path

from tuner.db import queries
from tuner.db.engine import make_engine, session_factory
from tuner.problem import Problem

FIXTURE = Path(__file__).parent / "fixtures" / "h100_simt.db"
BASE = Problem(2, 4, 512, 512, 64, "fp32", True)
GPU_KEY = "NVIDIA-H100-80GB-HBM3/sm_90"


def recording(dst: Path, jobs: int) -> list[Problem]:
    """A copy of the fixture at `dst` answering `jobs` problems (batch 2 is the recorded one)."""
    shutil.copy(FIXTURE, dst)
    dst.chmod(0o644)
    problems = [replace(BASE, batch=b) for b in range(2, 2 + jobs)]
    engine = make_engine(f"sqlite:///{dst}")
    with session_factory(engine).begin() as s:
        ids = {p.key: queries.upsert_problem(s, p).id for p in problems}
    engine.dispose()
    c = sqlite3.connect(dst)
    try:
        cols = [r[1] for r in c.execute("PRAGMA table_info(ft_measurements)") if r[1] not in ("id", "problem_id")]
        scaled = {"median_ms", "min_ms", "max_ms"}
        base_id = ids[BASE.key]
        for p in problems[1:]:
            f = p.batch / BASE.batch
            picks = ", ".join(f"{col} * {f}" if col in scaled else col for col in cols)
            c.execute(f"INSERT INTO ft_measurements (problem_id, {', '.join(cols)}) "
                      f"SELECT ?, {picks} FROM ft_measurements WHERE problem_id = ?", (ids[p.key], base_id))
        c.commit()
    finally:
        c.close()
    return problems
