"""The cluster simulator: event loop, cost models, links, simulated clusters in every mode, parity with the
runtime's instance loops, and the simulated side-by-side report."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sim_helpers import COST, PROFILE
from tetriinfer.bench.metrics import summarize
from tetriinfer.bench.side_by_side import CELL_KEYS, parse_columns
from tetriinfer.bench.workloads import Workload, WorkloadRequest, load_workload
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.sim.cluster import SimCluster, SimConfig, SimResult
from tetriinfer.sim.cost_model import (
    HARDWARE_PRESETS,
    ProfileCostModel,
    RooflineCostModel,
    kv_bytes_per_token,
    model_config,
)
from tetriinfer.sim.events import EventLoop
from tetriinfer.sim.instances import SimPrefill
from tetriinfer.sim.link import Links
from tetriinfer.sim.side_by_side import SimSideBySide, SimSideBySideConfig, markdown_report

P = SamplingParams(max_tokens=4)


def seg(rid: str, start: int, n: int, sample: bool = True) -> ScheduledSegment:
    return ScheduledSegment(rid, start, tuple([5] * n), tuple(range(-(-(start + n) // 16))), sample, P, 0)


# ------------------------------------------------------------------------------------------ event loop


def test_event_loop_runs_in_time_order_with_ties_in_scheduling_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for name, t in (("c", 2.0), ("a", 1.0), ("b", 1.0), ("d", 1.0)):
        loop.at(t, lambda name=name: seen.append((loop.now, name)))
    loop.at(0.5, lambda: loop.after(0.5, lambda: seen.append((loop.now, "e"))))  # scheduled later, same time
    assert loop.run() == 6
    assert seen == [(1.0, "a"), (1.0, "b"), (1.0, "d"), (1.0, "e"), (2.0, "c")]
    with pytest.raises(ValueError):
        loop.at(1.5, lambda: None)  # the past
    with pytest.raises(ValueError):
        loop.after(-1, lambda: None)
    loop.at(10.0, lambda: None)
    assert loop.run(until=5.0) == 0 and loop.now == 5.0 and loop.pending == 1


# ------------------------------------------------------------------------------------------ cost models


def test_profile_cost_model_interpolates_measured_points() -> None:
    assert COST.prefill_seconds(128) == pytest.approx(0.06)
    assert COST.prefill_seconds(320) == pytest.approx(0.06 + (0.22 - 0.06) * (320 - 128) / (512 - 128))
    assert COST.prefill_seconds(2048) == pytest.approx(0.45 + (0.45 - 0.22) * (2048 - 1024) / 512)  # extrapolated
    assert COST.decode_seconds(8) == pytest.approx(0.0154 + (0.0347 - 0.0154) * 4 / 12)
    # a pure decode step costs the decode curve at its batch; any prompt tokens make it a prefill-curve step
    dec = SchedulerOutput(1, StepKind.DECODE, tuple(seg(f"r{i}", 100, 1) for i in range(4)))
    assert COST.step_seconds(dec) == pytest.approx(0.0154)
    mixed = SchedulerOutput(2, StepKind.MIXED, (seg("p", 0, 124, sample=False), *dec.segments))
    assert COST.step_seconds(mixed) == pytest.approx(0.06)
    padded = SchedulerOutput(3, StepKind.PREFILL, (seg("p", 0, 100),), num_padding_tokens=412)
    assert COST.step_seconds(padded) == pytest.approx(0.22)
    assert COST.step_seconds(SchedulerOutput(4, StepKind.IDLE)) == 0.0
    with_overhead = ProfileCostModel.from_profile(PROFILE, step_overhead_s=0.002)
    assert with_overhead.step_seconds(dec) == pytest.approx(0.0174)
    for bad in ({**PROFILE, "decode": []}, {**PROFILE, "prefill": [{"tokens": 16, "seconds": 0.0}]},
                {**PROFILE, "prefill": [{"tokens": 0, "seconds": 0.1}]}):
        with pytest.raises(ValueError):
            ProfileCostModel.from_profile(bad)
    repeated = {**PROFILE, "prefill": [{"tokens": 64, "seconds": 0.1}, {"tokens": 64, "seconds": 0.2}]}
    assert ProfileCostModel.from_profile(repeated).prefill == ((64, 0.1),)  # a size measured twice: the faster


def test_several_profiles_give_their_lower_envelope() -> None:
    """Noise only adds time: the fastest measurement of each size wins, and no size costs more than a larger one."""
    a = {"prefill": [{"tokens": 16, "seconds": 0.02}, {"tokens": 64, "seconds": 0.05}],
         "decode": [{"batch": 1, "seconds": 0.010}, {"batch": 2, "seconds": 0.016}, {"batch": 4, "seconds": 0.015}]}
    b = {"prefill": [{"tokens": 16, "seconds": 0.03}, {"tokens": 64, "seconds": 0.04}, {"tokens": 128, "seconds": 0.08}],
         "decode": [{"batch": 1, "seconds": 0.012}, {"batch": 2, "seconds": 0.013}, {"batch": 4, "seconds": 0.018}]}
    cost = ProfileCostModel.from_profile([a, b])
    assert cost.prefill == ((16, 0.02), (64, 0.04), (128, 0.08))
    assert cost.decode == ((1, 0.010), (2, 0.013), (4, 0.015))
    one = ProfileCostModel.from_profile({**a, "decode": a["decode"]})
    assert one.decode == ((1, 0.010), (2, 0.015), (4, 0.015))  # 2 capped by 4's time


def test_roofline_matches_hand_arithmetic() -> None:
    cfg = model_config("llama-2-7b")
    assert 6.6e9 < cfg.num_params() < 6.8e9  # Llama-2-7B has 6.74B parameters
    assert kv_bytes_per_token(cfg, 2) == 2 * 32 * 32 * 128 * 2  # 512 KiB per token in fp16
    a100 = HARDWARE_PRESETS["a100-80g"]
    cost = RooflineCostModel(cfg, a100, dtype_bytes=2, mfu=0.5, mbu=0.7, step_overhead_s=0.0)
    # decode at batch 1, short context: memory-bound, ~ reading every weight once
    dec = SchedulerOutput(1, StepKind.DECODE, (seg("r", 10, 1),))
    weights = (cost.layer_params + cost.lm_head_params) * 2
    assert cost.step_seconds(dec) == pytest.approx(weights / (a100.mem_bandwidth_Bps * 0.7), rel=0.02)
    # a 2048-token prefill: compute-bound, ~ 2 FLOPs per weight per token (+ attention)
    pre = SchedulerOutput(2, StepKind.PREFILL, (seg("p", 0, 2048),))
    linear = 2.0 * cost.layer_params * 2048 / (a100.peak_flops * 0.5)
    assert linear < cost.step_seconds(pre) < linear * 1.3
    # more tokens or rows never cost less; the step overhead adds once
    costs = [cost.step_seconds(SchedulerOutput(1, StepKind.DECODE, tuple(seg(f"r{i}", 500, 1) for i in range(b))))
             for b in (1, 8, 64, 256)]
    assert costs == sorted(costs) and costs[0] < costs[-1]
    assert replace(cost, step_overhead_s=0.003).step_seconds(dec) == pytest.approx(cost.step_seconds(dec) + 0.003)
    assert 100_000 < cost.kv_capacity_tokens() < 200_000  # (72 GiB - 13.5 GB) / 512 KiB
    with pytest.raises(ValueError):
        RooflineCostModel(model_config("llama-2-13b"), HARDWARE_PRESETS["v100-32g"]).kv_capacity_tokens(0.5)
    with pytest.raises(ValueError):
        model_config("no-such-model")


def test_links_serialize_payloads_per_pair_and_add_latency() -> None:
    links = Links(bandwidth="8Gbps", latency="1ms")  # 1e9 bytes/s
    assert links.send("p", "d", 1_000_000, now=0.0) == pytest.approx(0.001 + 0.001)
    assert links.send("p", "d", 1_000_000, now=0.0) == pytest.approx(0.002 + 0.001)  # waits for the first
    assert links.send("p", "e", 1_000_000, now=0.0) == pytest.approx(0.002)  # another link: no wait
    assert links.message(5.0) == pytest.approx(5.001) and links.bytes_sent == 3_000_000


# ------------------------------------------------------------------------------------------ clusters

MODES = {
    "colocated": dict(mode="colocated"),
    "sarathi": dict(mode="sarathi"),
    "distserve": dict(mode="distserve"),
    "tetriinfer": dict(mode="tetriinfer", prefill_policy="srtf", predictor="oracle", decode_policy="reserve-dynamic"),
    "tetri-local": dict(mode="tetriinfer", prefill_policy="sjf", local_prefill=True),
    "tetri-keep": dict(mode="tetriinfer", keep_decode=True, local_prefill=True),
    "tetri-wait": dict(mode="tetriinfer", keep_decode=True, keep_decode_rule="cost", dispatch_when_full="wait",
                       local_prefill=True, pd_controller="adaptive", flip=True),
    # chunk-wise KV transfer: plain (least-loaded dispatch), and with the adaptive controller's defaults
    "tetri-chunk": dict(mode="tetriinfer", kv_transfer="chunk", predictor="oracle"),
    "tetri-chunk-adaptive": dict(mode="tetriinfer", kv_transfer="chunk", keep_decode=True, keep_decode_rule="cost",
                                 dispatch_when_full="wait", local_prefill=True, pd_controller="adaptive", flip=True,
                                 flip_window_s=0.2, prefill_tail_tokens=128),
    "tetri-flip": dict(mode="tetriinfer", flip=True, flip_window_s=0.2, predictor="oracle",
                       decode_policy="reserve-static"),
    "tetri-auto": dict(mode="tetriinfer", flip=True, flip_window_s=0.2, autoscale=True, autoscale_window_s=0.3,
                       autoscale_cooldown_s=0.1, autoscale_high=0.5, autoscale_low=0.1, autoscale_max_instances=5,
                       autoscale_decode_load="busy", rebalance=True),
    "colocated-auto": dict(mode="colocated", autoscale=True, autoscale_window_s=0.3, autoscale_cooldown_s=0.1,
                           autoscale_high=0.5, autoscale_low=0.1, autoscale_max_instances=4, rebalance=True,
                           max_num_seqs=8),
    # live migration: every decode dispatched to one of two decode instances, balanced by moving running ones
    "tetri-migrate": dict(mode="tetriinfer", prefill_instances=1, decode_instances=2, dispatch_policy="imbalanced",
                          migrate=True, migrate_signal="running", migrate_min_gap=2),
    "tetri-auto-migrate": dict(mode="tetriinfer", flip=True, flip_window_s=0.2, autoscale=True,
                               autoscale_window_s=0.3, autoscale_cooldown_s=0.1, autoscale_high=0.5,
                               autoscale_low=0.1, autoscale_max_instances=5, autoscale_decode_load="busy",
                               migrate=True),
    "colocated-auto-migrate": dict(mode="colocated", autoscale=True, autoscale_window_s=0.3, autoscale_cooldown_s=0.1,
                                   autoscale_high=0.5, autoscale_low=0.1, autoscale_max_instances=4, max_num_seqs=8,
                                   migrate=True, migrate_signal="running", migrate_min_gap=2),
}


def sim_config(name: str, blocks: int = 400, instances: int = 2, **over: object) -> SimConfig:
    kw = {"instances": instances, "prefill_instances": max(1, instances // 2),
          "decode_instances": instances - max(1, instances // 2), **MODES[name], **over}
    cc = ClusterConfig(model="sim", block_size=16, **kw)  # type: ignore[arg-type]
    return SimConfig(cc, num_kv_blocks=blocks, kv_bytes_per_token=8192, max_model_len=2048)


def check_run(wl: Workload, res_records: list) -> None:
    by_id = {r.request_id: r for r in res_records}
    assert set(by_id) == {w.request_id for w in wl.requests}
    for w in wl.requests:
        r = by_id[w.request_id]
        if w.rejected:
            assert r.rejected and not r.success
            continue
        assert r.success, (w.request_id, r.error)
        assert r.output_tokens == w.output_tokens == len(r.chunk_times_s)
        assert r.arrival_s <= r.send_s <= r.first_token_s <= r.finish_s
        assert list(r.chunk_times_s) == sorted(r.chunk_times_s)


@pytest.mark.parametrize("name", list(MODES))
def test_every_mode_finishes_every_request_with_its_length_and_frees_every_block(name: str) -> None:
    wl = load_workload("mixed", 60, 3.0, 1, max_prompt_tokens=1024, max_output_tokens=160)
    res = SimCluster(sim_config(name), COST).run(wl)  # run() itself asserts every pool is whole at the end
    check_run(wl, res.records)
    assert res.resource_s > 0 and all(v >= 0 for v in res.busy_s.values())
    if name.startswith("tetri") or name == "distserve":
        assert res.transfer_bytes > 0 or res.local_prefills + res.kept_decodes == 60
    if name == "tetri-local":
        assert res.local_prefills > 0
    if name in ("tetri-keep", "tetri-wait"):
        assert res.kept_decodes > 0
    if name == "tetri-migrate":
        assert res.migration["moved_by_reason"].get("balance", 0) > 0 and res.steps["decode-0"] > 0
    again = SimCluster(sim_config(name), COST).run(wl)  # deterministic
    assert [r.to_dict() for r in again.records] == [r.to_dict() for r in res.records]


def test_disaggregation_removes_prefill_stalls_from_decodes() -> None:
    """Heavy prompts arriving while long decodes run: colocated (prefill-first) stalls the decodes for each
    prompt, disaggregated decodes never wait for a prefill, so their TPOT is the decode step's."""
    reqs = [WorkloadRequest(f"d{i}", 0.0, 32, 200) for i in range(4)]
    reqs += [WorkloadRequest(f"p{i}", 0.2 + 0.3 * i, 1000, 2) for i in range(8)]
    wl = Workload("interference", tuple(reqs), "test", "trace", None, 0)
    tpot = {}
    for name in ("colocated", "distserve"):
        res = SimCluster(sim_config(name, instances=2), COST).run(wl)
        check_run(wl, res.records)
        tpot[name] = summarize([r for r in res.records if r.request_id.startswith("d")])["tpot"]["mean"]
    assert tpot["distserve"] < COST.decode_seconds(4) * 1.05 < tpot["colocated"]


