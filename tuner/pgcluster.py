"""A throwaway PostgreSQL cluster on a loopback port, for the tests and the queue benchmark.

The fleet is meant for one PostgreSQL server shared by many hosts; the tests and
benchmarks/queue_throughput.py need a real one without anyone installing or configuring it by hand.
This runs the server binaries that Debian's `postgresql` package (or any install on PATH) ships:
initdb into a temporary folder, trust authentication on 127.0.0.1 only, the unix socket in that
folder, no fsync (nothing here outlives the run). initdb refuses to run as root, so as root the
server runs as `nobody`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

USER = "flashtune"


def find_bindir() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres: PATH first, then Debian's versioned
    /usr/lib/postgresql/<major>/bin (the newest), which Debian keeps off PATH."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3])
                  if Path(p).parts[-3].isdigit() else 0)
    return Path(dirs[-1]).parent if dirs else None


def unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    if find_bindir() is None:
        return ("no PostgreSQL server binaries (initdb) on PATH or in /usr/lib/postgresql/*/bin: install "
                "Debian's `postgresql` package (.ci/run does)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the psycopg driver is not installed: pip install 'flashtune[postgres]'"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without `runuser`: initdb refuses root and cannot be run as another user"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """A running server: `url(db)` names one of its databases, `create_database()` makes a fresh one."""

    root: Path
    port: int
    bindir: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, prefix: str = "t") -> str:
        """A new empty database (one per test: no state leaks between them); its URL."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, dbname="postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        _run_as_owner([str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop"],
                      check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _run_as_owner(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a server binary as ourselves, or as `nobody` when we are root."""
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "nobody", "--", *cmd]
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=120)


def start(max_connections: int = 300) -> Cluster:
    """initdb and start a server on a free loopback port (three ports tried); raises RuntimeError
    with the server's log where it cannot start."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    bindir = find_bindir()
    assert bindir is not None
    root = Path(tempfile.mkdtemp(prefix="flashtune-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "nobody")
    try:
        _run_as_owner([str(bindir / "initdb"), "-D", str(root / "data"), "-A", "trust", "-U", USER, "-E", "UTF8",
                       "--no-sync", "--locale=C"])
        for _ in range(3):
            port = _free_port()
            opts = (f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
                    f"-c full_page_writes=off -c max_connections={max_connections}")
            r = _run_as_owner([str(bindir / "pg_ctl"), "-D", str(root / "data"), "-o", opts, "-l",
                               str(root / "server.log"), "-w", "-t", "60", "start"], check=False)
            if r.returncode == 0:
                return Cluster(root, port, bindir)
        log = (root / "server.log").read_text(errors="replace")[-2000:] if (root / "server.log").exists() else ""
        raise RuntimeError(f"the PostgreSQL server did not start: {r.stderr.strip()} {log}")
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


@contextlib.contextmanager
def running(max_connections: int = 300) -> Iterator[Cluster]:
    cluster = start(max_connections)
    try:
        yield cluster
    finally:
        cluster.stop()
