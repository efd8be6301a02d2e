"""The pure policies driven together as a tiny disaggregated cluster with a fake executor.

Global policy -> prefill schedulers -> dispatcher -> decode schedulers, with the flip policy flipping
instances in place (a new scheduler of the other role over an equal, empty KV pool). Checks: every
request ends exactly once with its forced output length, no block is lost, flips drain with no lost
request and never take the last instance of a role, and the whole thing always makes progress.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
from tetriinfer.core.dispatcher import Dispatcher, DispatcherConfig
from tetriinfer.core.flip_policy import FlipAction, FlipConfig, FlipPolicy
from tetriinfer.core.global_policy import GlobalPolicy, Phase
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState, LoadReport, Role
from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig
from tetriinfer.core.request import Request
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import StepKind, StepResult

BLOCKS, BS = 64, 4


@dataclass
class Instance:
    iid: str
    sched: PrefillScheduler | DecodeScheduler
    busy: float = 0.0

    @property
    def role(self) -> Role:
        return Role.PREFILL if isinstance(self.sched, PrefillScheduler) else Role.DECODE

    def report(self, now: float) -> LoadReport:
        return self.sched.load_report(self.iid, now, utilization=self.busy)


def make_sched(role: Role, decode_policy: str) -> PrefillScheduler | DecodeScheduler:
    kv = KVCacheManager(BLOCKS, BS)
    if role is Role.PREFILL:
        return PrefillScheduler(PrefillSchedulerConfig(policy="sjf", prefill_sched_batch=4, chunk_size=32), kv)
    return DecodeScheduler(DecodeSchedulerConfig(policy=decode_policy, max_num_seqs=8), kv)


def run_cluster(
    specs: list[tuple[int, int, int]], n_prefill: int, n_decode: int, decode_policy: str, seed: int,
    flip: FlipConfig,
) -> tuple[dict[str, Request], FlipPolicy]:
    """``specs``: (arrival tick, prompt tokens, output tokens). Returns ended requests and the flip policy."""
    insts = [Instance(f"p{i}", make_sched(Role.PREFILL, decode_policy)) for i in range(n_prefill)]
    insts += [Instance(f"d{i}", make_sched(Role.DECODE, decode_policy)) for i in range(n_decode)]
    by_id = {i.iid: i for i in insts}
    g = GlobalPolicy()
    flips = FlipPolicy(flip)
    dispatcher = Dispatcher(DispatcherConfig(seed=seed, alpha_empty="wait"))
    rng = random.Random(seed)
    reqs = {f"r{k}": Request(f"r{k}", [3] * n, SamplingParams(max_tokens=m)) for k, (_, n, m) in enumerate(specs)}
    for k, r in enumerate(reqs.values()):  # predictions, sometimes wrong
        true = specs[k][2]
        guess = true if rng.random() < 0.7 else rng.randrange(0, 300)
        r.predicted_bucket, r.predicted_lower, r.predicted_upper = guess // 100, guess // 100 * 100, guess // 100 * 100 + 100
    arrivals = sorted((t, k) for k, (t, _, _) in enumerate(specs))
    arrived: list[str] = []
    ready: list[tuple[str, Request]] = []  # (prefill instance, request) awaiting dispatch
    ended: dict[str, Request] = {}
    tick = 0
    bound = 5 * sum(n + m for _, n, m in specs) + 200
    while len(ended) < len(reqs):
        tick += 1
        now = tick * 0.1
        assert tick < bound, "no progress: deadlock"
        while arrivals and arrivals[0][0] <= tick:
            rid = f"r{arrivals.pop(0)[1]}"
            g.add(rid, now, reqs[rid].num_prompt_tokens)
            arrived.append(rid)
        # Monitor: reports -> flip decisions -> broadcast with the monitor's states.
        for cmd in flips.observe([i.report(now) for i in insts], now):
            inst = by_id[cmd.instance_id]
            assert inst.role is cmd.from_role
            if cmd.action is FlipAction.SWITCH:
                assert not inst.sched.has_unfinished() and inst.sched.kv.num_used_blocks == 0
                inst.sched = make_sched(cmd.to_role, decode_policy)  # in place: same pool size, no reload
                flips.on_switched(inst.iid, now + 0.005)
        for role in Role:
            assert flips.num_active(role) >= 1, "the last instance of a role was flipped"
        loads = flips.annotate([i.report(now) for i in insts])
        for rid in list(arrived):
            target = g.route(rid, loads, now)
            if target is not None:
                assert flips.state(target) is InstanceState.ACTIVE
                by_id[target].sched.add_request(reqs[rid])
                arrived.remove(rid)
        # Prefill instances step.
        for inst in insts:
            if isinstance(inst.sched, PrefillScheduler):
                out = inst.sched.schedule()
                inst.busy = 0.0 if out.kind is StepKind.IDLE else 1.0
                res = StepResult(out.step_id, {s.request_id: 5 for s in out.segments if s.sample})
                upd = inst.sched.update(out, res)
                for r in upd.finished:
                    assert r.request_id not in ended
                    ended[r.request_id] = r
                    g.on_terminal(r.request_id, Phase.FINISHED, now)
                ready.extend((inst.iid, r) for r in upd.prefilled)
        # Dispatch + (instant) KV transfer.
        for src, req in list(ready):
            dec = dispatcher.choose(loads, req.num_tokens, req.predicted_lower)
            if dec.instance_id is None:
                continue
            assert flips.state(dec.instance_id) is InstanceState.ACTIVE
            dst = by_id[dec.instance_id].sched
            assert isinstance(dst, DecodeScheduler)
            if dst.reserve(req):
                by_id[src].sched.release(req.request_id)  # type: ignore[union-attr]
                dst.on_kv_received(req.request_id)
                g.on_dispatched(req.request_id, dec.instance_id)
                ready.remove((src, req))
                loads = flips.annotate([i.report(now) for i in insts])
        # Decode instances step.
        for inst in insts:
            if isinstance(inst.sched, DecodeScheduler):
                out = inst.sched.schedule()
                inst.busy = 0.0 if out.kind is StepKind.IDLE else 1.0
                res = StepResult(out.step_id, {s.request_id: 5 for s in out.segments if s.sample})
                for r in inst.sched.update(out, res).finished:
                    assert r.request_id not in ended
                    ended[r.request_id] = r
                    g.on_terminal(r.request_id, Phase.FINISHED, now)
        for inst in insts:
            inst.sched.check_invariants()
            assert inst.sched.kv.num_free_blocks + inst.sched.kv.num_used_blocks == BLOCKS
    for inst in insts:
        assert inst.sched.kv.num_free_blocks == BLOCKS and not inst.sched.has_unfinished()
    assert all(rec.phase is Phase.FINISHED for rec in g.records())
    return ended, flips


def test_light_prefill_heavy_decode_flips_a_prefill_instance_without_losing_requests() -> None:
    rng = random.Random(1)
    specs = [(t // 3, rng.randrange(4, 20), rng.randrange(60, 120)) for t in range(40)]
    ended, flips = run_cluster(specs, n_prefill=3, n_decode=1, decode_policy="reserve-dynamic", seed=1,
                               flip=FlipConfig(threshold=0.1, window_s=0.5, busy_threshold=0.5, cooldown_s=5.0))
    assert len(ended) == len(specs)
    for rid, r in ended.items():
        assert r.num_output_tokens == specs[int(rid[1:])][2]
    to_decode = [rec for rec in flips.records if rec.to_role is Role.DECODE]
    assert to_decode, "an idle prefill instance should have flipped to decode"
    assert all(abs(rec.switch_s - 0.005) < 1e-9 and rec.drain_s >= 0 for rec in flips.records)


@settings(max_examples=25, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 60), st.integers(1, 60)), min_size=1, max_size=16),
    n_prefill=st.integers(1, 2),
    n_decode=st.integers(1, 2),
    decode_policy=st.sampled_from(["greedy", "reserve-static", "reserve-dynamic"]),
    seed=st.integers(0, 1000),
    flip_on=st.booleans(),
)
def test_property_cluster(
    specs: list[tuple[int, int, int]], n_prefill: int, n_decode: int, decode_policy: str, seed: int, flip_on: bool
) -> None:
    flip = FlipConfig(enabled=flip_on, threshold=0.2, window_s=0.2, busy_threshold=0.3, cooldown_s=1.0)
    ended, _ = run_cluster(specs, n_prefill, n_decode, decode_policy, seed, flip)
    assert len(ended) == len(specs)
    for rid, r in ended.items():
        assert r.num_output_tokens == specs[int(rid[1:])][2]
