"""Prefix-aware routing: the global scheduler's model of what each instance's prefix cache holds (pure).

The front end cannot see an instance's cache, but it routed every prompt that filled it: per instance it keeps the
chained block names (``core.prefix_cache.block_digests``) of the prompts it sent there, least recently used first,
at most as many as the instance has KV blocks (its cache cannot hold more). A new request then costs, on each
candidate instance, the prompt tokens queued there plus its own prompt tokens *not* in that instance's cache
(``GlobalPolicy.pick_prefill``): a conversation's next turn goes back to the instance holding its history unless
that instance is backed up by more than the prefill the cache would save, so affinity never piles work onto one
instance (SGLang's cache-aware router and Dynamo's KV router trade the same two quantities).

The model is approximate by design: an instance evicts blocks the front end still lists (a request then prefills
more than predicted, nothing breaks) and caches output blocks the front end never lists (a hit it did not
predict). Correctness never depends on it: the instance's own ``PrefixCache`` decides what is reused.

Invariants: per instance, at most ``capacity`` names, each once; ``forget`` drops everything about an instance.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tetriinfer.core.prefix_cache import block_digests


class PrefixAffinity:
    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def digests(self, prompt_token_ids: Sequence[int]) -> tuple[bytes, ...]:
        """Names of the prompt's blocks an instance could reuse: full blocks before its last token (which is always
        computed, as ``KVCacheManager.match_prefix`` never matches it)."""
        usable = (len(prompt_token_ids) - 1) // self.block_size
        return tuple(block_digests(prompt_token_ids[: usable * self.block_size], self.block_size))

    def matched_tokens(self, instance_id: str, digests: Sequence[bytes]) -> int:
        """Tokens of the longest leading run of ``digests`` this instance was sent (and has not pushed out)."""
        seen = self._seen.get(instance_id)
        if not seen:
            return 0
        n = 0
        for d in digests:
            if d not in seen:
                break
            n += 1
        return n * self.block_size

    def record(self, instance_id: str, digests: Sequence[bytes], capacity: int | None) -> None:
        """The prompt with these block names was routed to ``instance_id``, whose pool has ``capacity`` blocks
        (None: not known yet, nothing is pushed out)."""
        seen = self._seen.setdefault(instance_id, OrderedDict())
        for d in reversed(digests):  # the head most recent: pushed out last, as an instance's cache frees tails first
            seen[d] = None
            seen.move_to_end(d)
        while capacity is not None and len(seen) > max(0, capacity):
            seen.popitem(last=False)

    def forget(self, instance_id: str) -> None:
        """The instance left, changed role or lost its cache: nothing of it is known any more."""
        self._seen.pop(instance_id, None)

    def num_known(self, instance_id: str) -> int:
        return len(self._seen.get(instance_id, ()))
