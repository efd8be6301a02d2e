"""Per-request block tables on top of a ``BlockPool``.

Owns the mapping request id -> list of block ids. A request's table covers token positions
``[0, len(table) * block_size)``; token ``t`` lives in block ``table[t // block_size]`` at offset
``t % block_size``.

Invariants: every block in some table is used in the pool; ``free_request`` returns all of a request's
blocks exactly once; reservations (blocks promised to a request that has not arrived yet, as the
decode side does before a KV transfer) are ordinary tables.
"""

from __future__ import annotations

from tetriinfer.core.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self._tables: dict[str, list[int]] = {}

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
        need = self.blocks_needed(request_id, num_tokens)
        if need == 0:
            self._tables.setdefault(request_id, [])
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        self._tables.setdefault(request_id, []).extend(blocks)
        return True

    def free_request(self, request_id: str) -> int:
        """Free every block of the request; returns how many. Unknown ids free nothing."""
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        self.pool.free(table)
        return len(table)

    def request_ids(self) -> list[str]:
        return list(self._tables)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        seen: set[int] = set()
        for rid, table in self._tables.items():
            for b in table:
                if b in seen:
                    raise AssertionError(f"block {b} in two tables (request {rid})")
                if self.pool.ref_count(b) < 1:
                    raise AssertionError(f"request {rid} holds free block {b}")
                seen.add(b)
        if len(seen) != self.pool.num_used:
            raise AssertionError(f"{self.pool.num_used} used blocks but {len(seen)} in tables")
