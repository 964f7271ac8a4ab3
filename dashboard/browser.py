"""The dashboard in a real headless Chromium: serve the app over a database on a loopback port,
load a page by its URL, keep its DOM and a screenshot once it has rendered. One home for the
browser test and benchmarks/dashboard_screenshots.py.

Streamlit draws a page client-side over a websocket, so a DOM read right after load is only the
skeleton, and Chromium's virtual time budget runs out before a slow server answers. Chromium is
driven over its DevTools protocol instead (`websockets`, a dependency of Streamlit's): navigate,
read the DOM until the page says it is done (the script stopped, the page's own text there, its
charts drawn), then take the screenshot.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tuner.dashboard.launch import streamlit_command

CHROMIUM = Path("/usr/bin/chromium")
WINDOW = (1500, 1100)
EXCEPTION_MARKS = ('data-testid="stException"', "Traceback (most recent call last)")


class RenderError(RuntimeError):
    """The server, the browser or a page did not come up; `dom` is the page's last DOM, if any."""

    def __init__(self, message: str, dom: str = "") -> None:
        super().__init__(message)
        self.dom = dom


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RenderError(f"streamlit exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RenderError(f"streamlit was not healthy after {timeout:.0f} s:\n{log.read_text()}")


def _stop(proc: subprocess.Popen) -> None:
    """End a process started in a session of its own, and its children, and nothing else."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def serve(db_url: str, workdir: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """`tuner dashboard`'s command on a free loopback port; yields the base URL. The server runs
    in a session of its own and only it is stopped afterwards."""
    port = _free_port()
    log = workdir / "streamlit.log"
    with log.open("w") as out:
        proc = subprocess.Popen(streamlit_command(db_url, port), stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=workdir, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}/"
        _wait_healthy(base + "_stcore/health", proc, log)
        yield base
    finally:
        _stop(proc)


class Page:
    """One Chromium tab over the DevTools protocol: navigate, read the DOM, take a screenshot."""

    def __init__(self, ws: Any) -> None:
        self._ws, self._ids = ws, itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        self._ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:  # events arrive in between; the answer carries our id
            msg = json.loads(self._ws.recv(timeout=60))
            if msg.get("id") == n:
                if "error" in msg:
                    raise RenderError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def dom(self) -> str:
        return self.call("Runtime.evaluate", expression="document.documentElement.outerHTML")["result"]["value"]

    def load(self, url: str, ready: Callable[[str], bool], timeout: float = 120) -> str:
        """Open `url` and wait until ready(dom); returns that DOM. Raises RenderError with the
        last DOM if the page never is."""
        self.call("Page.navigate", url=url)
        end, dom = time.monotonic() + timeout, ""
        while time.monotonic() < end:
            time.sleep(0.5)
            dom = self.dom()
            if ready(dom):
                time.sleep(1)  # Plotly's last layout pass
                return self.dom()
        raise RenderError(f"{url} did not render in {timeout:.0f} s", dom)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


@contextmanager
def chromium(size: tuple[int, int] = WINDOW) -> Iterator[Page]:
    """A headless Chromium of its own (profile in a temporary folder) and one tab in it."""
    from websockets.sync.client import connect

    profile = Path(tempfile.mkdtemp(prefix="ft-chromium-"))
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1", f"--user-data-dir={profile}",
           f"--window-size={size[0]},{size[1]}", "about:blank"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file, end = profile / "DevToolsActivePort", time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > end:
                raise RenderError(f"chromium gave no DevTools port (exit code {proc.poll()})")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            target = next(t for t in json.load(r) if t["type"] == "page")
        with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
            page = Page(ws)
            page.call("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1], deviceScaleFactor=1,
                      mobile=False)
            yield page
    finally:
        _stop(proc)
        shutil.rmtree(profile, ignore_errors=True)


def rendered(dom: str, text: str, charts: int = 0) -> bool:
    """The script has stopped, `text` is on the page, and at least `charts` Plotly charts are drawn."""
    return ('data-test-script-state="notRunning"' in dom and text in dom
            and dom.count('class="js-plotly-plot"') >= charts)


def exceptions_shown(dom: str) -> list[str]:
    """The marks of an exception drawn on the page (Streamlit's exception box, a traceback)."""
    return [m for m in EXCEPTION_MARKS if m in dom]
