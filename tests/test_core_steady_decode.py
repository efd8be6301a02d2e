"""Steady decode runs (``core.steady_decode``): jumping many decode steps at once leaves exactly the state that
``schedule()`` + ``update()`` called step by step leave, and the run length is never optimistic."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from tetriinfer.core.colocated_scheduler import (
    ColocatedSchedulerConfig,
    colocated_load_report,
    make_colocated_scheduler,
)
from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState
from tetriinfer.core.request import Request
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import StepKind, StepResult

TOKEN = 1


def _request(rng: random.Random, i: int, prefilled: bool) -> Request:
    prompt = [rng.randrange(2, 50) for _ in range(rng.randrange(1, 70))]
    stop = (TOKEN,) if rng.random() < 0.15 else ()
    params = SamplingParams(max_tokens=rng.randrange(2, 90), temperature=0.0, ignore_eos=rng.random() < 0.7,
                            min_tokens=0 if rng.random() < 0.6 else rng.randrange(0, 2), stop_token_ids=list(stop))
    req = Request(f"r{i}", prompt, params, eos_token_id=TOKEN if rng.random() < 0.5 else 0)
    if prefilled:
        req.output_token_ids.append(7)
        req.num_computed_tokens = req.num_tokens - 1
    return req


def _decode_scheduler(seed: int) -> DecodeScheduler:
    rng = random.Random(seed)
    policy = rng.choice(["greedy", "reserve-static", "reserve-dynamic"])
    kv = KVCacheManager(rng.randrange(20, 80), rng.choice([1, 4, 16]))
    sched = DecodeScheduler(DecodeSchedulerConfig(policy=policy, max_model_len=rng.randrange(60, 200)), kv)
    for i in range(rng.randrange(1, 9)):
        req = _request(rng, i, prefilled=True)
        req.predicted_lower = rng.randrange(1, 60) if rng.random() < 0.5 else None
        try:
            if sched.reserve(req):
                sched.on_kv_received(req.request_id)
        except ValueError:
            pass
    return sched


def _colocated_scheduler(seed: int) -> Any:
    rng = random.Random(seed)
    kind = rng.choice(["vllm", "sarathi"])
    kv = KVCacheManager(rng.randrange(20, 80), rng.choice([1, 4, 16]))
    sched = make_colocated_scheduler(kind, ColocatedSchedulerConfig(max_num_batched_tokens=rng.randrange(40, 300),
                                                                    max_model_len=rng.randrange(80, 200)), kv)
    for i in range(rng.randrange(1, 7)):
        try:
            sched.add_request(_request(rng, i, prefilled=False))
        except ValueError:
            pass
    for _ in range(rng.randrange(0, 12)):  # prefill (and some decode) step by step first
        out = sched.schedule()
        sched.update(out, StepResult(out.step_id, {s.request_id: TOKEN for s in out.segments if s.sample}))
    return sched


def _state(sched: Any) -> dict[str, Any]:
    kv = sched.kv
    return {
        "requests": {rid: (list(r.output_token_ids), r.num_computed_tokens, r.status) for rid, r in sched.requests.items()},
        "running": [r.request_id for r in sched.running],
        "tables": {rid: kv.block_table(rid) for rid in sched.requests},
        "free": kv.num_free_blocks,
        "step_id": sched._step_id,
        "extensions": getattr(sched, "num_extensions", None),
        "targets": dict(getattr(sched, "_target", {})),
        "preemptions": sched.num_preemptions,
    }


def _pool_order(sched: Any) -> list[int]:
    """The pool's next allocations (destructive): equal lists mean equal free lists, tier by tier."""
    return sched.kv.pool.allocate(sched.kv.num_free_blocks) or []


