"""SIGINT and SIGTERM during a search: stop cleanly, never half-way through bookkeeping.

`install()` (the CLI calls it first thing) turns both signals into `Interrupted`, a
KeyboardInterrupt that remembers its signal. The search wraps its bookkeeping (Optuna ask/tell,
DB writes) in `deferred()`: a signal arriving there is held and raised when the block ends, or at
the next `checkpoint()`, or on entering an `allowed()` window. The only windows are around the
runner's measurement (seconds to minutes on a GPU), so a signal stops a measurement at once, and
the search's `except` marks that trial FAIL before the interrupt goes on up.

So a trial is never left RUNNING by SIGINT/SIGTERM, and a DB transaction is committed whole or not
at all (SQLite's atomic commit does the rest). Only SIGKILL can leave a RUNNING trial behind; the
search counts COMPLETE trials only, so a resumed study is not misled by it.

Without `install()` (a library user, a non-main thread) the blocks cost a counter and do nothing.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM; `exit_code` is the shell's convention, 128 + signal number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State(threading.local):
    depth = 0
    pending: int | None = None


_state = _State()
_installed = False
last: Interrupted | None = None  # the latest one raised: typer turns it into Exit(130), the CLI asks here


def _raise(signum: int) -> None:
    global last
    last = Interrupted(signum)
    raise last


def _handler(signum, frame) -> None:
    if threading.current_thread() is not threading.main_thread():  # pragma: no cover
        return
    if _state.depth > 0:
        if _state.pending is None:
            _state.pending = signum
        return
    _raise(signum)


def install() -> bool:
    """Route SIGINT/SIGTERM through the handler (main thread only). True if installed."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return False
    for s in SIGNALS:
        signal.signal(s, _handler)
    _installed = True
    return True


def finish() -> None:
    """The command has ended, its results stored or its error reported: SIGINT and SIGTERM are
    ignored from here to the process's exit. A signal during that teardown (the worker pool's
    shutdown, the interpreter's) would otherwise escape as a KeyboardInterrupt outside the CLI's
    handling, and Python then dies of SIGINT (exit -2) after a run that had finished."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def uninstall() -> None:
    global _installed
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _installed = False
    _state.depth, _state.pending = 0, None


def _raise_pending() -> None:
    signum, _state.pending = _state.pending, None
    if signum is not None:
        _raise(signum)


def checkpoint() -> None:
    """Raise a held signal now (call where nothing is half done)."""
    if _state.depth <= 1:  # not nested inside a critical section
        _raise_pending()


class deferred:
    """Hold signals until the block ends; nests.

    The context managers here are classes, not @contextmanager generators: a signal landing
    between a generator's yield and the `with` body leaves the generator suspended, and the
    interpreter finalizes it at exit, after this module's globals are gone, printing a traceback
    (seen once in CI). `__exit__` also puts back the depth it found instead of counting down, so a
    signal that escaped an inner `allowed()` before its `__exit__` was registered cannot leave the
    count wrong for the bookkeeping that follows."""

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        self._saved = _state.depth
        _state.depth = self._saved + 1

    def __exit__(self, *exc) -> None:
        _state.depth = self._saved
        if self._saved == 0 and _state.pending is not None:
            _raise_pending()


class allowed:
    """Inside a deferred() block: let signals through (a held one is raised on entry)."""

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        self._saved = _state.depth
        _state.depth = 0
        try:
            _raise_pending()
        except BaseException:
            _state.depth = self._saved
            raise

    def __exit__(self, *exc) -> None:
        _state.depth = self._saved


def pending() -> int | None:
    return _state.pending
