"""Automatic prefix caching: full KV blocks found again by the tokens they hold (pure: no tensors).

A *full* block -- ``block_size`` computed tokens -- is named by a chained digest:
``digest_i = sha256(digest_{i-1} || tokens of block i)`` (``digest_{-1}`` empty), so a name stands for the whole
prefix up to and including the block, not only its own tokens: two requests share block ``i`` only if they agree
on every token before it too. SHA-256 makes a false match (another prefix's K/V served) practically impossible,
unlike a 64-bit ``hash()``.

This module owns the name <-> block maps and the hit counters; the ``BlockPool`` owns reference counts and the
free tiers (named free blocks: least recently freed reused first, after every unnamed one), and tells
``forget_block`` when it reuses a cached block for other tokens.

Invariants: the two maps are inverse bijections; a name maps to a block that holds exactly the tokens the name
was made from (callers register a block only once its K/V are computed, and only the pool's reuse changes a
block's contents, which unmaps it first); blocks are never written while named (a request writes only past its
matched prefix, into blocks it allocated).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_digests(token_ids: Sequence[int], block_size: int, parents: Sequence[bytes] = ()) -> list[bytes]:
    """Chained digests of every full block of ``token_ids``; ``parents`` are digests already known for its
    first blocks (extended, not recomputed). Tokens are hashed as signed 64-bit integers."""
    out = list(parents)
    prev = out[-1] if out else b""
    for i in range(len(out), len(token_ids) // block_size):
        tokens = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        prev = hashlib.sha256(prev + tokens).digest()
        out.append(prev)
    return out


class PrefixCache:
    """Name <-> block maps and hit statistics (token counts: ``queried_tokens`` looked up, ``hit_tokens`` found)."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def longest_match(self, digests: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached run of ``digests`` from the first."""
        blocks: list[int] = []
        for d in digests:
            b = self._block_of.get(d)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def register(self, block: int, digest: bytes) -> bool:
        """Name ``block`` (its K/V now computed). A no-op, returning False, when the name is already cached
        (another request computed the same prefix meanwhile: its copy stays the cached one) or the block is
        already named."""
        if digest in self._block_of or block in self._name_of:
            return False
        self._block_of[digest] = block
        self._name_of[block] = digest
        return True

    def forget_block(self, block: int) -> None:
        """The pool reuses ``block`` for other tokens: its name goes (nothing if it had none)."""
        digest = self._name_of.pop(block, None)
        if digest is not None:
            del self._block_of[digest]

    def is_named(self, block: int) -> bool:
        return block in self._name_of

    def name_of(self, block: int) -> bytes | None:
        return self._name_of.get(block)

    def clear(self) -> None:
        """Forget every name (the K/V behind them is no longer trusted, e.g. the weights changed)."""
        self._block_of.clear()
        self._name_of.clear()

    def check_invariants(self) -> None:
        if len(self._block_of) != len(self._name_of):
            raise AssertionError("prefix cache maps differ in size")
        for digest, block in self._block_of.items():
            if self._name_of.get(block) != digest:
                raise AssertionError(f"block {block} and its name disagree")
