"""Decode at a prefill instance (``core.keep_decode``): the keep rule, and the block hand-over from the prefill
scheduler to a decode scheduler sharing one KV cache (``PrefillScheduler.keep`` -> ``DecodeScheduler.adopt``)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
from tetriinfer.core.keep_decode import (
    KeepDecodeConfig,
    keep_commitment,
    keep_offer_targets,
    keep_row,
    kv_peak_blocks,
    prompt_only_instance,
    should_keep,
)
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState, LoadReport, Role
from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import StepResult

ON = KeepDecodeConfig(enabled=True, ratio=0.5, max_running=4, max_kv_fraction=0.5)


def decode_load(iid: str, running: int, queued: int = 0, state: InstanceState = InstanceState.ACTIVE) -> LoadReport:
    return LoadReport(iid, Role.DECODE, state=state, num_running=running, num_queued=queued, num_free_blocks=100,
                      block_size=16)


def keep(cfg: KeepDecodeConfig = ON, **kw: object) -> bool:
    args: dict = {"own_running": 0, "own_queued": 0, "own_committed_blocks": 0, "request_blocks": 4,
                  "pool_blocks": 100, "decode_loads": [decode_load("d0", 6), decode_load("d1", 4)]}
    args.update(kw)
    return should_keep(cfg, **args)


def test_keep_rule_on_crafted_scenarios() -> None:
    assert keep()  # 0 + 1 <= 0.5 * 4 (the least-loaded decode instance)
    assert not keep(KeepDecodeConfig())  # off by default
    assert not keep(own_queued=1)  # a prompt waits here: stay a prefill instance
    assert keep(own_running=1) and not keep(own_running=2)  # 2 + 1 > 0.5 * 4
    assert not keep(decode_loads=[decode_load("d0", 1, queued=0)])  # idle decode tier gets the request
    assert keep(decode_loads=[decode_load("d0", 1, queued=3)])  # queued decodes count as load
    assert not keep(decode_loads=[])  # nothing to compare with
    # draining decode instances are not candidates: the least-loaded ACTIVE one decides
    assert not keep(decode_loads=[decode_load("d0", 0, state=InstanceState.DRAINING), decode_load("d1", 1)])
    assert keep(decode_loads=[decode_load("d0", 0, state=InstanceState.DRAINING), decode_load("d1", 8)])
    # KV cap: kept decodes at full length stay within half the pool
    assert keep(own_committed_blocks=46, request_blocks=4) and not keep(own_committed_blocks=47, request_blocks=4)
    many = [decode_load("d0", 100)]
    assert keep(own_running=3, decode_loads=many) and not keep(own_running=4, decode_loads=many)  # max_running


def test_config_validation() -> None:
    for bad in ({"ratio": 0}, {"max_running": 0}, {"max_kv_fraction": 0}, {"max_kv_fraction": 1.5},
                {"commitment": "half"}):
        with pytest.raises(ValueError):
            KeepDecodeConfig(**bad)  # type: ignore[arg-type]


def _pair(blocks: int = 40, chunk: int = 32) -> tuple[PrefillScheduler, DecodeScheduler, KVCacheManager]:
    kv = KVCacheManager(blocks, 4)
    pre = PrefillScheduler(PrefillSchedulerConfig(policy="fcfs", chunk_size=chunk), kv)
    dec = DecodeScheduler(DecodeSchedulerConfig(policy="greedy", max_model_len=4096), kv)
    return pre, dec, kv


def _prefill_step(pre: PrefillScheduler) -> list[Request]:
    out = pre.schedule()
    return list(pre.update(out, StepResult(out.step_id, {s.request_id: 7 for s in out.segments if s.sample})).prefilled)


def _decode_step(dec: DecodeScheduler) -> list[Request]:
    out = dec.schedule()
    return list(dec.update(out, StepResult(out.step_id, {s.request_id: 9 for s in out.segments if s.sample})).finished)


def test_keep_hands_blocks_over_without_copy_or_free() -> None:
    pre, dec, kv = _pair()
    pre.add_request(Request("a", [3] * 10, SamplingParams(max_tokens=5)))
    (req,) = _prefill_step(pre)
    table = kv.block_table("a")
    dec.adopt(pre.keep("a"))
    assert not pre.has_unfinished() and kv.block_table("a") == table  # same blocks, nothing moved
    assert req.status is RequestStatus.RUNNING and dec.running == [req]
    finished: list[Request] = []
    while not finished:
        kv.check_invariants()
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
        finished = _decode_step(dec)
    assert finished == [req] and req.num_output_tokens == 5 and req.output_token_ids == [7, 9, 9, 9, 9]
    assert kv.num_free_blocks == kv.num_blocks and not dec.has_unfinished()
    with pytest.raises(KeyError):
        pre.keep("a")


def test_adopt_refuses_what_is_not_prefilled_here() -> None:
    pre, dec, kv = _pair()
    fresh = Request("f", [3] * 10, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="prefilled"):
        dec.adopt(fresh)
    pre.add_request(Request("a", [3] * 10, SamplingParams(max_tokens=5)))
    (req,) = _prefill_step(pre)
    other = Request("b", [3] * 10, SamplingParams(max_tokens=5))  # prefilled elsewhere: holds no blocks here
    other.output_token_ids.append(7)
    other.num_computed_tokens = 10
    with pytest.raises(ValueError, match="blocks"):
        dec.adopt(other)
    done = Request("c", [3] * 10, SamplingParams(max_tokens=1))
    done.output_token_ids.append(7)
    done.num_computed_tokens = 10
    with pytest.raises(ValueError, match="output tokens"):
        dec.adopt(done)
    dec.adopt(pre.keep("a"))
    with pytest.raises(ValueError, match="duplicate"):
        dec.adopt(req)
    assert dec.abort("a") is req and kv.num_free_blocks == kv.num_blocks  # abort frees the kept blocks


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.integers(12, 60))
def test_property_prefill_and_kept_decodes_share_one_pool(seed: int, blocks: int) -> None:
    """Random prompts and outputs through one prefill scheduler whose prefilled requests are either kept
    (decoded by a decode scheduler on the same KV cache) or released (sent away); prefill has priority, as in
    the runtime's step. Every request ends exactly once, free + used = pool at every step, all blocks free."""
    rng = random.Random(seed)
    pre, dec, kv = _pair(blocks=blocks, chunk=16)
    n = rng.randint(1, 12)
    reqs = [Request(f"r{i}", [3] * rng.randint(1, 30), SamplingParams(max_tokens=rng.randint(1, 20)))
            for i in range(n)]
    pending = list(reqs)
    ended: list[str] = []
    for _ in range(5000):
        if pending and rng.random() < 0.3:
            pre.add_request(pending.pop(0))
        stepped = False
        if pre.num_queued:
            out = pre.schedule()
            if not out.is_empty:
                upd = pre.update(out, StepResult(out.step_id, {s.request_id: 7 for s in out.segments if s.sample}))
                ended += [r.request_id for r in upd.finished]
                for r in upd.prefilled:
                    if rng.random() < 0.6:
                        dec.adopt(pre.keep(r.request_id))
                    else:
                        pre.release(r.request_id)
                        ended.append(r.request_id)  # sent to a decode instance: ends here
                stepped = True
        if not stepped and (dec.running or dec.suspended):
            ended += [r.request_id for r in _decode_step(dec)]
        kv.check_invariants()
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
        if not pending and not pre.has_unfinished() and not dec.has_unfinished():
            break
    assert sorted(ended) == sorted(r.request_id for r in reqs)  # each exactly once
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("rule", ["ratio", "cost"])
def test_keep_rule_read_through_dispatcher_views_decides_as_the_plain_scan(rule: str) -> None:
    """``should_keep(..., views=)`` reads the ACTIVE decode instances and the least loaded one from the dispatcher's
    view of the loads (derived in O(1) across ``Dispatcher.charge``); every decision equals the plain sort and
    scan over the same loads, on broadcasts and on charged lists alike."""
    from tetriinfer.core.dispatcher import Dispatcher, DispatcherConfig

    rng = random.Random(11)
    cfg = KeepDecodeConfig(enabled=True, rule=rule, ratio=0.7, max_running=64, min_decode_pressure=0.3,
                           cost_max_kv_fraction=0.9)
    for trial in range(40):
        n = rng.randint(1, 12)
        loads = []
        for i in rng.sample(range(40), n):
            free = rng.randint(0, 200)
            loads.append(LoadReport(f"d{i}", Role.DECODE, state=rng.choice([InstanceState.ACTIVE] * 4 + [
                InstanceState.DRAINING]), num_running=rng.randint(0, 8), num_queued=rng.randint(0, 3),
                num_free_blocks=free, num_used_blocks=200 - free, block_size=16,
                step_inflation=rng.random()))
        disp = Dispatcher(DispatcherConfig(seed=trial))
        for _ in range(30):
            kw = {"own_running": rng.randint(0, 6), "own_queued": 0, "own_committed_blocks": rng.randint(0, 60),
                  "request_blocks": rng.randint(1, 30), "pool_blocks": 200}
            assert should_keep(cfg, decode_loads=loads, views=disp.views, **kw) == should_keep(
                cfg, decode_loads=loads, **kw)
            decision = disp.choose(loads, rng.randint(1, 900), rng.choice([None, 0, 200, 400]))
            if decision.instance_id is not None:
                loads = disp.charge(loads, decision.instance_id, rng.randint(1, 900), rng.choice([None, 200]))


