"""Why a run stops before its end, and how: an interrupt, or a non-finite value.

Both stop a run without losing it (docs/design.md, "The trainer"): an interrupt finishes the
step and writes a checkpoint; a non-finite loss or gradient norm stops it before anything more
is written, so the last checkpoint on disk is a good one.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

__all__ = ["NonFiniteError", "TrainingInterrupted", "SignalFlag", "Interrupted", "signals_raise", "STOP_SIGNALS",
           "deliver_again_soon", "unsafe_to_raise"]

# What asks a run to stop: Ctrl-C, `kill`, and the terminal going away (a closed ssh session).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm stopped the run; nothing was written after it."""


class TrainingInterrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP stopped the run after a whole step and a checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} at step {step}; checkpoint {checkpoint}")

    @property
    def exit_code(self) -> int:
        """The shell's convention for death by a signal: 128 + its number (130 for SIGINT)."""
        return 128 + self.signum


class Interrupted(BaseException):
    """A stop signal outside the training steps (start-up, final sampling) or a second one during
    them: raised where the program is, like KeyboardInterrupt; the command reports it in one line."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def unsafe_to_raise(frame) -> bool:
    """Whether an exception raised by a signal handler in `frame` would be lost or abort the process:

    - no function of the program running, only a module's top level, where the interpreter is inside C
      code such as an extension that torch or numba is loading: the exception could unwind through C++
      that cannot pass it on (pybind11 aborts the process: "terminate called after throwing an instance
      of 'pybind11::error_already_set'", seen once in CI for a SIGINT 0.3 s into `mxflux train`);
    - the import machinery's own code or a `__del__`: Python runs its module-lock weakref callbacks and
      finalizers with exceptions ignored, so the stop would be printed as "Exception ignored in" and
      the command run on (seen in CI for a SIGINT 0.15 s and a SIGTERM 0.6 s into `mxflux train`).

    (Holding the signal back for every import would hold it through most of the start-up, whose imports
    are lazy, into the training steps: a module's own functions are safe.)"""
    if frame is None:
        return True
    code = frame.f_code
    return code.co_name in ("<module>", "__del__") or code.co_filename.startswith("<frozen importlib")


_DEFERRED_S: dict[int, float] = {}


def deliver_again_soon(signum: int, delay_s: float = 0.02, limit_s: float = 5.0) -> None:
    """The signal sent to this process once more after `delay_s`, for a handler that cannot act on it
    where it arrived: the handler then runs again wherever the program is by then. After `limit_s` of
    such waits (an import that does not end) the process ends at once, with one line."""
    waited = _DEFERRED_S.get(signum, 0.0)
    if waited >= limit_s:
        os.write(2, f"mxflux: interrupted ({signal.Signals(signum).name}) while loading; ended at once\n".encode())
        os._exit(128 + signum)
    _DEFERRED_S[signum] = waited + delay_s
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def _raise(signum, frame):
    if unsafe_to_raise(frame):
        deliver_again_soon(signum)
        return
    raise Interrupted(signum)


class signals_raise:
    """Within the block, each of STOP_SIGNALS raises Interrupted (the main thread only)."""

    def __enter__(self) -> "signals_raise":
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, _raise)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class SignalFlag:
    """Within the block, SIGINT, SIGTERM and SIGHUP set `signum` instead of killing the process. Only
    the first one: a second signal gets the previous handler, so a second Ctrl-C still stops a
    stuck run at once. Only the main thread can install handlers; elsewhere it does nothing."""

    SIGNALS = STOP_SIGNALS

    def __enter__(self) -> "SignalFlag":
        self.signum: int | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()
