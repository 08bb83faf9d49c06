"""Stopping a run by signal without losing it: SIGINT or SIGTERM lets the current iteration finish
and checkpoint; a second signal, or any once nothing is left to save, stops at once (a reward
function that hangs must not need kill -9)."""

import contextlib
import signal
import threading


class TrainingInterrupted(SystemExit):
    """Raised after a SIGINT or SIGTERM once the current iteration is checkpointed; exits non-zero."""


class StoppedAtOnce(KeyboardInterrupt):
    """A signal the run could not wait for: it stops where it is."""


class Signals(list):
    """The names of the SIGINTs and SIGTERMs a run received, and ``at_once``: the message to stop
    at once with when nothing is left to save (None: finish the iteration)."""

    at_once = None


@contextlib.contextmanager
def stop_on_signals(stop: Signals):
    """While active, SIGINT and SIGTERM append their name to ``stop`` instead of killing the run,
    or stop it at once (see :class:`Signals`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(number, _frame):
        stop.append(signal.Signals(number).name)
        if stop.at_once:
            raise StoppedAtOnce(f"{stop.at_once} ({stop[-1]})")
        if len(stop) > 1:
            raise StoppedAtOnce(
                f"stopped at once by a second signal ({' then '.join(stop)}), without a checkpoint; "
                "the newest checkpoint is intact"
            )

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
