"""How much batching slows each decode token: a decode instance's saturation, for the flip policy.

A decode instance steps back to back whenever it holds any request, so its busy fraction says nothing about
how loaded it is. What does: how much longer a step takes at the current batch than at batch 1. While decode is
memory-bound, adding a request is nearly free (the weights are read once per step either way) and the step time
barely moves; once it is compute-bound, every added request slows every other one.

``StepInflation`` observes decode-only steps (batch size, seconds; measured by the runtime, costed by the
simulator) and reports ``1 - t1 / mean step time`` over the steps since the last report, where ``t1`` is the
fastest batch-1 decode step it has seen. In [0, 1]: ~0 when batching is free, -> 1 when each step is many times
a batch-1 step. 0 until a batch-1 step has been seen or when no step ran in the window.

Pure: no clock; the caller passes the seconds.
"""

from __future__ import annotations


class StepInflation:
    def __init__(self) -> None:
        self.t1: float | None = None  # fastest batch-1 decode step seen
        self._sum_s = 0.0
        self._steps = 0

    def observe(self, batch: int, seconds: float, batch1_seconds: float | None = None) -> None:
        """One decode-only step of ``batch`` rows took ``seconds``. An executor that can cost the same step at
        batch 1 (the simulator) passes it as ``batch1_seconds``; the runtime learns ``t1`` from batch-1 steps."""
        if batch < 1 or seconds <= 0:
            return
        for t in (seconds if batch == 1 else None, batch1_seconds):
            if t is not None and t > 0 and (self.t1 is None or t < self.t1):
                self.t1 = t
        self._sum_s += seconds
        self._steps += 1

    def take(self) -> float:
        """The window's inflation (see the module docstring); starts a new window."""
        steps, total = self._steps, self._sum_s
        self._steps, self._sum_s = 0, 0.0
        if not steps or self.t1 is None:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.t1 / (total / steps)))
