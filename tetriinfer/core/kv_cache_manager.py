"""Per-request block tables on top of a ``BlockPool``.

Owns the mapping request id -> list of block ids. A request's table covers token positions
``[0, len(table) * block_size)``; token ``t`` lives in block ``table[t // block_size]`` at offset
``t % block_size``.

With ``enable_prefix_caching`` (``core.prefix_cache``), a request about to be prefilled first takes the longest
cached run of full blocks that hold exactly its leading tokens (``match_prefix``: shared, reference-counted, never
written), and a scheduler names its newly full computed blocks after each step (``cache_computed``) so later
requests find them. A freed named block keeps its K/V until the pool reuses it (after every unnamed free block;
least recently freed first).

Invariants: every block in some table is used in the pool, and its reference count is the number of tables that
hold it (a block is in two tables only when it is a shared cached prefix block); ``free_request`` drops each of a
request's references exactly once; reservations (blocks promised to a request that has not arrived yet, as the
decode side does before a KV transfer) are ordinary tables; a match never covers a request's last token (a step
must compute at least one token to sample from).
"""

from __future__ import annotations

from tetriinfer.core.block_pool import BlockPool
from tetriinfer.core.prefix_cache import PrefixCache, block_digests
from tetriinfer.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self._tables: dict[str, list[int]] = {}
        # request -> its table as a tuple, made on first ask after a change (a decode step asks for every running
        # request's table, which grows one block per block_size tokens): dropped whenever the table changes
        self._frozen: dict[str, tuple[int, ...]] = {}
        self.prefix_cache: PrefixCache | None = None
        self._digests: dict[str, list[bytes]] = {}  # request -> chained digests of its full blocks known so far
        self._named: dict[str, int] = {}  # request -> how many of its leading blocks ``cache_computed`` named
        # request -> (tokens looked up, tokens found) by its last ``match_prefix``, until ``free_request``
        self._lookups: dict[str, tuple[int, int]] = {}
        if enable_prefix_caching:
            self.prefix_cache = PrefixCache()
            self.pool.on_reuse = self.prefix_cache.forget_block
            self.pool.is_cached = self.prefix_cache.is_named

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table as a tuple (the same blocks as ``block_table``; shared, never mutated)."""
        frozen = self._frozen.get(request_id)
        if frozen is None:
            frozen = self._frozen[request_id] = tuple(self._tables.get(request_id, ()))
        return frozen

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks needed so the request's table covers ``num_tokens`` token positions."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.pool.blocks_for_tokens(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(request_id, num_tokens) + reserve <= self.pool.num_free

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to cover ``num_tokens`` positions. All-or-nothing."""
        table = self._tables.get(request_id)
        # blocks_needed, inline: this runs once per running request per step
        need = -(-num_tokens // self.pool.block_size) - (len(table) if table is not None else 0)
        if need <= 0:
            if table is None:
                self._tables[request_id] = []
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        if table is None:
            self._tables[request_id] = blocks
        else:
            table.extend(blocks)
        self._frozen.pop(request_id, None)
        return True

    def grow(self, request_id: str, num_tokens: int) -> int:
        """``allocate_slots`` that returns how many blocks the request holds afterwards, or -1 when the pool could
        not supply them (nothing allocated then): one call per decode row instead of two."""
        table = self._tables.get(request_id)
        have = len(table) if table is not None else 0
        need = -(-num_tokens // self.pool.block_size) - have
        if need <= 0:
            if table is None:
                self._tables[request_id] = []
            return have
        blocks = self.pool.allocate(need)
        if blocks is None:
            return -1
        if table is None:
            self._tables[request_id] = blocks
        else:
            table.extend(blocks)
        self._frozen.pop(request_id, None)
        return have + need

    def free_request(self, request_id: str) -> int:
        """Free every block of the request; returns how many. Unknown ids free nothing. The tail goes to the
        free queue first, so a cached prefix's later blocks are reused before its earlier (more shared) ones."""
        self._digests.pop(request_id, None)
        self._named.pop(request_id, None)
        self._lookups.pop(request_id, None)
        self._frozen.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        self.pool.free(table[::-1])
        return len(table)

    # ---- prefix caching ------------------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    def _digests_for(self, req: Request, num_blocks: int) -> list[bytes]:
        known = self._digests.get(req.request_id, [])
        if len(known) < num_blocks:
            bs = self.block_size
            known = block_digests(req.token_ids_range(0, num_blocks * bs), bs, known)
            self._digests[req.request_id] = known
        return known[:num_blocks]

    def _cached_blocks(self, cache: PrefixCache, req: Request) -> list[int]:
        """The cached blocks holding the request's longest leading run of full blocks, up to its second-to-last
        token (its last token is always computed, to sample from)."""
        matchable = (req.num_tokens - 1) // self.block_size
        return cache.longest_match(self._digests_for(req, matchable)) if matchable else []

    def cached_prefix_tokens(self, req: Request) -> int:
        """How many leading tokens ``match_prefix`` would take from the cache for this request now, without
        taking them (no blocks pinned, no statistics): 0 without prefix caching or once the request holds
        blocks or computed tokens (its progress then shows in ``num_uncomputed_tokens``)."""
        cache = self.prefix_cache
        if cache is None or req.num_computed_tokens or self._tables.get(req.request_id):
            return 0
        return len(self._cached_blocks(cache, req)) * self.block_size

    def match_prefix(self, req: Request) -> int:
        """Before a request's first computed token here: take the cached blocks holding its longest leading run
        of full blocks (at most up to its second-to-last token) as its table, set ``num_computed_tokens`` to the
        tokens they cover and return that count. Does nothing (returns 0) without prefix caching, or when the
        request already holds blocks or has computed tokens."""
        cache = self.prefix_cache
        if cache is None or req.num_computed_tokens or self._tables.get(req.request_id):
            return 0
        blocks = self._cached_blocks(cache, req)
        cache.record_lookup(req.num_tokens, len(blocks) * self.block_size)
        self._lookups[req.request_id] = (req.num_tokens, len(blocks) * self.block_size)
        if not blocks:
            return 0
        for b in blocks:
            self.pool.acquire(b)
        self._tables[req.request_id] = blocks
        self._frozen.pop(req.request_id, None)
        self._named[req.request_id] = len(blocks)
        req.num_computed_tokens = len(blocks) * self.block_size
        return req.num_computed_tokens

    def unmatch_prefix(self, req: Request) -> None:
        """Undo ``match_prefix`` for a waiting request that was not admitted after all: free the blocks it
        matched, set ``num_computed_tokens`` back to 0, and take its lookup back out of the hit statistics (it is
        looked up again when next offered, so a request waiting through many steps counts once)."""
        looked = self._lookups.pop(req.request_id, None)
        if looked is not None and self.prefix_cache is not None:
            self.prefix_cache.record_lookup(-looked[0], -looked[1])
        self.free_request(req.request_id)
        req.num_computed_tokens = 0

    def cache_computed(self, req: Request) -> int:
        """Name the request's full blocks whose K/V are now computed (after a step), so later requests can match
        them; returns how many were newly named. Does nothing without prefix caching."""
        cache = self.prefix_cache
        table = self._tables.get(req.request_id)
        if cache is None or not table:
            return 0
        full = min(req.num_computed_tokens // self.block_size, len(table))
        done = self._named.get(req.request_id, 0)
        if full <= done:
            return 0
        digests = self._digests_for(req, full)
        named = sum(cache.register(table[i], digests[i]) for i in range(done, full))
        self._named[req.request_id] = full
        return named

    def prefix_cache_stats(self) -> dict[str, int]:
        """Cumulative lookups (prompt tokens looked up, tokens found) and blocks named now; zeros when disabled.
        Keys are the ``cluster_info()`` instance fields ``/metrics`` exports."""
        cache = self.prefix_cache
        if cache is None:
            return {"prefix_cache_hit_tokens": 0, "prefix_cache_queried_tokens": 0, "prefix_cache_blocks": 0}
        return {"prefix_cache_hit_tokens": cache.hit_tokens, "prefix_cache_queried_tokens": cache.queried_tokens,
                "prefix_cache_blocks": cache.num_cached_blocks}

    def request_ids(self) -> list[str]:
        return list(self._tables)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for rid, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {rid} holds a block twice")
            for b in table:
                if self.pool.ref_count(b) < 1:
                    raise AssertionError(f"request {rid} holds free block {b}")
                holders[b] = holders.get(b, 0) + 1
        if len(holders) != self.pool.num_used:
            raise AssertionError(f"{self.pool.num_used} used blocks but {len(holders)} in tables")
        for b, n in holders.items():
            if self.pool.ref_count(b) != n:
                raise AssertionError(f"block {b}: ref count {self.pool.ref_count(b)}, held by {n} tables")
            if n > 1 and (self.prefix_cache is None or self.prefix_cache.name_of(b) is None):
                raise AssertionError(f"block {b} is shared by {n} requests but is not a cached prefix block")
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
