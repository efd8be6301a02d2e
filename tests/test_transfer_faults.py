"""Fault injection, retries, link pacing and the transfer state machine (property-based)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tetriinfer.transfer import (
    LEGAL_TRANSITIONS,
    AgentConfig,
    FaultPlan,
    IllegalTransition,
    PacedLink,
    RetryingSender,
    RetryPolicy,
    Role,
    TransferBackend,
    TransferRecord,
    TransferState,
    make_backend,
    nixl_available,
    parse_bandwidth,
    parse_duration,
)
from tetriinfer.transfer.nixl_backend import NIXL_IMPORT_ERROR
from tetriinfer.transfer.staging import leaked_segments

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason=f"nixl is not importable ({NIXL_IMPORT_ERROR}); optional: pip install nixl==1.5.1"))

FAST = AgentConfig(timeout_s=0.3, sweep_interval_s=0.005)
ORDER = {TransferState.PENDING: 0, TransferState.TRANSFERRING: 1, TransferState.DONE: 2, TransferState.FAILED: 2}


def wait_terminal(backend: object, tids: list[str], limit_s: float = 5.0) -> dict[str, TransferState]:
    deadline = time.monotonic() + limit_s
    while True:
        states = {t: backend.poll(t) for t in tids}  # type: ignore[attr-defined]
        if all(s.terminal for s in states.values()):
            return states
        assert time.monotonic() < deadline, f"hang: {states}"
        time.sleep(0.001)


def assert_clean(*backends: TransferBackend) -> None:
    for b in backends:
        s = b.stats()
        assert (s.records, s.active, s.regions, s.pinned_payloads, s.staging_segments) == (0, 0, 0, 0, 0), s


@pytest.fixture(params=["inproc", "shm", "tcp", NIXL])
def inner_kind(request: pytest.FixtureRequest) -> str:
    return request.param


def faulty_pair(kind: str, **plan: float) -> tuple[TransferBackend, TransferBackend]:
    a = make_backend("faulty", inner=kind, config=FAST, **plan)
    b = make_backend(kind, config=FAST)
    return a, b


@pytest.fixture
def shm_guard() -> Iterator[None]:
    before = set(leaked_segments())
    yield
    assert set(leaked_segments()) - before == set()


def test_drop_times_out_to_failed_without_hang(inner_kind: str, shm_guard: None) -> None:
    a, b = faulty_pair(inner_kind, drop_p=1.0)
    try:
        b.recv("d", [np.zeros(1000, np.float32)])
        t0 = time.monotonic()
        a.send("d", [np.ones(1000, np.float32)], b.address)
        assert wait_terminal(a, ["d"])["d"] is TransferState.FAILED
        assert wait_terminal(b, ["d"])["d"] is TransferState.FAILED
        assert time.monotonic() - t0 < 2.0
        assert "timed out" in a.status("d").reason and "timed out" in b.status("d").reason
        assert a.fault_of("d") == "drop"  # type: ignore[attr-defined]
        a.release("d")
        b.release("d")
        assert_clean(a, b)
    finally:
        a.shutdown()
        b.shutdown()


def test_delay_completes_after_delay(inner_kind: str, shm_guard: None) -> None:
    a, b = faulty_pair(inner_kind, delay_p=1.0, delay_s=0.15)
    try:
        src = [np.arange(5000, dtype=np.float32), np.arange(3, dtype=np.uint16)]
        dst = [np.zeros_like(x) for x in src]
        b.recv("late", dst)
        t0 = time.monotonic()
        a.send("late", src, b.address)
        time.sleep(0.05)
        assert b.poll("late") is TransferState.PENDING
        assert wait_terminal(b, ["late"])["late"] is TransferState.DONE
        assert wait_terminal(a, ["late"])["late"] is TransferState.DONE
        assert time.monotonic() - t0 >= 0.15
        assert all(np.array_equal(x, y) for x, y in zip(src, dst, strict=True))
        a.release("late")
        b.release("late")
        assert_clean(a, b)
    finally:
        a.shutdown()
        b.shutdown()


def test_corrupt_length_fails_with_reason(inner_kind: str, shm_guard: None) -> None:
    a, b = faulty_pair(inner_kind, corrupt_p=1.0)
    try:
        b.recv("bad", [np.zeros(64, np.float32), np.zeros(10, np.uint16)])
        a.send("bad", [np.ones(64, np.float32), np.ones(10, np.uint16)], b.address)
        assert wait_terminal(a, ["bad"])["bad"] is TransferState.FAILED
        assert wait_terminal(b, ["bad"])["bad"] is TransferState.FAILED
        assert "length mismatch in slot 1" in a.status("bad").reason
        assert "length mismatch in slot 1" in b.status("bad").reason
        a.release("bad")
        b.release("bad")
        assert_clean(a, b)
    finally:
        a.shutdown()
        b.shutdown()


def test_retry_recovers_from_first_attempt_faults(shm_guard: None) -> None:
    for fault in ("drop_p", "corrupt_p"):
        a, b = faulty_pair("tcp", **{fault: 1.0, "faulty_attempts": 1})
        try:
            src = [np.arange(777, dtype=np.float32)]
            dst = [np.zeros(777, np.float32)]
            b.recv("r", dst, timeout_s=3.0)  # the receiver outlives the sender's retries
            sender = RetryingSender(a, RetryPolicy(max_attempts=3))
            sender.send("r", src, b.address)
            assert wait_terminal(sender, ["r"])["r"] is TransferState.DONE, sender.status("r").reason
            assert sender.attempts("r") == 2
            assert wait_terminal(b, ["r"])["r"] is TransferState.DONE  # receiver waited across the retry
            assert np.array_equal(src[0], dst[0])
            sender.release("r")
            b.release("r")
            assert sender.live() == 0
            assert_clean(a, b)
        finally:
            a.shutdown()
            b.shutdown()


def test_retry_gives_up_after_max_attempts(shm_guard: None) -> None:
    a, b = faulty_pair("inproc", corrupt_p=1.0)
    try:
        b.recv("r", [np.zeros(10, np.uint8)])
        sender = RetryingSender(a, RetryPolicy(max_attempts=3, backoff_s=0.01))
        sender.send("r", [np.zeros(10, np.uint8)], b.address)
        assert wait_terminal(sender, ["r"])["r"] is TransferState.FAILED
        reason = sender.status("r").reason
        assert "failed after 3 attempt(s)" in reason and reason.count("length mismatch") == 3
        assert wait_terminal(b, ["r"])["r"] is TransferState.FAILED  # last attempt is final for the receiver
        sender.release("r")
        b.release("r")
        assert_clean(a, b)
    finally:
        a.shutdown()
        b.shutdown()


def test_parse_bandwidth_and_duration() -> None:
    assert parse_bandwidth("200Gbps") == pytest.approx(25e9)
    assert parse_bandwidth("300GB/s") == pytest.approx(300e9)
    assert parse_bandwidth("10Gbps") == pytest.approx(1.25e9)
    assert parse_bandwidth("1.5 MB/s") == pytest.approx(1.5e6)
    assert parse_bandwidth("roce-200g") == pytest.approx(25e9)
    assert parse_duration("5us") == pytest.approx(5e-6)
    assert parse_duration("2ms") == pytest.approx(2e-3)
    for bad in ("fast", "-3Gbps", "0Gbps", "10 furlongs"):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_paced_link_achieves_configured_bandwidth() -> None:
    b = make_backend("inproc")
    a = PacedLink(make_backend("inproc"), bandwidth="1Gbps", latency="1ms")
    try:
        src = [np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8) for _ in range(8)]  # 8 MiB
        dst = [np.zeros_like(x) for x in src]
        b.recv("p", dst)
        t0 = time.perf_counter()
        a.open("p", b.address)
        for x in src:  # chunk by chunk over one link
            a.append("p", [x])
        a.close("p")
        assert wait_terminal(b, ["p"])["p"] is TransferState.DONE
        elapsed = time.perf_counter() - t0
        achieved = sum(x.nbytes for x in src) / elapsed
        assert 0.5 <= achieved / parse_bandwidth("1Gbps") <= 1.2, achieved
        assert elapsed >= a.transfer_time(8 << 20) * 0.99
        assert all(np.array_equal(x, y) for x, y in zip(src, dst, strict=True))
        assert wait_terminal(a, ["p"])["p"] is TransferState.DONE
        a.release("p")
        b.release("p")
        assert_clean(a, b)
    finally:
        a.shutdown()
        b.shutdown()


# --------------------------------------------------------------------------- state machine properties
EVENTS = st.sampled_from([TransferState.PENDING, TransferState.TRANSFERRING, TransferState.DONE,
                          TransferState.FAILED])


@given(st.lists(EVENTS, max_size=12))
def test_record_never_takes_an_illegal_transition(events: list[TransferState]) -> None:
    rec = TransferRecord("x", Role.SENDER, timeout_s=1.0, now=0.0)
    seen_terminal: list[TransferState] = []
    for ev in events:
        before = rec.state
        if ev in LEGAL_TRANSITIONS[before]:
            rec.advance(ev, reason="r" if ev is TransferState.FAILED else "")
            assert rec.state is ev
        else:
            with pytest.raises(IllegalTransition):
                rec.advance(ev, reason="r")
            assert rec.state is before
        if rec.state.terminal:
            seen_terminal.append(rec.state)
    assert len(set(seen_terminal)) <= 1  # once terminal, always the same terminal state
    rec.fail("end of test")
    assert rec.state.terminal and (rec.state is TransferState.DONE or rec.reason)


SCRIPT = st.fixed_dictionaries({
    "chunks": st.integers(1, 3),
    "close": st.booleans(),
    "fault": st.sampled_from(["none", "drop", "corrupt", "delay"]),
    "cancel": st.sampled_from(["no", "sender", "receiver"]),
})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(SCRIPT, min_size=1, max_size=5))
def test_random_transfers_end_in_exactly_one_terminal_state(scripts: list[dict]) -> None:
    b = make_backend("inproc", config=FAST)
    inner = make_backend("inproc", config=FAST)
    a = make_backend("faulty", inner=inner, plan=FaultPlan(delay_p=0.0))
    try:
        tids = [f"s{i}" for i in range(len(scripts))]
        for tid, sc in zip(tids, scripts, strict=True):
            # force the scripted fault by choosing the plan per transfer id (the plan is seeded, not random here)
            a.plan = FaultPlan(**{f"{sc['fault']}_p": 1.0}, delay_s=0.05) if sc["fault"] != "none" \
                else FaultPlan()  # type: ignore[misc]
            b.recv(tid, [np.zeros(16, np.float32) for _ in range(sc["chunks"])])
            a.open(tid, b.address)
            for _ in range(sc["chunks"]):
                a.append(tid, [np.ones(16, np.float32)])
            if sc["close"]:
                a.close(tid)
        for tid, sc in zip(tids, scripts, strict=True):
            if sc["cancel"] == "sender":
                a.release(tid)
            elif sc["cancel"] == "receiver":
                b.release(tid)
        history: dict[tuple[str, str], list[TransferState]] = {}
        deadline = time.monotonic() + 5
        while True:
            live = 0
            for side, be in (("a", a), ("b", b)):
                for tid in tids:
                    try:
                        s = be.poll(tid)
                    except KeyError:  # released by the script
                        continue
                    h = history.setdefault((side, tid), [])
                    if not h or h[-1] is not s:
                        h.append(s)
                    live += not s.terminal
            if live == 0:
                break
            assert time.monotonic() < deadline, history
            time.sleep(0.002)
        for (side, tid), h in history.items():
            ranks = [ORDER[s] for s in h]
            assert ranks == sorted(ranks), (side, tid, h)  # never goes backwards
            assert sum(s.terminal for s in h) == 1, (side, tid, h)  # exactly one terminal state, then frozen
            sc = scripts[tids.index(tid)]
            ok = sc["fault"] in ("none", "delay") and sc["close"]
            if sc["cancel"] == "no":
                assert (h[-1] is TransferState.DONE) == ok, (side, tid, sc, h)
            elif not ok:  # a cancel races with completion, but cannot rescue a doomed transfer
                assert h[-1] is TransferState.FAILED, (side, tid, sc, h)
        for tid in tids:
            a.release(tid)
            b.release(tid)
        assert_clean(a, b)
    finally:
        a.shutdown()
        b.shutdown()
