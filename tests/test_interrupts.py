"""tuner.interrupts on its own: which signals are held, which go through, and the bookkeeping after
a signal lands in a context manager's entry (the process-level behaviour is in
test_reliability_interrupt.py)."""

from __future__ import annotations

import signal

import pytest

from tuner import interrupts


@pytest.fixture(autouse=True)
def handler():
    assert interrupts.install()
    yield
    interrupts.uninstall()


def test_a_signal_in_deferred_is_held_to_the_end_of_the_block():
    reached = False
    with pytest.raises(interrupts.Interrupted) as exc:
        with interrupts.deferred():
            signal.raise_signal(signal.SIGTERM)
            assert interrupts.pending() == signal.SIGTERM
            reached = True
    assert reached and exc.value.exit_code == 128 + signal.SIGTERM
    assert interrupts.pending() is None


def test_allowed_lets_a_signal_through_and_raises_a_held_one_on_entry():
    with interrupts.deferred():
        with pytest.raises(interrupts.Interrupted):
            with interrupts.allowed():
                signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # held again once the window has closed
        with pytest.raises(interrupts.Interrupted):
            with interrupts.allowed():
                pytest.fail("the held signal should have been raised on entering the window")


def _enter_then_signal(cm) -> None:
    cm.__enter__()
    signal.raise_signal(signal.SIGINT)  # lands before a `with` would have registered __exit__


def test_a_signal_between_allowed_entry_and_its_with_leaves_the_depth_right():
    """CI once printed a traceback at exit from such an abandoned window (a @contextmanager
    generator finalized after the module's globals were gone), and it had left the nesting count
    at -1, so the next bookkeeping block would no longer hold a signal."""
    with interrupts.deferred():
        with pytest.raises(interrupts.Interrupted):
            _enter_then_signal(interrupts.allowed())
    try:
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            assert interrupts.pending() == signal.SIGINT  # still held
            interrupts.uninstall()  # drop it: the point was that it was held
    except interrupts.Interrupted:
        pytest.fail("a signal inside deferred() went straight through")