def _exact_peak(rows: list[tuple[int, int]], bs: int) -> int:
    """Step by step: each row adds one token per step until it has added ``left`` tokens, then ends."""
    peak = 0
    for t in range(max((left for _, left in rows), default=0) + 1):
        peak = max(peak, sum(-(-(now + t) // bs) for now, left in rows if left >= t))
    return peak


def test_commitment_defaults_to_peak_under_the_cost_rule_and_full_under_the_ratio_rule() -> None:
    assert KeepDecodeConfig(rule="cost").commitment == "peak"
    assert KeepDecodeConfig(rule="ratio").commitment == "full"
    assert KeepDecodeConfig(rule="cost", commitment="full").commitment == "full"  # the paper's count, by flag


def test_peak_commitment_counts_blocks_that_short_decodes_give_back_before_long_ones_peak() -> None:
    # two 1000-token prompts on 16-token blocks: one adds 400 tokens, the other 20: at full length together they
    # would hold 88 + 64 = 152 blocks, but the short one ends (at 64 + 64 = 128 blocks held) long before the long
    # one reaches 88
    kept, row = [(1000, 400)], (1000, 20)
    full = keep_commitment(KeepDecodeConfig(rule="cost", commitment="full"), kept, row, 16)
    peak = keep_commitment(KeepDecodeConfig(rule="cost"), kept, row, 16)
    assert full == (88, 64)
    assert _exact_peak([*kept, row], 16) == 128
    assert peak[1] == 64 and 128 <= sum(peak) < 128 + 2  # within a block per row of the exact peak
    assert sum(peak) < sum(full)
    # the keep rule then keeps under a cap that the full count would break
    cfg = KeepDecodeConfig(enabled=True, rule="cost", cost_max_kv_fraction=0.9)
    loads = [LoadReport("d0", Role.DECODE, num_running=6, num_free_blocks=10, num_used_blocks=190, block_size=16)]
    assert should_keep(cfg, own_running=1, own_queued=0, own_committed_blocks=peak[0], request_blocks=peak[1],
                       pool_blocks=150, decode_loads=loads)
    assert not should_keep(cfg, own_running=1, own_queued=0, own_committed_blocks=full[0], request_blocks=full[1],
                           pool_blocks=150, decode_loads=loads)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 120)), min_size=1, max_size=8),
       st.sampled_from([1, 4, 16]))
