"""Stopping a run by signal without losing it: SIGINT or SIGTERM lets the current iteration finish
and checkpoint; a second signal, or any once nothing is left to save, stops at once (a reward
function that hangs must not need kill -9).

Signals are counted where they are delivered, not where Python handles them. CPython runs a Python
handler in the main thread between two bytecodes, once however many copies of a signal arrived in
the meantime, and in signal-number order; a main thread inside one long C call (a backward of many
seconds, a reward stuck in C) runs none. So the C-level handler's byte for each delivery
(``signal.set_wakeup_fd``) is read by a thread of its own, which appends the names in the order
received. When that makes a stop at once, the thread signals the main thread to raise
:class:`StoppedAtOnce` (its ``finally`` blocks run, a caller can catch it); a main thread that does
not take it within ``GRACE_SECONDS`` is in C, and the process ends there and then: the message on
stderr, exit status 130. Checkpoints are written atomically and the run lock is an ``flock``, so
nothing is left half-written or held."""

import contextlib
import os
import signal
import sys
import threading

PROGRAM = "fastppo train"  # how the message of a stop at once starts, as the CLI's errors do
GRACE_SECONDS = 0.5  # how long a main thread has to take a stop at once before the process ends
EXIT_STATUS = 130  # as a shell reports a process stopped by SIGINT
HANDLED = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(SystemExit):
    """Raised after a SIGINT or SIGTERM once the current iteration is checkpointed; exits non-zero."""


class StoppedAtOnce(KeyboardInterrupt):
    """A signal the run could not wait for: it stops where it is."""


class Signals(list):
    """The names of the SIGINTs and SIGTERMs a run received, in the order received, and
    ``at_once``: the message to stop at once with when nothing is left to save (None: finish the
    iteration)."""

    at_once = None


def stop_message(stop: Signals):
    """The message to stop at once with after the signals of ``stop``, or None to go on."""
    if stop.at_once and stop:
        return f"{stop.at_once} ({stop[-1]})"
    if len(stop) > 1:
        return (
            f"stopped at once by a second signal ({' then '.join(stop)}), without a checkpoint; "
            "the newest checkpoint is intact"
        )
    return None


class _Watcher(threading.Thread):
    """Reads the wakeup pipe: each byte one delivered signal."""

    def __init__(self, stop: Signals, pipe: int):
        super().__init__(name="fastppo-signals", daemon=True)
        self.stop, self.pipe = stop, pipe
        self.message = None  # the stop at once the main thread is asked to raise
        self.raised = threading.Event()  # the main thread took it
        self.done = False  # the run left stop_on_signals (a 0 byte wakes the thread to see it)
        self.own = 0  # SIGINTs this thread sent the main thread, not yet read back

    def run(self):
        while not self.done:
            received = os.read(self.pipe, 64)
            for number in received:
                if number == signal.SIGINT and self.own:  # the one this thread sent the main thread
                    self.own -= 1
                elif number in HANDLED:
                    self.receive(signal.Signals(number).name)

    def receive(self, name: str):
        self.stop.append(name)
        message = stop_message(self.stop)
        if message is None:
            return
        if self.message is None:  # the first stop at once: the main thread may take it ...
            self.message = message
            self.own += 1  # a real signal, not interrupt_main: it also wakes a sleep or a wait
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            if self.raised.wait(GRACE_SECONDS):
                return
        elif self.raised.is_set():  # ... it did, and is unwinding: a further signal waits for it
            return
        # ... it is inside one long C call: end the process here
        try:
            sys.stderr.write(f"\n{PROGRAM}: {self.message}\n")  # a line of its own, after a progress bar's
            sys.stderr.flush()
        finally:
            os._exit(EXIT_STATUS)


@contextlib.contextmanager
def stop_on_signals(stop: Signals):
    """While active, SIGINT and SIGTERM append their name to ``stop`` instead of killing the run,
    or stop it at once (see :class:`Signals` and this module's docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # set_wakeup_fd's condition: a signal handler never blocks
    watcher = _Watcher(stop, read_end)

    def handle(_number, _frame):  # the main thread's turn: counting is the watcher's
        if watcher.message is not None and not watcher.raised.is_set():
            watcher.raised.set()
            raise StoppedAtOnce(watcher.message)

    previous = {sig: signal.getsignal(sig) for sig in HANDLED}
    for sig in HANDLED:
        signal.signal(sig, handle)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        watcher.done = True
        os.write(write_end, b"\0")
        watcher.join()
        os.close(write_end)
        os.close(read_end)
