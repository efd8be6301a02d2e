"""Incremental routing (running totals, heap-pruned routings) decides exactly as the original quadratic code.

The reference is the original ``GlobalPolicy`` kept verbatim in ``tests/fixtures/reference``; both policies get the
same random sequence of arrivals, load reports (some stale, some out of order), first tokens, terminations,
reroutes and forgotten instances, and must pick the same instance and report the same backlog every time.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.global_policy import GlobalPolicy, LocalPrefillConfig, Phase
from tetriinfer.core.load import InstanceState, LoadReport, Role

_REF_PATH = Path(__file__).parent / "fixtures" / "reference" / "quadratic_global_policy.py"
_spec = importlib.util.spec_from_file_location("quadratic_global_policy", _REF_PATH)
assert _spec is not None and _spec.loader is not None
_ref = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _ref  # dataclasses resolve their module by name
_spec.loader.exec_module(_ref)

PREFILLS = ("p0", "p1", "p2")
DECODES = ("d0", "d1")

op = st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 600), st.floats(0.0, 0.05)),
    st.tuples(st.just("report"), st.sampled_from(PREFILLS + DECODES), st.integers(0, 2000), st.floats(0.0, 1.0)),
    st.tuples(st.just("first_token"), st.integers(0, 10_000)),
    st.tuples(st.just("end"), st.integers(0, 10_000)),
    st.tuples(st.just("reroute"), st.integers(0, 10_000)),
    st.tuples(st.just("forget_instance"), st.sampled_from(PREFILLS + DECODES)),
    st.tuples(st.just("drain"), st.sampled_from(PREFILLS), st.booleans()),
)


def _report(iid: str, tokens: int, t: float, state: InstanceState) -> LoadReport:
    if iid.startswith("p"):
        return LoadReport(iid, Role.PREFILL, state, time=t, tokens_in_flight=tokens, num_free_blocks=50)
    return LoadReport(iid, Role.DECODE, state, time=t, num_running=tokens % 7, num_free_blocks=tokens // 20,
                      num_used_blocks=3, block_size=16, num_prefill_tokens=tokens // 3)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(ops=st.lists(op, min_size=1, max_size=120), local=st.booleans(), weight=st.floats(0.0, 1.0))
def test_incremental_routing_matches_reference(ops: list[tuple], local: bool, weight: float) -> None:
    cfg_new = LocalPrefillConfig(enabled=local, interference_weight=weight)
    cfg_old = _ref.LocalPrefillConfig(enabled=local, interference_weight=weight)
    new, old = GlobalPolicy(cfg_new), _ref.GlobalPolicy(cfg_old)
    now = 0.0
    states = {iid: InstanceState.ACTIVE for iid in PREFILLS + DECODES}
    reports = {iid: _report(iid, 0, 0.0, InstanceState.ACTIVE) for iid in PREFILLS + DECODES}
    ids: list[str] = []
    for o in ops:
        kind = o[0]
        if kind == "arrive":
            now += o[2]
            rid = f"r{len(ids)}"
            ids.append(rid)
            new.add(rid, now, o[1])
            old.add(rid, now, o[1])
            loads = list(reports.values())
            got, want = new.route(rid, loads, now), old.route(rid, loads, now)
            assert got == want
            for r in loads:
                assert new.backlog_tokens(r) == old.backlog_tokens(r)
        elif kind == "report":
            iid = o[1]
            t = max(0.0, now - o[3])  # a report built a little while ago: routings after it still count
            reports[iid] = _report(iid, o[2], t, states[iid])
        elif kind == "drain":
            states[o[1]] = InstanceState.DRAINING if o[2] else InstanceState.ACTIVE
            old_r = reports[o[1]]
            reports[o[1]] = _report(o[1], old_r.tokens_in_flight, old_r.time, states[o[1]])
        elif kind == "forget_instance":
            new.forget_instance(o[1])
            old.forget_instance(o[1])
        elif ids:
            rid = ids[o[1] % len(ids)]
            a, b = new.get(rid), old.get(rid)
            if kind == "first_token":
                new.on_tokens(rid, 1, now)
                old.on_tokens(rid, 1, now)
            elif kind == "end":
                assert new.on_terminal(rid, Phase.FINISHED, now) == old.on_terminal(rid, _ref.Phase.FINISHED, now)
            elif kind == "reroute" and a.phase is Phase.PREFILL:
                new.reroute(rid)
                old.reroute(rid)
            assert a.phase.value == b.phase.value and a.prefill_instance == b.prefill_instance
        for r in reports.values():
            assert new.backlog_tokens(r) == old.backlog_tokens(r)
    assert new.num_local_prefills == old.num_local_prefills


@settings(max_examples=150, deadline=None, derandomize=True)
@given(ops=st.lists(op, min_size=1, max_size=120), local=st.booleans())
def test_routing_on_a_reused_broadcast_matches_reference(ops: list[tuple], local: bool) -> None:
    """The pick index kept across calls on one loads sequence (a monitor broadcast routes many arrivals) picks as
    the reference does, with backlogs read (and pruned) through newer reports in between."""
    new, old = GlobalPolicy(LocalPrefillConfig(enabled=local)), _ref.GlobalPolicy(_ref.LocalPrefillConfig(enabled=local))
    now = 0.0
    reports = {iid: _report(iid, 0, 0.0, InstanceState.ACTIVE) for iid in PREFILLS + DECODES}
    loads = list(reports.values())  # the broadcast: a new list only when a report changes
    ids: list[str] = []
    for o in ops:
        kind = o[0]
        if kind == "arrive":
            now += o[2]
            rid = f"r{len(ids)}"
            ids.append(rid)
            new.add(rid, now, o[1])
            old.add(rid, now, o[1])
            assert new.route(rid, loads, now) == old.route(rid, loads, now)
        elif kind in ("report", "drain"):
            iid = o[1]
            if kind == "report":
                reports[iid] = _report(iid, o[2], max(0.0, now - o[3]), reports[iid].state)
                if o[2] % 3 == 0:  # read through the fresh report before the next broadcast
                    assert new.backlog_tokens(reports[iid]) == old.backlog_tokens(reports[iid])
                    continue
            else:
                r = reports[iid]
                reports[iid] = _report(iid, r.tokens_in_flight, r.time,
                                       InstanceState.DRAINING if o[2] else InstanceState.ACTIVE)
            loads = list(reports.values())
        elif kind == "forget_instance":
            new.forget_instance(o[1])
            old.forget_instance(o[1])
        elif ids:
            rid = ids[o[1] % len(ids)]
            if kind == "first_token":
                new.on_tokens(rid, 1, now)
                old.on_tokens(rid, 1, now)
            elif kind == "end":
                new.on_terminal(rid, Phase.FINISHED, now)
                old.on_terminal(rid, _ref.Phase.FINISHED, now)
            elif kind == "reroute" and new.get(rid).phase is Phase.PREFILL:
                new.reroute(rid)
                old.reroute(rid)
        for r in loads:
            assert new.backlog_tokens(r) == old.backlog_tokens(r)


def test_burst_routing_work_is_bounded() -> None:
    """A burst between two reports keeps one pending routing per request, and a newer report prunes them all."""
    g = GlobalPolicy()
    loads = [_report(p, 0, 0.0, InstanceState.ACTIVE) for p in PREFILLS]
    for i in range(3000):
        g.add(f"r{i}", now=1.0 + i * 1e-4, num_prompt_tokens=10)
        assert g.route(f"r{i}", loads, now=1.0 + i * 1e-4) is not None
    assert sum(len(g._routed[p].heap) for p in PREFILLS) == 3000
    assert sum(g.backlog_tokens(r) for r in loads) == 30_000
    newer = [_report(p, 10_000, 5.0, InstanceState.ACTIVE) for p in PREFILLS]
    g.add("late", now=6.0, num_prompt_tokens=10)
    g.route("late", newer, now=6.0)
    assert sum(len(g._routed[p].heap) for p in PREFILLS) == 1
