"""The P:D controller (core.pd_controller): its model, its flips, and what a simulated cluster keeps across them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sim_helpers import COST
from tetriinfer.bench.workloads import Workload, WorkloadRequest
from tetriinfer.core.flip_policy import FlipAction, FlipConfig
from tetriinfer.core.keep_decode import KeepDecodeConfig, should_keep
from tetriinfer.core.load import InstanceState, LoadReport, Role
from tetriinfer.core.pd_controller import (
    PDController,
    PDControllerConfig,
    TierState,
    kv_pressure,
    queue_factor,
)
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.sim.cluster import SimCluster, SimConfig
from tetriinfer.sim.shift import phase_names, phased_workload


def test_config_and_workload_names_are_validated() -> None:
    with pytest.raises(ValueError, match="policy"):
        PDControllerConfig(policy="magic")
    with pytest.raises(ValueError, match="margin"):
        PDControllerConfig(margin=1.0)
    with pytest.raises(ValueError, match="min_per_role"):
        PDControllerConfig(min_per_role=0)
    with pytest.raises(ValueError, match="rule"):
        KeepDecodeConfig(rule="always")
    with pytest.raises(ValueError, match="pd_controller"):
        ClusterConfig(model="sim", pd_controller="auto")
    with pytest.raises(ValueError, match="two phases"):
        phase_names("shift:lphd")
    assert phase_names("shift:hpld+lphd+hpld") == ["hpld", "lphd", "hpld"]


def test_the_model_prefers_the_tier_that_holds_the_requests() -> None:
    # 30 requests decoding on one instance whose steps are 3x a batch-1 step, prefill tier nearly idle
    s = TierState(n_prefill=3, n_decode=1, waiting_prefill=0.2, in_decode=30.0, prefill_offered=0.6,
                  inflation=2 / 3, kv_pressure=0.5)
    assert s.cost(3, 1) == pytest.approx(30.2)
    assert s.cost(2, 2) < 0.7 * s.cost(3, 1)  # halving the batch: 1 + 2 * 1/2 = 2 instead of 3
    # an overloaded queue keeps getting worse past 90% load (no plateau that hides the gain of one more instance)
    assert queue_factor(0.5) == pytest.approx(2.0) and queue_factor(1.5) > queue_factor(1.2) > queue_factor(0.9)
    # requests waiting for KV count as the memory they will need
    rep = LoadReport("d", Role.DECODE, num_running=4, num_queued=4, num_used_blocks=90, num_free_blocks=10)
    assert kv_pressure(rep) == pytest.approx(1.8)


def fluid_reports(roles: dict[str, Role], states: dict[str, InstanceState], prefill_work: float,
                  decode_requests: int, now: float) -> list[LoadReport]:
    """A constant load spread over the ACTIVE instances of each role: prefill busy fraction and queue from
    ``prefill_work`` (instance-units of work), decode batch and step inflation from ``decode_requests``
    (steps cost 1 + batch/8 batch-1 steps). Draining instances report empty (they drain at once)."""
    n_p = sum(1 for i, r in roles.items() if r is Role.PREFILL and states[i] is InstanceState.ACTIVE)
    n_d = sum(1 for i, r in roles.items() if r is Role.DECODE and states[i] is InstanceState.ACTIVE)
    out = []
    for iid, role in sorted(roles.items()):
        if states[iid] is not InstanceState.ACTIVE:
            out.append(LoadReport(iid, role, time=now, num_free_blocks=100))
        elif role is Role.PREFILL:
            rho = prefill_work / n_p
            queued = int(round(min(20.0, rho / max(0.05, 1 - rho)))) if rho < 1 else 20
            out.append(LoadReport(iid, role, time=now, num_queued=queued, utilization=min(1.0, rho),
                                  num_prefill_tokens=queued * 512, num_free_blocks=100))
        else:
            batch = decode_requests // n_d
            inflation = (batch / 8) / (1 + batch / 8)
            used = min(100, batch * 2)
            out.append(LoadReport(iid, role, time=now, num_running=batch, num_used_blocks=used,
                                  num_free_blocks=100 - used, step_inflation=inflation))
    return out


def drive(ctl: PDController, n_prefill: int, n_decode: int, prefill_work: float, decode_requests: int,
          seconds: float, step: float = 0.1) -> list[tuple[float, str, Role]]:
    """Run the controller on ``fluid_reports`` for ``seconds``, acting on its commands as a monitor does (a
    switch completes at the next report). Returns ``(decided_at, instance, from_role)`` per flip decided."""
    roles = {f"p{i}": Role.PREFILL for i in range(n_prefill)} | {f"d{i}": Role.DECODE for i in range(n_decode)}
    states = dict.fromkeys(roles, InstanceState.ACTIVE)
    decided: list[tuple[float, str, Role]] = []
    switching: list[str] = []
    t = 0.0
    while t <= seconds:
        for iid in switching:
            ctl.on_switched(iid, t)
            roles[iid] = roles[iid].other
            states[iid] = InstanceState.ACTIVE
        switching = []
        for cmd in ctl.observe(fluid_reports(roles, states, prefill_work, decode_requests, t), t):
            if cmd.action is FlipAction.DRAIN:
                states[cmd.instance_id] = InstanceState.DRAINING
                decided.append((t, cmd.instance_id, cmd.from_role))
            else:
                states[cmd.instance_id] = InstanceState.FLIPPING
                switching.append(cmd.instance_id)
        for role in Role:
            assert ctl.flips.num_active(role) + sum(
                1 for i, r in roles.items() if r is role and states[i] is not InstanceState.ACTIVE) >= 1
        t = round(t + step, 6)
    return decided


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_prefill=st.integers(1, 4), n_decode=st.integers(1, 4), prefill_work=st.floats(0.0, 3.0),
       decode_requests=st.integers(0, 200))
def test_constant_load_settles_without_oscillation(n_prefill: int, n_decode: int, prefill_work: float,
                                                   decode_requests: int) -> None:
    ctl = PDController(PDControllerConfig(dwell_s=1.0, smoothing_s=0.3))
    decided = drive(ctl, n_prefill, n_decode, prefill_work, decode_requests, seconds=40.0)
    # one direction only (no flip back), each instance at most once, never below one instance per role
    assert len({role for _, _, role in decided}) <= 1
    assert len({iid for _, iid, _ in decided}) == len(decided)
    assert len(decided) <= n_prefill + n_decode - 2
    # minimum dwell between decisions
    assert all(b[0] - a[0] >= 1.0 for a, b in zip(decided, decided[1:], strict=False))
    # the split it reached is kept: the timeline ends where the flips took it
    t_end, p_end, d_end = ctl.timeline[-1]
    moved = len(decided) if decided and decided[0][2] is Role.DECODE else -len(decided)
    assert (p_end, d_end) == (n_prefill + moved, n_decode - moved)


def test_adaptive_moves_the_split_toward_the_loaded_tier_and_back() -> None:
    ctl = PDController(PDControllerConfig(dwell_s=2.0, smoothing_s=0.3))
    # decode-heavy: the idle prefill instances go to decode (least loaded first), one per dwell
    assert [r for _, _, r in drive(ctl, 3, 1, 0.1, 160, seconds=20.0)] == [Role.PREFILL, Role.PREFILL]
    assert ctl.timeline[-1][1:] == (1, 3)
    # the same controller then sees a prefill flood and a light decode tier: it moves instances back
    ctl2 = PDController(PDControllerConfig(dwell_s=2.0, smoothing_s=0.3))
    back = drive(ctl2, 1, 3, 2.5, 3, seconds=20.0)
    assert back and all(r is Role.DECODE for _, _, r in back)


def test_static_never_flips_and_paper_keeps_the_idle_rule() -> None:
    static = PDController(PDControllerConfig(policy="static"))
    assert drive(static, 3, 1, 0.0, 200, seconds=10.0) == []
    paper = PDController(PDControllerConfig(policy="paper", paper=FlipConfig(window_s=0.5, busy_threshold=0.3)))
    flips = drive(paper, 2, 1, 0.0, 200, seconds=3.0)  # an idle prefill instance while decode is busy
    assert flips and flips[0][2] is Role.PREFILL
    cfg = ClusterConfig(model="sim", flip=True, pd_controller="paper", flip_window_s=0.7)
    assert cfg.pd_controller_config().paper.window_s == 0.7
    assert ClusterConfig(model="sim", flip=False, pd_controller="adaptive").pd_controller_config().policy == "static"


def test_cost_rule_keeps_decodes_only_when_the_decode_tier_is_tighter() -> None:
    cfg = KeepDecodeConfig(enabled=True, rule="cost")
    full = LoadReport("d", Role.DECODE, num_running=5, num_used_blocks=380, num_free_blocks=20)
    roomy = LoadReport("d", Role.DECODE, num_running=2, num_used_blocks=40, num_free_blocks=360)
    busy = LoadReport("d", Role.DECODE, num_running=6, num_used_blocks=40, num_free_blocks=360)
    kw = dict(own_running=2, own_committed_blocks=50, request_blocks=40, pool_blocks=400)
    assert should_keep(cfg, own_queued=0, decode_loads=[full], **kw)  # the decode pool is the tighter one
    assert not should_keep(cfg, own_queued=0, decode_loads=[roomy], **kw)  # as many kept here as decoding there
    two = dict(prefill_ids=["p0", "p1"], instance_id="p1")  # a prompt-only prefill instance beside this one
    assert should_keep(cfg, own_queued=0, decode_loads=[busy], **two, **kw)  # share a bigger batch
    assert not should_keep(KeepDecodeConfig(enabled=True, rule="cost", min_step_inflation=0.3), own_queued=0,
                           decode_loads=[busy], **two, **kw)  # ... only once batching slows its steps that much
    assert not should_keep(cfg, own_queued=0, decode_loads=[busy], **kw)  # alone: not at an uninflated step
    assert not should_keep(cfg, own_queued=1, decode_loads=[full], **kw)  # prompts wait here: stay a prefill
    assert not should_keep(cfg, own_queued=0, decode_loads=[full], own_running=1, own_committed_blocks=330,
                           request_blocks=40, pool_blocks=400)  # over 90% of its own pool


def shifting_workload(seed: int) -> Workload:
    """Short prompts with long outputs (decode-heavy), then long prompts with one token, then decode-heavy."""
    reqs = []
    t = 0.0
    for phase, (prompt, output, n) in enumerate(((16, 400, 60), (900, 1, 60), (16, 400, 60))):
        for i in range(n):
            reqs.append(WorkloadRequest(f"s{seed}-{phase}-{i}", t, prompt + (i * 7 + seed) % 13, output))
            t += 0.05
    return Workload("shift", tuple(reqs), "test", "trace", None, seed)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), policy=st.sampled_from(["adaptive", "paper"]))
def test_every_request_ends_once_and_every_block_returns_across_flips(seed: int, policy: str) -> None:
    cc = ClusterConfig(model="sim", mode="tetriinfer", prefill_instances=2, decode_instances=2, flip=True,
                       pd_controller=policy, flip_window_s=0.2, keep_decode=policy == "adaptive",
                       keep_decode_rule="cost", block_size=16)
    wl = shifting_workload(seed)
    sim = SimCluster(SimConfig(cc, num_kv_blocks=600, kv_bytes_per_token=8192, max_model_len=2048), COST)
    res = sim.run(wl)  # run() raises if a request ends twice, one is left unfinished, or a pool is not whole
    assert res.flips, "the shifting load must make the controller flip"
    assert sorted(r.request_id for r in res.records) == sorted(w.request_id for w in wl.requests)
    assert all(r.success and r.finish_s is not None for r in res.records)
    assert all(r.output_tokens == w.output_tokens for r, w in zip(res.records, wl.requests, strict=True))
    for inst in sim.instances.values():
        assert inst.kv.num_free_blocks == inst.kv.num_blocks
    assert res.split[0] == (0.0, 2, 2) and len(res.split) >= 2
    assert all(f["switched_s"] >= f["drained_s"] >= f["decided_s"] for f in res.flips)


def test_phased_workload_plays_its_phases_in_order() -> None:
    wl = phased_workload("shift:lphd+hpld", 20, 5.0, 0)
    assert len(wl) == 20 and wl.requests[0].request_id.startswith("p0-") and wl.requests[-1].request_id.startswith("p1-")
    first, second = wl.requests[:10], wl.requests[10:]
    assert max(r.arrival_s for r in first) < min(r.arrival_s for r in second)
    assert sum(r.prompt_tokens for r in second) > sum(r.prompt_tokens for r in first)


def test_serve_flags_resolve_the_controller_and_explicit_flags_win() -> None:
    import argparse

    from tetriinfer.server.cli import add_cluster_args, cluster_config_from_args

    def cfg(*argv: str) -> ClusterConfig:
        p = argparse.ArgumentParser()
        add_cluster_args(p)
        return cluster_config_from_args(p.parse_args(list(argv)), "sim")

    tetri = cfg("--mode", "tetriinfer")
    assert (tetri.pd_controller, tetri.flip, tetri.keep_decode, tetri.keep_decode_rule, tetri.local_prefill) == \
        ("adaptive", True, True, "cost", True)
    assert cfg("--mode", "distserve").pd_controller == "static" and not cfg("--mode", "distserve").flip
    paper = cfg("--mode", "tetriinfer", "--flip")
    assert (paper.pd_controller, paper.keep_decode, paper.local_prefill) == ("paper", False, False)
    static = cfg("--mode", "tetriinfer", "--pd-controller", "static")
    assert not (static.flip or static.keep_decode or static.local_prefill)
    assert not cfg("--mode", "tetriinfer", "--no-keep-decode").keep_decode
    assert tetri.dispatch_when_full == "wait" and paper.dispatch_when_full == static.dispatch_when_full == "least-loaded"
    assert cfg("--mode", "tetriinfer", "--dispatch-when-full", "least-loaded").dispatch_when_full == "least-loaded"


def test_sim_side_by_side_measures_against_the_chosen_baseline() -> None:
    from tetriinfer.bench.side_by_side import parse_columns
    from tetriinfer.sim.side_by_side import VLLM1, SimSideBySide, SimSideBySideConfig

    cols = parse_columns("tetriinfer,colocated", [], [])
    kw = dict(num_kv_blocks=400, kv_bytes_per_token=8192, max_model_len=2048, num_requests=16, rate=4.0,
              floor=False, progress=False, max_prompt_tokens=400, max_output_tokens=200)
    with pytest.raises(ValueError, match="baseline"):
        SimSideBySideConfig(("lphd",), cols, baseline="nope", **kw)  # type: ignore[arg-type]
    result, _ = SimSideBySide(SimSideBySideConfig(("lphd",), cols, baseline=VLLM1, **kw), COST).run()  # type: ignore[arg-type]
    cells = result["workloads"]["lphd"]
    assert set(cells) == {"tetriinfer", "colocated", VLLM1} and cells[VLLM1]["perf_per_dollar"] == 1.0
    assert result["meta"]["baseline"] == VLLM1
    details = result["meta"]["details"]["lphd"]
    assert details[VLLM1]["busy_per_instance_s"].keys() == {"instance-0"}  # one colocated instance
    assert details["colocated"]["perf_per_dollar_provisioned"] is not None


def test_work_counts_by_kind_not_by_the_instances_role() -> None:
    """A prefill instance busy decoding the requests it kept (no prompt queued) offers no prefill work and
    its held requests are decodes; a decode instance's local prompt backlog is prefill work waiting."""
    ctl = PDController(PDControllerConfig(smoothing_s=0.0))
    reports = [
        LoadReport("p0", Role.PREFILL, num_running=12, utilization=1.0, num_free_blocks=100),
        LoadReport("p1", Role.PREFILL, num_queued=2, num_prefill_tokens=1024, utilization=0.5, num_free_blocks=100),
        LoadReport("d0", Role.DECODE, num_running=20, num_queued=3, num_prefill_tokens=2048, num_used_blocks=40,
                   num_free_blocks=60, step_inflation=0.2),
    ]
    ctl.observe(reports, 0.0)
    s = ctl.tier_state()
    assert s is not None and (s.n_prefill, s.n_decode) == (2, 1)
    # p0's busy time was decoding: only p1's busy fraction and the queued tokens (1024 + 2048 of 4096) count
    assert s.prefill_offered == pytest.approx(0.5 + 0.25 + 0.5)
    assert s.waiting_prefill == pytest.approx(2 + 3)  # p1's queue and d0's local prompts
    assert s.in_decode == pytest.approx(12 + 20)  # p0's kept decodes and d0's running ones
