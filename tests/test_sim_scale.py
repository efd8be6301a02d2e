"""Simulator scale features: the ``scale:N`` and ``--trace-repeat`` workloads, placement layouts in worker
processes, and the cached block-table tuples decode steps are built from."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tetriinfer.bench.workloads import load_trace, load_workload
from tetriinfer.core.kv_cache_manager import KVCacheManager

HEAD200 = Path(__file__).parent / "fixtures" / "azure_conv_head200.csv"
HEAD6 = Path(__file__).parent / "fixtures" / "azure_conv_head6.csv"


def test_scale_workload_draws_lengths_and_gaps_from_its_source_deterministically() -> None:
    rows = load_trace(HEAD200)
    pairs = {(r.prompt_tokens, r.output_tokens) for r in rows}
    wl = load_workload("scale:5000", 3000, None, 3, length_source=str(HEAD200))
    assert wl.name == "scale:5000" and len(wl) == 3000 and wl.arrival_process == "trace"
    assert all((r.prompt_tokens, r.output_tokens) in pairs for r in wl.requests)
    assert len({(r.prompt_tokens, r.output_tokens) for r in wl.requests}) > 150  # resampled, not one row repeated
    ts = sorted(r.timestamp_s for r in rows)
    trace_rate = (len(ts) - 1) / (ts[-1] - ts[0])
    arrivals = [r.arrival_s for r in wl.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(trace_rate, rel=0.15)  # the trace's own rate
    again = load_workload("scale:5000", 3000, None, 3, length_source=str(HEAD200))
    assert again.requests == wl.requests
    other = load_workload("scale:5000", 3000, None, 4, length_source=str(HEAD200))
    assert other.requests != wl.requests
    # the first n of N: a shorter run is a prefix of a longer one; a rate rescales the arrivals exactly
    assert load_workload("scale:5000", 10, None, 3, length_source=str(HEAD200)).requests == wl.requests[:10]
    fast = load_workload("scale:5000", 3000, 50.0, 3, length_source=str(HEAD200))
    assert (len(fast) - 1) / fast.requests[-1].arrival_s == pytest.approx(50.0)
    for bad in ("scale:0", "scale:x", "scale:"):
        with pytest.raises(ValueError, match="scale:N"):
            load_workload(bad, 1, None, 0, length_source=str(HEAD200))
    with pytest.raises(ValueError, match="only 10 requests"):
        load_workload("scale:10", 11, None, 0, length_source=str(HEAD200))


def test_trace_repeat_plays_the_trace_back_to_back_with_unique_ids() -> None:
    once = load_workload(f"trace:{HEAD6}", 6)
    twice = load_workload(f"trace:{HEAD6}", 12, trace_repeat=2)
    assert twice.name.endswith("x2") and len({r.request_id for r in twice.requests}) == 12
    first, second = twice.requests[:6], twice.requests[6:]
    assert [(r.prompt_tokens, r.output_tokens) for r in second] == [(r.prompt_tokens, r.output_tokens)
                                                                      for r in once.requests]
    span = once.requests[-1].arrival_s
    shift = span + span / 5  # one mean gap after the first copy ends
    assert [r.arrival_s for r in first] == [r.arrival_s for r in once.requests]
    assert [r.arrival_s for r in second] == pytest.approx([r.arrival_s + shift for r in once.requests])
    with pytest.raises(ValueError, match="only 12 requests"):
        load_workload(f"trace:{HEAD6}", 13, trace_repeat=2)
    with pytest.raises(ValueError, match="trace_repeat"):
        load_workload("mixed", 4, trace_repeat=2)


def test_block_ids_follow_the_table_through_growth_frees_and_prefix_matches() -> None:
    from tetriinfer.core.request import Request
    from tetriinfer.core.sampling_params import SamplingParams

    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    assert kv.block_ids("a") == () and not kv.has("a")
    assert kv.allocate_slots("a", 5) and kv.block_ids("a") == tuple(kv.block_table("a")) and len(kv.block_ids("a")) == 2
    held = kv.block_ids("a")
    assert kv.allocate_slots("a", 8) and kv.block_ids("a") is held  # no new block: the same tuple
    assert kv.allocate_slots("a", 9) and kv.block_ids("a") == tuple(kv.block_table("a")) and len(kv.block_ids("a")) == 3
    assert not kv.allocate_slots("b", 100) and not kv.has("b") and kv.block_ids("b") == ()
    kv.free_request("a")
    assert kv.block_ids("a") == ()
    params = SamplingParams(max_tokens=2)
    first = Request("p", list(range(9)), params)
    assert kv.allocate_slots("p", 9)
    first.num_computed_tokens = 9
    kv.cache_computed(first)
    second = Request("q", list(range(9)), params)
    assert kv.block_ids("q") == () and kv.match_prefix(second) == 8
    assert kv.block_ids("q") == tuple(kv.block_table("q")) == kv.block_ids("p")[:2]
    kv.check_invariants()


def test_placement_layouts_in_worker_processes_give_the_serial_result() -> None:
    from tetriinfer.bench.metrics import SLO
    from tetriinfer.sim.cost_model import ProfileCostModel
    from tetriinfer.sim.placement import PlacementConfig, PlacementSearch, candidate_layouts

    cost = ProfileCostModel.from_profile({
        "model": "t", "prefill": [{"tokens": 16, "seconds": 0.01}, {"tokens": 512, "seconds": 0.2}],
        "decode": [{"batch": 1, "seconds": 0.01}, {"batch": 32, "seconds": 0.04}]})
    layouts = candidate_layouts(["tetriinfer", "colocated"], 2, {})
    cfg = PlacementConfig(("lpld",), tuple(layouts), SLO(ttft_ms=2000.0), num_kv_blocks=400,
                          kv_bytes_per_token=4096, max_model_len=2048, num_requests=24, min_duration_s=0.0,
                          probe_requests=12, probe_concurrency=4, rel_tol=0.2, max_prompt_tokens=256,
                          max_output_tokens=32, progress=False)
    serial = PlacementSearch(cfg, cost).run()
    parallel = PlacementSearch(replace(cfg, jobs=2), cost).run()
    for result in (serial, parallel):
        result["meta"].pop("wall_s")
    assert len(serial["workloads"]["lpld"]["layouts"]) == len(layouts) >= 2
    assert json.dumps(parallel, sort_keys=True) == json.dumps(serial, sort_keys=True)
