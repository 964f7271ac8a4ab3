"""Recording the attention problems a program meets, so that `tuner search --recorded FILE` tunes
exactly those.

With FLASHTUNE_RECORD=FILE in the environment (`tuner record -- python train.py` sets it), the
dispatcher appends each distinct problem it plans for to FILE as one JSON line. The dispatcher
plans once per shape, so this costs nothing on the hot path. Appends are one write(2) of one line
to a file opened O_APPEND, so lines from several processes never interleave, and a crash leaves at
most a torn last line, which reading skips. Problems already in the file are not written again.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from .problem import Problem

ENV = "FLASHTUNE_RECORD"


class Recorder:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._seen = {p.key for p in read_recorded(self.path, missing_ok=True)}
        self._lock = threading.Lock()

    def note(self, problem: Problem) -> None:
        with self._lock:
            if problem.key in self._seen:
                return
            self._seen.add(problem.key)
            line = json.dumps({"key": problem.key, "problem": problem.to_dict()}, sort_keys=True) + "\n"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)


_recorder: Recorder | None = None
_recorder_lock = threading.Lock()


def note(problem: Problem) -> None:
    """Record `problem` where FLASHTUNE_RECORD names a file (the dispatcher calls this once per
    shape). A file that cannot be written is the program's problem only once: recording stops."""
    global _recorder
    path = os.environ.get(ENV)
    if not path:
        return
    with _recorder_lock:
        if _recorder is None or _recorder.path != Path(path):
            _recorder = Recorder(path)
    try:
        _recorder.note(problem)
    except OSError as exc:
        import warnings

        warnings.warn(f"flashtune: cannot record to {path} ({exc.strerror or exc}); recording stops", stacklevel=3)
        os.environ.pop(ENV, None)


def read_recorded(path: str | os.PathLike[str], *, missing_ok: bool = False) -> list[Problem]:
    """The distinct problems of a recording, in the order first met. A torn last line (a crash
    mid-write) is skipped; any other bad line is one ValueError naming it."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").split("\n")
    except FileNotFoundError:
        if missing_ok:
            return []
        raise ValueError(f"{p}: no recording there (run your program under `tuner record -o {p} -- ...`)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: cannot read the recording: {e}") from None
    out: dict[str, Problem] = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            problem = Problem.from_dict(json.loads(line)["problem"])
        except (ValueError, KeyError, TypeError) as e:
            if i == len(lines):   # no newline after it: a write cut short
                break
            raise ValueError(f"{p}: line {i} is not a recorded problem ({str(e).splitlines()[0] if str(e) else e})") from None
        out.setdefault(problem.key, problem)
    return list(out.values())
