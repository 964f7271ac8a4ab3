"""Several `tuner search` processes on one SQLite file at once (CPU, replay backend): two tune the
same study, a third another problem. No "database is locked", no lost row, no duplicated row, no
trial left RUNNING, and the shared lookup file ends up whole.

Two processes in one study get distinct trials from Optuna; both may propose the same point. The
search re-checks the DB inside its write transaction (BEGIN IMMEDIATE: one writer at a time), so
the second one takes the stored answer instead of adding a second row."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna

from tuner.db import queries
from tuner.db.engine import make_engine, session_factory
from tuner.gpu import GpuSpec
from tuner.kernel_templates import get_family
from tuner.problem import Problem
from tuner.records import STATUSES, Measurement

FIXTURE = Path(__file__).parent / "fixtures" / "h100_simt.db"
P1 = "2,4,512,64,causal"
P2 = Problem(2, 4, 256, 256, 64, "fp32", False)



def _replay(tmp: Path) -> str:
    """The fixture plus synthetic answers for a second problem (every valid point)."""
    shutil.copy(FIXTURE, tmp / "replay.db")
    (tmp / "replay.db").chmod(0o644)
    url = f"sqlite:///{tmp / 'replay.db'}"
    sessions = session_factory(make_engine(url))
    with sessions.begin() as s:
        (g,) = queries.list_gpus(s)
        gpu = GpuSpec(**g.spec)
        fam = get_family("flash_fwd_simt")
        for i, params in enumerate(fam.valid_points(gpu, P2)):
            ms = 0.05 + 0.001 * ((i * 37) % 101)
            queries.record_measurement(s, gpu, P2, fam.name, params, Measurement(
                "ok", median_ms=ms, tflops=P2.tflops(ms), rel_err=1e-7, versions={"synthetic": "1"}))
    return url


def test_three_searches_on_one_db(tmp_path):
    replay = _replay(tmp_path)
    db = tmp_path / "shared.db"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1", TUNER_REPLAY_DELAY="0.01")
    common = ["--replay", replay, "--trials", "40", "--no-peers", "--db", f"sqlite:///{db}",
              "--lookup", str(tmp_path / "best.json")]
    shapes = [P1, P1, "2,4,256,64"]
    procs = [subprocess.Popen([sys.executable, "-m", "tuner.cli", "search", "--shape", sh, "--seed", str(i), *common],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for i, sh in enumerate(shapes)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "locked" not in (out + err).lower() and "Traceback" not in err

    c = sqlite3.connect(db)
    try:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert {s for (s,) in c.execute("SELECT DISTINCT status FROM ft_measurements")} <= set(STATUSES)
        dups = c.execute("""SELECT config_id, problem_id, gpu_id, versions_key, COUNT(*) FROM ft_measurements
                            GROUP BY config_id, problem_id, gpu_id, versions_key HAVING COUNT(*) > 1""").fetchall()
        assert dups == []
        assert c.execute("SELECT COUNT(*) FROM trials WHERE state = 'RUNNING'").fetchone()[0] == 0
        rows = {(pk, params) for pk, params in c.execute(
            "SELECT p.key, c.params_json FROM ft_measurements m JOIN ft_problems p ON p.id = m.problem_id "
            "JOIN ft_configs c ON c.id = m.config_id")}
        assert c.execute("SELECT COUNT(*) FROM ft_best").fetchone()[0] == 2
    finally:
        c.close()

    storage = f"sqlite:///{db}"
    names = optuna.get_all_study_names(storage)
    assert len(names) == 2
    for name in names:
        study = optuna.load_study(study_name=name, storage=storage)
        problem_key = name.split("|")[2]
        complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert len({t.number for t in study.trials}) == len(study.trials)
        assert sum(bool(t.user_attrs.get("counted")) for t in complete) >= 40
        for t in complete:  # no lost row: every answered trial's point is in the DB
            assert (problem_key, json.dumps(t.params, sort_keys=True, separators=(",", ":"))) in rows, t.params
    print(f"\n3 processes: {len(rows)} rows, 0 duplicates, trials per study "
          f"{[len(optuna.load_study(study_name=n, storage=storage).trials) for n in names]}")
    doc = json.loads((tmp_path / "best.json").read_text())
    assert len(doc["entries"]) >= 1
