"""Memory pool of the NIXL backend: large private blocks registered with NIXL once, carved into buffers.

Invariant: free lists are sorted by offset and coalesced; a block's `reg` is its NIXL registration (set by the
backend). No nixl import here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tetriinfer.transfer.freelist import FreeList

ALIGN = 4096  # pool allocations start on page boundaries


class Slab:
    """One NIXL-registered block of private memory that alloc() carves buffers from (first fit, coalescing)."""

    __slots__ = ("mem", "arr", "base", "size", "free", "reg")

    def __init__(self, size: int) -> None:
        self.mem = np.empty(size + ALIGN, np.uint8)
        skip = (-int(self.mem.ctypes.data)) % ALIGN
        self.arr = self.mem[skip:skip + size]
        self.base = int(self.arr.ctypes.data)
        self.size = size
        self.free = FreeList(size)
        self.reg: Any = None

    def take(self, nbytes: int) -> int | None:
        return self.free.take(nbytes)

    def give(self, off: int, nbytes: int) -> None:
        self.free.give(off, nbytes)
