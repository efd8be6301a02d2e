"""Colocated baselines: vLLM-style (prefill-first, whole prompts) and Sarathi-Serve (stall-free)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.colocated_scheduler import (
    ColocatedSchedulerConfig,
    SarathiScheduler,
    VLLMScheduler,
    make_colocated_scheduler,
)
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import SchedulerOutput, StepKind, StepResult


def make_req(rid: str, n_prompt: int, max_tokens: int) -> Request:
    return Request(rid, [4] * n_prompt, SamplingParams(max_tokens=max_tokens))


def step(sched: VLLMScheduler | SarathiScheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    res = StepResult(out.step_id, {s.request_id: 9 for s in out.segments if s.sample})
    return out, list(sched.update(out, res).finished)


def test_vllm_prefills_whole_prompts_first_within_budget() -> None:
    cfg = ColocatedSchedulerConfig(max_num_batched_tokens=100)
    sched = VLLMScheduler(cfg, KVCacheManager(100, 4))
    sched.add_request(make_req("a", 60, 3))
    out, _ = step(sched)
    assert out.kind is StepKind.PREFILL and [(s.start, s.num_tokens) for s in out.segments] == [(0, 60)]
    sched.add_request(make_req("b", 30, 3))
    sched.add_request(make_req("c", 30, 3))
    sched.add_request(make_req("d", 50, 3))
    out, _ = step(sched)  # prefill first: a's decode waits while prompts are waiting
    assert out.kind is StepKind.PREFILL
    assert [s.request_id for s in out.segments] == ["b", "c"]  # d would exceed the budget
    assert all(s.sample and s.start == 0 for s in out.segments)
    out, _ = step(sched)
    assert [s.request_id for s in out.segments] == ["d"]
    out, _ = step(sched)
    assert out.kind is StepKind.DECODE and [s.request_id for s in out.segments] == ["a", "b", "c", "d"]


def test_vllm_prompt_longer_than_budget_runs_alone() -> None:
    sched = VLLMScheduler(ColocatedSchedulerConfig(max_num_batched_tokens=16), KVCacheManager(100, 4))
    sched.add_request(make_req("big", 40, 2))
    sched.add_request(make_req("small", 4, 2))
    out, _ = step(sched)
    assert [(s.request_id, s.num_tokens) for s in out.segments] == [("big", 40)]


def test_sarathi_is_stall_free_and_respects_budget() -> None:
    cfg = ColocatedSchedulerConfig(max_num_batched_tokens=32)
    sched = SarathiScheduler(cfg, KVCacheManager(200, 4))
    sched.add_request(make_req("a", 10, 50))
    sched.add_request(make_req("b", 10, 50))
    step(sched)  # a and b prefilled in one step (20 tokens)
    sched.add_request(make_req("long", 100, 2))
    chunks = 0
    while any(r.request_id == "long" for r in sched.waiting):
        out, _ = step(sched)
        assert out.num_scheduled_tokens <= 32
        decodes = [s.request_id for s in out.segments if s.num_tokens == 1 and s.start > 0]
        assert decodes[:2] == ["a", "b"]  # every running request decodes in every step
        prefills = [s for s in out.segments if s.request_id == "long"]
        assert len(prefills) == 1 and prefills[0].num_tokens == min(30, 100 - 30 * chunks)
        assert out.kind is StepKind.MIXED
        chunks += 1
    assert chunks == 4  # 100 prompt tokens in chunks of 32 - 2 decodes


def test_factory_and_validation() -> None:
    kv = KVCacheManager(10, 4)
    assert isinstance(make_colocated_scheduler("vllm", ColocatedSchedulerConfig(), kv), VLLMScheduler)
    assert isinstance(make_colocated_scheduler("sarathi", ColocatedSchedulerConfig(), kv), SarathiScheduler)
    with pytest.raises(ValueError, match="unknown colocated"):
        make_colocated_scheduler("orca", ColocatedSchedulerConfig(), kv)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ColocatedSchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="cannot fit"):
        VLLMScheduler(ColocatedSchedulerConfig(), kv).add_request(make_req("x", 50, 2))


@pytest.mark.parametrize("kind", ["vllm", "sarathi"])
def test_preemption_by_recompute_under_memory_pressure(kind: str) -> None:
    sched = make_colocated_scheduler(kind, ColocatedSchedulerConfig(max_num_batched_tokens=64), KVCacheManager(8, 4))
    reqs = [make_req(f"r{i}", 6, 10) for i in range(3)]  # 3 x 16 tokens > 32 slots
    for r in reqs:
        sched.add_request(r)
    preempted = set()
    for _ in range(300):
        if not sched.has_unfinished():
            break
        out, _ = step(sched)
        sched.check_invariants()
        preempted.update(out.preempted_request_ids)
    assert not sched.has_unfinished()
    assert preempted and "r0" not in preempted  # the oldest is never the victim
    assert all(r.num_output_tokens == 10 and r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert sched.kv.num_free_blocks == 8


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["vllm", "sarathi"]),
    budget=st.sampled_from([8, 24, 64]),
    blocks=st.integers(4, 30),
    max_num_seqs=st.integers(1, 5),
    reqs=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=10),
)
def test_property_colocated(
    kind: str, budget: int, blocks: int, max_num_seqs: int, reqs: list[tuple[int, int, int]]
) -> None:
    bs = 4
    cfg = ColocatedSchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=4096)
    sched = make_colocated_scheduler(kind, cfg, KVCacheManager(blocks, bs))
    arrivals = sorted(((a, i, min(n, blocks * bs - 1), m) for i, (a, n, m) in enumerate(reqs)))
    ended: set[str] = set()
    tick = 0
    bound = 20 * sum(n + m for _, _, n, m in arrivals) + 100
    pending = list(arrivals)
    while pending or sched.has_unfinished():
        tick += 1
        assert tick < bound, "no progress: deadlock"
        while pending and pending[0][0] <= tick:
            _, i, n, m = pending.pop(0)
            sched.add_request(make_req(f"r{i}", n, m))
        out, finished = step(sched)
        sched.check_invariants()
        assert sched.kv.num_free_blocks + sched.kv.num_used_blocks == blocks
        if kind == "sarathi":
            assert out.num_scheduled_tokens <= budget
        for r in finished:
            assert r.request_id not in ended
            ended.add(r.request_id)
            if r.num_tokens < blocks * bs:
                assert r.num_output_tokens == r.sampling_params.max_tokens
    assert len(ended) == len(reqs)
    assert sched.kv.num_free_blocks == blocks


@pytest.mark.parametrize("kind", ["vllm", "sarathi"])
def test_abort_during_a_step(kind: str) -> None:
    sched = make_colocated_scheduler(kind, ColocatedSchedulerConfig(), KVCacheManager(20, 4))
    sched.add_request(make_req("a", 8, 5))
    sched.add_request(make_req("b", 8, 5))
    out = sched.schedule()
    assert sched.abort("a") is not None and sched.abort("a") is None
    sched.update(out, StepResult(out.step_id, {s.request_id: 9 for s in out.segments if s.sample}))
    while sched.has_unfinished():
        step(sched)
    assert sched.kv.num_free_blocks == 20 and sched.schedule().kind is StepKind.IDLE
