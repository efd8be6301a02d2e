"""Fixed-size KV block accounting (pure: no tensors).

A block holds the K/V of ``block_size`` consecutive tokens of one request (per layer, in the engine's
tensors). The pool only counts; it never touches memory.

Invariants (checked by ``check_invariants``):
- ``num_free + num_used == num_blocks`` at every point;
- a block is free iff its reference count is 0;
- ``allocate`` is all-or-nothing: it returns the full list or ``None`` and changes nothing.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each), or return ``None`` if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 return to the free list."""
        for b in blocks:
            rc = self._ref_counts[b]
            if rc <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._ref_counts[b] = rc - 1
            if rc == 1:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_invariants(self) -> None:
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("duplicate block in free list")
        for b, rc in enumerate(self._ref_counts):
            if rc < 0 or (rc == 0) != (b in free_set):
                raise AssertionError(f"block {b}: ref count {rc} disagrees with free list")