def test_peak_blocks_bound_the_exact_peak_and_never_exceed_every_row_at_full_length(
        rows: list[tuple[int, int]], bs: int) -> None:
    exact = _exact_peak(rows, bs)
    got = kv_peak_blocks(rows, bs)
    full = sum(-(-(now + left) // bs) for now, left in rows)
    assert exact <= got <= full
    assert got < exact + len(rows)  # above the exact peak by less than one block per row


def test_keep_row_is_the_context_now_and_what_max_tokens_may_still_add_within_the_model() -> None:
    req = Request("r", list(range(100)), SamplingParams(max_tokens=50))
    assert keep_row(req, 4096) == (100, 50)
    assert keep_row(req, 120) == (100, 20)
    req.append_output(1)
    assert keep_row(req, 4096) == (101, 49)


def test_the_first_of_two_or_more_prefill_instances_is_prompt_only_and_a_lone_one_keeps() -> None:
    assert prompt_only_instance(["p1", "p0"]) == "p0"
    assert prompt_only_instance(["p0", "p1", "p2"]) == "p0"
    assert prompt_only_instance(["p0"]) is None and prompt_only_instance([]) is None
    cfg = KeepDecodeConfig(enabled=True, rule="cost")
    assert cfg.prompt_instance and not KeepDecodeConfig(rule="ratio").prompt_instance
    loads = [LoadReport("d0", Role.DECODE, num_running=6, num_free_blocks=10, num_used_blocks=190, block_size=16)]
    args: dict = {"own_running": 0, "own_queued": 0, "own_committed_blocks": 0, "request_blocks": 4,
                  "pool_blocks": 100, "decode_loads": loads}
    assert not should_keep(cfg, instance_id="p0", prefill_ids=["p0", "p1"], **args)  # prompts never wait here
    assert should_keep(cfg, instance_id="p1", prefill_ids=["p0", "p1"], **args)
    assert should_keep(cfg, instance_id="p0", prefill_ids=["p0"], **args)  # a lone prefill instance keeps
    assert should_keep(replace(cfg, prompt_instance=False), instance_id="p0", prefill_ids=["p0", "p1"], **args)


def test_a_lone_prefill_instance_shares_the_decode_batch_only_once_decode_steps_are_inflated() -> None:
    """Under the cost rule, with the decode tier's memory roomy, a prefill instance keeps for compute while it runs
    fewer kept decodes than the least loaded decode instance. Beside another prefill instance it does so at any step
    inflation (``min_step_inflation`` 0); alone (every prompt comes through it) only from
    ``lone_min_step_inflation`` (0.5: the decode tier's steps take twice a batch-1 step)."""
    cfg = KeepDecodeConfig(enabled=True, rule="cost")
    assert cfg.min_step_inflation == 0.0 and cfg.lone_min_step_inflation == 0.5

    def decode(inflation: float) -> list[LoadReport]:
        return [LoadReport("d0", Role.DECODE, num_running=6, num_free_blocks=360, num_used_blocks=40,
                           block_size=16, step_inflation=inflation)]

    args: dict = {"own_running": 2, "own_queued": 0, "own_committed_blocks": 10, "request_blocks": 4,
                  "pool_blocks": 100, "instance_id": "p1"}
    for inflation in (0.0, 0.3, 0.49):
        assert should_keep(cfg, decode_loads=decode(inflation), prefill_ids=["p0", "p1"], **args)
        assert not should_keep(cfg, decode_loads=decode(inflation), prefill_ids=["p1"], **args)
        assert not should_keep(cfg, decode_loads=decode(inflation), prefill_ids=[], **args)  # none reported yet
    for inflation in (0.5, 0.8):
        assert should_keep(cfg, decode_loads=decode(inflation), prefill_ids=["p1"], **args)
    assert should_keep(replace(cfg, lone_min_step_inflation=0.0), decode_loads=decode(0.0), prefill_ids=["p1"],
                       **args)
    with pytest.raises(ValueError, match="lone_min_step_inflation"):
        KeepDecodeConfig(enabled=True, rule="cost", lone_min_step_inflation=1.5)
    # the memory rule is unchanged at a lone prefill instance: a tight decode pool shares its decodes at once
    full = [LoadReport("d0", Role.DECODE, num_running=6, num_free_blocks=20, num_used_blocks=380, block_size=16)]
    assert should_keep(cfg, decode_loads=full, prefill_ids=["p1"], **args)


def test_only_the_prompt_only_instance_offers_its_prefilled_requests_to_the_keeping_ones() -> None:
    """``offer_to_keepers`` (off unless asked): the prompt-only prefill instance offers to the other prefill
    instances in id order; a keeping one, a lone one and any instance without the flag, keep-decode or the prompt-only
    instance offer to none."""
    cfg = KeepDecodeConfig(enabled=True, rule="cost", offer_to_keepers=True)
    assert not KeepDecodeConfig(enabled=True, rule="cost").offer_to_keepers
    assert keep_offer_targets(cfg, "p0", ["p1", "p0"]) == ("p1",)
    assert keep_offer_targets(cfg, "p0", ["p2", "p0", "p1", "p1"]) == ("p1", "p2")
    assert keep_offer_targets(cfg, "p1", ["p0", "p1"]) == ()  # a keeping instance keeps or dispatches itself
    assert keep_offer_targets(cfg, "p0", ["p0"]) == ()  # a lone prefill instance keeps
    assert keep_offer_targets(replace(cfg, offer_to_keepers=False), "p0", ["p0", "p1"]) == ()
    assert keep_offer_targets(replace(cfg, prompt_instance=False), "p0", ["p0", "p1"]) == ()  # every one keeps
    assert keep_offer_targets(replace(cfg, enabled=False), "p0", ["p0", "p1"]) == ()
    # the keeper judges an offer by the same rule as its own prompts: room, and no prompt queued there
    loads = [LoadReport("d0", Role.DECODE, num_running=6, num_free_blocks=360, num_used_blocks=40, block_size=16)]
    args: dict = {"own_running": 2, "own_committed_blocks": 10, "request_blocks": 4, "pool_blocks": 100,
                  "decode_loads": loads, "instance_id": "p1", "prefill_ids": ["p0", "p1"]}
    assert should_keep(cfg, own_queued=0, **args) and not should_keep(cfg, own_queued=1, **args)
