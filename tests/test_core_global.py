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


def test_equal_backlogs_send_the_prompt_to_the_prefill_instance_holding_fewer_prefilled_requests() -> None:
    from dataclasses import replace

    # both idle of prompts; p0 decodes 3 requests it kept (its steps are in flight when the prompt lands, and its
    # chunks carry their rows), p1 holds one staged for a transfer: the prompt goes to p1
    loads = [replace(prefill("p0", 0), num_running=3), replace(prefill("p1", 0), num_running=1)]
    g = GlobalPolicy()
    g.add("a", now=0.0, num_prompt_tokens=100)
    assert g.route("a", loads, now=0.0) == "p1"
    # the prompt backlog still comes first: tokens to prefill outweigh held requests
    g.add("b", now=0.0, num_prompt_tokens=100)
    assert g.route("b", [replace(prefill("p0", 0), num_running=3), replace(prefill("p1", 50), num_running=0)],
                   now=0.0) == "p0"


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


# ---- conditional disaggregation (LocalPrefillConfig) ------------------------------------------------
def decode(iid: str, running: int = 0, free: int = 100, prefill_tokens: int = 0, t: float = 0.0,
           state: InstanceState = InstanceState.ACTIVE) -> LoadReport:
    return LoadReport(iid, Role.DECODE, state, time=t, num_running=running, num_free_blocks=free,
                      num_used_blocks=0, block_size=16, num_prefill_tokens=prefill_tokens)


def local_policy(weight: float = 0.25, **kw) -> GlobalPolicy:
    from tetriinfer.core.global_policy import LocalPrefillConfig

    return GlobalPolicy(LocalPrefillConfig(enabled=True, interference_weight=weight, **kw))


def test_local_prefill_is_off_by_default_and_validated() -> None:
    from tetriinfer.core.global_policy import LocalPrefillConfig

    g = GlobalPolicy()
    g.add("a", now=0.0, num_prompt_tokens=100)
    assert g.route("a", [prefill("p0", 10_000), decode("d0")], now=0.0) == "p0"
    assert g.num_local_prefills == 0
    for bad in ({"interference_weight": -1.0}, {"min_prefill_backlog_tokens": -1}, {"max_prompt_tokens": 0}):
        with pytest.raises(ValueError):
            LocalPrefillConfig(enabled=True, **bad)


def test_backed_up_prefill_tier_sends_the_request_to_an_idle_decode_instance() -> None:
    g = local_policy()
    g.add("a", now=0.1, num_prompt_tokens=300)
    assert g.route("a", [prefill("p0", 0), decode("d0")], now=0.1) == "p0"  # idle prefill tier: disaggregate
    g.add("b", now=0.1, num_prompt_tokens=300)
    # p0 now has a's 300 tokens (routed after its report): b would wait for them; d0 is idle -> local
    assert g.route("b", [prefill("p0", 0), decode("d0")], now=0.1) == "d0"
    rec = g.get("b")
    assert rec.phase is Phase.DECODE and rec.prefill_instance == rec.decode_instance == "d0"
    assert g.num_local_prefills == 1
    # c sees b's 300 tokens queued at d0 and a's 300 at p0: no gain from going local -> p0
    g.add("c", now=0.1, num_prompt_tokens=300)
    assert g.route("c", [prefill("p0", 0), decode("d0")], now=0.1) == "p0"
    g.on_tokens("b", 1, now=0.3)  # a local request streams and ends like any other
    assert g.on_terminal("b", Phase.FINISHED, now=1.0)
    # b's first token came back: d0 has nothing left to prefill, though no report says so yet; p0 still has a + c
    assert g.backlog_tokens(decode("d0")) == 0 and g.backlog_tokens(prefill("p0", 0)) == 600
    g.add("e", now=0.4, num_prompt_tokens=300)
    assert g.route("e", [prefill("p0", 0), decode("d0")], now=0.4) == "d0"


def test_backlog_is_the_smaller_of_the_reports_and_the_prompts_without_a_first_token() -> None:
    """A report is up to an interval old: prompts whose first token already streamed do not count (no local
    prefill beside a prefill instance that just went idle); a report newer than the routings wins where it is
    smaller (a prompt part-way through its chunks)."""
    g = local_policy(weight=0.0)
    for rid in ("a", "b"):
        g.add(rid, now=0.0, num_prompt_tokens=400)
        assert g.route(rid, [prefill("p0", 0, t=-1.0), decode("d0")], now=0.0) in ("p0", "d0")
    assert [g.get(r).prefill_instance for r in ("a", "b")] == ["p0", "d0"]  # b found a's 400 tokens ahead
    stale = prefill("p0", 400, t=0.0)  # built just after a was routed, before a finished
    assert g.backlog_tokens(stale) == 400
    g.on_tokens("a", 1, now=0.2)  # a's first token: p0 is idle now, whatever the stale report says
    assert g.backlog_tokens(stale) == 0
    g.add("c", now=0.21, num_prompt_tokens=400)
    assert g.route("c", [stale, decode("d0", t=0.0)], now=0.21) == "p0"
    g.add("d", now=0.22, num_prompt_tokens=100)
    assert g.backlog_tokens(prefill("p0", 150, t=0.215)) == 150  # c is part-way: the newer report is smaller
    assert g.route("d", [prefill("p0", 150, t=0.215), decode("d0", t=0.0)], now=0.22) == "d0"
    assert g.on_terminal("d", Phase.ABORTED, now=0.3)  # an end settles a request too: d0 holds b's prompt only
    assert g.backlog_tokens(decode("d0", prefill_tokens=500, t=0.25)) == 400
    g.on_tokens("b", 1, now=0.4)
    assert g.backlog_tokens(decode("d0", prefill_tokens=500, t=0.25)) == 0


