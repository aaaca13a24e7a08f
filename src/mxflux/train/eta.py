"""The training progress bar's time-remaining estimate: the mean speed over a long window.

A step's time is not steady: evaluations and checkpoints pause training every few hundred
steps, and on a shared machine the speed drifts with the load. An estimate from the speed of the
last few seconds (rich's default `TimeRemainingColumn` uses the steps of its last 30 s) swings
with every pause and every busy neighbour; on a loaded 2-core machine it said 3:47 left with about
8 minutes to go. The mean speed over the last `window_s` seconds (the whole run so far while it
is shorter) counts the pauses at their usual rate and averages the drift out.
"""

from __future__ import annotations

import collections

__all__ = ["SmoothedETA", "format_remaining"]


class SmoothedETA:
    """Steps per second over the last `window_s` seconds of (time, step) samples, and the time
    that leaves until an end step. Feed it `update(step, now)` at each progress update."""

    def __init__(self, window_s: float = 300.0):
        if window_s <= 0:
            raise ValueError(f"window_s: expected > 0, got {window_s}")
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, step: int, now: float) -> None:
        if self._samples and step < self._samples[-1][1]:
            self._samples.clear()  # the step went back (a new run in the same bar): start over
        self._samples.append((now, step))
        # Keep the newest sample at or before the window's start, so the window is always covered.
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def steps_per_s(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def remaining_s(self, end_step: int) -> float | None:
        speed = self.steps_per_s()
        if speed is None:
            return None
        return max(end_step - self._samples[-1][1], 0) / speed


def format_remaining(seconds: float | None) -> str:
    """H:MM:SS, as rich shows time; -:--:-- while unknown."""
    if seconds is None:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