def test_waiting_dispatch_lets_the_prefill_instance_decode_what_the_full_decode_pool_cannot_take() -> None:
    """1 prefill + 1 decode instance whose KV pool holds a few requests (the V100 regime): with
    ``dispatch_when_full=least-loaded`` every prefilled request queues at the decode instance and the prefill
    instance idles once the prompts are done; with ``wait`` the requests no decode pool has room for stay staged
    and the prefill instance decodes them itself when it has room, so both pools decode, as two colocated
    instances would."""
    reqs = tuple(WorkloadRequest(f"r{i}", 0.05 * i, 600, 300) for i in range(40))
    wl = Workload("memory-bound", reqs, "test", "trace", None, 0)
    out = {}
    for when_full in ("least-loaded", "wait"):
        cc = ClusterConfig(model="sim", mode="tetriinfer", prefill_instances=1, decode_instances=1, keep_decode=True,
                           keep_decode_rule="cost", dispatch_when_full=when_full, block_size=16)
        res = SimCluster(SimConfig(cc, num_kv_blocks=200, kv_bytes_per_token=8192, max_model_len=2048), COST).run(wl)
        check_run(wl, res.records)
        out[when_full] = (res.kept_decodes, summarize(res.records)["jct"]["mean"])
    assert out["wait"][0] > out["least-loaded"][0]
    assert out["wait"][1] < out["least-loaded"][1]