@pytest.mark.parametrize("build", [_decode_scheduler, _colocated_scheduler], ids=["decode", "colocated"])
def test_advancing_a_steady_run_equals_stepping_it(build: Callable[[int], Any]) -> None:
    checked_runs = 0
    for seed in range(300):
        stepped, jumped = build(seed), build(seed)
        assert _state(stepped) == _state(jumped)
        limit = random.Random(seed).randrange(1, 120)
        k = stepped.steady_steps(TOKEN, limit=limit)
        assert k == min(limit, jumped.steady_steps(TOKEN, limit=10**9))
        if k == 0:
            continue
        checked_runs += 1
        rows = [r.request_id for r in stepped.running]
        cuts = sorted(random.Random(seed + 1).sample(range(1, 2 * k + 1), min(2 * k, 4)) + [2 * k])
        done, h = 0, 0
        for cut in cuts:
            while h < cut:  # the step-by-step run, half step by half step
                if h % 2 == 0:
                    out = stepped.schedule()
                    # steady: a pure decode step of exactly the running rows, nothing preempted or ended
                    assert out.kind is StepKind.DECODE and [s.request_id for s in out.segments] == rows
                    assert not out.preempted_request_ids and not out.finished_request_ids
                else:
                    upd = stepped.update(out, StepResult(out.step_id, dict.fromkeys(rows, TOKEN)))
                    assert not upd.finished and list(upd.new_tokens) == rows
                h += 1
            # what a report reads at ``cut``, before jumping there
            ahead = jumped.steady_load_report("d", 1.5, 0.25, InstanceState.ACTIVE, done, cut)
            if isinstance(jumped, DecodeScheduler):
                assert ahead == stepped.load_report("d", 1.5, 0.25, InstanceState.ACTIVE), f"seed {seed}: {cut}"
            else:
                assert ahead == colocated_load_report(stepped, "d", 1.5, 0.25, InstanceState.ACTIVE), f"{seed}: {cut}"
            jumped.advance_steady(TOKEN, done, cut)
            done = cut
            assert _state(jumped) == _state(stepped), f"seed {seed}: half step {cut} of {2 * k}"
            if cut % 2:  # inside a step: the output the step-by-step run is executing
                assert jumped.steady_output() == out
        assert _pool_order(jumped) == _pool_order(stepped)
    assert checked_runs > 100  # the generator makes steady runs often enough for the check to mean something


@pytest.mark.parametrize("build", [_decode_scheduler, _colocated_scheduler], ids=["decode", "colocated"])
def test_a_steady_run_ends_where_something_would_change(build: Callable[[int], Any]) -> None:
    """One step past the longest steady run, stepping changes the batch: a row finishes, a block is missing
    (preemption) or the run hit its limit."""
    ended_by = set()
    for seed in range(300):
        sched = build(seed)
        k = sched.steady_steps(TOKEN, limit=10**6)
        if k == 0:
            continue
        rows = [r.request_id for r in sched.running]
        for _ in range(k):
            out = sched.schedule()
            sched.update(out, StepResult(out.step_id, dict.fromkeys(rows, TOKEN)))
        out = sched.schedule()
        upd = sched.update(out, StepResult(out.step_id, {s.request_id: TOKEN for s in out.segments if s.sample}))
        changed = bool(upd.finished or out.preempted_request_ids or [s.request_id for s in out.segments] != rows)
        assert changed, f"seed {seed}: step {k + 1} is still steady"
        ended_by.add("finish" if upd.finished else "blocks")
    assert ended_by == {"finish", "blocks"}


def test_nothing_is_steady_while_requests_wait_or_a_prefix_cache_names_blocks() -> None:
    kv = KVCacheManager(64, 4)
    sched = make_colocated_scheduler("vllm", ColocatedSchedulerConfig(), kv)
    rng = random.Random(0)
    a = _request(rng, 0, prefilled=False)
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, StepResult(out.step_id, {a.request_id: 5}))
    assert sched.steady_steps(TOKEN, 100) > 0
    sched.add_request(_request(rng, 1, prefilled=False))
    assert sched.steady_steps(TOKEN, 100) == 0  # the next step prefills the waiting prompt
    cached = make_colocated_scheduler("vllm", ColocatedSchedulerConfig(), KVCacheManager(64, 4, enable_prefix_caching=True))
    b = _request(rng, 2, prefilled=False)
    cached.add_request(b)
    out = cached.schedule()
    cached.update(out, StepResult(out.step_id, {b.request_id: 5}))
    assert cached.steady_steps(TOKEN, 100) == 0
    with pytest.raises(ValueError, match="back"):
        sched.advance_steady(TOKEN, 3, 2)
