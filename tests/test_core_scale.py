"""The autoscaling rule (core.scale_policy): crafted scenarios and properties over random load sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.load import InstanceState, LoadReport, Role
from tetriinfer.core.scale_policy import ScaleAction, ScaleConfig, ScalePolicy


def rep(iid: str, util: float, *, role: Role = Role.PREFILL, state: InstanceState = InstanceState.ACTIVE,
        used: int = 0, free: int = 100, inflation: float = 0.0, queued: int = 0, running: int = 0) -> LoadReport:
    return LoadReport(iid, role, state=state, utilization=util, num_used_blocks=used, num_free_blocks=free,
                      step_inflation=inflation, num_queued=queued, num_running=running)


def drive(policy: ScalePolicy, reports, roles, t0: float, t1: float, dt: float = 0.1):
    """Observe the same reports every dt from t0 to t1; the commands and when they came."""
    out, t = [], t0
    while t <= t1 + 1e-9:
        out += [(round(t, 3), c) for c in policy.observe(reports, roles, t)]
        t += dt
    return out


CFG = ScaleConfig(enabled=True, high=0.8, low=0.2, window_s=2.0, cooldown_s=5.0, max_instances=4)


def test_sustained_high_load_adds_one_instance_after_the_window_and_then_waits() -> None:
    p = ScalePolicy(CFG)
    roles = {"prefill-0": "prefill", "decode-0": "decode"}
    reps = [rep("prefill-0", 0.95), rep("decode-0", 0.5, role=Role.DECODE, running=3)]
    got = drive(p, reps, roles, 0.0, 10.0)
    assert len(got) == 1  # one command in flight at a time
    t, cmd = got[0]
    assert cmd.action is ScaleAction.ADD and cmd.role == "prefill" and cmd.mean_load >= 0.8
    assert t == pytest.approx(2.0)  # not before the samples span the window
    p.finished(10.0)
    assert drive(p, reps, roles, 10.1, 14.9) == []  # cooldown
    again = drive(p, reps, roles, 15.0, 18.0)
    assert again and again[0][0] >= 17.0  # a fresh window after the cooldown


def test_a_short_spike_does_not_add() -> None:
    p = ScalePolicy(CFG)
    roles = {"prefill-0": "prefill"}
    got = drive(p, [rep("prefill-0", 0.1)], roles, 0.0, 3.0)
    got += drive(p, [rep("prefill-0", 1.0)], roles, 3.1, 3.5)  # mean over the 2 s window stays low
    assert all(c.action is not ScaleAction.ADD for _, c in got)


def test_colocated_load_is_waiting_requests_and_kv_not_busy_time() -> None:
    """A colocated instance busy all the time with its batch admitted is not overloaded; one with most of its
    requests waiting to be admitted is."""
    roles = {"instance-0": "colocated"}
    calm = [rep("instance-0", 1.0, role=Role.DECODE, running=12, used=30, free=70)]
    assert drive(ScalePolicy(CFG), calm, roles, 0.0, 5.0) == []
    swamped = [rep("instance-0", 1.0, role=Role.DECODE, running=4, queued=16, used=30, free=70)]
    got = drive(ScalePolicy(CFG), swamped, roles, 0.0, 5.0)
    assert [(c.action, c.role) for _, c in got] == [(ScaleAction.ADD, "colocated")]
    assert got[0][1].mean_load == pytest.approx(0.8)
    full = [rep("instance-0", 1.0, role=Role.DECODE, running=4, used=90, free=10)]
    assert drive(ScalePolicy(CFG), full, roles, 0.0, 5.0)[0][1].action is ScaleAction.ADD


def test_low_load_removes_the_least_loaded_then_youngest_but_never_below_min() -> None:
    p = ScalePolicy(CFG)
    roles = {"decode-0": "decode", "decode-1": "decode", "decode-2": "decode", "prefill-0": "prefill"}
    reps = [rep("decode-0", 0.0, role=Role.DECODE), rep("decode-1", 0.0, role=Role.DECODE),
            rep("decode-2", 0.1, role=Role.DECODE, inflation=0.1), rep("prefill-0", 0.5)]
    got = drive(p, reps, roles, 0.0, 3.0)
    assert [(c.action, c.instance_id) for _, c in got] == [(ScaleAction.REMOVE, "decode-1")]
    # one decode instance left and idle: nothing more to remove
    p2 = ScalePolicy(CFG)
    assert drive(p2, [rep("decode-0", 0.0, role=Role.DECODE), rep("prefill-0", 0.0)],
                 {"decode-0": "decode", "prefill-0": "prefill"}, 0.0, 5.0) == []


def test_adds_the_hotter_role_and_respects_max_instances() -> None:
    roles = {"prefill-0": "prefill", "decode-0": "decode"}
    reps = [rep("prefill-0", 0.85), rep("decode-0", 0.0, role=Role.DECODE, used=95, free=5)]
    got = drive(ScalePolicy(CFG), reps, roles, 0.0, 3.0)
    assert [(c.action, c.role) for _, c in got] == [(ScaleAction.ADD, "decode")]  # KV 95% > busy 85%
    full = {f"decode-{i}": "decode" for i in range(3)} | {"prefill-0": "prefill"}
    reps = [rep(i, 1.0, role=Role.DECODE, used=99, free=1) for i in full if i.startswith("decode")]
    assert drive(ScalePolicy(CFG), reps + [rep("prefill-0", 1.0)], full, 0.0, 5.0) == []  # 4 = max


def test_decode_load_measures() -> None:
    busy_decode = rep("decode-0", 1.0, role=Role.DECODE, used=10, free=90, inflation=0.3)
    assert ScalePolicy(ScaleConfig(decode_load="busy")).load(busy_decode, "decode") == 1.0
    assert ScalePolicy(ScaleConfig(decode_load="kv")).load(busy_decode, "decode") == pytest.approx(0.1)
    assert ScalePolicy(ScaleConfig(decode_load="inflation")).load(busy_decode, "decode") == pytest.approx(0.3)
    assert ScalePolicy(ScaleConfig(decode_load="kv")).load(busy_decode, "prefill") == 1.0
    preempted = rep("decode-0", 1.0, role=Role.DECODE, used=10, free=90, queued=3, running=1)
    assert ScalePolicy(ScaleConfig(decode_load="kv")).load(preempted, "decode") == pytest.approx(0.75)


def test_draining_instances_and_unknown_ids_are_ignored() -> None:
    p = ScalePolicy(CFG)
    reps = [rep("instance-0", 1.0, state=InstanceState.DRAINING), rep("ghost", 1.0)]
    assert drive(p, reps, {"instance-0": "colocated"}, 0.0, 5.0) == []


def test_disabled_policy_and_bad_configs() -> None:
    assert drive(ScalePolicy(ScaleConfig()), [rep("i", 1.0)], {"i": "colocated"}, 0, 10) == []
    for bad in ({"low": 0.8, "high": 0.8}, {"high": 1.5}, {"window_s": 0}, {"cooldown_s": -1},
                {"min_per_role": 0}, {"max_instances": 0}, {"decode_load": "tpot"}):
        with pytest.raises(ValueError, match="autoscale"):
            ScaleConfig(**bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.booleans()), min_size=20, max_size=200),
       st.integers(1, 3), st.integers(2, 6))
def test_property_pool_stays_within_bounds_and_one_command_at_a_time(loads, min_per_role, max_instances) -> None:
    """A simulated pool that applies every command at once and reports it finished some steps later: whatever the
    loads, the pool stays within [min_per_role per role, max_instances] (it starts inside), and no command comes
    while one is in flight."""
    cfg = ScaleConfig(enabled=True, high=0.7, low=0.3, window_s=0.5, cooldown_s=0.3, min_per_role=min_per_role,
                      max_instances=max(max_instances, 2 * min_per_role))
    p = ScalePolicy(cfg)
    pool = {f"prefill-{i}": "prefill" for i in range(min_per_role)} | {f"decode-{i}": "decode"
                                                                         for i in range(min_per_role)}
    next_id = {"prefill": min_per_role, "decode": min_per_role}
    t = 0.0
    pending = False
    for pl, dl, finish in loads:  # finish: the runtime completes the command in flight at this step
        t += 0.1
        if pending and finish:
            p.finished(t)
            pending = False
        reps = [rep(i, pl) if r == "prefill" else rep(i, dl, role=Role.DECODE, inflation=dl) for i, r in pool.items()]
        cmds = p.observe(reps, pool, t)
        assert len(cmds) <= 1
        assert not (pending and cmds), "a command while another is in flight"
        for c in cmds:
            pending = True
            if c.action is ScaleAction.ADD:
                assert 1 <= c.count <= cfg.max_step
                for _ in range(c.count):
                    pool[f"{c.role}-{next_id[c.role]}"] = c.role
                    next_id[c.role] += 1
            else:
                assert c.instance_id in pool and pool[c.instance_id] == c.role
                del pool[c.instance_id]
            assert p.observe(reps, pool, t + 0.01) == []  # in flight
        assert len(pool) <= cfg.max_instances
        for role in ("prefill", "decode"):
            assert sum(1 for r in pool.values() if r == role) >= min_per_role


def test_scale_out_is_sized_to_bring_the_role_to_the_middle_of_the_band() -> None:
    """ADD count = ceil(n x mean / ((high + low) / 2)) - n, at least 1, at most max_step and what max_instances
    leaves: a saturated pair of prefill instances (mean 1.0, band middle 0.5) asks for 2 more."""
    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}
    hot = [rep("prefill-0", 1.0), rep("prefill-1", 1.0), rep("decode-0", 0.5, role=Role.DECODE, running=3)]
    cfg = ScaleConfig(enabled=True, high=0.8, low=0.2, window_s=1.0, cooldown_s=1.0, max_instances=16)
    [(_, cmd)] = drive(ScalePolicy(cfg), hot, roles, 0.0, 1.15)
    assert cmd.action is ScaleAction.ADD and cmd.role == "prefill" and cmd.count == 2
    just = [rep("prefill-0", 0.85), rep("prefill-1", 0.85), hot[2]]  # ceil(3.4) - 2 = 2
    assert drive(ScalePolicy(cfg), just, roles, 0.0, 1.15)[0][1].count == 2
    wide = ScaleConfig(enabled=True, high=0.6, low=0.0, window_s=1.0, cooldown_s=1.0, max_instances=16)
    assert drive(ScalePolicy(wide), hot, roles, 0.0, 1.15)[0][1].count == 4  # ceil(2 / 0.3) - 2 = 5 -> max_step 4
    capped = ScaleConfig(enabled=True, high=0.8, low=0.2, window_s=1.0, cooldown_s=1.0, max_instances=4)
    assert drive(ScalePolicy(capped), hot, roles, 0.0, 1.15)[0][1].count == 1  # 3 in the pool, 4 at most
    one_step = ScaleConfig(enabled=True, high=0.6, low=0.0, window_s=1.0, cooldown_s=1.0, max_step=1)
    assert drive(ScalePolicy(one_step), hot, roles, 0.0, 1.15)[0][1].count == 1
    with pytest.raises(ValueError):
        ScaleConfig(max_step=0)


def test_step_inflation_counts_what_decodes_wait_through_on_a_colocated_instance() -> None:
    """TPOT inflation: a prefill-only step while decodes are running is a stall (its seconds count, no decode
    step); a mixed step counts whole but never teaches t1; a prefill step with no decode waiting counts nothing."""
    from tetriinfer.core.request import Request
    from tetriinfer.core.sampling_params import SamplingParams
    from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind
    from tetriinfer.core.step_inflation import StepInflation, decode_rows

    def seg(rid: str, start: int, n: int) -> ScheduledSegment:
        return ScheduledSegment(rid, start, (1,) * n, (0,), True, SamplingParams(), 0)

    decode = SchedulerOutput(1, StepKind.DECODE, (seg("a", 10, 1),))
    prefill = SchedulerOutput(2, StepKind.PREFILL, (seg("b", 0, 64),))
    mixed = SchedulerOutput(3, StepKind.MIXED, (seg("a", 11, 1), seg("b", 64, 32)))
    assert (decode_rows(decode), decode_rows(prefill), decode_rows(mixed)) == (1, 0, 1)
    decoding = Request("a", [1] * 10, SamplingParams(max_tokens=8))
    decoding.output_token_ids.append(5)
    fresh = Request("b", [1] * 96, SamplingParams(max_tokens=8))

    est = StepInflation()
    est.observe_colocated(mixed, 0.05, [decoding, fresh])
    assert est.t1 is None  # a batch-1 mixed step is not a batch-1 decode step
    est.observe_colocated(decode, 0.01, [decoding, fresh])
    assert est.t1 == 0.01
    est.take()
    est.observe_colocated(prefill, 0.03, [fresh])  # nobody decoding: not a stall
    assert est.take() == 0.0
    est.observe_colocated(prefill, 0.03, [decoding, fresh])
    est.observe_colocated(decode, 0.01, [decoding, fresh])
    assert est.take() == pytest.approx(1 - 0.01 / 0.04)  # one decode token took the stall plus its own step
    est.observe_colocated(prefill, 0.03, [decoding, fresh])
    assert est.take() == 1.0  # decodes waited all window
    est.observe_colocated(mixed, 0.02, [decoding, fresh], batch1_seconds=0.008)  # a costed batch-1 step refines t1
    assert est.t1 == 0.008 and est.take() == pytest.approx(1 - 0.008 / 0.02)


def test_decode_is_scaled_before_prefill_when_both_are_hot() -> None:
    """Both tiers saturated: decode is downstream (more prefill would only park prefilled requests), so it grows
    first even with the lower mean."""
    roles = {"prefill-0": "prefill", "decode-0": "decode"}
    reps = [rep("prefill-0", 1.0), rep("decode-0", 0.0, role=Role.DECODE, used=85, free=15, running=20)]
    cfg = ScaleConfig(enabled=True, high=0.8, low=0.2, window_s=1.0, cooldown_s=1.0, max_instances=8)
    [(_, cmd)] = drive(ScalePolicy(cfg), reps, roles, 0.0, 1.15)
    assert cmd.action is ScaleAction.ADD and cmd.role == "decode"


def test_at_the_cap_a_role_that_can_spare_an_instance_gives_one_to_the_hot_role() -> None:
    """At max_instances, decode hot: a prefill tier of 3 at mean 0.3 can lose one (3 x 0.3 / 2 = 0.45 < 0.8), so
    one prefill instance (the least loaded) is removed to make room; at mean 0.6 it could not (0.9 >= 0.8)."""
    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "prefill-2": "prefill", "decode-0": "decode"}
    hot_decode = rep("decode-0", 0.0, role=Role.DECODE, used=95, free=5, running=30)
    cfg = ScaleConfig(enabled=True, high=0.8, low=0.2, window_s=1.0, cooldown_s=1.0, max_instances=4)
    spare = [rep("prefill-0", 0.4), rep("prefill-1", 0.2), rep("prefill-2", 0.3), hot_decode]
    [(_, cmd)] = drive(ScalePolicy(cfg), spare, roles, 0.0, 1.15)
    assert cmd.action is ScaleAction.REMOVE and cmd.instance_id == "prefill-1"
    busy = [rep("prefill-0", 0.6), rep("prefill-1", 0.6), rep("prefill-2", 0.6), hot_decode]
    assert drive(ScalePolicy(cfg), busy, roles, 0.0, 3.0) == []
