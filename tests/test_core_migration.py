"""Live migration (core.migration) and the decode scheduler's detach / reattach / release: crafted scenarios and
properties (block accounting conserved, every request ends exactly once wherever it runs)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState, LoadReport, Role
from tetriinfer.core.migration import MigrateCommand, MigrationConfig, MigrationPlanner, pick_migrants
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import StepResult

KV = MigrationConfig(enabled=True, signal="kv", high=0.8, low=0.5, max_per_move=8)
RUNNING = MigrationConfig(enabled=True, signal="running", min_gap=4, high=0.9, max_per_move=8)
ROLES = {"d0": "decode", "d1": "decode", "d2": "decode", "p0": "prefill"}


def rep(iid: str, used: int, running: int, *, total: int = 100, state: InstanceState = InstanceState.ACTIVE,
        role: Role = Role.DECODE) -> LoadReport:
    return LoadReport(iid, role, state=state, num_running=running, num_used_blocks=used, num_free_blocks=total - used)


def decoding(rid: str, n_prompt: int, max_tokens: int = 50, outputs: int = 1) -> Request:
    req = Request(rid, [5] * n_prompt, SamplingParams(max_tokens=max_tokens))
    req.output_token_ids.extend([9] * outputs)
    req.num_computed_tokens = req.num_tokens - 1
    req.status = RequestStatus.RUNNING
    return req


# ---- planner -----------------------------------------------------------------------------------
def test_disabled_plans_nothing() -> None:
    planner = MigrationPlanner(MigrationConfig())
    assert planner.plan([rep("d0", 99, 10), rep("d1", 0, 0)], ROLES, evacuate={"d0"}) == []


def test_evacuation_spreads_everything_freest_first_and_never_past_high() -> None:
    planner = MigrationPlanner(KV)
    reports = [rep("d0", 60, 6), rep("d1", 10, 1), rep("d2", 50, 5), rep("p0", 90, 9, role=Role.PREFILL)]
    [cmd] = planner.plan(reports, ROLES, evacuate={"d0"})
    assert cmd.source == "d0" and cmd.reason == "evacuate" and cmd.count == 6
    # 10 blocks per request; d1 (10 used) is freest: it takes requests until it is as full as d2, then they
    # alternate: both end at 60 used
    assert dict(cmd.targets) == {"d1": 5, "d2": 1}
    assert planner.pending == {"d0"}
    assert planner.plan(reports, ROLES, evacuate={"d0"}) == []  # one move in flight per source
    planner.done("d0")
    assert planner.plan(reports, ROLES, evacuate={"d0"})  # asked again once it answered


def test_evacuation_moves_what_fits_and_nothing_when_peers_are_full() -> None:
    planner = MigrationPlanner(KV)
    [cmd] = planner.plan([rep("d0", 80, 8), rep("d1", 60, 6)], ROLES, evacuate={"d0"})
    assert cmd.targets == (("d1", 2),)  # 60 + 2 * 10 = 80 = high
    planner = MigrationPlanner(KV)
    assert planner.plan([rep("d0", 80, 8), rep("d1", 75, 6)], ROLES, evacuate={"d0"}) == []
    assert planner.pending == frozenset()


def test_never_to_a_leaving_draining_or_non_decode_instance() -> None:
    planner = MigrationPlanner(KV)
    reports = [rep("d0", 95, 9), rep("d1", 0, 0, state=InstanceState.DRAINING), rep("d2", 0, 0),
               rep("p0", 0, 0, role=Role.PREFILL)]
    assert planner.plan(reports, ROLES, evacuate={"d2"}) == []  # d2 leaves, d1 drains, p0 prefills
    [cmd] = planner.plan(reports, ROLES)
    assert cmd.targets[0][0] == "d2" and cmd.reason == "balance"


def test_kv_balance_sheds_to_the_pair_mean_within_max_per_move() -> None:
    planner = MigrationPlanner(KV)
    # d0 90 used / 9 running (10 per request), d1 10 used: mean 50 -> 4 requests
    assert planner.plan([rep("d0", 90, 9), rep("d1", 10, 1)], ROLES) == [
        MigrateCommand("d0", (("d1", 4),), "balance")]
    planner = MigrationPlanner(KV)
    assert planner.plan([rep("d0", 90, 9), rep("d1", 55, 5)], ROLES) == []  # target not below low
    assert planner.plan([rep("d0", 75, 9), rep("d1", 0, 0)], ROLES) == []  # source not above high
    capped = MigrationPlanner(MigrationConfig(enabled=True, high=0.8, low=0.5, max_per_move=2))
    assert capped.plan([rep("d0", 90, 9), rep("d1", 10, 1)], ROLES)[0].count == 2


def test_running_balance_halves_the_gap_and_respects_the_target_kv() -> None:
    planner = MigrationPlanner(RUNNING)
    assert planner.plan([rep("d0", 30, 10), rep("d1", 10, 2)], ROLES) == [
        MigrateCommand("d0", (("d1", 4),), "balance")]
    planner = MigrationPlanner(RUNNING)
    assert planner.plan([rep("d0", 30, 5), rep("d1", 10, 2)], ROLES) == []  # gap 3 < min_gap
    planner = MigrationPlanner(RUNNING)  # the target has room for one request of 10 blocks below high
    assert planner.plan([rep("d0", 80, 8), rep("d1", 80, 2)], ROLES)[0].count == 1


def test_two_sources_do_not_herd_onto_one_target() -> None:
    planner = MigrationPlanner(RUNNING)
    moves = planner.plan([rep("d0", 30, 12), rep("d1", 30, 12), rep("d2", 0, 0)], ROLES)
    assert [m.source for m in moves] == ["d0", "d1"]
    # d0 sends 6 to d2 (12 vs 0); d2 then runs 6: d1 sends (12 - 6) // 2 = 3, to d2 still the least running
    assert [m.targets for m in moves] == [(("d2", 6),), (("d2", 3),)]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="signal"):
        MigrationConfig(signal="busy")
    with pytest.raises(ValueError, match="low < high"):
        MigrationConfig(low=0.9, high=0.8)
    with pytest.raises(ValueError, match="min_gap"):
        MigrationConfig(min_gap=1)
    with pytest.raises(ValueError, match="max_per_move"):
        MigrationConfig(max_per_move=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 20), st.sampled_from(list(InstanceState))),
                min_size=1, max_size=5),
       st.sets(st.integers(0, 4)), st.sampled_from([KV, RUNNING]))
def test_plans_respect_the_invariants(instances, leaving, config) -> None:  # noqa: ANN001
    ids = [f"d{i}" for i in range(len(instances))]
    reports = [rep(iid, used, running, state=state) for iid, (used, running, state) in zip(ids, instances, strict=True)]
    roles = dict.fromkeys(ids, "decode")
    evacuate = {f"d{i}" for i in leaving}
    planner = MigrationPlanner(config)
    moves = planner.plan(reports, roles, evacuate)
    by_id = {r.instance_id: r for r in reports}
    sources = [m.source for m in moves]
    assert len(sources) == len(set(sources))
    for m in moves:
        assert m.count >= 1
        for target, n in m.targets:
            assert n >= 1 and target != m.source and target not in evacuate
            assert by_id[target].state is InstanceState.ACTIVE
        if m.reason == "balance":
            assert m.count <= config.max_per_move and m.source not in evacuate
        assert m.count <= by_id[m.source].num_running
    assert planner.pending == set(sources)
    again = planner.plan(reports, roles, evacuate)  # same (stale) reports: a pending source is never asked again
    assert not {m.source for m in again} & set(sources)


# ---- picking and the scheduler's side -------------------------------------------------------------
def test_pick_migrants_takes_decodes_with_the_fewest_tokens_and_not_about_to_finish() -> None:
    short, long_, ending = decoding("a", 8), decoding("b", 40), decoding("c", 2, max_tokens=3, outputs=2)
    prefilling = Request("d", [1] * 4, SamplingParams(max_tokens=9))
    assert [r.request_id for r in pick_migrants([long_, ending, prefilling, short], 5)] == ["a", "b"]
    assert [r.request_id for r in pick_migrants([long_, short], 1)] == ["a"]


def _sched(blocks: int = 40) -> DecodeScheduler:
    return DecodeScheduler(DecodeSchedulerConfig(max_model_len=4096), KVCacheManager(blocks, 4))


def _admit(s: DecodeScheduler, req: Request) -> None:
    assert s.reserve(req)
    s.on_kv_received(req.request_id)


def _step(s: DecodeScheduler) -> list[str]:
    out = s.schedule()
    s.update(out, StepResult(out.step_id, {g.request_id: 7 for g in out.segments if g.sample}))
    return [g.request_id for g in out.segments]


def test_detach_holds_blocks_out_of_the_batch_release_frees_and_reattach_resumes() -> None:
    src, dst = _sched(), _sched()
    for rid in ("a", "b"):
        _admit(src, decoding(rid, 10))
    _step(src)
    held = src.kv.num_blocks_of("a")
    req = src.detach("a")
    assert _step(src) == ["b"] and src.kv.num_blocks_of("a") == held and not src.check_invariants()
    moved = decoding("a", 10, outputs=req.num_output_tokens)  # what the target builds from the handoff
    _admit(dst, moved)
    assert src.release_migrated("a") is req and src.kv.num_blocks_of("a") == 0
    assert src.kv.num_free_blocks + src.kv.num_used_blocks == src.kv.num_blocks and "a" not in src.requests
    out = src.schedule()
    assert "a" not in out.finished_request_ids  # it left unfinished: nothing reported here
    assert _step(dst) == ["a"]
    src.detach("b")
    src.reattach("b")
    assert src.running[-1].request_id == "b"
    src.check_invariants()


def test_detach_refuses_what_is_not_a_running_decode_and_abort_frees_a_migrating_request() -> None:
    s = _sched()
    with pytest.raises(KeyError):
        s.detach("nope")
    assert s.admit_local(Request("p", [3] * 9, SamplingParams(max_tokens=5)))
    with pytest.raises(ValueError, match="not decoding"):
        s.detach("p")
    _admit(s, decoding("a", 6))
    s.detach("a")
    assert s.abort("a") is not None
    assert "a" not in s.migrating and s.kv.num_blocks_of("a") == 0
    with pytest.raises(KeyError):
        s.release_migrated("a")
    s.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(2, 20)), min_size=1, max_size=8),
       st.lists(st.sampled_from(["step", "move", "fail", "abort"]), max_size=40), st.integers(0, 2**16))
def test_migrating_between_two_schedulers_ends_every_request_once_and_conserves_blocks(
        requests, actions, seed) -> None:  # noqa: ANN001
    import random

    rng = random.Random(seed)
    a, b = _sched(60), _sched(60)
    ended: list[str] = []
    for i, (prompt, max_tokens) in enumerate(requests):
        if a.reserve(decoding(f"r{i}", prompt, max_tokens)):
            a.on_kv_received(f"r{i}")
    admitted = set(a.requests)

    def run(s: DecodeScheduler) -> None:
        out = s.schedule()
        upd = s.update(out, StepResult(out.step_id, {g.request_id: 7 for g in out.segments if g.sample}))
        ended.extend(r.request_id for r in upd.finished)

    for action in actions:
        src, dst = (a, b) if rng.random() < 0.5 else (b, a)
        if action == "step":
            run(src)
        elif action in ("move", "fail"):
            [req] = pick_migrants(src.running, 1) or [None]
            if req is None:
                continue
            src.detach(req.request_id)
            copy = decoding(req.request_id, req.num_prompt_tokens, req.sampling_params.max_tokens,
                            req.num_output_tokens)
            if action == "move" and dst.reserve(copy):
                dst.on_kv_received(req.request_id)
                src.release_migrated(req.request_id)
            else:
                src.reattach(req.request_id)
        elif src.requests:
            rid = sorted(src.requests)[0]
            src.abort(rid)
            ended.append(rid)
        for s in (a, b):
            s.check_invariants()
            assert s.kv.num_free_blocks + s.kv.num_used_blocks == s.kv.num_blocks
        assert not set(a.requests) & set(b.requests)
    for _ in range(200):
        if not a.requests and not b.requests:
            break
        run(a)
        run(b)
    assert sorted(ended) == sorted(admitted)  # each exactly once
    assert a.kv.num_used_blocks == b.kv.num_used_blocks == 0


# ---- colocated schedulers (both sides) -------------------------------------------------------------
@pytest.mark.parametrize("policy", ["vllm", "sarathi"])
def test_colocated_schedulers_hand_over_and_take_in_running_decodes(policy: str) -> None:
    from tetriinfer.core.colocated_scheduler import ColocatedSchedulerConfig, make_colocated_scheduler

    cfg = ColocatedSchedulerConfig(max_num_batched_tokens=64, max_num_seqs=3, max_model_len=512)
    src, dst = (make_colocated_scheduler(policy, cfg, KVCacheManager(30, 4)) for _ in range(2))
    for i in range(3):
        src.add_request(Request(f"r{i}", [2] * (5 + i), SamplingParams(max_tokens=20)))
    for _ in range(3):
        _step(src)
    assert len(src.running) == 3
    [req] = pick_migrants(src.running, 1)
    src.detach(req.request_id)
    src.add_request(Request("late", [2] * 4, SamplingParams(max_tokens=4)))
    _step(src)
    assert "late" not in [r.request_id for r in src.running]  # the leaving request keeps its seat
    copy = decoding(req.request_id, req.num_prompt_tokens, 20, req.num_output_tokens)
    assert dst.admit_migrant(copy)
    assert dst.kv.num_blocks_of(req.request_id) == dst.kv.pool.blocks_for_tokens(copy.num_tokens)
    assert _step(dst) == []  # nothing runs before its KV is in
    dst.on_kv_received(req.request_id)
    src.release_migrated(req.request_id)
    assert _step(dst) == [req.request_id]
    for s in (src, dst):
        s.check_invariants()
        assert s.kv.num_free_blocks + s.kv.num_used_blocks == s.kv.num_blocks
    # refusals: no seat, a context over the model, a duplicate; a failed receive frees its blocks
    full = make_colocated_scheduler(policy, ColocatedSchedulerConfig(max_num_seqs=1, max_model_len=512),
                                    KVCacheManager(30, 4))
    assert full.admit_migrant(decoding("x", 8))
    assert not full.admit_migrant(decoding("y", 8))
    with pytest.raises(ValueError):
        full.admit_migrant(decoding("x", 8))
    with pytest.raises(ValueError, match="fills the model context"):
        full.admit_migrant(decoding("z", 600))
    full.migrant_failed("x")
    assert full.kv.num_used_blocks == 0 and not full.has_unfinished()
    assert not make_colocated_scheduler(policy, cfg, KVCacheManager(2, 4)).admit_migrant(decoding("big", 20))
