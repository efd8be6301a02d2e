"""Prefill scheduler: FCFS/SJF/LJF order, PrefillSchedBatch starvation bound, SRTF, chunking, release."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.prefill_policy import PrefillPolicy
from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig, PrefillStepUpdate
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import SchedulerOutput, StepKind, StepResult


def make_req(rid: str, n_prompt: int, max_tokens: int = 8) -> Request:
    return Request(rid, [3 + i % 50 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens))


def step(sched: PrefillScheduler) -> tuple[SchedulerOutput, PrefillStepUpdate]:
    out = sched.schedule()
    res = StepResult(out.step_id, {s.request_id: 7 for s in out.segments if s.sample})
    return out, sched.update(out, res)


def run_until_empty(sched: PrefillScheduler, max_steps: int = 1000) -> list[str]:
    order: list[str] = []
    for _ in range(max_steps):
        if not sched.queue:
            break
        out, upd = step(sched)
        for r in upd.prefilled:
            order.append(r.request_id)
            sched.release(r.request_id)
    return order


def sched_with(policy: str, batch: int = 16, chunk: int = 64, blocks: int = 1000) -> PrefillScheduler:
    cfg = PrefillSchedulerConfig(policy=policy, prefill_sched_batch=batch, chunk_size=chunk)
    return PrefillScheduler(cfg, KVCacheManager(blocks, 16))


LENS = {"r0": 300, "r1": 50, "r2": 500, "r3": 120}


@pytest.mark.parametrize(
    "policy,expected",
    [
        ("fcfs", ["r0", "r1", "r2", "r3"]),
        ("sjf", ["r1", "r3", "r0", "r2"]),
        ("ljf", ["r2", "r0", "r3", "r1"]),
        ("srtf", ["r1", "r3", "r0", "r2"]),
    ],
)
def test_policy_order(policy: str, expected: list[str]) -> None:
    sched = sched_with(policy)
    for rid, n in LENS.items():
        sched.add_request(make_req(rid, n))
    assert run_until_empty(sched) == expected
    sched.check_invariants()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_every_chunk_is_exactly_chunk_size_and_prompt_only() -> None:
    sched = sched_with("fcfs", chunk=64)
    for rid, n in LENS.items():
        sched.add_request(make_req(rid, n))
    total = 0
    while sched.queue:
        out, upd = step(sched)
        assert out.kind is StepKind.PREFILL
        assert out.num_scheduled_tokens + out.num_padding_tokens == 64
        for seg in out.segments:
            assert seg.end <= LENS[seg.request_id]  # prompt tokens only
        total += out.num_scheduled_tokens
        for r in upd.prefilled:
            sched.release(r.request_id)
    assert total == sum(LENS.values())
    # Slicing and merging: the last chunk of r0 (300 = 4*64 + 44) shares its chunk with r1.
    assert sched.schedule().kind is StepKind.IDLE


def test_build_chunk_merge_limit_runs_a_saturating_head_alone_and_merges_small_prompts() -> None:
    from tetriinfer.core.chunking import build_chunk

    def slices(cands: list[tuple[str, int, int]], limit: int | None) -> list[tuple[str, int, int]]:
        chunk = build_chunk(cands, 512, pad=False, merge_limit=limit)
        return [(s.request_id, s.start, s.num_tokens) for s in chunk.slices]

    big = [("a", 0, 200), ("b", 0, 300)]
    assert slices(big, None) == [("a", 0, 200), ("b", 0, 300)]  # the paper: fill the chunk
    assert slices(big, 128) == [("a", 0, 200)]  # the head alone already saturates: nothing merged behind it
    assert slices([("a", 0, 900), ("b", 0, 10)], 128) == [("a", 0, 512)]  # the head is bounded by chunk_size only
    small = [("a", 0, 40), ("b", 0, 50), ("c", 0, 100)]
    assert slices(small, 128) == [("a", 0, 40), ("b", 0, 50), ("c", 0, 38)]  # merged up to the limit in all
    assert slices(small, 90) == [("a", 0, 40), ("b", 0, 50)]
    padded = build_chunk(big, 512, pad=True, merge_limit=128)
    assert padded.num_real_tokens == 200 and padded.num_padding == 312  # padding still fills the chunk
    with pytest.raises(ValueError, match="merge_limit"):
        build_chunk(big, 512, merge_limit=0)
    with pytest.raises(ValueError, match="merge_limit"):
        PrefillSchedulerConfig(merge_limit=0)


@pytest.mark.parametrize("limit", [None, 128])
def test_merge_limit_gives_the_shortest_prompt_its_first_token_alone(limit: int | None) -> None:
    """SRTF over a 200- and a 300-token prompt with 512-token chunks: filling the chunk makes both wait for one
    500-token forward; with a merge limit below 200 the short one gets its first token from a 200-token forward."""
    cfg = PrefillSchedulerConfig(policy="srtf", chunk_size=512, pad_last_chunk=False, merge_limit=limit)
    sched = PrefillScheduler(cfg, KVCacheManager(200, 16))
    sched.add_request(make_req("long", 300))
    sched.add_request(make_req("short", 200))
    out, upd = step(sched)
    first = [(s.request_id, s.num_tokens) for s in out.segments]
    if limit is None:
        assert first == [("short", 200), ("long", 300)] and {r.request_id for r in upd.prefilled} == {"short", "long"}
    else:
        assert first == [("short", 200)] and [r.request_id for r in upd.prefilled] == ["short"]
        out, upd = step(sched)
        assert [(s.request_id, s.num_tokens) for s in out.segments] == [("long", 300)]
    for r in list(sched.handed_over.values()):
        sched.release(r.request_id)
    sched.check_invariants()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_sched_batch_bounds_starvation_for_late_short_arrivals() -> None:
    sched = sched_with("sjf", batch=2, chunk=32)
    sched.add_request(make_req("long", 200))
    sched.add_request(make_req("mid", 100))
    out, _ = step(sched)  # batch {long, mid} formed and sorted: mid first
    assert [s.request_id for s in out.segments] == ["mid"]
    for i in range(5):  # short requests keep arriving after the batch was formed
        sched.add_request(make_req(f"short{i}", 10))
    order = run_until_empty(sched)
    assert order.index("long") < min(order.index(f"short{i}") for i in range(5))
    assert order[:2] == ["mid", "long"]


def test_without_batch_bound_sjf_would_starve() -> None:
    """Control for the test above: with a huge batch the late short requests do overtake."""
    sched = sched_with("sjf", batch=1000, chunk=32)
    sched.add_request(make_req("long", 200))
    for i in range(5):
        sched.add_request(make_req(f"short{i}", 10))
    order = run_until_empty(sched)
    assert order[-1] == "long"


def test_srtf_preempts_at_chunk_boundary_and_aging_bounds_passing() -> None:
    sched = sched_with("srtf", batch=3, chunk=16)
    sched.add_request(make_req("long", 64))
    out, _ = step(sched)
    assert [s.request_id for s in out.segments] == ["long"]
    served_after_long = 0
    for i in range(10):
        sched.add_request(make_req(f"s{i}", 16))
        out, upd = step(sched)
        ids = [s.request_id for s in out.segments]
        for r in upd.prefilled:
            sched.release(r.request_id)
        if "long" in ids:
            break
        served_after_long += 1
    assert served_after_long == 3  # passed over exactly prefill_sched_batch times, then urgent
    assert sched.queue.passed_over("long") == 3


def test_prefilled_request_keeps_blocks_until_release() -> None:
    sched = sched_with("fcfs", chunk=64, blocks=20)
    sched.add_request(make_req("a", 40))
    _, upd = step(sched)
    assert [r.request_id for r in upd.prefilled] == ["a"]
    req = upd.prefilled[0]
    assert req.status is RequestStatus.RUNNING and req.num_output_tokens == 1
    assert req.num_computed_tokens == req.num_tokens - 1
    assert sched.kv.num_blocks_of("a") == 3
    assert sched.load_report("p0", now=1.0).num_running == 1
    assert sched.release("a") == 3
    assert sched.kv.num_free_blocks == 20 and not sched.has_unfinished()
    with pytest.raises(KeyError):
        sched.release("a")


def test_first_token_can_finish_a_request_at_prefill() -> None:
    sched = sched_with("fcfs")
    sched.add_request(make_req("one", 10, max_tokens=1))
    _, upd = step(sched)
    assert not upd.prefilled and [r.status for r in upd.finished] == [RequestStatus.FINISHED_LENGTH]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_require_prediction_holds_handover_until_predicted() -> None:
    cfg = PrefillSchedulerConfig(chunk_size=64, require_prediction=True)
    sched = PrefillScheduler(cfg, KVCacheManager(100, 16))
    sched.add_request(make_req("a", 30))
    sched.add_request(make_req("b", 30))
    assert sched.set_prediction("b", 1, 200, 400) is None  # predicted before prefill ends
    _, upd = step(sched)
    assert [r.request_id for r in upd.prefilled] == ["b"]
    ready = sched.set_prediction("a", 0, 0, 200)
    assert ready is not None and ready.request_id == "a" and ready.predicted_lower == 0


def test_memory_stall_waits_for_release_then_progresses() -> None:
    sched = sched_with("fcfs", chunk=32, blocks=4)  # 64 tokens of KV
    sched.add_request(make_req("a", 60))
    sched.add_request(make_req("b", 20))
    _, upd = step(sched)
    _, upd = step(sched)
    assert [r.request_id for r in upd.prefilled] == ["a"]
    out = sched.schedule()  # a holds the blocks until released: nothing fits
    assert out.kind is StepKind.IDLE
    sched.release("a")
    assert run_until_empty(sched) == ["b"]


def test_partial_holders_give_way_instead_of_deadlocking() -> None:
    sched = sched_with("fcfs", chunk=16, blocks=4)  # 64 tokens of KV
    sched.add_request(make_req("a", 60))
    sched.add_request(make_req("b", 60))
    order = run_until_empty(sched, max_steps=50)
    assert order == ["a", "b"]
    sched.check_invariants()


def test_add_request_validates() -> None:
    sched = sched_with("fcfs", blocks=2)
    with pytest.raises(ValueError, match="cannot fit"):
        sched.add_request(make_req("big", 100))
    with pytest.raises(ValueError, match="unknown prefill policy"):
        PrefillSchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="prefill_sched_batch"):
        PrefillSchedulerConfig(prefill_sched_batch=0)


# ---- property test -------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(list(PrefillPolicy)),
    batch=st.integers(1, 5),
    chunk=st.sampled_from([8, 16, 48]),
    merge=st.sampled_from([None, 1, 5, 20]),
    blocks=st.integers(8, 40),
    lens=st.lists(st.integers(1, 120), min_size=1, max_size=14),
    seed=st.integers(0, 10_000),
)
def test_property_prefill(
    policy: PrefillPolicy, batch: int, chunk: int, merge: int | None, blocks: int, lens: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    block_size = 4
    sched = PrefillScheduler(
        PrefillSchedulerConfig(policy=policy, prefill_sched_batch=batch, chunk_size=chunk, max_model_len=4096,
                               merge_limit=merge),
        KVCacheManager(blocks, block_size),
    )
    lens = [min(n, blocks * block_size) for n in lens]
    arrivals = sorted(rng.randrange(0, 3 * len(lens)) for _ in lens)
    arrival_idx = {f"r{i}": i for i in range(len(lens))}
    ended: dict[str, int] = {}
    first_step: dict[str, int] = {}
    last_step: dict[str, int] = {}
    batch_of: dict[str, int] = {}
    passed: dict[str, int] = {}
    pending_release: list[tuple[int, str]] = []
    nxt = 0
    step_no = 0
    bound = 20 * (sum(lens) // chunk + len(lens) + 5)
    while nxt < len(lens) or sched.has_unfinished():
        step_no += 1
        assert step_no < bound, "no progress: deadlock"
        while nxt < len(lens) and arrivals[nxt] <= step_no:
            sched.add_request(make_req(f"r{nxt}", lens[nxt], max_tokens=rng.choice([1, 4])))
            nxt += 1
        queued = [r.request_id for r in sched.queue.requests()]
        out, upd = step(sched)
        sched.check_invariants()
        assert sched.kv.num_free_blocks + sched.kv.num_used_blocks == blocks
        served = [s.request_id for s in out.segments]
        if served:
            assert out.num_scheduled_tokens + out.num_padding_tokens == chunk
        for rid in served:
            first_step.setdefault(rid, step_no)
            last_step[rid] = step_no
            b = sched.queue.batch_index(rid)
            if b is not None:
                batch_of[rid] = b
        newest = max((arrival_idx[i] for i in served), default=-1)
        for rid in queued:
            if rid not in served and arrival_idx[rid] < newest:
                passed[rid] = passed.get(rid, 0) + 1
        for r in list(upd.prefilled) + list(upd.finished):
            assert r.request_id not in ended, "a request ended twice"
            ended[r.request_id] = step_no
        for r in upd.prefilled:
            pending_release.append((step_no + rng.randrange(0, 3), r.request_id))
        for due, rid in list(pending_release):
            if due <= step_no:
                sched.release(rid)
                pending_release.remove((due, rid))
        if not sched.queue and pending_release:
            for _, rid in pending_release:
                sched.release(rid)
            pending_release.clear()
    assert set(ended) == set(arrival_idx)
    assert sched.kv.num_free_blocks == blocks
    if policy is PrefillPolicy.SRTF:
        assert max(passed.values(), default=0) <= batch
    else:
        # Batches are formed in arrival order and served in formation order: a request is never
        # overtaken by one from a later batch (which includes everything that arrived after its batch).
        for r, br in batch_of.items():
            for s, bs in batch_of.items():
                if arrival_idx[s] > arrival_idx[r]:
                    assert bs >= br
                if bs > br:
                    assert first_step[s] >= last_step[r], f"{s} (batch {bs}) overtook {r} (batch {br})"


def test_abort_queued_inflight_and_handed_over() -> None:
    sched = sched_with("fcfs", chunk=16, blocks=20)
    for rid in ("a", "b", "c"):
        sched.add_request(make_req(rid, 20))
    out = sched.schedule()  # a's first 16 tokens
    assert sched.abort("a") is not None
    upd = sched.update(out, StepResult(out.step_id, {}))
    assert not upd.prefilled and sched.kv.num_blocks_of("a") == 0
    _, upd = step(sched)
    _, upd = step(sched)
    assert [r.request_id for r in upd.prefilled] == ["b"]
    assert sched.abort("b") is not None and sched.abort("c") is not None
    assert sched.kv.num_free_blocks == 20 and not sched.has_unfinished()
    assert set(sched.schedule().finished_request_ids) == {"b", "c"}


def test_chunk_budget_takes_a_tail_of_at_most_tail_tokens_into_the_chunk_that_empties_the_queue() -> None:
    from tetriinfer.core.chunking import chunk_budget

    assert chunk_budget(512, 575, 128) == 575  # 63 tokens past one chunk: no step of their own
    assert chunk_budget(512, 640, 128) == 640
    assert chunk_budget(512, 641, 128) == 512  # more than a tail left: a full chunk, as the paper does
    assert chunk_budget(512, 400, 128) == 512  # one chunk holds it all anyway
    assert chunk_budget(512, 575, 0) == 512  # off
    with pytest.raises(ValueError):
        chunk_budget(512, 575, -1)


def test_build_chunk_with_a_tail_budget_pads_only_up_to_chunk_size() -> None:
    from tetriinfer.core.chunking import build_chunk

    chunk = build_chunk([("a", 512, 575)], 512, pad=True, budget=575)
    assert [(s.request_id, s.start, s.num_tokens) for s in chunk.slices] == [("a", 512, 575)]
    assert chunk.num_padding == 0 and chunk.chunk_size == 512
    shrunk = build_chunk([("a", 0, 575)], 512, admit=lambda rid, start, n: 100, pad=True, budget=575)
    assert shrunk.num_real_tokens == 100 and shrunk.num_padding == 412  # padded to chunk_size, not to the budget
    with pytest.raises(ValueError, match="budget"):
        build_chunk([("a", 0, 575)], 512, budget=500)


def test_a_lone_prompt_just_past_two_chunks_is_prefilled_in_two_steps_with_a_tail_merge() -> None:
    def steps(tail: int, lens: dict[str, int]) -> list[int]:
        cfg = PrefillSchedulerConfig(chunk_size=512, tail_tokens=tail, max_model_len=4096)
        sched = PrefillScheduler(cfg, KVCacheManager(1000, 16))
        for rid, n in lens.items():
            sched.add_request(make_req(rid, n))
        sizes = []
        while sched.queue:
            out, upd = step(sched)
            sizes.append(out.num_scheduled_tokens)
            for r in upd.prefilled:
                sched.release(r.request_id)
        sched.check_invariants()
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        return sizes

    assert steps(0, {"a": 1087}) == [512, 512, 63]  # the paper's fixed chunks: a 63-token step of its own
    assert steps(128, {"a": 1087}) == [512, 575]
    # a chunk grows only when it empties the queue: with more queued, every chunk but the last is chunk_size
    assert steps(128, {"a": 1087, "b": 300}) == [512, 512, 363]
    assert steps(128, {"a": 1087, "b": 900}) == [512, 512, 512, 451]
