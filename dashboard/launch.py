"""How the dashboard's server is started: one home for `tuner dashboard`, the browser test and the
screenshot script, so all three serve the same app with the same options."""

from __future__ import annotations

import sys
from pathlib import Path

APP = Path(__file__).with_name("app.py")

# A results browser, not an app being written: no Deploy button, no rerun/settings menu
# ("viewer" keeps only what a reader needs); no usage statistics; never a browser of its own.
SERVER_OPTIONS = {
    "server.headless": "true",
    "browser.gatherUsageStats": "false",
    "client.toolbarMode": "viewer",
}


def streamlit_command(db_url: str, port: int, address: str = "127.0.0.1") -> list[str]:
    """`python -m streamlit run app.py` on `address:port` over `db_url` (passed after `--`)."""
    options = {**SERVER_OPTIONS, "server.port": str(port), "server.address": address}
    flags = [part for name, value in options.items() for part in (f"--{name}", value)]
    return [sys.executable, "-m", "streamlit", "run", str(APP), *flags, "--", "--db", db_url]
