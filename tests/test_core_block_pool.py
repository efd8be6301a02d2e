"""``BlockPool`` free tiers: hot (freed, nothing cached: reused most recently freed first), fresh (never allocated),
cached (freed named prefix blocks: evicted least recently freed first, only when nothing else is free).

Why it matters: on CPU the KV tensors are allocated lazily, and a never-touched page costs a fault (~5-20 us per
4 KiB page here) when first written. A pool that cycles through every block before reusing one pays that on every
request's KV writes (a KV hand-off install measured 3-9 ms instead of 0.3-0.5 ms); one that reuses freed blocks
touches new memory only when it must."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.block_pool import BlockPool
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.request import Request
from tetriinfer.core.sampling_params import SamplingParams


def test_freed_blocks_come_back_before_never_used_ones_in_their_table_order() -> None:
    kv = KVCacheManager(64, 4)
    assert kv.allocate_slots("a", 12) and kv.allocate_slots("b", 8)
    a, b = kv.block_table("a"), kv.block_table("b")
    assert a == [0, 1, 2] and b == [3, 4]
    kv.free_request("a")
    assert kv.allocate_slots("c", 16)  # a's three blocks, head first, then one never used
    assert kv.block_table("c") == [0, 1, 2, 5]
    assert kv.pool.num_never_used == 64 - 6
    kv.free_request("b")
    kv.free_request("c")
    assert kv.allocate_slots("d", 8)
    assert kv.block_table("d") == [0, 1]  # c was freed last: its head comes first
    kv.check_invariants()


def test_named_blocks_are_evicted_only_after_every_other_free_block() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    r = Request("r", list(range(100, 109)), SamplingParams(max_tokens=2, ignore_eos=True))  # 2 full blocks + 1
    kv.match_prefix(r)
    assert kv.allocate_slots("r", r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed(r)
    kv.free_request("r")
    cache = kv.prefix_cache
    assert cache is not None and cache.num_cached_blocks == 2
    assert kv.allocate_slots("x", 6 * 4)  # the unnamed block, then the 5 never used: no name lost
    assert cache.num_cached_blocks == 2 and kv.pool.num_never_used == 0
    assert kv.allocate_slots("y", 4)  # now the least recently freed named block (r's tail: freed first)
    assert cache.num_cached_blocks == 1 and kv.block_table("y") == [1]
    kv.check_invariants()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), min_size=1, max_size=120))
def test_property_the_pool_touches_a_new_block_only_when_no_freed_one_is_left(ops: list[tuple[bool, int]]) -> None:
    """Without prefix caching, the blocks ever allocated are exactly the peak number used at once (so the memory a
    run touches is its peak KV footprint, not the pool), and the accounting holds after every operation."""
    pool = BlockPool(40, 16)
    live: list[list[int]] = []
    peak = 0
    for grow, n in ops:
        if grow or not live:
            got = pool.allocate(n)
            if got is None:
                assert n > pool.num_free
                continue
            live.append(got)
        else:
            pool.free(live.pop(n % len(live))[::-1])
        peak = max(peak, pool.num_used)
        assert pool.num_blocks - pool.num_never_used == peak
        assert pool.num_free + pool.num_used == pool.num_blocks
        pool.check_invariants()