def test_flip_moves_an_idle_prefill_instance_to_decode_without_losing_requests() -> None:
    """Light prompts, long outputs, 2 prefill + 1 decode: the prefill tier idles while decode is busy."""
    reqs = tuple(WorkloadRequest(f"r{i}", 0.05 * i, 16, 400) for i in range(40))
    wl = Workload("lphd", reqs, "test", "trace", None, 0)
    cc = ClusterConfig(model="sim", mode="tetriinfer", prefill_instances=2, decode_instances=1, flip=True,
                       flip_window_s=0.3)
    res = SimCluster(SimConfig(cc, num_kv_blocks=2000, kv_bytes_per_token=8192, max_model_len=2048), COST).run(wl)
    check_run(wl, res.records)
    assert res.flips and res.flips[0]["from"] == "prefill" and res.flips[0]["to"] == "decode"
    assert all(f["switched_s"] >= f["drained_s"] >= f["decided_s"] for f in res.flips)


def test_a_flipped_instance_keeps_its_kv_pool_and_cache_statistics() -> None:
    """As the runtime switches a role in place (one KV manager for the process), the simulated flip keeps the
    instance's pool: with prefix caching on, every prompt looked up before the flip is still counted after
    it, and the shared leading blocks are found."""
    reqs = tuple(WorkloadRequest(f"r{i}", 0.05 * i, 48, 400, prefix_blocks=(0, 1, 100 + i), prefix_block_tokens=16)
                 for i in range(40))
    wl = Workload("lphd", reqs, "test", "trace", None, 0)
    cc = ClusterConfig(model="sim", mode="tetriinfer", prefill_instances=2, decode_instances=1, flip=True,
                       flip_window_s=0.3, enable_prefix_caching=True)
    res = SimCluster(SimConfig(cc, num_kv_blocks=2000, kv_bytes_per_token=8192, max_model_len=2048), COST).run(wl)
    check_run(wl, res.records)
    assert res.flips and res.flips[0]["from"] == "prefill"
    assert res.prefix_queried_tokens >= 48 * 40
    assert res.prefix_hit_tokens >= 32 * (40 - 2)  # all but the first prompt at each prefill instance


