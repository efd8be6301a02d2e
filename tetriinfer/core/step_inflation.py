"""How much batching slows each decode token: a decode instance's saturation, for the flip policy.

A decode instance steps back to back whenever it holds any request, so its busy fraction says nothing about
how loaded it is. What does: how much longer a step takes at the current batch than at batch 1. While decode is
memory-bound, adding a request is nearly free (the weights are read once per step either way) and the step time
barely moves; once it is compute-bound, every added request slows every other one.

``StepInflation`` observes decode steps (batch size, seconds; measured by the runtime, costed by the simulator)
and reports ``1 - t1 / mean seconds per decode step`` over the steps since the last report, where ``t1`` is the
fastest batch-1 decode-only step it has seen. In [0, 1]: ~0 when batching is free, -> 1 when each step is many
times a batch-1 step. 0 until a batch-1 step has been seen or when nothing ran in the window.

Colocated instances also feed it what their decodes wait through, so it measures TPOT inflation, not just batch
cost: a step that mixes prefill chunks with decode rows (Sarathi) counts whole (``decode_only=False``: it never
teaches ``t1``), and a prefill-only step while decodes are running (vLLM's prefill-first) is a ``stall``: its
seconds add to the window without a decode step (a window of stalls alone reads 1).

``decode_segments(out)`` / ``decode_rows(out)``: a step's decode rows. Pure: no clock; the caller passes the seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tetriinfer.core.request import Request
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput


class StepInflation:
    def __init__(self) -> None:
        self.t1: float | None = None  # fastest batch-1 decode step seen
        self._sum_s = 0.0
        self._steps = 0
        self._stalled = False  # a stall since the last take()

    def observe(self, batch: int, seconds: float, batch1_seconds: float | None = None,
                decode_only: bool = True) -> None:
        """One step advancing ``batch`` decode rows took ``seconds``. An executor that can cost a batch-1 decode
        step (the simulator) passes it as ``batch1_seconds``; otherwise ``t1`` is learned from batch-1 steps
        that were ``decode_only``."""
        if batch < 1 or seconds <= 0:
            return
        for t in (seconds if batch == 1 and decode_only else None, batch1_seconds):
            if t is not None and t > 0 and (self.t1 is None or t < self.t1):
                self.t1 = t
        self._sum_s += seconds
        self._steps += 1

    def observe_steps(self, batch: int, seconds: Sequence[float], batch1_seconds: Sequence[float]) -> None:
        """``observe(batch, seconds[i], batch1_seconds[i])`` for each ``i`` in order (decode-only steps of one
        batch: a steady decode run's), in one call: the same ``t1``, sums and counts, bit for bit."""
        if batch < 1:
            return
        t1, total, steps = self.t1, self._sum_s, self._steps
        own = batch == 1  # a batch-1 decode-only step teaches ``t1`` its own seconds
        for sec, one in zip(seconds, batch1_seconds, strict=True):
            if sec <= 0:
                continue
            if own and (t1 is None or sec < t1):
                t1 = sec
            if one is not None and one > 0 and (t1 is None or one < t1):
                t1 = one
            total += sec
            steps += 1
        self.t1, self._sum_s, self._steps = t1, total, steps

    def stall(self, seconds: float) -> None:
        """A step of ``seconds`` ran while decodes waited (no decode row in it)."""
        if seconds > 0:
            self._sum_s += seconds
            self._stalled = True

    def observe_colocated(self, out: SchedulerOutput, seconds: float, running: Iterable[Request],
                          batch1_seconds: float | None = None, rows: int | None = None) -> None:
        """A colocated instance's step (``running``: its running requests, read before ``update``): decode rows
        -> a decode step (whole seconds, prefill chunks included); none while some running request has output
        tokens -> a stall; a pure prefill step with no decode waiting counts for nothing. ``rows``: the step's
        ``decode_rows`` when the caller has counted them already."""
        if rows is None:
            rows = decode_rows(out)
        if rows:
            self.observe(rows, seconds, batch1_seconds, decode_only=out.is_decode_only)
        elif any(r.num_output_tokens for r in running):
            self.stall(seconds)

    @property
    def window_empty(self) -> bool:
        """Nothing observed (no step, no stall) since the last ``take``: ``take()`` would return 0.0 and change
        nothing."""
        return not self._steps and not self._stalled

    def take(self) -> float:
        """The window's inflation (see the module docstring); starts a new window."""
        steps, total, stalled = self._steps, self._sum_s, self._stalled
        self._steps, self._sum_s, self._stalled = 0, 0.0, False
        if self.t1 is None or not (steps or stalled):
            return 0.0
        if not steps:
            return 1.0  # decodes waited the whole window
        return min(1.0, max(0.0, 1.0 - self.t1 / (total / steps)))


def decode_segments(out: SchedulerOutput) -> list[ScheduledSegment]:
    """Segments of ``out`` that continue a request by one sampled token (decode rows)."""
    return [s for s in out.segments if s.num_tokens == 1 and s.start > 0 and s.sample]


def decode_rows(out: SchedulerOutput) -> int:
    return len(decode_segments(out))
