"""Files replaced whole: a reader (another process, a later run) sees the old content or the new,
never half, and a failed write leaves no temporary behind; and one maker at a time for a file that
several processes may set out to make at once (`one_maker`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def atomic_write(path: Path, data: bytes, suffix: str = ".tmp", durable: bool = False) -> None:
    """Write `data` beside `path` under a unique temporary name ending in `suffix`, then move it
    over `path`. `durable`: the data and the rename are flushed to disk before returning (where
    the platform lets a directory be synced), for files a crash must not take back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    try:  # not possible everywhere (e.g. Windows)
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


@contextmanager
def one_maker(lock: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on the file `lock` (made if need be) for the block: processes
    about to make the same thing (a cubin, the C++ call path: every rank of a job launching the same
    kernel on its first call) make it one at a time, and those that waited find it made. Where no
    lock can be had (no fcntl, a read-only folder) the block runs unlocked: the lock saves work,
    correctness does not rest on it (what is made is replaced whole)."""
    try:
        import fcntl

        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:   # a filesystem that keeps no locks: unlocked
        pass
    try:
        yield
    finally:
        os.close(fd)   # closing releases the lock