BURST = Workload("burst", tuple([WorkloadRequest(f"b{i}", i / 8, 300, 120) for i in range(120)]
                                + [WorkloadRequest(f"t{i}", 20.0 + 6.0 * i, 300, 120) for i in range(12)]),
                 "test", "trace", None, 0)  # 15 s at 8 req/s, then one request every 6 s
BURST_AUTO = dict(autoscale=True, autoscale_window_s=3.0, autoscale_cooldown_s=0.5, autoscale_high=0.6,
                  autoscale_low=0.2, autoscale_max_instances=4)


def run_burst(instances: int, **over: object) -> SimResult:
    """``BURST`` on colocated instances running at most 16 requests each; new instances serve 2 s after the
    decision. Checks every request's record."""
    cfg = replace(sim_config("colocated", blocks=2000, instances=instances, max_num_seqs=16, **over),
                  scale_out_s=2.0)
    res = SimCluster(cfg, COST).run(BURST)
    check_run(BURST, res.records)
    return res


def test_autoscale_grows_under_a_burst_and_shrinks_after_it() -> None:
    """One colocated instance (at most 16 running requests, so a burst queues), a 15 s burst at 8 req/s, then a
    sparse tail: the same scaling rule as the runtime adds instances during the burst (each taking work
    scale_out_s after the decision) and drains them away after;
    every request finishes, every pool is whole, and the pool pays fewer instance-seconds than a fixed pool of the
    peak size while finishing the burst far sooner than one instance."""
    scaled, one, peak = run_burst(1, **BURST_AUTO), run_burst(1), run_burst(4)
    actions = [e["action"] for e in scaled.scaling]
    assert actions.count("autoscale-add") >= 2 and actions.count("autoscale-remove") >= 1, scaled.scaling
    for e in scaled.scaling:
        if e["action"] == "autoscale-add":
            assert e["started_s"] == pytest.approx(e["decided_s"] + 2.0) and e["mean_load"] >= 0.6
        else:
            assert e["retired_s"] is not None and e["retired_s"] >= e["decided_s"] and e["mean_load"] <= 0.2
    assert len(scaled.alive_s) == 1 + actions.count("autoscale-add")  # ids never reused
    spans = [(0.0, min((e["retired_s"] for e in scaled.scaling if e["instance"] == "instance-0" and
                        e["action"] == "autoscale-remove"), default=scaled.duration_s))]
    for e in scaled.scaling:
        if e["action"] == "autoscale-add":
            end = next((r["retired_s"] for r in scaled.scaling if r["instance"] == e["instance"]
                        and r["action"] == "autoscale-remove"), scaled.duration_s)
            spans.append((e["started_s"], end))
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) <= 4  # never more than max at once
    assert set(scaled.busy_s) == set(scaled.alive_s)
    assert scaled.instance_s < 0.8 * peak.instance_s
    jct = {name: summarize(r.records)["jct"]["mean"] for name, r in (("auto", scaled), ("one", one))}
    assert jct["auto"] < 0.8 * jct["one"]


def test_rebalance_moves_queued_requests_onto_instances_added_by_autoscaling() -> None:
    """The burst above, autoscaled, with and without --rebalance: the backed-up first instance hands unstarted
    queued requests to the instances autoscaling adds, which cuts mean TTFT and JCT; every request still ends
    exactly once with its length; a balanced fixed pool moves nothing."""
    plain, moved = run_burst(1, **BURST_AUTO), run_burst(1, rebalance=True, **BURST_AUTO)
    s_plain, s_moved = summarize(plain.records), summarize(moved.records)
    assert plain.migrated == 0 and moved.migrated >= 10
    assert s_moved["ttft"]["mean"] < 0.9 * s_plain["ttft"]["mean"]
    assert s_moved["jct"]["mean"] < s_plain["jct"]["mean"]
    balanced = run_burst(4, rebalance=True)
    assert balanced.migrated == 0


