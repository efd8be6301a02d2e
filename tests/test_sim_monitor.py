"""The simulator monitor's shortcuts over its pass of every instance (``SimInstance.monitor_report`` and
``SimCluster._monitor``): every report they give equals the one built from scratch, in every mode, so they change
no simulated number (``tests/test_sim_golden.py`` checks the totals)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from tests.sim_helpers import COST
from tests.test_sim import MODES, check_run, sim_config
from tetriinfer.bench.workloads import load_workload
from tetriinfer.core.load import LoadReport
from tetriinfer.sim.cluster import SimCluster
from tetriinfer.sim.instances import SimInstance


@pytest.mark.parametrize("name", list(MODES))
def test_an_idle_instances_kept_report_equals_a_fresh_one(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whenever ``monitor_report`` answers for a quiet instance, building the report from scratch right after
    (utilization and step inflation taken again: there is nothing to take) gives an equal report."""
    seen = {"quiet": 0, "kept": 0}
    fast = SimInstance.monitor_report

    def checked(self: SimInstance, now: float, interval_s: float) -> LoadReport:
        quiet = self.is_quiet()
        kept = quiet and self._quiet_key == (self.state, self.kv.num_free_blocks)
        rep = fast(self, now, interval_s)
        if quiet:
            seen["quiet"] += 1
            seen["kept"] += kept
            assert self.is_quiet()
            assert rep == self.report(now, self.take_utilization(interval_s)), (name, self.iid, now)
            assert rep.time == now and rep.utilization == 0.0 and rep.step_inflation == 0.0
        return rep

    monkeypatch.setattr(SimInstance, "monitor_report", checked)
    # bursts with gaps: instances fall idle between them (kept reports), and work again after
    wl = load_workload("mixed", 60, 3.0, 1, max_prompt_tokens=1024, max_output_tokens=160)
    res = SimCluster(sim_config(name, instances=3), COST).run(wl)
    check_run(wl, res.records)
    assert seen["kept"] > 0 and seen["quiet"] > seen["kept"]


def test_monitor_report_is_report_with_taken_utilization_for_busy_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy instance (not quiet) gets the plain report: the whole run equals one whose monitor calls ``report``
    itself every pass."""
    def plain(self: SimInstance, now: float, interval_s: float) -> LoadReport:
        return self.report(now, self.take_utilization(interval_s))

    wl = load_workload("mixed", 60, 3.0, 1, max_prompt_tokens=1024, max_output_tokens=160)
    out: list[Any] = []
    for patch in (False, True):
        with monkeypatch.context() as m:
            if patch:
                m.setattr(SimInstance, "monitor_report", plain)
            res = SimCluster(sim_config("tetri-auto-migrate", instances=3), COST).run(wl)
        out.append({k: v for k, v in asdict(res).items() if k != "events"})
    assert out[0] == out[1]
