"""Queue rebalancing (core.rebalance) and the schedulers' ``take_unstarted``: crafted scenarios and a property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.colocated_scheduler import ColocatedSchedulerConfig, SarathiScheduler, VLLMScheduler
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState, LoadReport, Role
from tetriinfer.core.local_scheduler import LocalScheduler, LocalSchedulerConfig
from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig
from tetriinfer.core.rebalance import Move, RebalanceConfig, Rebalancer
from tetriinfer.core.request import Request
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import StepResult

ON = RebalanceConfig(enabled=True, min_queued=2, max_move=16)


def rep(iid: str, queued: int, *, role: Role = Role.PREFILL, state: InstanceState = InstanceState.ACTIVE) -> LoadReport:
    return LoadReport(iid, role, state=state, num_queued=queued)


def req(rid: str, n: int = 40, out: int = 4) -> Request:
    return Request(rid, [3] * n, SamplingParams(max_tokens=out))


def step(sched) -> None:  # noqa: ANN001 - any core scheduler
    out = sched.schedule()
    sched.update(out, StepResult(out.step_id, {s.request_id: 7 for s in out.segments if s.sample}))


def test_the_longest_queue_gives_half_to_an_idle_peer_once_until_answered() -> None:
    rb = Rebalancer(ON)
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    reports = [rep("p0", 9), rep("p1", 0), rep("d0", 30, role=Role.DECODE)]
    assert rb.plan(reports, roles) == [Move("p0", 4, "prefill")]  # 9 // 2; decode instances never give
    assert rb.plan(reports, roles) == []  # p0 has not answered yet
    rb.done("p0")
    assert rb.plan(reports, roles) == [Move("p0", 4, "prefill")]
    rb.forget("p0")  # left the pool: its answer is not awaited
    assert rb.pending == frozenset()
    assert Rebalancer(RebalanceConfig(enabled=True, max_move=3)).plan(reports, roles)[0].count == 3


def test_no_move_without_an_idle_receiver_a_real_queue_or_an_active_donor() -> None:
    roles = {"p0": "prefill", "p1": "prefill", "p2": "prefill"}
    assert Rebalancer(ON).plan([rep("p0", 9), rep("p1", 1), rep("p2", 3)], roles) == []  # every peer queues
    assert Rebalancer(ON).plan([rep("p0", 1), rep("p1", 0)], roles) == []  # below min_queued
    draining = [rep("p0", 9, state=InstanceState.DRAINING), rep("p1", 0)]
    assert Rebalancer(ON).plan(draining, roles) == []
    assert Rebalancer(ON).plan([rep("p0", 9), rep("p1", 0, state=InstanceState.DRAINING)], roles) == []
    assert Rebalancer(RebalanceConfig()).plan([rep("p0", 9), rep("p1", 0)], roles) == []  # disabled
    assert Rebalancer(ON).plan([rep("p0", 9), rep("x", 0)], {"p0": "prefill"}) == []  # unknown ids ignored
    with pytest.raises(ValueError):
        RebalanceConfig(min_queued=0)
    with pytest.raises(ValueError):
        RebalanceConfig(max_move=0)


def test_tiers_are_balanced_separately() -> None:
    roles = {"p0": "prefill", "c0": "colocated", "c1": "colocated"}
    moves = Rebalancer(ON).plan([rep("p0", 8), rep("c0", 6), rep("c1", 0)], roles)
    assert moves == [Move("c0", 3, "colocated")]  # p0 has no idle prefill peer


def make_scheduler(name: str):  # noqa: ANN201 - one of the four schedulers that queue unstarted requests
    """A small scheduler of each kind that queues requests (at most 2 running, 24-token chunks, 64 blocks of 4)."""
    kv = KVCacheManager(64, 4)
    if name == "vllm":
        return VLLMScheduler(ColocatedSchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv)
    if name == "sarathi":
        return SarathiScheduler(ColocatedSchedulerConfig(max_num_seqs=2, max_num_batched_tokens=24), kv)
    if name == "local":
        return LocalScheduler(LocalSchedulerConfig(chunk_size=24, max_num_seqs=2, pad_last_chunk=False), kv)
    return PrefillScheduler(PrefillSchedulerConfig(chunk_size=24, pad_last_chunk=False), kv)


@pytest.mark.parametrize("name", ["vllm", "sarathi", "local", "prefill"])
def test_take_unstarted_hands_back_only_untouched_requests_newest_first(name: str) -> None:
    sched = make_scheduler(name)
    for i in range(5):
        sched.add_request(req(f"r{i}"))
    step(sched)  # something started: it holds blocks or ran
    started = {rid for rid in sched.requests if sched.kv.num_blocks_of(rid) or sched.requests[rid].num_computed_tokens}
    assert started
    used = sched.kv.num_used_blocks
    taken = sched.take_unstarted(10)
    ids = [r.request_id for r in taken]
    assert ids == sorted(ids, reverse=True) and not set(ids) & started  # newest first, never a started one
    assert set(ids) | set(sched.requests) == {f"r{i}" for i in range(5)}  # nothing lost, nothing twice
    assert not set(ids) & set(sched.requests)
    assert sched.kv.num_used_blocks == used  # they held nothing
    assert all(r.num_computed_tokens == 0 and not r.output_token_ids and not r.is_finished for r in taken)
    assert sched.take_unstarted(0) == []
    other = make_scheduler(name)
    for r in taken:  # another instance takes them as new
        other.add_request(r)
    for _ in range(200):
        if not other.has_unfinished():
            break
        step(other)
        if name == "prefill":
            for r in list(other.handed_over.values()):
                other.release(r.request_id)
    assert not other.has_unfinished() and other.kv.num_used_blocks == 0


def test_take_unstarted_skips_preempted_requests_that_already_produced_tokens() -> None:
    sched = VLLMScheduler(ColocatedSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), KVCacheManager(24, 4))
    for i in range(3):
        sched.add_request(req(f"r{i}", n=28, out=20))
    for _ in range(12):  # decodes outgrow the pool: the youngest is preempted by recompute
        step(sched)
    preempted = [r for r in sched.waiting if r.output_token_ids]
    assert preempted, "the scenario must preempt a request with output"
    assert not {r.request_id for r in sched.take_unstarted(10)} & {r.request_id for r in preempted}


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(4, 60), min_size=1, max_size=10),
    steps_before=st.integers(0, 6),
    limit=st.integers(0, 12),
    which=st.sampled_from(["vllm", "sarathi", "local", "prefill"]),
)
def test_property_taking_then_readding_conserves_requests_and_blocks(
    lens: list[int], steps_before: int, limit: int, which: str
) -> None:
    sched = make_scheduler(which)
    for i, n in enumerate(lens):
        sched.add_request(req(f"r{i}", n=n))
    for _ in range(steps_before):
        if sched.has_unfinished():
            step(sched)
    before = set(sched.requests)
    taken = sched.take_unstarted(limit)
    assert len(taken) <= limit
    assert {r.request_id for r in taken} | set(sched.requests) == before
    kv = sched.kv
    assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
    for r in taken:
        sched.add_request(r)  # back where it came from: still valid as new
    assert set(sched.requests) == before