def test_migrate_evacuates_instances_that_autoscaling_removes() -> None:
    """The burst above, autoscaled, with --migrate: an instance chosen for removal hands its running decodes to
    the instances that stay, so it leaves as soon as its queue is empty instead of after its longest decode: the
    pool pays fewer instance-seconds; every request still ends exactly once with its length."""
    wl = Workload("burst-long", tuple(sorted(
        [WorkloadRequest(f"b{i}", i / 8, 300, 120) for i in range(120)]  # the burst: autoscaling grows to 4
        + [WorkloadRequest(f"L{i}", 12.0 + 0.5 * i, 300, 1500) for i in range(6)],  # long decodes outlive it
        key=lambda w: w.arrival_s)), "test", "trace", None, 0)
    runs = {}
    for migrate in (False, True):
        cfg = replace(sim_config("colocated", blocks=2000, instances=1, max_num_seqs=16, migrate=migrate,
                                 **BURST_AUTO), scale_out_s=2.0)
        runs[migrate] = SimCluster(cfg, COST).run(wl)
        check_run(wl, runs[migrate].records)
    plain, moved = runs[False], runs[True]
    assert moved.migration["moved_by_reason"].get("evacuate", 0) > 0, moved.migration
    assert plain.migration["moved"] == 0
    assert moved.instance_s < 0.95 * plain.instance_s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(list(MODES)),
    reqs=st.lists(st.tuples(st.floats(0, 3), st.integers(1, 700), st.integers(1, 120)), min_size=1, max_size=25),
    blocks=st.integers(60, 300),
    accuracy=st.sampled_from([1.0, 0.5, 0.0]),
    bandwidth=st.sampled_from(["200Gbps", "1Gbps"]),
)
def test_property_every_request_ends_once_and_every_block_comes_back(
    name: str, reqs: list[tuple[float, int, int]], blocks: int, accuracy: float, bandwidth: str,
) -> None:
    wl = Workload("random", tuple(WorkloadRequest(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(sorted(reqs))),
                  "test", "trace", None, 0)
    cfg = replace(sim_config(name, blocks=blocks), predictor_accuracy=accuracy, link_bandwidth=bandwidth)
    res = SimCluster(cfg, COST).run(wl)  # raises SimulationStuck / AssertionError on a deadlock or a lost block
    check_run(wl, res.records)


def test_closed_loop_keeps_at_most_c_in_flight() -> None:
    wl = load_workload("lpld", 30, None, 0, max_prompt_tokens=512, max_output_tokens=64)
    res = SimCluster(replace(sim_config("colocated"), max_concurrency=3), COST).run(wl)
    check_run(wl, res.records)
    events = sorted([(r.send_s, 1) for r in res.records] + [(r.finish_s, -1) for r in res.records],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak == 3


def test_settings_the_simulator_does_not_model_are_refused() -> None:
    for over in (dict(predictor="/some/predictor"), dict(fault_drop_p=0.1)):
        with pytest.raises(ValueError, match="not simulated|simulated"):
            sim_config("tetriinfer", **over)


def test_requests_too_long_for_the_model_are_rejected_not_sent() -> None:
    reqs = (WorkloadRequest("ok", 0.0, 100, 10), WorkloadRequest("long", 0.0, 3000, 10, rejected=True, reject_reason="too long"))
    wl = Workload("caps", reqs, "test", "trace", None, 0)
    res = SimCluster(sim_config("tetriinfer"), COST).run(wl)
    check_run(wl, res.records)
    assert summarize(res.records)["rejected"] == 1


# ------------------------------------------------------------------------------------------ parity


class _RecordingRunner:
    """The runtime's model runner replaced by a recorder that samples token 1 for every sampled row."""

    def __init__(self) -> None:
        self.outputs: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput):  # noqa: ANN201
        from tetriinfer.sim.instances import synthetic_result

        self.outputs.append(out)
        return synthetic_result(out)


def _shape(outs: list[SchedulerOutput]) -> list[tuple]:
    return [(o.kind, tuple((s.request_id, s.start, s.num_tokens, s.sample) for s in o.segments))
            for o in outs if not o.is_empty]


@pytest.mark.parametrize("mode", ["colocated", "sarathi", "decode-local"])
def test_the_simulator_schedules_exactly_what_the_runtime_instance_loop_does(mode: str) -> None:
    """DESIGN section 3's parity test: the runtime's instance worker with a recording executor and the simulated
    instance with a zero-latency cost model, given the same requests, produce the same SchedulerOutput sequence."""
    from tetriinfer.core.kv_cache_manager import KVCacheManager
    from tetriinfer.runtime.colocated_worker import ColocatedWorker
    from tetriinfer.runtime.decode_worker import DecodeWorker
    from tetriinfer.runtime.instance_spec import InstanceSpec
    from tetriinfer.runtime.messages import NewRequest, WireParams
    from tetriinfer.runtime.worker_base import InstanceContext
    from tetriinfer.sim.instances import InstancePolicies, SimColocated, SimDecode

    specs = [(f"r{i}", 40 + 97 * i % 600, 3 + 11 * i % 40) for i in range(12)]
    role = "decode" if mode == "decode-local" else "colocated"
    spec = InstanceSpec("i0", role, "ipc://unused", "sim", chunk_size=256, pad_last_chunk=False,
                        colocated_policy="sarathi" if mode == "sarathi" else "vllm",
                        max_num_batched_tokens=256 if mode == "sarathi" else 2048, max_num_seqs=8)
    runner = _RecordingRunner()
    ctx = InstanceContext(spec, runner, KVCacheManager(120, 16), 2048, None, lambda m: None,  # type: ignore[arg-type]
                          lambda i, m: None)
    worker = DecodeWorker(ctx) if role == "decode" else ColocatedWorker(ctx)
    for rid, p, o in specs:
        params = WireParams.from_params(SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0))
        worker.handle(NewRequest(rid, [2] * p, params, 0.0))
    while worker.has_work() or (role == "decode" and worker.local_pending):
        worker.step()

    class Zero:
        def step_seconds(self, out: SchedulerOutput) -> float:
            return 0.0

    class Host:
        loop = EventLoop()

        def on_tokens(self, new_tokens: dict, finished: tuple) -> None: ...

    sim_runner = _RecordingRunner()
    pol = InstancePolicies(chunk_size=256, colocated_policy=spec.colocated_policy,
                           max_num_batched_tokens=spec.max_num_batched_tokens, max_num_seqs=8)
    cls = SimDecode if role == "decode" else SimColocated
    inst = cls("i0", KVCacheManager(120, 16), Zero(), Host(), pol)  # type: ignore[arg-type]
    next_step = inst.next_step

    def recording_next_step() -> SchedulerOutput | None:  # what the simulated instance executes, step by step
        out = next_step()
        if out is not None:
            sim_runner.outputs.append(out)
        return out

    inst.next_step = recording_next_step  # type: ignore[method-assign]
    from tetriinfer.core.request import Request

    for rid, p, o in specs:
        req = Request(rid, [2] * p, SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0))
        inst.add_local(req) if role == "decode" else inst.add(req)  # type: ignore[attr-defined]
    Host.loop.run()
    assert _shape(runner.outputs) and _shape(sim_runner.outputs) == _shape(runner.outputs)