def test_local_prefill_prices_the_interference_with_running_decodes() -> None:
    # backlog 1000 at p0; a 400-token prompt on d0 delays its R running decodes: cost = 0.25 * R * 400
    for running, want in ((0, "d0"), (9, "d0"), (10, "p0"), (40, "p0")):
        g = local_policy()
        g.add("x", now=0.0, num_prompt_tokens=400)
        assert g.route("x", [prefill("p0", 1000), decode("d0", running=running)], now=0.0) == want, running
    g = local_policy(weight=0.0)  # TTFT only: any decode instance with less backlog wins
    g.add("x", now=0.0, num_prompt_tokens=400)
    assert g.route("x", [prefill("p0", 1000), decode("d0", running=200)], now=0.0) == "d0"


def test_local_prefill_picks_the_cheapest_decode_instance_and_skips_unfit_ones() -> None:
    g = local_policy()
    loads = [prefill("p0", 2000), decode("d0", running=4), decode("d1", running=1),
             decode("d2", running=0, free=3),  # 3 blocks of 16 cannot hold 100 + 1 tokens
             decode("d3", running=0, state=InstanceState.DRAINING), decode("d4", running=0, prefill_tokens=500)]
    g.add("x", now=0.0, num_prompt_tokens=100)
    assert g.route("x", loads, now=0.0) == "d1"  # cost 25 (d0: 100, d4: 500, d2/d3 not eligible)
    g = local_policy(max_prompt_tokens=50)
    g.add("y", now=0.0, num_prompt_tokens=100)
    assert g.route("y", loads, now=0.0) == "p0"  # too long to prefill locally
    g = local_policy(min_prefill_backlog_tokens=5000)
    g.add("z", now=0.0, num_prompt_tokens=100)
    assert g.route("z", loads, now=0.0) == "p0"  # backlog under the floor


def test_without_an_accepting_prefill_instance_a_decode_instance_prefills() -> None:
    g = local_policy()
    g.add("a", now=0.0, num_prompt_tokens=100)
    assert g.route("a", [prefill("p0", 0, state=InstanceState.FLIPPING), decode("d0")], now=0.0) == "d0"
    off = GlobalPolicy()
    off.add("a", now=0.0, num_prompt_tokens=100)
    assert off.route("a", [prefill("p0", 0, state=InstanceState.FLIPPING), decode("d0")], now=0.0) is None


# ---- prefix-aware routing (core.prefix_affinity) ------------------------------------------------------------------
def test_prefix_routing_sends_a_shared_prefix_back_unless_that_instance_is_backed_up_more_than_it_saves() -> None:
    from tetriinfer.core.prefix_affinity import PrefixAffinity

    g = GlobalPolicy(affinity=PrefixAffinity(16))
    system = list(range(160))  # 10 full blocks
    g.add("a", 0.0, 170, prompt_token_ids=system + [500] * 10)
    assert g.route("a", [prefill("p0", 0, t=1.0), prefill("p1", 0, t=1.0)], now=0.5) == "p0"
    # p1 is less loaded, but p0 holds the 160-token prefix: 40 queued + 10 uncached < 0 queued + 170 uncached
    g.add("b", 1.1, 170, prompt_token_ids=system + [600] * 10)
    assert g.route("b", [prefill("p0", 40, t=1.0), prefill("p1", 0, t=1.0)], now=1.1) == "p0"
    assert g._extra(prefill("p0", 40, t=1.0)) == 170 - 160  # charged only what it must compute
    # backed up by more than the cache saves: least-loaded wins
    g.add("c", 1.2, 170, prompt_token_ids=system + [700] * 10)
    assert g.route("c", [prefill("p0", 400, t=1.15), prefill("p1", 0, t=1.15)], now=1.2) == "p1"
    # without affinity: plain least-loaded, whatever was routed before
    plain = GlobalPolicy()
    plain.add("a", 0.0, 170, prompt_token_ids=system + [500] * 10)
    plain.route("a", [prefill("p0", 0, t=1.0), prefill("p1", 0, t=1.0)], now=0.5)
    plain.add("b", 1.1, 170, prompt_token_ids=system + [600] * 10)
    assert plain.route("b", [prefill("p0", 40, t=1.0), prefill("p1", 0, t=1.0)], now=1.1) == "p1"
    # a forgotten instance (left or flipped) holds nothing any more
    g.forget_instance("p0")
    g.add("d", 2.0, 170, prompt_token_ids=system + [800] * 10)
    assert g.route("d", [prefill("p0", 1, t=2.0), prefill("p1", 0, t=2.0)], now=2.0) == "p1"


def test_prefix_affinity_names_usable_blocks_and_keeps_only_what_fits() -> None:
    from tetriinfer.core.prefix_affinity import PrefixAffinity
    from tetriinfer.core.prefix_cache import block_digests

    aff = PrefixAffinity(4)
    assert aff.digests(list(range(8))) == tuple(block_digests(list(range(4)), 4))  # never the block of the last token
    assert len(aff.digests(list(range(9)))) == 2
    a, b = aff.digests(list(range(13))), aff.digests(list(range(8)) + [99] * 5)
    aff.record("x", a, capacity=None)
    assert aff.matched_tokens("x", a) == 12 and aff.matched_tokens("x", b) == 8 and aff.matched_tokens("y", a) == 0
    aff.record("x", b, capacity=2)  # a pool of 2 blocks: the newest prompt's head survives, tails go first
    assert aff.num_known("x") == 2 and aff.matched_tokens("x", b) == 8 and aff.matched_tokens("x", a) == 8
    with pytest.raises(ValueError):
        PrefixAffinity(0)
