"""Files replaced whole: a reader (another process, a later run) sees the old content or the new,
never half, and a failed write leaves no temporary behind."""

from __future__ import annotations

import os
import tempfile
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