# ------------------------------------------------------------------------------------------ side by side


def test_simulated_side_by_side_has_the_bench_shape_and_floor(tmp_path: Path) -> None:
    cols = parse_columns("tetriinfer,colocated,sarathi", [], ["tetriinfer:--prefill-policy srtf --local-prefill"])
    cfg = SimSideBySideConfig(("mixed", "lphd"), cols, num_kv_blocks=500, kv_bytes_per_token=8192,
                              max_model_len=2048, num_requests=40, probe_requests=16, probe_concurrency=8,
                              max_prompt_tokens=1024, max_output_tokens=192, progress=False, rate_fractions=(0.5, 1.0))
    result, raw = SimSideBySide(cfg, COST, "test").run()
    assert set(result["workloads"]) == {"mixed@50%", "mixed@100%", "lphd@50%", "lphd@100%"}
    for cells in result["workloads"].values():
        assert set(cells) == {"tetriinfer", "colocated", "sarathi"}
        for cell in cells.values():
            assert set(cell) == set(CELL_KEYS) and cell["completed"] == 40 and cell["failed"] == 0
        assert cells["colocated"]["perf_per_dollar"] == pytest.approx(1.0)
    meta = result["meta"]
    assert meta["simulated"] and set(meta["floor"]) == {"mixed", "lphd"}
    for key, cells in result["workloads"].items():  # nothing beats a request alone on an instance
        floor = meta["floor"][key.split("@")[0]]
        assert all(c["ttft_mean"] >= floor["mean_s"] * 0.999 for c in cells.values())
    assert meta["rates"]["mixed@100%"]["rate_rps"] == pytest.approx(2 * meta["rates"]["mixed@50%"]["rate_rps"])
    assert SimSideBySide(cfg, COST, "test").run()[0]["workloads"] == result["workloads"]  # deterministic
    md = markdown_report(result)
    assert "| mixed@100% | tetriinfer |" in md and "## Floor" in md and "Simulated" in md
    with pytest.raises(ValueError, match="baseline"):
        replace(cfg, columns=parse_columns("tetriinfer", [], []))


