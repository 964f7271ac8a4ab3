"""FLASHTUNE_RECORD and `tuner record`: every distinct problem the dispatcher meets, once, in a
file that survives a crash mid-write; `tuner search --recorded` reads exactly those."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tuner import recording
from tuner.dispatch import Dispatcher, Plan
from tuner.problem import Problem
from tuner.recording import Recorder, read_recorded

A = Problem(1, 32, 512, 8192, 128, "bf16", "causal_br", 8)
B = Problem(2, 16, 197, 197, 64, "fp16")


def test_each_problem_once_in_order_and_across_recorders(tmp_path):
    path = tmp_path / "rec.jsonl"
    r = Recorder(path)
    for p in (A, B, A, B):
        r.note(p)
    Recorder(path).note(A)   # another process starting later: already there
    lines = path.read_text().splitlines()
    assert [json.loads(x)["key"] for x in lines] == [A.key, B.key]
    assert read_recorded(path) == [A, B]


def test_a_torn_last_line_is_skipped_and_a_bad_one_named(tmp_path):
    path = tmp_path / "rec.jsonl"
    Recorder(path).note(A)
    with path.open("a") as f:
        f.write('{"key": "B2-H16-N197-D64-fp16-full", "problem": {"batch": 2, "hea')   # the crash
    assert read_recorded(path) == [A]
    Recorder(path).note(B)   # appends after the torn text: that line is bad now, and named
    with pytest.raises(ValueError, match=r"line 2 is not a recorded problem"):
        read_recorded(path)
    with pytest.raises(ValueError, match="no recording there"):
        read_recorded(tmp_path / "none.jsonl")


def test_the_dispatcher_records_what_it_plans(tmp_path, monkeypatch):
    """Once per shape and mask, whatever it then runs (here nothing: no GPU, the plan fails later)."""
    path = tmp_path / "rec.jsonl"
    monkeypatch.setenv(recording.ENV, str(path))
    monkeypatch.setattr(Dispatcher, "_plan", lambda self, problem, index: Plan(None, None))
    with FakeTensorMode():
        q, kv = torch.empty(1, 32, 512, 128, dtype=torch.bfloat16, device="cuda"), \
            torch.empty(1, 8, 8192, 128, dtype=torch.bfloat16, device="cuda")
    d = Dispatcher(tmp_path / "none.json")
    for _ in range(3):
        d.plan(q, kv, kv, "causal_br")
    d.plan(q, kv, kv, True)
    assert read_recorded(path) == [A, Problem(1, 32, 512, 8192, 128, "bf16", "causal", 8)]


def test_tuner_record_runs_the_program_and_search_reads_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        from tuner import recording
        from tuner.problem import Problem
        recording.note(Problem.from_key("{A.key}"))
        recording.note(Problem.from_key("{B.key}"))
        raise SystemExit(3)
    """))
    out_file = tmp_path / "rec.jsonl"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1")
    run = subprocess.run([sys.executable, "-m", "tuner.cli", "record", "-o", str(out_file), "--", sys.executable,
                          str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 3 and "2 new problem(s) recorded" in run.stdout, run.stderr
    assert read_recorded(out_file) == [A, B]
    run = subprocess.run([sys.executable, "-m", "tuner.cli", "search", "--recorded", str(out_file), "--replay",
                          str(tmp_path / "missing.db")], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no database at" in run.stderr   # read the recording, then the replay
