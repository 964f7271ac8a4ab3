"""Files replaced whole: a reader (another process, a later run) sees the old content or the new,
never half, and a failed write leaves no temporary behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes, suffix: str = ".tmp") -> None:
    """Write `data` beside `path` under a unique temporary name ending in `suffix`, then move it
    over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
