"""Flip policy state machine on crafted load reports."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tetriinfer.core.flip_policy import FlipAction, FlipConfig, FlipPolicy
from tetriinfer.core.load import InstanceState, LoadReport, Role


def rep(iid: str, role: Role, util: float, queued: int = 0, running: int = 0, used: int = 0) -> LoadReport:
    return LoadReport(iid, role, utilization=util, num_queued=queued, num_running=running,
                      num_free_blocks=100 - used, num_used_blocks=used)


def cluster(p_util: float, d_util: float, p1_busy: bool = False) -> list[LoadReport]:
    return [
        rep("p0", Role.PREFILL, p_util),
        rep("p1", Role.PREFILL, 0.9 if p1_busy else p_util),
        rep("d0", Role.DECODE, d_util, running=5, used=int(d_util * 100)),
    ]


def test_idle_prefill_flips_to_decode_after_window_and_drains() -> None:
    fp = FlipPolicy(FlipConfig(threshold=0.1, window_s=1.0, busy_threshold=0.5))
    assert fp.observe(cluster(0.0, 0.95), now=0.0) == []
    assert fp.observe(cluster(0.0, 0.95), now=0.5) == []  # window not elapsed
    cmds = fp.observe(cluster(0.0, 0.95), now=1.0)
    assert [(c.action, c.instance_id, c.to_role) for c in cmds] == [(FlipAction.DRAIN, "p0", Role.DECODE)]
    assert fp.state("p0") is InstanceState.DRAINING
    assert fp.annotate(cluster(0.0, 0.95))[0].state is InstanceState.DRAINING
    # p1 is the last ACTIVE prefill instance: it must not flip, however idle.
    busy_p0 = [rep("p0", Role.PREFILL, 0.0, queued=2, used=4), *cluster(0.0, 0.95)[1:]]
    assert fp.observe(busy_p0, now=5.0) == []  # p0 still has work: keeps draining
    cmds = fp.observe(cluster(0.0, 0.95), now=6.0)  # p0 empty now
    assert [(c.action, c.instance_id) for c in cmds] == [(FlipAction.SWITCH, "p0")]
    assert fp.state("p0") is InstanceState.FLIPPING
    rec = fp.on_switched("p0", now=6.007)
    assert fp.role("p0") is Role.DECODE and fp.state("p0") is InstanceState.ACTIVE
    assert rec.drain_s == pytest.approx(5.0) and rec.switch_s == pytest.approx(0.007)
    assert rec.total_s == pytest.approx(5.007) and fp.records == [rec]
    # Prefill p1 is the only prefill instance left: never flipped.
    for t in range(7, 30):
        assert all(c.instance_id != "p1" for c in fp.observe(cluster(0.0, 0.95), now=float(t)))


def test_no_flip_when_other_role_is_not_loaded_or_load_returns() -> None:
    fp = FlipPolicy(FlipConfig(threshold=0.1, window_s=1.0, busy_threshold=0.5))
    for t in range(10):
        assert fp.observe(cluster(0.0, 0.2), now=float(t)) == []  # decode not loaded
    fp2 = FlipPolicy(FlipConfig(threshold=0.1, window_s=1.0))
    assert fp2.observe(cluster(0.0, 0.9), now=0.0) == []
    assert fp2.observe(cluster(0.5, 0.9), now=0.6) == []  # load came back: timer resets
    assert fp2.observe(cluster(0.0, 0.9), now=1.2) == []
    assert [c.instance_id for c in fp2.observe(cluster(0.0, 0.9), now=2.2)] == ["p0"]


def test_decode_to_prefill_and_cooldown_and_concurrency() -> None:
    fp = FlipPolicy(FlipConfig(window_s=0.0, cooldown_s=10.0, max_concurrent=1))
    reports = [rep("p0", Role.PREFILL, 1.0, queued=40), rep("d0", Role.DECODE, 0.0), rep("d1", Role.DECODE, 0.0),
               rep("d2", Role.DECODE, 0.0)]
    cmds = fp.observe(reports, now=0.0)
    assert [(c.instance_id, c.to_role) for c in cmds] == [("d0", Role.PREFILL)]  # one at a time
    assert fp.observe(reports, now=0.1)[0].action is FlipAction.SWITCH  # d0 was empty
    assert fp.observe(reports, now=0.2) == []  # max_concurrent: d0 still flipping
    fp.on_switched("d0", now=0.3)
    assert fp.num_active(Role.PREFILL) == 2 and fp.num_active(Role.DECODE) == 2
    reports2 = [rep("p0", Role.PREFILL, 1.0), rep("d0", Role.PREFILL, 0.0), rep("d1", Role.DECODE, 0.0),
                rep("d2", Role.DECODE, 0.0)]
    cmds = fp.observe(reports2, now=1.0)
    # d0 (now prefill) is idle but cooling down; the prefill side (mean load 0.5) is still loaded, so the
    # idle decode d1 flips next, while d2 stays: never the last decode instance.
    assert [c.instance_id for c in cmds if c.action is FlipAction.DRAIN] == ["d1"]
    with pytest.raises(ValueError, match="not flipping"):
        fp.on_switched("d2", now=2.0)


def test_disabled_and_validation() -> None:
    fp = FlipPolicy(FlipConfig(enabled=False, window_s=0.0))
    assert fp.observe(cluster(0.0, 1.0), now=0.0) == [] and fp.observe(cluster(0.0, 1.0), now=5.0) == []
    with pytest.raises(ValueError, match="threshold"):
        FlipConfig(threshold=0.0)
    with pytest.raises(ValueError, match="min_per_role"):
        FlipConfig(min_per_role=0)


def test_decode_load_kv_judges_decode_instances_by_memory_not_busy_time() -> None:
    """A decode instance stepping a few short requests is busy 100% of the time with 5% of its KV used. Under the
    default measure it looks loaded, so an idle prefill instance is flipped to decode even while prompts are the
    bottleneck; with ``decode_load="kv"`` it looks idle: no prefill instance goes, and when the prefill tier is busy
    that decode instance (not the last one) is the one that flips."""
    def reports(p0_util: float) -> list[LoadReport]:
        return [rep("p0", Role.PREFILL, p0_util), rep("p1", Role.PREFILL, 0.9),
                rep("d0", Role.DECODE, 1.0, running=3, used=5), rep("d1", Role.DECODE, 1.0, running=3, used=5)]

    busy = FlipPolicy(FlipConfig(threshold=0.1, window_s=1.0))
    kv = FlipPolicy(FlipConfig(threshold=0.1, window_s=1.0, decode_load="kv"))
    for t in (0.0, 1.0):
        got_busy, got_kv = busy.observe(reports(0.0), now=t), kv.observe(reports(0.0), now=t)
    assert [(c.instance_id, c.to_role) for c in got_busy] == [("p0", Role.DECODE)]  # idle prefill -> decode
    assert got_kv == []  # prefill tier mean load 0.45 < 0.5: not loaded; decode not loaded either
    assert kv.load(reports(0.0)[2]) == pytest.approx(0.05) and busy.load(reports(0.0)[2]) == 1.0
    kv2 = FlipPolicy(FlipConfig(threshold=0.1, window_s=1.0, decode_load="kv"))
    for t in (0.0, 1.0):
        got = kv2.observe(reports(0.9), now=t)  # both prefill instances busy
    assert [(c.instance_id, c.to_role) for c in got] == [("d0", Role.PREFILL)]
    with pytest.raises(ValueError):
        FlipConfig(decode_load="util")


def test_step_inflation_measures_how_much_batching_slows_each_step() -> None:
    from tetriinfer.core.step_inflation import StepInflation

    est = StepInflation()
    est.observe(8, 0.02)
    assert est.take() == 0.0  # no batch-1 step seen yet: unknown
    est.observe(1, 0.010)
    est.observe(1, 0.012)  # t1 is the fastest batch-1 step
    est.observe(4, 0.011)
    assert est.t1 == 0.010 and est.take() == pytest.approx(1 - 0.010 / ((0.010 + 0.012 + 0.011) / 3))
    assert est.take() == 0.0  # empty window
    est.observe(32, 0.040)
    est.observe(32, 0.040, batch1_seconds=0.008)  # an executor that can cost batch 1 refines t1
    assert est.take() == pytest.approx(1 - 0.008 / 0.040)
    est.observe(2, 0.001)  # faster than t1 (noise): clamped at 0
    assert est.take() == 0.0


def test_decode_load_inflation_uses_kv_or_step_inflation() -> None:
    fp = FlipPolicy(FlipConfig(decode_load="inflation"))
    d = LoadReport("d0", Role.DECODE, utilization=1.0, num_running=30, num_free_blocks=90, num_used_blocks=10,
                   step_inflation=0.7)
    assert fp.load(d) == pytest.approx(0.7)
    assert fp.load(replace(d, step_inflation=0.02)) == pytest.approx(0.1)  # KV usage
    assert fp.load(rep("p0", Role.PREFILL, 0.3)) == pytest.approx(0.3)  # prefill: busy fraction as before
    with pytest.raises(ValueError):
        LoadReport("x", Role.DECODE, step_inflation=1.5)


def test_idle_by_mean_tolerates_spikes_that_every_report_mode_does_not() -> None:
    """A prefill instance at ~5% mean load that spikes to 30% in one report of every five: never idle for a whole
    window under the default rule, idle on average under ``idle_by="mean"`` (and only after a full window)."""
    def reports(t: int) -> list[LoadReport]:
        return [rep("p0", Role.PREFILL, 0.3 if t % 5 == 0 else 0.0), rep("p1", Role.PREFILL, 0.9),
                rep("d0", Role.DECODE, 0.95, running=5, used=95)]

    every = FlipPolicy(FlipConfig(threshold=0.1, window_s=1.0))
    mean = FlipPolicy(FlipConfig(threshold=0.1, window_s=1.0, idle_by="mean"))
    flips: dict[str, list] = {"every": [], "mean": []}
    for t in range(0, 30):  # reports every 0.1 s for 3 s
        flips["every"] += every.observe(reports(t), now=t / 10)
        flips["mean"] += mean.observe(reports(t), now=t / 10)
    assert flips["every"] == []
    drains = [c for c in flips["mean"] if c.action is FlipAction.DRAIN]
    assert [(c.instance_id, c.to_role) for c in drains] == [("p0", Role.DECODE)]
    assert drains[0].time >= 1.0  # not before a whole window was seen
    with pytest.raises(ValueError):
        FlipConfig(idle_by="median")
