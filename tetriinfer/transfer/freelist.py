"""First-fit free list over one contiguous byte range: the allocator behind the shm arena and the NIXL pool."""

from __future__ import annotations

import bisect


class FreeList:
    """Free spans of a ``size``-byte range, as sorted, coalesced ``(offset, nbytes)`` pairs.

    Invariants: spans never overlap and never touch (neighbours are merged on ``give``); ``idle`` holds exactly
    when every byte is free. The caller gives back exactly the (offset, nbytes) it took.
    """

    __slots__ = ("size", "spans")

    def __init__(self, size: int) -> None:
        self.size = size
        self.spans: list[tuple[int, int]] = [(0, size)]

    @property
    def idle(self) -> bool:
        return self.spans == [(0, self.size)]

    def take(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` taken from the first span that fits, or None when none does."""
        for i, (off, size) in enumerate(self.spans):
            if size >= nbytes:
                if size == nbytes:
                    del self.spans[i]
                else:
                    self.spans[i] = (off + nbytes, size - nbytes)
                return off
        return None

    def give(self, off: int, nbytes: int) -> None:
        """Return a taken range, merging it with free neighbours."""
        spans = self.spans
        i = bisect.bisect_left(spans, (off, 0))
        if i < len(spans) and spans[i][0] == off + nbytes:  # merge with the next free span
            nbytes += spans[i][1]
            del spans[i]
        if i > 0 and spans[i - 1][0] + spans[i - 1][1] == off:  # merge with the previous one
            off, nbytes = spans[i - 1][0], spans[i - 1][1] + nbytes
            del spans[i - 1]
            i -= 1
        spans.insert(i, (off, nbytes))
