"""Decode scheduler: admission policies, reservations, mispredictions, preemption, no deadlock."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.decode_scheduler import (
    DecodePolicy,
    DecodeScheduler,
    DecodeSchedulerConfig,
    PreemptionMode,
)
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import SchedulerOutput, StepKind, StepResult

BS = 4


def prefilled(rid: str, n_prompt: int, max_tokens: int, lower: int | None = None, upper: int | None = None) -> Request:
    """A request as a prefill instance hands it over: prompt computed, first token sampled."""
    req = Request(rid, [5] * n_prompt, SamplingParams(max_tokens=max_tokens))
    req.output_token_ids.append(9)
    req.num_computed_tokens = n_prompt
    req.status = RequestStatus.RUNNING
    if lower is not None:
        req.predicted_bucket, req.predicted_lower, req.predicted_upper = 0, lower, upper or lower
    return req


def make(policy: str, blocks: int, preemption: str = "recompute", max_num_seqs: int = 64) -> DecodeScheduler:
    cfg = DecodeSchedulerConfig(policy=policy, preemption=preemption, max_num_seqs=max_num_seqs, max_model_len=4096)
    return DecodeScheduler(cfg, KVCacheManager(blocks, BS))


def step(sched: DecodeScheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    res = StepResult(out.step_id, {s.request_id: 9 for s in out.segments if s.sample})
    return out, list(sched.update(out, res).finished)


def admit(sched: DecodeScheduler, req: Request) -> bool:
    ok = sched.reserve(req)
    if ok:
        sched.on_kv_received(req.request_id)
    return ok


def test_reserve_static_never_admits_beyond_pool_greedy_does() -> None:
    # prompt 4 + first token = 5 tokens -> 2 blocks now; predicted 12 outputs -> 16 tokens -> 4 blocks.
    static, greedy = make("reserve-static", 10), make("greedy", 10)
    admitted_static = [admit(static, prefilled(f"r{i}", 4, 12, lower=12)) for i in range(5)]
    admitted_greedy = [admit(greedy, prefilled(f"r{i}", 4, 12, lower=12)) for i in range(5)]
    assert admitted_static == [True, True, False, False, False]
    assert admitted_greedy == [True] * 5
    assert static.kv.num_used_blocks == 8 and greedy.kv.num_used_blocks == 10
    # With exact predictions, static never preempts; greedy must.
    while static.has_unfinished() or greedy.has_unfinished():
        o1, _ = step(static)
        o2, _ = step(greedy)
        assert not o1.preempted_request_ids
        static.check_invariants()
        greedy.check_invariants()
    assert static.num_preemptions == 0 and greedy.num_preemptions > 0


def test_reserve_dynamic_counts_on_the_shortest_running_request() -> None:
    sched = make("reserve-dynamic", 10)
    assert admit(sched, prefilled("short", 4, 4, lower=4))  # 8 tokens -> 2 blocks, 3 outputs left
    assert admit(sched, prefilled("long", 4, 20, lower=20))  # 24 tokens -> 6 blocks
    # 2 free now; "x" needs 4 at its target: fits once "short" (2 blocks) finishes -> admitted.
    x = prefilled("x", 4, 12, lower=12)
    assert sched.reserve(x)
    assert sched.kv.num_blocks_of("x") == 2 and sched.committed_blocks() == 2
    # Nothing more fits even after the shortest finishes.
    assert not sched.reserve(prefilled("y", 4, 4, lower=4))
    static = make("reserve-static", 10)
    assert admit(static, prefilled("short", 4, 4, lower=4)) and admit(static, prefilled("long", 4, 20, lower=20))
    assert not static.reserve(prefilled("x", 4, 12, lower=12))
    sched.on_kv_received("x")
    while sched.has_unfinished():
        step(sched)
        sched.check_invariants()
    assert sched.kv.num_free_blocks == 10


def test_misprediction_extends_when_blocks_are_free() -> None:
    sched = make("reserve-static", 20)
    req = prefilled("a", 4, 20, lower=4)  # predicted 4, truly 20
    assert admit(sched, req)
    assert sched.kv.num_blocks_of("a") == 2
    while sched.has_unfinished():
        step(sched)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 20
    assert sched.num_extensions > 0 and sched.num_preemptions == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_misprediction_preempts_youngest_and_resumes(mode: str) -> None:
    sched = make("reserve-static", 6, preemption=mode)
    old = prefilled("old", 4, 16, lower=4)  # predicted 8 tokens -> 2 blocks, truly 20 tokens
    young = prefilled("young", 4, 12, lower=12)  # 16 tokens -> 4 blocks, exact: the pool is full
    assert admit(sched, old) and admit(sched, young)
    seen_preempt = seen_resume = False
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out, _ = step(sched)
        sched.check_invariants()
        if out.preempted_request_ids:
            assert out.preempted_request_ids == ("young",)  # the youngest, never the oldest
            seen_preempt = True
            if mode == "swap":
                assert [rid for rid, _ in out.swapped_out] == ["young"]
        segs = {s.request_id: s for s in out.segments}
        if seen_preempt and not seen_resume and "young" in segs:
            seen_resume = True
            seg = segs["young"]
            assert seg.sample and seg.end == young.num_tokens - 1  # young got its token in update
            if mode == "recompute":  # re-prefilled here: prompt + outputs as one prefill segment
                assert seg.start == 0 and seg.num_tokens == young.num_tokens - 1
                assert out.kind in (StepKind.PREFILL, StepKind.MIXED)
            else:  # swapped back in: its K/V is copied back, it decodes one token
                assert [rid for rid, _ in out.swapped_in] == ["young"] and seg.num_tokens == 1
                assert len(out.swapped_in[0][1]) == -(-seg.start // BS)
    assert seen_preempt and seen_resume
    assert old.num_output_tokens == 16 and young.num_output_tokens == 12
    assert sched.kv.num_free_blocks == 6


def test_transfer_failure_frees_and_hands_back() -> None:
    sched = make("greedy", 10)
    req = prefilled("a", 10, 4)
    assert sched.reserve(req)
    assert sched.kv.num_used_blocks == 3
    assert sched.schedule().kind is StepKind.IDLE  # not runnable before its KV arrives
    assert sched.transfer_failed("a") is req
    assert sched.kv.num_free_blocks == 10 and not sched.has_unfinished()
    with pytest.raises(KeyError):
        sched.on_kv_received("a")


def test_reserve_refusals_and_errors() -> None:
    sched = make("greedy", 4, max_num_seqs=1)
    assert admit(sched, prefilled("a", 2, 2))
    assert not sched.reserve(prefilled("b", 2, 2))  # max_num_seqs
    with pytest.raises(ValueError, match="cannot fit"):
        make("greedy", 2).reserve(prefilled("huge", 20, 2))
    with pytest.raises(ValueError, match="prefilled"):
        sched.reserve(Request("raw", [1, 2], SamplingParams()))
    with pytest.raises(ValueError, match="unknown decode policy"):
        DecodeSchedulerConfig(policy="lazy")


def test_lone_request_larger_than_pool_finishes_with_length_instead_of_hanging() -> None:
    sched = make("greedy", 3)
    req = prefilled("a", 4, 100)
    assert admit(sched, req)
    for _ in range(50):
        if not sched.has_unfinished():
            break
        step(sched)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_computed_tokens == 12  # every slot used
    assert sched.kv.num_free_blocks == 3


def test_load_report_counts_heavy_and_light() -> None:
    sched = make("greedy", 50)
    admit(sched, prefilled("h", 4, 300, lower=200, upper=400))
    sched.reserve(prefilled("l", 4, 10, lower=0, upper=200))
    rep = sched.load_report("d0", now=3.0)
    assert (rep.num_heavy_decodes, rep.num_light_decodes) == (1, 1)
    assert (rep.num_running, rep.num_queued, rep.time) == (1, 1, 3.0)
    assert rep.num_free_blocks + rep.num_used_blocks == 50


# ---- property test -------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(list(DecodePolicy)),
    mode=st.sampled_from(list(PreemptionMode)),
    blocks=st.integers(6, 30),
    max_num_seqs=st.integers(1, 6),
    reqs=st.lists(
        st.tuples(st.integers(1, 20), st.integers(2, 30), st.integers(0, 40), st.booleans()), min_size=1, max_size=12
    ),
    seed=st.integers(0, 10_000),
)
def test_property_decode(
    policy: DecodePolicy, mode: PreemptionMode, blocks: int, max_num_seqs: int,
    reqs: list[tuple[int, int, int, bool]], seed: int,
) -> None:
    rng = random.Random(seed)
    cfg = DecodeSchedulerConfig(policy=policy, preemption=mode, max_num_seqs=max_num_seqs, max_model_len=4096)
    sched = DecodeScheduler(cfg, KVCacheManager(blocks, BS))
    pending: list[Request] = []
    for i, (n_prompt, true_len, predicted, has_pred) in enumerate(reqs):
        n_prompt = min(n_prompt, blocks * BS - 1)
        pending.append(prefilled(f"r{i}", n_prompt, true_len, lower=predicted if has_pred else None))
    ended: dict[str, Request] = {}
    in_transfer: list[tuple[int, str]] = []
    tick = 0
    bound = 50 * sum(r.sampling_params.max_tokens + r.num_prompt_tokens for r in pending) + 100
    while pending or sched.has_unfinished():
        tick += 1
        assert tick < bound, "no progress: deadlock"
        if pending and sched.reserve(pending[0]):
            free_before = sched.kv.num_free_blocks
            assert free_before >= 0
            in_transfer.append((tick + rng.randrange(0, 3), pending.pop(0).request_id))
        for due, rid in list(in_transfer):
            if due <= tick:
                in_transfer.remove((due, rid))
                if rng.random() < 0.1:
                    pending.append(sched.transfer_failed(rid))  # retried later
                else:
                    sched.on_kv_received(rid)
        out, finished = step(sched)
        sched.check_invariants()
        assert sched.kv.num_free_blocks + sched.kv.num_used_blocks == blocks
        assert len(sched.running) + len(sched.reserved) <= max_num_seqs
        for seg in out.segments:
            assert seg.end <= len(seg.block_table) * BS
        for r in finished:
            assert r.request_id not in ended, "finished twice"
            ended[r.request_id] = r
    assert len(ended) == len(reqs)
    for r in ended.values():
        if r.num_tokens < blocks * BS:  # otherwise it may legitimately hit the pool's size
            assert r.num_output_tokens == r.sampling_params.max_tokens
    assert sched.kv.num_free_blocks == blocks


def test_abort_anywhere_frees_blocks_and_ignores_the_inflight_step() -> None:
    sched = make("greedy", 6)
    a, b, c = prefilled("a", 4, 30), prefilled("b", 4, 30), prefilled("c", 4, 30)
    assert admit(sched, a) and admit(sched, b) and sched.reserve(c)
    out = sched.schedule()
    assert sched.abort("a") is a and a.status is RequestStatus.FINISHED_ABORTED
    sched.update(out, StepResult(out.step_id, {s.request_id: 9 for s in out.segments if s.sample}))
    assert a.num_output_tokens == 1  # the in-flight step's token was dropped
    assert sched.abort("c") is c and sched.abort("c") is None  # reserved, KV never arrived
    d = prefilled("d", 4, 30)
    assert admit(sched, d)
    for _ in range(40):  # b and d grow until the youngest (d) is preempted
        step(sched)
        if sched.suspended:
            break
    assert list(sched.suspended) == [d]
    assert sched.abort("d") is d and sched.abort("b") is b
    assert sched.kv.num_free_blocks == 6 and not sched.has_unfinished()
    assert sched.schedule().finished_request_ids  # the ends are reported to the executor


# ---- conditional disaggregation: requests prefilled at the decode instance (admit_local) --------------
def fresh(rid: str, n_prompt: int, max_tokens: int) -> Request:
    return Request(rid, [5] * n_prompt, SamplingParams(max_tokens=max_tokens))


def test_local_prefill_runs_in_chunks_alongside_decodes_then_decodes() -> None:
    cfg = DecodeSchedulerConfig(max_model_len=4096, local_prefill_chunk=8)
    sched = DecodeScheduler(cfg, KVCacheManager(64, BS))
    assert admit(sched, prefilled("d", 4, 10))
    assert sched.admit_local(fresh("loc", 20, 3))
    assert sched.load_report("i", 0.0).num_prefill_tokens == 20
    kinds, loc_tokens = [], []
    for _ in range(3):  # 20 prompt tokens in chunks of 8, 8, 4; the running decode never stalls
        out, _ = step(sched)
        segs = {s.request_id: s for s in out.segments}
        assert segs["d"].num_tokens == 1 and segs["d"].sample
        loc_tokens.append(segs["loc"].num_tokens)
        kinds.append(out.kind)
        assert segs["loc"].sample == (len(loc_tokens) == 3)  # only the last chunk samples the first token
    assert loc_tokens == [8, 8, 4] and set(kinds) == {StepKind.MIXED}
    loc = sched.requests["loc"]
    assert loc.num_output_tokens == 1 and loc.num_computed_tokens == 20
    assert sched.load_report("i", 0.0).num_prefill_tokens == 0
    out, finished = step(sched)
    assert {s.request_id: s.num_tokens for s in out.segments} == {"d": 1, "loc": 1}
    ended = [r.request_id for r in finished]
    for _ in range(20):
        ended += [r.request_id for r in step(sched)[1]]
    assert sorted(ended) == ["d", "loc"]
    assert not sched.has_unfinished() and sched.kv.num_used_blocks == 0
    sched.check_invariants()


def test_local_prefill_budget_is_shared_oldest_first() -> None:
    cfg = DecodeSchedulerConfig(max_model_len=4096, local_prefill_chunk=10)
    sched = DecodeScheduler(cfg, KVCacheManager(64, BS))
    assert sched.admit_local(fresh("a", 7, 2)) and sched.admit_local(fresh("b", 7, 2))
    out, _ = step(sched)
    assert [(s.request_id, s.num_tokens) for s in out.segments] == [("a", 7), ("b", 3)]
    out, _ = step(sched)
    assert [(s.request_id, s.num_tokens) for s in out.segments] == [("a", 1), ("b", 4)]
    assert sched.requests["b"].num_output_tokens == 1
    sched.check_invariants()


def test_admit_local_refuses_like_reserve_and_rejects_bad_requests() -> None:
    sched = make("greedy", 4, max_num_seqs=2)  # 4 blocks of 4 tokens
    with pytest.raises(ValueError, match="unprefilled"):
        sched.admit_local(prefilled("p", 4, 4))
    with pytest.raises(ValueError, match="cannot fit"):
        sched.admit_local(fresh("big", 16, 4))  # 16 + 1 tokens need 5 blocks
    assert sched.admit_local(fresh("a", 7, 4))  # 2 blocks
    assert not sched.admit_local(fresh("b", 8, 4))  # 3 blocks, 2 free: refused, nothing held
    assert sched.admit_local(fresh("c", 3, 4))
    assert not sched.admit_local(fresh("d", 1, 4))  # no seat left (max_num_seqs=2)
    assert sched.kv.num_used_blocks == 3 and set(sched.requests) == {"a", "c"}
    static = make("reserve-static", 8)
    assert static.admit_local(fresh("s", 4, 12))  # target: 4 + 12 tokens -> 4 blocks held at once
    assert static.kv.num_blocks_of("s") == 4
    assert not static.admit_local(fresh("t", 4, 30))  # target 9 blocks > 4 free
    static.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
       st.integers(8, 40), st.integers(1, 16))
def test_mixed_local_and_transferred_requests_all_end_and_free_every_block(reqs, blocks, chunk) -> None:
    """Random mixes of handed-over and locally prefilled requests on a small pool: every admitted request
    finishes exactly once, blocks are conserved at every step and all come back."""
    cfg = DecodeSchedulerConfig(max_model_len=4096, local_prefill_chunk=chunk)
    sched = DecodeScheduler(cfg, KVCacheManager(blocks, BS))
    waiting = [(f"r{i}", local, n, m) for i, (local, n, m) in enumerate(reqs)]
    admitted: set[str] = set()
    done: list[str] = []
    for _ in range(2000):
        while waiting:
            rid, local, n, m = waiting[0]
            try:
                ok = sched.admit_local(fresh(rid, n, m)) if local else admit(sched, prefilled(rid, n, m))
            except ValueError:
                waiting.pop(0)  # can never fit this pool: refused cleanly
                continue
            if not ok:
                break
            admitted.add(rid)
            waiting.pop(0)
        if not sched.has_unfinished() and not waiting:
            break
        _, finished = step(sched)
        done.extend(r.request_id for r in finished)
        sched.check_invariants()
        assert sched.kv.num_free_blocks + sched.kv.num_used_blocks == blocks
    assert sorted(done) == sorted(admitted) and len(done) == len(set(done))
    assert sched.kv.num_used_blocks == 0


def test_token_ids_range_spans_prompt_and_output_like_their_concatenation() -> None:
    req = Request("r", [10, 11, 12, 13], SamplingParams(max_tokens=8))
    for t in (20, 21, 22):
        req.append_output(t)
    whole = [10, 11, 12, 13, 20, 21, 22]
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert req.token_ids_range(start, end) == whole[start:end], (start, end)


def test_a_lone_request_short_of_blocks_held_elsewhere_waits_and_never_ends_short() -> None:
    """Kept at a prefill instance, a decode shares the pool with the prompts being prefilled there; alone in its
    batch and out of blocks, it is preempted (and resumes when the blocks come back), not ended with
    FINISHED_LENGTH: only a context larger than the whole pool ends that way."""
    sched = make("greedy", 8)
    req = prefilled("kept", 4, 20)  # 5 tokens now, 24 at the end: 6 of the 8 blocks
    assert admit(sched, req)
    assert sched.kv.allocate_slots("prefill-side", 6 * BS)  # the prefill scheduler's prompt holds the other 6
    preempted = False
    for _ in range(60):
        out, finished = step(sched)
        preempted |= bool(out.preempted_request_ids)
        assert not finished or req.num_output_tokens == 20
        if preempted and sched.kv.num_blocks_of("prefill-side"):
            sched.kv.free_request("prefill-side")  # its prompt is prefilled and staged: the blocks come back
        if not sched.has_unfinished():
            break
    assert preempted and req.status is RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 20
    too_long = make("greedy", 4)
    big = prefilled("big", 4, 40)  # 44 tokens can never fit 4 blocks of 4
    assert admit(too_long, big)
    while too_long.has_unfinished():
        step(too_long)
    assert big.status is RequestStatus.FINISHED_LENGTH and big.num_computed_tokens == 16  # every slot used
