"""Dispatcher: alpha/beta split, power of two choices, heavy:light spreading, ablation policies."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.dispatcher import Dispatcher, DispatcherConfig
from tetriinfer.core.load import InstanceState, LoadReport, Role


def decode(iid: str, free: int, used: int = 0, heavy: int = 0, light: int = 0, state=InstanceState.ACTIVE) -> LoadReport:
    return LoadReport(iid, Role.DECODE, state, num_free_blocks=free, num_used_blocks=used, block_size=16,
                      num_running=heavy + light, num_heavy_decodes=heavy, num_light_decodes=light)


def simulate(policy: str, n_inst: int, classes: list[bool], seed: int = 0) -> dict[str, Counter]:
    """Dispatch requests in order, updating the load reports as the monitor would."""
    d = Dispatcher(DispatcherConfig(policy=policy, seed=seed))
    loads = {f"d{i}": decode(f"d{i}", free=10_000) for i in range(n_inst)}
    counts: dict[str, Counter] = {iid: Counter() for iid in loads}
    for heavy in classes:
        dec = d.choose(list(loads.values()), prompt_tokens=100, predicted_lower=400 if heavy else 0)
        assert dec.instance_id is not None and dec.heavy == heavy
        counts[dec.instance_id]["heavy" if heavy else "light"] += 1
        r = loads[dec.instance_id]
        loads[dec.instance_id] = dataclasses.replace(
            r, num_heavy_decodes=r.num_heavy_decodes + heavy, num_light_decodes=r.num_light_decodes + (not heavy)
        )
    return counts


def spread(counts: dict[str, Counter], cls: str) -> int:
    vals = [c[cls] for c in counts.values()]
    return max(vals) - min(vals)


def test_length_aware_spreads_heavy_decodes_evenly() -> None:
    classes = [i % 3 == 0 for i in range(60)]  # 20 heavy, 40 light, interleaved
    two = simulate("length-aware", 2, classes)
    assert spread(two, "heavy") <= 1 and spread(two, "light") <= 1
    four = simulate("length-aware", 4, classes)
    assert spread(four, "heavy") <= 2 and spread(four, "light") <= 2
    imbalanced = simulate("imbalanced", 4, classes)
    assert imbalanced["d0"]["heavy"] == 20 and imbalanced["d0"]["light"] == 0  # the hotspot
    rand = [spread(simulate("random", 4, classes, seed=s), "heavy") for s in range(5)]
    assert max(rand) > 2  # random placement does not keep the classes even


def test_never_picks_beta_while_alpha_nonempty() -> None:
    d = Dispatcher(DispatcherConfig(seed=3))
    # prompt 100 + predicted 400 = 500 tokens = 32 blocks of 16.
    loads = [decode("full1", free=31, used=69), decode("ok", free=32, used=68, heavy=9),
             decode("full2", free=5, used=95)]
    for _ in range(50):
        dec = d.choose(loads, prompt_tokens=100, predicted_lower=400)
        assert dec.instance_id == "ok" and dec.alpha == ("ok",)


def test_need_beyond_a_whole_pool_is_capped_so_an_empty_instance_is_alpha() -> None:
    loads = [decode("empty", free=20), decode("busy", free=19, used=1)]
    dec = Dispatcher(DispatcherConfig(alpha_empty="wait")).choose(loads, prompt_tokens=500, predicted_lower=400)
    assert dec.instance_id == "empty" and dec.alpha == ("empty",)


def test_alpha_empty_wait_or_fallback() -> None:
    loads = [decode("a", free=2, used=8), decode("b", free=3, used=1)]
    wait = Dispatcher(DispatcherConfig(alpha_empty="wait")).choose(loads, 100, 400)
    assert wait.instance_id is None and "wait" in wait.reason
    fallback = Dispatcher(DispatcherConfig(alpha_empty="least-loaded")).choose(loads, 100, 400)
    assert fallback.instance_id == "b"  # lower KV usage


def test_wait_counts_free_blocks_net_of_requests_already_waiting_for_admission() -> None:
    # need = 100 + 400 tokens = 32 blocks; "a" has 40 free but 20 of them are promised to requests waiting there
    loads = [dataclasses.replace(decode("a", free=40, used=24), num_waiting_blocks=20), decode("b", free=34, used=30)]
    wait = Dispatcher(DispatcherConfig(alpha_empty="wait")).choose(loads, 100, 400)
    assert wait.instance_id == "b" and wait.alpha == ("b",)
    full = [loads[0], dataclasses.replace(loads[1], num_waiting_blocks=3)]
    assert Dispatcher(DispatcherConfig(alpha_empty="wait")).choose(full, 100, 400).instance_id is None
    # least-loaded keeps the paper's rule (free blocks only): both are in alpha there
    assert Dispatcher(DispatcherConfig(alpha_empty="least-loaded")).choose(full, 100, 400).alpha == ("a", "b")
    with pytest.raises(ValueError):
        dataclasses.replace(loads[1], num_waiting_blocks=-1)


def test_skips_draining_and_flipping_instances() -> None:
    loads = [
        decode("drain", free=100, state=InstanceState.DRAINING),
        decode("flip", free=100, state=InstanceState.FLIPPING),
        decode("live", free=1, used=99),
        LoadReport("prefill", Role.PREFILL, num_free_blocks=1000),
    ]
    for policy in ("length-aware", "random", "round-robin", "least-loaded", "imbalanced"):
        d = Dispatcher(DispatcherConfig(policy=policy))
        for _ in range(10):
            assert d.choose(loads, 10, 0).instance_id == "live"
    assert Dispatcher(DispatcherConfig()).choose(loads[:2], 10, 0).instance_id is None


def test_deterministic_given_seed_and_round_robin_cycles() -> None:
    loads = [decode(f"d{i}", free=100) for i in range(5)]
    picks = [[Dispatcher(DispatcherConfig(policy="random", seed=s)).choose(loads, 10).instance_id for _ in range(3)]
             for s in (7, 7)]
    assert picks[0] == picks[1]
    d1, d2 = Dispatcher(DispatcherConfig(seed=11)), Dispatcher(DispatcherConfig(seed=11))
    assert [d1.choose(loads, 10, 300).choices for _ in range(20)] == [d2.choose(loads, 10, 300).choices for _ in range(20)]
    rr = Dispatcher(DispatcherConfig(policy="round-robin"))
    assert [rr.choose(loads, 10).instance_id for _ in range(6)] == ["d0", "d1", "d2", "d3", "d4", "d0"]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown dispatch policy"):
        DispatcherConfig(policy="best")
    with pytest.raises(ValueError, match="alpha_empty"):
        DispatcherConfig(alpha_empty="drop")
    with pytest.raises(ValueError, match="num_choices"):
        DispatcherConfig(num_choices=0)


@settings(max_examples=150, deadline=None)
@given(
    frees=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=8),
    prompt=st.integers(1, 600),
    lower=st.one_of(st.none(), st.integers(0, 800)),
    seed=st.integers(0, 1000),
)
def test_property_alpha_respected(frees: list[tuple[int, int, int]], prompt: int, lower: int | None, seed: int) -> None:
    loads = [decode(f"d{i}", free=f, heavy=h, light=li) for i, (f, h, li) in enumerate(frees)]
    d = Dispatcher(DispatcherConfig(seed=seed, alpha_empty="wait"))
    dec = d.choose(loads, prompt, lower)
    need = -(-(prompt + max(1, lower or 0)) // 16)
    alpha = {r.instance_id for r in loads if r.num_free_blocks >= min(need, r.num_blocks)}
    assert set(dec.alpha) == alpha
    if alpha:
        assert dec.instance_id in alpha and set(dec.choices) <= alpha and dec.instance_id in dec.choices
    else:
        assert dec.instance_id is None


@settings(max_examples=60, deadline=None, derandomize=True)
@given(policy=st.sampled_from(["length-aware", "random", "round-robin", "least-loaded", "imbalanced"]),
       ops=st.lists(st.tuples(st.integers(1, 3000), st.sampled_from([None, 0, 100, 400]), st.integers(0, 9),
                              st.booleans()), min_size=1, max_size=60))
def test_views_and_charge_decide_as_the_plain_scan(policy: str, ops: list[tuple]) -> None:
    """Dispatchers sharing ``DecodeViews`` (one broadcast read by several, each charging its own copy) choose and
    charge exactly as one that sees every sequence for the first time and charges with ``charge_dispatch``."""
    from tetriinfer.core.dispatcher import DecodeViews, charge_dispatch

    views = DecodeViews(capacity=3)
    fast = [Dispatcher(DispatcherConfig(policy=policy, seed=s), views) for s in range(2)]
    plain = [Dispatcher(DispatcherConfig(policy=policy, seed=s)) for s in range(2)]
    states = [InstanceState.ACTIVE] * 5 + [InstanceState.DRAINING]
    broadcast = [decode(f"d{i}", free=40 * i, used=60, heavy=i % 3, light=i % 2, state=states[i]) for i in (3, 0, 5, 1, 4, 2)]
    mine = [broadcast, broadcast]
    for prompt, lower, k, new_broadcast in ops:
        if new_broadcast and k < 2:  # the monitor's next broadcast (a new list, shared again)
            broadcast = [dataclasses.replace(r, num_free_blocks=(r.num_free_blocks + 37 * k) % 300) for r in broadcast]
            mine = [broadcast, broadcast]
            continue
        j = k % 2
        got = fast[j].choose(mine[j], prompt, lower)
        want = plain[j].choose(list(mine[j]), prompt, lower)
        assert got == want
        if got.instance_id is not None:
            charged = fast[j].charge(mine[j], got.instance_id, prompt, lower)
            assert charged == charge_dispatch(mine[j], got.instance_id, prompt, lower)
            mine[j] = charged
