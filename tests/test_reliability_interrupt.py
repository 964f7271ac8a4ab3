"""SIGINT / SIGTERM at random moments of a replay search (CPU): after every kill the process has
exited non-zero with one line and no traceback, the DB is intact and consistent, Optuna holds no
RUNNING trial; the same command run to the end resumes the study and re-measures nothing."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna

from tuner.records import STATUSES

FIXTURE = Path(__file__).parent / "fixtures" / "h100_simt.db"
SHAPE = "2,4,512,64,causal"
TRIALS = 60



def _cmd(tmp: Path) -> list[str]:
    return [sys.executable, "-m", "tuner.cli", "search", "--replay", f"sqlite:///{tmp / 'replay.db'}",
            "--shape", SHAPE, "--trials", str(TRIALS), "--no-peers", "--db", f"sqlite:///{tmp / 'r.db'}",
            "--lookup", str(tmp / "b.json")]


def _env(delay: float) -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1", COLUMNS="200", TUNER_REPLAY_DELAY=str(delay))


def check_db(path: Path) -> dict:
    """Integrity, statuses, no duplicate point, no RUNNING trial. Returns facts for later checks."""
    c = sqlite3.connect(path)
    try:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert c.execute("PRAGMA foreign_key_check").fetchall() == []
        statuses = {s for (s,) in c.execute("SELECT DISTINCT status FROM ft_measurements")}
        assert statuses <= set(STATUSES), statuses
        dups = c.execute("""SELECT config_id, problem_id, gpu_id, versions_key, COUNT(*) FROM ft_measurements
                            GROUP BY config_id, problem_id, gpu_id, versions_key HAVING COUNT(*) > 1""").fetchall()
        assert dups == [], dups
        running = c.execute("SELECT number FROM trials WHERE state = 'RUNNING'").fetchall() if _has(c, "trials") else []
        assert running == [], f"trials left RUNNING: {running}"
        configs = {p for (p,) in c.execute("SELECT c.params_json FROM ft_measurements m JOIN ft_configs c "
                                           "ON c.id = m.config_id")}
        last = c.execute("SELECT MAX(number) FROM trials").fetchone()[0] if _has(c, "trials") else None
        rows = c.execute("SELECT COUNT(*) FROM ft_measurements").fetchone()[0] if _has(c, "ft_measurements") else 0
        return {"configs": configs, "last_trial": -1 if last is None else last, "rows": rows}
    finally:
        c.close()


def _has(c: sqlite3.Connection, table: str) -> bool:
    return c.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone() is not None


def test_kill_at_random_moments_then_resume(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "replay.db")  # never the committed file in place
    (tmp_path / "replay.db").chmod(0o644)
    rng = random.Random(4)
    kills = [(signal.SIGINT if i % 2 else signal.SIGTERM, rng.uniform(0.3, 2.0)) for i in range(6)]
    interrupted, rows_before = 0, 0
    for sig, delay in kills:
        p = subprocess.Popen(_cmd(tmp_path), env=_env(0.15), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=tmp_path)
        first = p.stdout.readline()  # the search has started (the handler is installed well before)
        assert first.startswith("tuning"), first
        time.sleep(delay)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        if p.returncode == 0:  # it finished before the signal: nothing to check but the DB
            check_db(tmp_path / "r.db")
            continue
        interrupted += 1
        assert p.returncode == 128 + sig, (p.returncode, err)
        assert "Traceback" not in err + out
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"interrupted ({sig.name})"), err
        facts = check_db(tmp_path / "r.db")
        assert facts["rows"] >= rows_before  # nothing lost
        rows_before = facts["rows"]
        assert not list(tmp_path.glob(".b.json.*.tmp"))  # no half-written lookup left behind
    assert interrupted >= 4, "the signals kept missing the search"

    before = check_db(tmp_path / "r.db")
    done = subprocess.run(_cmd(tmp_path), env=_env(0), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    after = check_db(tmp_path / "r.db")

    study = optuna.load_study(study_name=_study_name(tmp_path), storage=f"sqlite:///{tmp_path / 'r.db'}")
    trials = study.trials
    counted = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("counted")]
    assert len(counted) == TRIALS
    assert len({json.dumps(t.params, sort_keys=True) for t in counted}) == TRIALS
    # (a signal landing between trials stops at a checkpoint, with no trial open: no FAIL needed)
    # the last run measured only points nobody had stored before it; the rest came from the DB
    last_run = [t for t in trials if t.number > before["last_trial"]]
    measured = [t for t in last_run if t.user_attrs.get("source") == "measured"]
    assert all(json.dumps(t.params, sort_keys=True, separators=(",", ":")) not in before["configs"] for t in measured)
    assert after["configs"] >= before["configs"]
    assert len(measured) < TRIALS  # the kills' work was reused
    assert after["rows"] == len(after["configs"])  # one row per point: nothing measured twice
    assert json.loads((tmp_path / "b.json").read_text())["entries"]
    fails = sum(t.state == optuna.trial.TrialState.FAIL for t in trials)
    print(f"\n{len(kills)} signals, {interrupted} landed mid-search; {fails} trials FAIL, 0 RUNNING; "
          f"{before['rows']} rows before the last run, {after['rows']} after, {len(measured)} measured by it; "
          f"{len(counted)} counted trials")


def _study_name(tmp: Path) -> str:
    (name,) = optuna.get_all_study_names(f"sqlite:///{tmp / 'r.db'}")
    return name


def test_a_signal_after_the_command_ended_is_ignored():
    """Once the CLI's command has returned, SIGINT and SIGTERM until the process exits are ignored:
    one arriving during the teardown (worker pool, interpreter) once made a finished search die of
    SIGINT (exit -2) in CI."""
    code = textwrap.dedent("""
        import os, signal, sys
        from tuner import cli
        sys.argv = ["tuner", "--help"]
        try:
            cli.main()
        except SystemExit as exc:
            assert not exc.code, exc.code
        print(all(signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)))
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        print("still here")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.splitlines()[-2:] == ["True", "still here"], r.stdout


def test_kill_9_leaves_no_trial_running_for_good(tmp_path):
    """SIGKILL gives the search no chance to tell its trial FAIL: the trial's heartbeat stops, and
    the next search of the study fails it once the grace period has passed (aged here)."""
    from tuner.search import GRACE_S

    shutil.copy(FIXTURE, tmp_path / "replay.db")
    (tmp_path / "replay.db").chmod(0o644)
    p = subprocess.Popen(_cmd(tmp_path), env=_env(5.0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path)
    assert p.stdout.readline().startswith("tuning")
    time.sleep(2.0)  # the first trial is in flight: each answer takes 5 s
    p.kill()
    p.communicate(timeout=60)
    c = sqlite3.connect(tmp_path / "r.db")
    running = [n for (n,) in c.execute("SELECT trial_id FROM trials WHERE state = 'RUNNING'")]
    assert running, "the kill landed outside a trial"
    beats = dict(c.execute("SELECT trial_id, heartbeat FROM trial_heartbeats"))
    assert set(running) <= set(beats)
    c.execute("UPDATE trial_heartbeats SET heartbeat = datetime(heartbeat, ?)", (f"-{GRACE_S + 1} seconds",))
    c.commit()
    c.close()
    done = subprocess.run(_cmd(tmp_path), env=_env(0), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    check_db(tmp_path / "r.db")  # no trial RUNNING
    c = sqlite3.connect(tmp_path / "r.db")
    states = dict(c.execute(f"SELECT trial_id, state FROM trials WHERE trial_id IN ({','.join('?' * len(running))})",
                            running))
    c.close()
    assert set(states.values()) == {"FAIL"}, states
