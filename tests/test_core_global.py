"""Global policy: status table, least-loaded prefill routing that skips draining instances."""

from __future__ import annotations

import pytest

from tetriinfer.core.global_policy import GlobalPolicy, Phase
from tetriinfer.core.load import InstanceState, LoadReport, Role


def prefill(iid: str, tokens: int, t: float = 0.0, state: InstanceState = InstanceState.ACTIVE) -> LoadReport:
    return LoadReport(iid, Role.PREFILL, state, time=t, tokens_in_flight=tokens, num_free_blocks=10)


def test_routes_to_least_loaded_and_skips_draining() -> None:
    g = GlobalPolicy()
    loads = [prefill("p0", 500), prefill("p1", 100), prefill("p2", 0, state=InstanceState.DRAINING),
             LoadReport("d0", Role.DECODE)]
    g.add("a", now=1.0, num_prompt_tokens=50)
    assert g.route("a", loads, now=1.0) == "p1"
    rec = g.get("a")
    assert rec.phase is Phase.PREFILL and rec.prefill_instance == "p1"
    with pytest.raises(ValueError, match="not arrived"):
        g.route("a", loads, now=1.0)
    g.add("b", now=1.0, num_prompt_tokens=10)
    assert g.route("b", [prefill("p2", 0, state=InstanceState.FLIPPING)], now=1.0) is None
    assert g.get("b").phase is Phase.ARRIVED


def test_burst_between_reports_is_spread() -> None:
    g = GlobalPolicy()
    loads = [prefill("p0", 0, t=0.0), prefill("p1", 0, t=0.0)]
    picks = []
    for i in range(6):
        g.add(f"r{i}", now=0.01 * (i + 1), num_prompt_tokens=100)
        picks.append(g.route(f"r{i}", loads, now=0.01 * (i + 1)))
    assert picks.count("p0") == 3 and picks.count("p1") == 3
    # A newer report already reflects those routings: they no longer count twice.
    newer = [prefill("p0", 300, t=1.0), prefill("p1", 0, t=1.0)]
    g.add("x", now=1.5, num_prompt_tokens=10)
    assert g.route("x", newer, now=1.5) == "p1"


def test_lifecycle_and_exactly_one_terminal_phase() -> None:
    g = GlobalPolicy()
    g.add("a", now=0.0, num_prompt_tokens=10, ttft_slo_s=1.0, tpot_slo_s=0.1)
    g.route("a", [prefill("p0", 0)], now=0.0)
    g.on_tokens("a", 1, now=0.5)
    g.on_dispatched("a", "d0")
    for k in range(1, 5):
        g.on_tokens("a", 1, now=0.5 + 0.05 * k)
    assert g.on_terminal("a", Phase.FINISHED, now=0.7, reason="length")
    assert not g.on_terminal("a", Phase.ABORTED, now=0.8)
    rec = g.forget("a")
    assert rec.phase is Phase.FINISHED and rec.ttft == 0.5 and rec.jct == pytest.approx(0.7)
    assert rec.tpot == pytest.approx(0.05) and rec.meets_slo() and rec.num_output_tokens == 5
    g.add("b", now=0.0, num_prompt_tokens=10, ttft_slo_s=0.1)
    with pytest.raises(ValueError, match="still"):
        g.forget("b")
    with pytest.raises(ValueError, match="cannot dispatch"):
        g.on_dispatched("b", "d0")
    with pytest.raises(ValueError, match="duplicate"):
        g.add("b", now=0.0, num_prompt_tokens=1)
    g.route("b", [prefill("p0", 0)], now=0.0)
    g.reroute("b")
    assert g.get("b").phase is Phase.ARRIVED and [r.request_id for r in g.active()] == ["b"]
