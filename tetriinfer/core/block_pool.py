"""Fixed-size KV block accounting (pure: no tensors).

A block holds the K/V of ``block_size`` consecutive tokens of one request (per layer, in the engine's
tensors) -- or, with prefix caching, of several requests that share those tokens (its reference count is how
many hold it). The pool only counts; it never touches memory.

Free blocks sit in three tiers, and ``allocate`` takes from the first non-empty one:
1. *hot*: freed blocks that hold nothing worth keeping, most recently freed first. Their memory has been written
   already, so reusing them costs no page faults (on CPU a never-touched 4 KiB page costs ~5-20 us to fault in,
   which is ms per request on the KV hand-off path) and they are likeliest to still be in cache.
2. *fresh*: blocks never allocated, lowest index first (one frontier index, no list).
3. *cached*: freed blocks that still hold the K/V of a cached prefix (``core.prefix_cache``; the ``is_cached``
   hook says which), least recently freed first. Such a block stays usable by a later request that shares the
   prefix (``acquire`` takes it back out) until ``allocate`` reuses it for other tokens, which first tells the
   ``on_reuse`` hook (the cache forgets it). So the cache evicts least recently used blocks first, only when no
   other free block is left, and never holds a block away from allocation.

Invariants (checked by ``check_invariants``):
- ``num_free + num_used == num_blocks`` at every point;
- every free block is in exactly one tier (fresh = indices from the frontier up, never allocated);
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
        self._hot: OrderedDict[int, None] = OrderedDict()  # tail: reused first
        self._frontier = 0  # blocks [frontier, num_blocks) were never allocated
        self._cached: OrderedDict[int, None] = OrderedDict()  # head: reused first (least recently freed)
        self.on_reuse: Callable[[int], None] | None = None  # called for each free block allocate() takes
        self.is_cached: Callable[[int], bool] | None = None  # does a block being freed hold K/V worth keeping?

    @property
    def num_free(self) -> int:
        return len(self._hot) + (self.num_blocks - self._frontier) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_never_used(self) -> int:
        """Blocks never allocated since the pool was made (their memory may not even be mapped yet)."""
        return self.num_blocks - self._frontier

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        if self._hot:
            return self._hot.popitem(last=True)[0]
        if self._frontier < self.num_blocks:
            self._frontier += 1
            return self._frontier - 1
        return self._cached.popitem(last=False)[0]

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each), hot ones first, then fresh, then cached (see the module
        docstring), or return ``None`` if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        hot, frontier = self._hot, self._frontier
        if len(hot) >= n:  # ``_take`` n times: all from the hot tier's tail
            blocks = [hot.popitem()[0] for _ in range(n)]
        elif not hot and self.num_blocks - frontier >= n:  # ... all fresh, lowest index first
            blocks = list(range(frontier, frontier + n))
            self._frontier = frontier + n
        else:
            blocks = [self._take() for _ in range(n)]
        refs, on_reuse = self._ref_counts, self.on_reuse
        if on_reuse is None:
            for b in blocks:
                refs[b] = 1
        else:
            for b in blocks:
                refs[b] = 1
                on_reuse(b)
        return blocks

    def acquire(self, block: int) -> None:
        """Add a reference to ``block`` whatever its state: a free (cached) block leaves its tier with its
        contents kept; a used one is shared."""
        if self._ref_counts[block] == 0:
            if block >= self._frontier:
                raise RuntimeError(f"acquire of never-allocated block {block}")
            if block in self._cached:
                del self._cached[block]
            else:
                del self._hot[block]
        self._ref_counts[block] += 1

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block. Blocks reaching 0 join the cached tier's tail in the order given (so
        a caller frees the blocks it would rather keep cached last) or, holding nothing cached, the hot tier, where
        the *last* given is reused first (a caller that frees a table tail first gets it back head first)."""
        cached, refs, hot = self.is_cached, self._ref_counts, self._hot
        for b in blocks:
            rc = refs[b]
            if rc <= 0:
                raise RuntimeError(f"double free of block {b}")
            refs[b] = rc - 1
            if rc == 1:
                if cached is not None and cached(b):
                    self._cached[b] = None
                else:
                    hot[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def is_free(self, block: int) -> bool:
        return self._ref_counts[block] == 0

    def check_invariants(self) -> None:
        if self._hot.keys() & self._cached.keys():
            raise AssertionError("a free block is in two tiers")
        for b, rc in enumerate(self._ref_counts):
            tiers = (b in self._hot) + (b in self._cached) + (b >= self._frontier)
            if rc < 0 or (rc == 0) != (tiers == 1) or tiers > 1:
                raise AssertionError(f"block {b}: ref count {rc} disagrees with the free tiers ({tiers})")
