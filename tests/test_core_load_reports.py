"""Instance-level load reports: what the runtime's workers and the simulator's instances add to their schedulers'
reports (one copy, in core)."""

from __future__ import annotations

import pytest

from tetriinfer.core.load import LoadReport, Role, decode_instance_report, prefill_instance_report


def test_prefill_report_counts_held_requests_as_running() -> None:
    rep = LoadReport("p0", Role.PREFILL, num_queued=3, num_running=1, tokens_in_flight=900)
    assert prefill_instance_report(rep, 0) is rep
    out = prefill_instance_report(rep, 4)
    assert (out.num_running, out.num_queued, out.tokens_in_flight) == (5, 3, 900)


def test_decode_report_counts_waiting_requests_and_attaches_step_inflation() -> None:
    rep = LoadReport("d0", Role.DECODE, num_queued=1, num_running=7, num_prefill_tokens=50)
    out = decode_instance_report(rep, waiting=3, waiting_prompt_tokens=400, step_inflation=0.4)
    assert (out.num_queued, out.num_running, out.num_prefill_tokens) == (4, 7, 450)
    assert out.step_inflation == pytest.approx(0.4)
    with pytest.raises(ValueError):
        decode_instance_report(rep, 0, 0, 1.2)
