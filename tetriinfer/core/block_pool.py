"""Fixed-size KV block accounting (pure: no tensors).

A block holds the K/V of ``block_size`` consecutive tokens of one request (per layer, in the engine's
tensors) -- or, with prefix caching, of several requests that share those tokens (its reference count is how
many hold it). The pool only counts; it never touches memory.

The free blocks form one least-recently-freed queue: ``allocate`` takes from its head, ``free`` appends at its
tail. A free block may still hold the K/V of a cached prefix (``core.prefix_cache``): it stays usable by a later
request that shares that prefix (``acquire`` takes it back out of the queue) until ``allocate`` reuses it for
other tokens, which first tells the ``on_reuse`` hook (the cache forgets it). So the cache evicts least recently
used blocks first and never holds a block away from allocation.

Invariants (checked by ``check_invariants``):
- ``num_free + num_used == num_blocks`` at every point;
- a block is free iff its reference count is 0;
- ``allocate`` is all-or-nothing: it returns the full list or ``None`` and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head: reused first
        self.on_reuse: Callable[[int], None] | None = None  # called for each free block allocate() takes

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each), least recently freed first, or return ``None`` if fewer
        are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
            if self.on_reuse is not None:
                self.on_reuse(b)
        return blocks

    def acquire(self, block: int) -> None:
        """Add a reference to ``block`` whatever its state: a free (cached) block leaves the free queue with
        its contents kept; a used one is shared."""
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the tail of the free queue, in the order
        given (so a caller frees the blocks it would rather keep cached last)."""
        for b in blocks:
            rc = self._ref_counts[b]
            if rc <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._ref_counts[b] = rc - 1
            if rc == 1:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def is_free(self, block: int) -> bool:
        return self._ref_counts[block] == 0

    def check_invariants(self) -> None:
        for b, rc in enumerate(self._ref_counts):
            if rc < 0 or (rc == 0) != (b in self._free):
                raise AssertionError(f"block {b}: ref count {rc} disagrees with free list")
