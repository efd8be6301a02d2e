"""Automatic prefix caching in the pure core: chained block names, LRU reuse of freed cached blocks, matching in
every prefill-capable scheduler, and a property test with a model of the KV *contents* (every matched block
holds exactly the tokens the request would have computed there; no shared block is ever written)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.colocated_scheduler import ColocatedSchedulerConfig, SarathiScheduler, VLLMScheduler
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.local_scheduler import LocalScheduler, LocalSchedulerConfig
from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig
from tetriinfer.core.prefix_cache import block_digests
from tetriinfer.core.request import Request
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import SchedulerOutput, StepResult

BS = 4


def req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def prefill_fully(kv: KVCacheManager, r: Request) -> None:
    """What a scheduler does for one request: match, allocate the rest, compute, name the full blocks."""
    kv.match_prefix(r)
    assert kv.allocate_slots(r.request_id, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed(r)


def test_block_names_chain_the_whole_prefix() -> None:
    a = block_digests(list(range(12)), BS)
    assert len(a) == 3 and len(set(a)) == 3
    assert block_digests(list(range(12)) + [99, 98], BS) == a  # a partial block has no name
    b = block_digests([0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11], BS)  # differs in block 1 only
    assert b[0] == a[0] and b[1] != a[1] and b[2] != a[2]  # block 2's tokens agree, its prefix does not
    assert block_digests(list(range(12)), BS, a[:2]) == a  # extending known names gives the same ones


def test_a_later_request_reuses_the_cached_prefix_and_never_its_last_token() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    first = req("a", list(range(10)))
    prefill_fully(kv, first)
    table_a = kv.block_table("a")
    assert kv.prefix_cache is not None and kv.prefix_cache.num_cached_blocks == 2  # 10 tokens: 2 full blocks
    second = req("b", list(range(9)) + [77])
    assert kv.match_prefix(second) == 8 and second.num_computed_tokens == 8
    assert kv.block_table("b") == table_a[:2]
    assert [kv.pool.ref_count(b) for b in table_a] == [2, 2, 1]  # shared while both hold them
    kv.check_invariants()
    exact = req("c", list(range(8)))  # a fully cached prompt still computes its last block
    assert kv.match_prefix(exact) == 4
    kv.check_invariants()
    for rid in ("a", "b", "c"):
        kv.free_request(rid)
    assert kv.num_free_blocks == 16 and kv.prefix_cache.num_cached_blocks == 2  # freed, still cached
    third = req("d", list(range(12)))
    assert kv.match_prefix(third) == 8 and kv.block_table("d") == table_a[:2]
    kv.check_invariants()


def test_the_pool_reuses_least_recently_freed_blocks_first_and_forgets_their_names() -> None:
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    old = req("old", list(range(100, 113)))  # 3 full blocks + 1 token
    prefill_fully(kv, old)
    kv.free_request("old")
    cache = kv.prefix_cache
    assert cache is not None and cache.num_cached_blocks == 3
    # The unnamed partial block goes first, then the 2 never-used ones, then the old request's named blocks: its
    # tail (freed first), its head last.
    assert kv.allocate_slots("filler", 3 * BS)
    assert cache.num_cached_blocks == 3  # the partial block had no name; the full ones survive
    assert kv.allocate_slots("filler", 4 * BS)  # one more: the old request's last full block
    assert cache.num_cached_blocks == 2
    again = req("again", list(range(100, 113)))
    assert kv.match_prefix(again) == 2 * BS  # the two leading blocks are still there
    kv.check_invariants()
    assert not kv.allocate_slots("filler", 7 * BS)  # matched blocks are held: not free, not evictable
    kv.check_invariants()


def test_without_prefix_caching_nothing_is_matched() -> None:
    kv = KVCacheManager(16, BS)
    prefill_fully(kv, req("a", list(range(10))))
    r = req("b", list(range(10)))
    assert kv.match_prefix(r) == 0 and r.num_computed_tokens == 0 and not kv.has("b")


def test_a_concurrent_copy_of_a_prefix_stays_private() -> None:
    """Two requests computing the same prefix at once: the first named keeps the name; the other's copy is
    freed normally (never shared, never named twice)."""
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a, b = req("a", list(range(9))), req("b", list(range(9)))
    for r in (a, b):
        kv.match_prefix(r)
        assert kv.allocate_slots(r.request_id, r.num_tokens)
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed(r)
    cache = kv.prefix_cache
    assert cache is not None and cache.num_cached_blocks == 2
    assert all(cache.name_of(blk) is not None for blk in kv.block_table("a")[:2])
    assert all(cache.name_of(blk) is None for blk in kv.block_table("b"))
    kv.check_invariants()


def test_prefill_scheduler_skips_the_cached_prefix() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    sched = PrefillScheduler(PrefillSchedulerConfig(chunk_size=16, pad_last_chunk=False), kv)
    shared = list(range(1000, 1012))
    sched.add_request(req("a", shared + [1, 2, 3]))
    out = sched.schedule()
    upd = sched.update(out, StepResult(out.step_id, {"a": 5}))
    assert [r.request_id for r in upd.prefilled] == ["a"]
    sched.release("a")
    sched.add_request(req("b", shared + [7, 8, 9, 10, 11]))
    out = sched.schedule()
    (seg,) = out.segments
    assert (seg.start, seg.num_tokens) == (12, 5)  # 3 cached blocks; only the new tokens are computed
    assert cache_hits(kv) == 12


def cache_hits(kv: KVCacheManager) -> int:
    assert kv.prefix_cache is not None
    return kv.prefix_cache.hit_tokens


@pytest.mark.parametrize("kind", ["vllm", "sarathi", "local"])
def test_colocated_schedulers_skip_the_cached_prefix(kind: str) -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    sched = make(kind, kv, 64)
    shared = list(range(500, 516))
    sched.add_request(req("a", shared + [1], max_tokens=2))
    while sched.has_unfinished():
        drive(sched)
    sched.add_request(req("b", shared + [2, 3], max_tokens=2))
    out = sched.schedule()
    (seg,) = out.segments
    assert (seg.start, seg.num_tokens) == (16, 2)
    kv.check_invariants()


def make(kind: str, kv: KVCacheManager, budget: int):
    if kind == "vllm":
        return VLLMScheduler(ColocatedSchedulerConfig(max_num_batched_tokens=budget, max_model_len=512), kv)
    if kind == "sarathi":
        return SarathiScheduler(ColocatedSchedulerConfig(max_num_batched_tokens=budget, max_model_len=512), kv)
    return LocalScheduler(LocalSchedulerConfig(chunk_size=budget, pad_last_chunk=False, max_model_len=512), kv)


def drive(sched, contents: dict[int, dict[int, int]] | None = None, rng: random.Random | None = None) -> None:
    out: SchedulerOutput = sched.schedule()
    if contents is not None:
        write_and_check(sched, out, contents)
    sampled = {s.request_id: (rng.randrange(50) if rng else 9) for s in out.segments if s.sample}
    sched.update(out, StepResult(out.step_id, sampled))


def write_and_check(sched, out: SchedulerOutput, contents: dict[int, dict[int, int]]) -> None:
    """The engine, as a model: a segment reads positions [0, start) from its blocks and writes [start, end).
    Every read must find the request's own tokens; no write may touch a block another request holds or that
    the cache names."""
    kv: KVCacheManager = sched.kv
    bs = kv.block_size
    for seg in out.segments:
        r = sched.requests[seg.request_id]
        tokens = r.token_ids_range(0, seg.end)
        for pos in range(seg.start):
            blk = seg.block_table[pos // bs]
            assert contents.get(blk, {}).get(pos % bs) == tokens[pos], f"{seg.request_id} reads stale K/V at {pos}"
        for pos in range(seg.start, seg.end):
            blk = seg.block_table[pos // bs]
            assert kv.pool.ref_count(blk) == 1, f"{seg.request_id} writes shared block {blk}"
            assert kv.prefix_cache is None or kv.prefix_cache.name_of(blk) is None, "writes a named block"
            contents.setdefault(blk, {})[pos % bs] = tokens[pos]


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["vllm", "sarathi", "local", "prefill"]),
    num_blocks=st.integers(8, 40),
    budget=st.integers(4, 48),
    prompts=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=12,
    ),
    seed=st.integers(0, 2**16),
)
def test_property_matched_kv_is_always_the_right_kv(
    kind: str, num_blocks: int, budget: int, prompts: list[tuple[int, int, int]], seed: int,
) -> None:
    """Random prompts built from 4 shared stems (so prefixes repeat), random outputs, tight pools (eviction,
    preemption by recompute): every read of a matched block finds the right tokens, every request ends, every
    block comes back, reference counts always equal the tables holding each block."""
    rng = random.Random(seed)
    stems = [[rng.randrange(6) for _ in range(24)] for _ in range(4)]
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    if kind == "prefill":
        sched = PrefillScheduler(PrefillSchedulerConfig(chunk_size=budget, pad_last_chunk=False, max_model_len=512), kv)
    else:
        sched = make(kind, kv, budget)
    pending = [
        req(f"r{i}", (stems[stem][:n] + [rng.randrange(6) for _ in range(n // 3)])[: max(1, n)], max_tokens=m)
        for i, (stem, n, m) in enumerate(prompts)
    ]
    contents: dict[int, dict[int, int]] = {}
    ended: set[str] = set()
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            r = pending.pop(0)
            if kv.pool.blocks_for_tokens(r.num_tokens + r.sampling_params.max_tokens) > num_blocks:
                ended.add(r.request_id)  # cannot fit at all: not part of this property
                continue
            sched.add_request(r)
        if not sched.has_unfinished():
            if not pending:
                break
            continue
        out = sched.schedule()
        write_and_check(sched, out, contents)
        sampled = {s.request_id: rng.randrange(6) for s in out.segments if s.sample}
        upd = sched.update(out, StepResult(out.step_id, sampled))
        for r in upd.finished:
            assert r.request_id not in ended
            ended.add(r.request_id)
        if kind == "prefill":
            for r in upd.prefilled:
                sched.release(r.request_id)
                ended.add(r.request_id)
        kv.check_invariants()
    assert not pending and not sched.has_unfinished()
    assert ended == {f"r{i}" for i in range(len(prompts))}
    assert kv.num_free_blocks == num_blocks
    kv.check_invariants()


@pytest.mark.parametrize("kind", ["vllm", "sarathi", "local", "prefill"])
def test_each_prompt_is_looked_up_once_however_long_it_waits(kind: str) -> None:
    """Eight requests (two sharing a 16-token stem) arrive together behind a 16-token budget, so most wait
    several steps (the vLLM policy matches a waiting request and gives the match back each step it is not
    admitted): without preemption, the tokens looked up are exactly the prompts' and the hits are the stem's."""
    kv = KVCacheManager(256, BS, enable_prefix_caching=True)
    if kind == "prefill":
        sched = PrefillScheduler(PrefillSchedulerConfig(chunk_size=16, pad_last_chunk=False, max_model_len=512), kv)
    else:
        sched = make(kind, kv, 16)
    stem = list(range(100, 116))
    sched.add_request(req("first", stem + [1, 2, 3], max_tokens=2))
    while sched.has_unfinished() and kv.prefix_cache is not None and not kv.prefix_cache.hit_tokens:
        out = sched.schedule()
        upd = sched.update(out, StepResult(out.step_id, {s.request_id: 9 for s in out.segments if s.sample}))
        if kind == "prefill":
            for r in upd.prefilled:
                sched.release(r.request_id)
        if not sched.has_unfinished():
            break
    reqs = [req(f"r{i}", [200 + 20 * i + k for k in range(12)], max_tokens=2) for i in range(6)]
    reqs.append(req("again", stem + [7], max_tokens=2))
    for r in reqs:
        sched.add_request(r)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        upd = sched.update(out, StepResult(out.step_id, {s.request_id: 9 for s in out.segments if s.sample}))
        if kind == "prefill":
            for r in upd.prefilled:
                sched.release(r.request_id)
    assert not sched.has_unfinished() and all(r.num_preemptions == 0 for r in reqs)
    assert kv.prefix_cache is not None
    assert kv.prefix_cache.queried_tokens == 19 + sum(r.num_prompt_tokens for r in reqs)
    assert kv.prefix_cache.hit_tokens == 16
    assert kv.num_free_blocks == 256


@pytest.mark.parametrize("policy", ["sjf", "srtf"])
@pytest.mark.parametrize(("caching", "aware"), [(True, True), (True, False), (False, True)])
def test_shortest_first_counts_only_the_uncached_part_of_a_prompt(policy: str, caching: bool, aware: bool) -> None:
    """After a 32-token prompt is prefilled and released, "long" (that prompt + 4 tokens: 36 tokens, 32 cached)
    and "short" (12 fresh tokens) queue together, "long" first. With caching, SJF/SRTF see 4 tokens of work vs
    12 and serve "long" first; without it (or with ``cache_aware_order=False``), 36 vs 12 puts "short" first.
    Peeking pins nothing and counts no lookup."""
    kv = KVCacheManager(64, BS, enable_prefix_caching=caching)
    sched = PrefillScheduler(PrefillSchedulerConfig(policy=policy, chunk_size=8, pad_last_chunk=False,
                                                    cache_aware_order=aware), kv)
    stem = list(range(300, 332))
    sched.add_request(req("warm", stem + [1]))
    while sched.has_unfinished():
        out = sched.schedule()
        upd = sched.update(out, StepResult(out.step_id, {s.request_id: 5 for s in out.segments if s.sample}))
        for r in upd.prefilled:
            sched.release(r.request_id)
    queried = kv.prefix_cache.queried_tokens if kv.prefix_cache else 0
    long, short = req("long", stem + [2, 3, 4, 5]), req("short", list(range(700, 712)))
    sched.add_request(long)
    sched.add_request(short)
    assert kv.cached_prefix_tokens(long) == (32 if caching else 0) and kv.num_free_blocks == 64
    if kv.prefix_cache:
        assert kv.prefix_cache.queried_tokens == queried
    out = sched.schedule()
    first = out.segments[0]
    if caching and aware:
        assert (first.request_id, first.start, first.num_tokens) == ("long", 32, 4)
        assert [s.request_id for s in out.segments] == ["long", "short"]
    else:
        assert (first.request_id, first.num_tokens) == ("short", 8)
