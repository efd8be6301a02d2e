"""DistServe-style placement search on the simulator (``tetriinfer sim placement``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_sim import COST, PROFILE
from tetriinfer.bench.metrics import SLO
from tetriinfer.sim.placement import (
    Layout,
    PlacementConfig,
    PlacementSearch,
    RatePoint,
    candidate_layouts,
    layout_cluster_config,
    max_rate_meeting,
)


def step_at(threshold: float, calls: list[float]):
    def evaluate(rate: float) -> RatePoint:
        calls.append(rate)
        return RatePoint(rate, 1.0 if rate <= threshold else 0.5)

    return evaluate


@pytest.mark.parametrize("start", [0.3, 7.3, 50.0])
def test_rate_search_brackets_the_threshold_within_tolerance(start: float) -> None:
    calls: list[float] = []
    found = max_rate_meeting(step_at(7.3, calls), 0.9, start, rel_tol=0.02)
    assert found.rate_rps <= 7.3
    assert found.rate_rps >= 7.3 / 1.02 - 1e-9
    assert len(calls) == len(set(calls)) == len(found.points)  # no rate simulated twice
    assert [p.rate_rps for p in found.points] == sorted(calls)
    # the answer is an evaluated rate that met the target, and a rate within tolerance above it missed
    assert any(p.rate_rps == found.rate_rps and p.attainment >= 0.9 for p in found.points)
    assert any(found.rate_rps < p.rate_rps <= found.rate_rps * 1.021 and p.attainment < 0.9 for p in found.points)


def test_rate_search_gives_zero_when_no_rate_meets_the_target_and_rejects_bad_input() -> None:
    calls: list[float] = []
    found = max_rate_meeting(lambda r: (calls.append(r), RatePoint(r, 0.2))[1], 0.9, 4.0, max_halvings=3)
    assert found.rate_rps == 0.0
    assert calls == [4.0, 2.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="target"):
        max_rate_meeting(step_at(1, []), 1.5, 1.0)
    with pytest.raises(ValueError, match="start_rps"):
        max_rate_meeting(step_at(1, []), 0.9, 0.0)


def test_candidate_layouts_cover_every_split_and_parse_as_serve_arguments() -> None:
    layouts = candidate_layouts(["colocated", "tetriinfer"], 4, {"tetriinfer": ("--prefill-policy", "sjf")})
    assert [lay.label for lay in layouts] == ["colocated x4", "tetriinfer 1P+3D", "tetriinfer 2P+2D",
                                              "tetriinfer 3P+1D"]
    assert all(lay.instances == 4 for lay in layouts)
    cfg = layout_cluster_config(layouts[2], "sim")
    assert (cfg.mode, cfg.prefill_instances, cfg.decode_instances, cfg.prefill_policy) == ("tetriinfer", 2, 2, "sjf")
    assert layout_cluster_config(layouts[0], "sim").instances == 4
    assert layouts[3].serve_command().startswith("tetriinfer serve --mode tetriinfer --prefill-instances 3 "
                                                 "--decode-instances 1")
    with pytest.raises(ValueError, match="at least 2"):
        candidate_layouts(["distserve"], 1)
    with pytest.raises(ValueError, match="unknown mode"):
        candidate_layouts(["vllm"], 2)
    with pytest.raises(ValueError, match="decode"):
        Layout("tetriinfer", 2, 0)


def config(workload: str, slo: SLO, modes: tuple[str, ...] = ("tetriinfer",), instances: int = 4,
           **over: object) -> PlacementConfig:
    kw: dict = dict(model="test", num_requests=40, min_duration_s=15.0, probe_requests=32, probe_concurrency=4,
                    max_prompt_tokens=1024, max_output_tokens=256, progress=False)
    kw.update(over)
    return PlacementConfig((workload,), tuple(candidate_layouts(modes, instances)), slo, num_kv_blocks=2000,
                           kv_bytes_per_token=8192, max_model_len=2048, **kw)


def test_placement_config_needs_a_slo_that_bounds_queueing() -> None:
    with pytest.raises(ValueError, match="TTFT or E2E"):
        config("mixed", SLO(tpot_ms=50))
    with pytest.raises(ValueError, match="attainment"):
        config("mixed", SLO(ttft_ms=500), attainment=0.0)


def test_prefill_heavy_work_gets_more_prefill_instances_and_decode_heavy_more_decode() -> None:
    slo = SLO(ttft_ms=3000, tpot_ms=60)
    hpld = PlacementSearch(config("hpld", slo), COST).run()["workloads"]["hpld"]
    lphd = PlacementSearch(config("lphd", slo), COST).run()["workloads"]["lphd"]
    assert hpld["best"] == "tetriinfer 3P+1D"
    assert lphd["best"] == "tetriinfer 1P+3D"
    for entry in (hpld, lphd):
        rates = [r["goodput_per_instance_rps"] for r in entry["layouts"]]
        assert rates == sorted(rates, reverse=True) and rates[0] > 0


def test_reported_goodput_meets_the_slo_and_a_higher_rate_does_not() -> None:
    cfg = config("mixed", SLO(ttft_ms=2000, tpot_ms=80), modes=("colocated", "tetriinfer"), instances=2,
                 rel_tol=0.05, target_rate=10.0)
    search = PlacementSearch(cfg, COST)
    result = search.run()
    entry = result["workloads"]["mixed"]
    assert {r["label"] for r in entry["layouts"]} == {"colocated x2", "tetriinfer 1P+1D"}
    for row in entry["layouts"]:
        layout = next(lay for lay in cfg.layouts if lay.label == row["label"])
        rate = row["goodput_rps"]
        assert rate > 0
        assert search.evaluate(layout, "mixed", rate).attainment >= 0.9  # re-simulated: deterministic
        assert search.evaluate(layout, "mixed", rate * 1.06).attainment < 0.9
        assert all(p["num_requests"] >= max(40, round(p["rate_rps"] * 15.0)) for p in row["points"])
    best = entry["layouts"][0]
    need = entry["for_target_rate"]
    assert need["replicas"] * best["goodput_rps"] >= 10.0 > (need["replicas"] - 1) * best["goodput_rps"]
    assert need["instances"] == need["replicas"] * best["instances"]
    assert result["meta"]["simulations"] == search.num_simulations - 4  # 4 re-simulations above


def test_sim_placement_cli_writes_json_report_and_plot(tmp_path: Path) -> None:
    from tetriinfer.cli import main

    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(PROFILE))
    out, md, plots = tmp_path / "p.json", tmp_path / "p.md", tmp_path / "plots"
    rc = main(["sim", "placement", "--cost", f"profile:{prof}", "--workloads", "lpld", "--modes",
               "colocated,distserve", "--instances", "2", "--slo-ttft", "1500", "--slo-tpot", "80", "-n", "30",
               "--min-duration-s", "5", "--probe-requests", "16", "--probe-concurrency", "2", "--rel-tol", "0.1",
               "--serve-arg", "distserve:--chunk-size 256", "--out", str(out), "--md", str(md), "--plot", str(plots),
               "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = result["workloads"]["lpld"]["layouts"]
    assert {r["label"] for r in rows} == {"colocated x2", "distserve 1P+1D"}
    assert "--chunk-size 256" in next(r for r in rows if r["mode"] == "distserve")["serve_command"]
    text = md.read_text()
    assert "| layout |" in text and "goodput" in text and "placement_lpld.png" in text
    assert (plots / "placement_lpld.png").stat().st_size > 0
    assert main(["sim", "placement", "--cost", f"profile:{prof}", "--slo-tpot", "50", "--out", str(out)]) == 2
    assert main(["sim", "placement", "--cost", f"profile:{prof}", "--slo-ttft", "50", "--serve-arg",
                 "vllm:--x 1", "--out", str(out)]) == 2
