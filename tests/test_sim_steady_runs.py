"""Steady decode runs in the simulator (``sim.instances.SteadyRun``): a cluster that prices runs of identical
decode steps at once gives exactly the numbers of one that takes an event per step, in every mode (flips,
keep-decode, local prefill, autoscaling, rebalancing, live migration), under both cost models, with and without KV
pressure; and it takes far fewer events."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sim_helpers import COST
from tests.test_sim import MODES, check_run, sim_config
from tetriinfer.bench.workloads import Workload, WorkloadRequest, load_workload
from tetriinfer.sim.cluster import SimCluster, SimConfig
from tetriinfer.sim.cost_model import HARDWARE_PRESETS, RooflineCostModel, model_config

ROOFLINE = RooflineCostModel(model_config("llama-3-8b"), HARDWARE_PRESETS["a100-80g"])


def _run(cfg: SimConfig, cost: Any, wl: Workload, steady: bool) -> tuple[dict[str, Any], int, int]:
    cluster = SimCluster(replace(cfg, steady_runs=steady), cost)
    res = cluster.run(wl)
    check_run(wl, res.records)
    everyone = {**cluster._retired, **cluster.instances}
    runs = sum(inst.num_steady_runs for inst in everyone.values())
    out = asdict(res)
    events = out.pop("events")
    return out, events, runs


@pytest.mark.parametrize("cost", [COST, ROOFLINE], ids=["profile", "roofline"])
@pytest.mark.parametrize("name", list(MODES))
def test_steady_runs_change_no_simulated_number(name: str, cost: Any) -> None:
    wl = load_workload("mixed", 60, 3.0, 1, max_prompt_tokens=1024, max_output_tokens=300)
    cfg = sim_config(name)
    stepped, stepped_events, none = _run(cfg, cost, wl, steady=False)
    jumped, jumped_events, runs = _run(cfg, cost, wl, steady=True)
    assert none == 0 and runs > 0
    assert jumped == stepped  # every record (every token time), busy time, step count, flip, scaling event
    assert jumped_events < stepped_events


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(list(MODES)),
    reqs=st.lists(st.tuples(st.floats(0, 4), st.integers(1, 700), st.integers(1, 400)), min_size=1, max_size=25),
    blocks=st.integers(60, 300),
    roofline=st.booleans(),
)
def test_property_steady_runs_equal_stepping_under_kv_pressure(
    name: str, reqs: list[tuple[float, int, int]], blocks: int, roofline: bool,
) -> None:
    """Small pools (preemptions, waiting dispatch, refused admissions), random arrivals and lengths; every request
    fits the pool alone."""
    fits = [(a, p, min(o, blocks * 16 - p)) for a, p, o in sorted(reqs)]
    wl = Workload("random", tuple(WorkloadRequest(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(fits)),
                  "test", "trace", None, 0)
    cfg = sim_config(name, blocks=blocks)
    cost = ROOFLINE if roofline else COST
    assert _run(cfg, cost, wl, steady=True)[0] == _run(cfg, cost, wl, steady=False)[0]


def test_a_long_decode_alone_takes_a_handful_of_events() -> None:
    """One request decoding 2,000 tokens alone: step by step that is an event per step; in runs, one per
    ``MAX_STEADY_STEPS`` steps and per monitor report it spans."""
    from tetriinfer.sim.instances import MAX_STEADY_STEPS

    wl = Workload("one", (WorkloadRequest("long", 0.0, 100, 2000),), "test", "trace", None, 0)
    cfg = replace(sim_config("colocated", instances=1), max_model_len=4096)
    stepped, stepped_events, _ = _run(cfg, ROOFLINE, wl, steady=False)
    jumped, jumped_events, runs = _run(cfg, ROOFLINE, wl, steady=True)
    assert jumped == stepped
    assert stepped_events > 2000 and runs >= 2000 // MAX_STEADY_STEPS
    reports = stepped["duration_s"] / cfg.cluster.report_interval_s
    assert jumped_events < 2 * (2000 / MAX_STEADY_STEPS + reports) + 20


@pytest.mark.parametrize("name", ["tetri-keep", "tetri-wait", "tetriinfer", "colocated", "sarathi"])
def test_tiny_pools_end_only_requests_larger_than_the_pool_short_and_never_stall(name: str) -> None:
    """Random workloads on pools of 60-100 blocks, some requests larger than the pool: those end (FINISHED_LENGTH)
    once they fill it; every other request gets exactly its length, kept decodes included, and the run never
    stalls with a request preempted and no event left."""
    import random

    for seed in range(12):
        rng = random.Random(seed)
        blocks = rng.randint(60, 100)
        reqs = sorted((rng.uniform(0, 4), rng.randint(1, 700), rng.randint(1, 400)) for _ in range(rng.randint(5, 25)))
        wl = Workload("random", tuple(WorkloadRequest(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(reqs)),
                      "test", "trace", None, 0)
        res = SimCluster(sim_config(name, blocks=blocks), COST).run(wl)  # SimulationStuck if it stalls
        for w, r in zip(wl.requests, sorted(res.records, key=lambda r: int(r.request_id[1:])), strict=True):
            assert r.success, (seed, w.request_id, r.error)
            if w.prompt_tokens + w.output_tokens <= blocks * 16:
                assert r.output_tokens == w.output_tokens, (seed, w.request_id)
            else:
                assert 1 <= r.output_tokens <= w.output_tokens