def test_sim_cli_writes_json_and_report(tmp_path: Path) -> None:
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(PROFILE))
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    from tetriinfer.cli import main

    rc = main(["sim", "side-by-side", "--cost", f"profile:{prof}", "--workloads", "lpld", "-n", "20",
               "--probe-requests", "8", "--probe-concurrency", "4", "--max-prompt-tokens", "512",
               "--max-output-tokens", "64", "--out", str(out), "--md", str(md), "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["workloads"]["lpld"]["tetriinfer"]["completed"] == 20 and "Simulated" in md.read_text()
    assert main(["sim", "side-by-side", "--cost", "roofline:tpu-v9", "--out", str(out)]) == 2
    assert main(["sim", "side-by-side", "--cost", f"profile:{tmp_path / 'missing.json'}", "--out", str(out)]) == 2


def test_simulator_never_imports_torch_or_sockets() -> None:
    code = ("import sys, tetriinfer.sim.cluster, tetriinfer.sim.side_by_side, tetriinfer.sim.cli\n"
            "print(sorted({m.split('.')[0] for m in sys.modules}))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout.replace("'", '"'))
    for bad in ("torch", "zmq", "fastapi", "uvicorn", "ray", "transformers"):
        assert bad not in loaded, bad


def test_a_request_alone_takes_exactly_its_steps_costs() -> None:
    """Colocated, one request: TTFT = front-end delay + the prefill step; then one batch-1 decode step per
    token. Disaggregated: the decode side adds the KV transfer over the link (blocks x block size x bytes)."""
    wl = Workload("one", (WorkloadRequest("r", 0.0, 128, 4),), "test", "trace", None, 0)
    for delay in (0.0, 0.05):
        rec = SimCluster(replace(sim_config("colocated"), frontend_delay_s=delay), COST).run(wl).records[0]
        assert rec.first_token_s == pytest.approx(delay + 0.06)
        assert rec.chunk_times_s[-1] == pytest.approx(delay + 0.06 + 3 * 0.011)
    cfg = replace(sim_config("distserve"), link_bandwidth="8Gbps", link_latency="1ms")  # 1e9 bytes/s
    res = SimCluster(cfg, COST).run(wl)
    rec = res.records[0]
    kv = 8 * 16 * 8192  # 128 prompt tokens = 8 blocks of 16 tokens
    assert res.transfer_bytes == kv
    assert rec.first_token_s == pytest.approx(0.06)
    assert rec.chunk_times_s[1] == pytest.approx(0.06 + 0.001 + kv / 1e9 + 0.001 + 0.011)  # handoff, KV, decode


def test_simulated_decode_instance_reports_step_inflation() -> None:
    """16 requests decoding together: each step costs the profile's batch-16 time, a batch-1 step its batch-1
    time, so the reported inflation is 1 - t1 / t16; the flip policy's ``inflation`` measure reads it."""
    from tetriinfer.core.kv_cache_manager import KVCacheManager
    from tetriinfer.core.request import Request
    from tetriinfer.sim.instances import InstancePolicies, SimDecode

    class Host:
        loop = EventLoop()

        def on_tokens(self, new_tokens: dict, finished: tuple) -> None: ...

    inst = SimDecode("d0", KVCacheManager(400, 16), COST, Host(), InstancePolicies())  # type: ignore[arg-type]
    for i in range(16):
        inst.add_local(Request(f"r{i}", [2] * 16, SamplingParams(max_tokens=200, ignore_eos=True)))
    Host.loop.run(until=0.5)  # the local prefill, then decode steps
    inst.report(0.5, 1.0)  # starts a fresh window
    Host.loop.run(until=1.0)
    rep = inst.report(1.0, 1.0)
    assert len(inst.scheduler.running) == 16
    assert rep.step_inflation == pytest.approx(1 - COST.decode_seconds(1) / COST.decode_seconds(16), rel=1e-6)


@pytest.mark.parametrize("name", ["tetriinfer", "colocated", "sarathi"])
def test_simulated_prefix_caching_finds_only_the_traces_sharing_and_saves_prefill_time(name: str) -> None:
    """Mooncake-style hash blocks (scaled): with caching the simulator reuses exactly the blocks the trace shares
    (the system block and earlier turns), every request still ends with its length, and prefill busy time drops;
    requests without hash blocks never hit (their stand-in tokens are their own)."""
    bt = 64  # tokens per hash block (a multiple of the block size: every shared block is whole)
    turns = [(0, (0, 1, 2)), (1, (0, 1, 2, 3, 4)), (2, (0, 5, 6)), (3, (0, 1, 2, 3, 4, 7, 8))]
    reqs = [WorkloadRequest(f"t{i}", 2.0 * k, len(h) * bt, 8, prefix_blocks=h, prefix_block_tokens=bt)
            for k, (i, h) in enumerate(turns)]
    reqs.append(WorkloadRequest("plain", 9.0, 300, 8))
    wl = Workload("conversations", tuple(reqs), "test", "trace", None, 0)
    over = {"sarathi": {"chunk_size": 128}}.get(name, {})
    plain = SimCluster(sim_config(name, instances=2, **over), COST).run(wl)
    cached = SimCluster(sim_config(name, instances=2, enable_prefix_caching=True, **over), COST).run(wl)
    check_run(wl, cached.records)
    assert plain.prefix_hit_tokens == 0
    if name == "tetriinfer":  # one prefill instance sees every turn: each finds all its shared leading blocks
        assert cached.prefix_hit_tokens == (3 + 1 + 5) * bt
        assert cached.resource_s < plain.resource_s
    else:  # two colocated instances: a turn finds what its instance saw, never more
        assert 0 < cached.prefix_hit_tokens <= (3 + 1 + 5) * bt
    assert cached.prefix_queried_tokens == sum(r.prompt_tokens for r in reqs)


def test_simulated_prefix_routing_keeps_conversations_on_the_instance_that_caches_them() -> None:
    """Six interleaved 4-turn conversations on two colocated instances: least-loaded routing scatters the turns
    (each instance re-prefills histories the other holds); prefix-aware routing sends turns back, finding more of
    the prefixes the trace shares, and spending less prefill time for it."""
    bt = 64
    reqs = []
    for turn in range(4):  # a wave of turns every 5 s, conversations in a different order each time
        for i in range(6):
            conv = (turn + i) % 6
            blocks = tuple(1000 * conv + k for k in range(2 * turn + 2))
            reqs.append(WorkloadRequest(f"c{conv}t{turn}", 5.0 * turn + 0.01 * i, len(blocks) * bt, 4,
                                        prefix_blocks=blocks, prefix_block_tokens=bt))
    wl = Workload("conversations", tuple(reqs), "test", "trace", None, 0)
    runs = {routing: SimCluster(sim_config("colocated", instances=2, enable_prefix_caching=True,
                                           prefix_routing=routing), COST).run(wl)
            for routing in (False, True)}
    for res in runs.values():
        check_run(wl, res.records)
    ideal = sum(len(r.prefix_blocks) - 2 for r in reqs) * bt  # every earlier turn's blocks, found again
    assert runs[True].prefix_hit_tokens >= 0.9 * ideal  # (measured: 97%; one turn goes elsewhere for load)
    assert runs[False].prefix_hit_tokens <= 0.6 * ideal  # (measured: 50%)
    assert runs[True].resource_s < runs[False].resource_s


def test_simulated_side_by_side_reports_prefix_hits_on_a_scaled_mooncake_trace() -> None:
    """A trace column with --enable-prefix-caching reports the prompt tokens its cache found (details and the
    markdown note); the same mode without it queries nothing; --length-scale shrinks the trace's lengths."""
    trace = "trace:" + str(Path(__file__).parent / "fixtures" / "mooncake_conv_head30.jsonl")
    cols = parse_columns("colocated,tetriinfer,apc=tetriinfer", [], ["apc:--enable-prefix-caching"])
    cfg = SimSideBySideConfig((trace,), cols, num_kv_blocks=800, kv_bytes_per_token=8192, max_model_len=4096,
                              num_requests=30, rate=2.0, length_scale=1 / 32, floor=False, progress=False,
                              max_prompt_tokens=None, max_output_tokens=None)
    result, raw = SimSideBySide(cfg, COST, "test").run()
    (key,) = result["workloads"]
    details = result["meta"]["details"][key]
    assert details["tetriinfer"]["prefix_queried_tokens"] == 0
    apc = details["apc"]
    prompts = [r["prompt_tokens"] for r in raw[key]["apc"]["requests"]]
    # every prompt is looked up at least once (again if it is recomputed after a preemption)
    assert apc["prefix_queried_tokens"] >= sum(prompts) and 0 < apc["prefix_hit_tokens"] < sum(prompts)
    assert len(prompts) == 30 and max(prompts) <= 87_169 / 32 + 1  # scaled: the fixture's longest is 87,169
    assert "apc: prefix cache found" in markdown_report(result)
    with pytest.raises(ValueError, match="length_scale"):
        replace(cfg, length_scale=-1.0)


def test_cache_aware_prefill_order_flag_reaches_the_runtime_spec_and_the_simulated_scheduler() -> None:
    """``--no-cache-aware-prefill-order`` (the ablation of cache-aware shortest-first) is one ClusterConfig field
    that both the runtime's instance spec and the simulator's prefill scheduler take."""
    import argparse

    from tetriinfer.server.cli import add_cluster_args, cluster_config_from_args

    p = argparse.ArgumentParser()
    add_cluster_args(p)
    on = cluster_config_from_args(p.parse_args(["--mode", "tetriinfer", "--enable-prefix-caching"]), "m")
    off = cluster_config_from_args(p.parse_args(["--mode", "tetriinfer", "--enable-prefix-caching",
                                                 "--no-cache-aware-prefill-order"]), "m")
    assert on.cache_aware_prefill_order and not off.cache_aware_prefill_order
    for cc, want in ((on, True), (off, False)):
        cc = replace(cc, model="sim")
        sim = SimCluster(SimConfig(cc, num_kv_blocks=100, kv_bytes_per_token=8192, max_model_len=2048), COST)
        prefill = next(i for i in sim.instances.values() if isinstance(i, SimPrefill))
        assert prefill.scheduler.config.cache_aware_order is want


def _run_two_by_two_keeping(wl: Workload, **cluster: object) -> tuple[SimCluster, SimResult]:
    """2 prefill + 2 decode with cost-based keep-decode (and ``cluster``'s other ClusterConfig fields) on ``wl``."""
    cc = ClusterConfig(model="sim", mode="tetriinfer", prefill_instances=2, decode_instances=2, keep_decode=True,
                       keep_decode_rule="cost", block_size=16, **cluster)  # type: ignore[arg-type]
    sim = SimCluster(SimConfig(cc, num_kv_blocks=400, kv_bytes_per_token=8192, max_model_len=2048), COST)
    res = sim.run(wl)
    check_run(wl, res.records)
    return sim, res


def test_kept_decodes_stay_off_the_prompt_only_prefill_instance() -> None:
    """2 prefill + 2 decode with cost-based keep-decode: the first prefill instance keeps nothing (prompts routed
    there never wait behind a decode step), the other keeps; ``--no-prompt-only-prefill`` lets both keep."""
    wl = load_workload("lphd", 80, 6.0, 3, max_prompt_tokens=512, max_output_tokens=200)
    kept_at = {}
    for prompt_only in (None, False):
        cluster, _ = _run_two_by_two_keeping(wl, prompt_only_prefill=prompt_only)
        kept_at[prompt_only] = {r.decode_instance for r in cluster.policy.records()
                                if r.decode_instance is not None and r.decode_instance.startswith("prefill")}
    assert kept_at[None] == {"prefill-1"}
    assert kept_at[False] == {"prefill-0", "prefill-1"}


def test_keep_offer_lets_the_keeping_prefill_instance_decode_what_the_prompt_only_one_prefilled() -> None:
    """``--keep-offer``: the prompt-only prefill instance offers what it prefilled to the keeping one, which takes
    some of it (its KV over the link), so more requests decode at a prefill instance and every one still completes;
    without it the keeping instance decodes only prompts it prefilled itself."""
    wl = load_workload("lphd", 80, 6.0, 3, max_prompt_tokens=512, max_output_tokens=200)
    kept, moved = {}, {}
    for offer in (False, True):
        cluster, res = _run_two_by_two_keeping(wl, keep_offer=offer)
        assert all(r.success for r in res.records)
        at = {r.request_id: r.decode_instance for r in cluster.policy.records()}
        assert "prefill-0" not in at.values()  # the prompt-only instance still keeps nothing
        kept[offer] = res.kept_decodes
        assert kept[offer] == sum(1 for v in at.values() if v == "prefill-1")
        moved[offer] = res.transfer_bytes
    assert kept[True] > kept[False]
    assert moved[True] > 0
    from tetriinfer.runtime.cluster import ClusterEngineClient

    with pytest.raises(ValueError, match="simulated only"):  # the runtime refuses the flag
        ClusterEngineClient(ClusterConfig(model="sim", mode="tetriinfer", keep_decode=True, keep_offer=True))
