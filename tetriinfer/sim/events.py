"""The simulator's virtual clock: a heap of timed callbacks.

Invariants: ``now`` never decreases; events due at the same time run in the order they were scheduled
(a sequence number breaks ties), so a run is deterministic given its inputs; an event scheduled in the past
is refused (it would move time backwards); a cancelled ``Timer`` is dropped as if never scheduled.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Timer:
    """A cancellable event (``EventLoop.timer``): once cancelled it never runs, does not move ``now`` and is not
    counted."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn = self.fn
        if fn is not None:
            fn()

    def cancel(self) -> None:
        self.fn = None


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``when`` (>= now)."""
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now={self.now}")
        heapq.heappush(self._heap, (when, next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        heapq.heappush(self._heap, (self.now + delay, next(self._seq), fn))  # ``at``, inline: never in the past

    def timer(self, when: float, fn: Callable[[], None]) -> Timer:
        """``at``, cancellable."""
        t = Timer(fn)
        self.at(when, t)
        return t

    def reserve(self) -> int:
        """A place in the order of events: ``timer_reserved(when, place, fn)`` later runs ``fn`` where an event
        scheduled at ``when`` by ``at`` now (instead of later) would run among the events of that instant. The
        caller must schedule it before any event that it would precede has run (in practice: before the clock
        reaches ``when``)."""
        return next(self._seq)

    def timer_reserved(self, when: float, place: int, fn: Callable[[], None]) -> Timer:
        """``timer`` in the order ``place`` (from ``reserve``) holds."""
        t = Timer(fn)
        self.at_reserved(when, place, t)
        return t

    def at_reserved(self, when: float, place: int, fn: Callable[[], None]) -> None:
        """``at`` in the order ``place`` (from ``reserve``) holds (the caller's duty as for ``timer_reserved``)."""
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now={self.now}")
        heapq.heappush(self._heap, (when, place, fn))

    @property
    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, max_events: int | None = None) -> int:
        """Run events in time order until none is left, the next is after ``until`` (then ``now = until``), or
        ``max_events`` ran. Returns the number of events run."""
        ran = 0
        heap, pop = self._heap, heapq.heappop
        limit = float("inf") if until is None else until
        cap = float("inf") if max_events is None else max_events
        while heap:
            when = heap[0][0]
            if when > limit:
                self.now = max(self.now, limit)
                break
            if ran >= cap:
                break
            _, _, fn = pop(heap)
            if fn.__class__ is Timer and fn.fn is None:  # type: ignore[attr-defined]
                continue  # cancelled: no time passes for it
            self.now = when
            fn()
            ran += 1
        self.num_events += ran
        return ran
