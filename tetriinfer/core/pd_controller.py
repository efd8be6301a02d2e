"""The P:D controller: one policy object that keeps the prefill:decode split following the load.

Run by the cluster monitor (the runtime's and the simulator's alike) on every round of load reports; pure
(time is passed in, no clock, no I/O). It owns each instance's role and flip state through a ``FlipPolicy``
(the drain -> switch state machine and its records) and decides *which* flips to start by one of three named
policies (``PD_POLICIES``):

- ``adaptive`` (the default of ``--mode tetriinfer``): each role's load is smoothed over ``smoothing_s``
  (exponential moving average, time constant ``smoothing_s``), with
  - prefill load of an instance = busy fraction + prompt backlog in units of ``backlog_full_tokens`` (the
    backlog term is capped at 1): a prefill instance that is busy *and* has a queue counts up to 2;
  - decode load of an instance = max(KV pressure, step inflation), where KV pressure = KV usage scaled by
    (running + queued) / running (requests waiting for blocks count as the memory they will need; capped
    at 2): a decode instance is loaded when its memory is, or when batching slows each token, not merely
    because it steps (a decode instance with any request is always busy).
  A role is *hot* when its mean smoothed load is above ``high``. One instance of the other role flips to the
  hot role when that other role would stay below ``low_after`` without it: its load scaled by
  n / (n - 1). Since ``low_after < high`` the donor role cannot become hot from the flip alone, so a
  constant load gives no flip back (hysteresis). At most one flip is decided per ``dwell_s`` (minimum
  dwell), never while another is in progress, never below ``min_per_role`` ACTIVE instances per role; the
  least loaded instance of the donor role is the one chosen.
- ``paper``: the paper's rule (an instance idle, under ``FlipConfig.threshold`` load for a window, while the
  other role is loaded, flips), i.e. ``FlipPolicy`` with its own thresholds.
- ``static``: no flips (the paper's fixed configuration).

Invariants: every decision is a function of the reports and ``now`` (deterministic); the ACTIVE instance
count of a role never drops below ``min_per_role`` through a flip; at most ``max_concurrent`` (one) flip is in
progress; flips are recorded (``records``) and the split after every change is kept in ``timeline`` as
``(now, prefill count, decode count)`` so a run can show how the split moved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tetriinfer.core.flip_policy import FlipCommand, FlipConfig, FlipPolicy, FlipRecord
from tetriinfer.core.load import InstanceState, LoadReport, Role

PD_POLICIES = ("adaptive", "paper", "static")


@dataclass(frozen=True)
class PDControllerConfig:
    policy: str = "adaptive"
    high: float = 0.85  # a role is hot above this mean smoothed load
    low_after: float = 0.6  # a donor role must stay below this with one instance fewer
    dwell_s: float = 5.0  # minimum time between two flip decisions
    smoothing_s: float = 2.0  # time constant of the load averages
    backlog_full_tokens: int = 4096  # prompt tokens queued at one prefill instance that count as one more load
    min_per_role: int = 1
    paper: FlipConfig = field(default_factory=FlipConfig)  # the 'paper' policy's rule

    def __post_init__(self) -> None:
        if self.policy not in PD_POLICIES:
            raise ValueError(f"P:D controller policy must be one of {', '.join(PD_POLICIES)}, got {self.policy!r}")
        if not 0.0 < self.low_after < self.high:
            raise ValueError(f"need 0 < low_after < high (hysteresis), got low_after={self.low_after}, "
                             f"high={self.high}")
        if self.dwell_s < 0 or self.smoothing_s < 0:
            raise ValueError(f"dwell_s and smoothing_s must be >= 0, got {self.dwell_s}, {self.smoothing_s}")
        if self.backlog_full_tokens < 1:
            raise ValueError(f"backlog_full_tokens must be >= 1, got {self.backlog_full_tokens}")
        if self.min_per_role < 1:
            raise ValueError(f"min_per_role must be >= 1, got {self.min_per_role}")


def prefill_load(report: LoadReport, backlog_full_tokens: int) -> float:
    """Busy fraction + queued prompt tokens / ``backlog_full_tokens`` (capped at 1), in [0, 2]."""
    return report.utilization + min(1.0, report.num_prefill_tokens / backlog_full_tokens)


def kv_pressure(report: LoadReport) -> float:
    """KV usage with the requests waiting for blocks counted at the running ones' mean size, in [0, 2]."""
    if report.num_running == 0:
        return 1.0 if report.num_queued else report.kv_usage
    return min(2.0, report.kv_usage * (report.num_running + report.num_queued) / report.num_running)


def decode_load(report: LoadReport) -> float:
    """max(KV pressure, step inflation), in [0, 2]."""
    return max(kv_pressure(report), report.step_inflation)


class PDController:
    """Owns the roles and flip states (through ``FlipPolicy``) and picks the flips (``PDControllerConfig``)."""

    def __init__(self, config: PDControllerConfig) -> None:
        self.config = config
        if config.policy == "paper":
            paper = config.paper
            flip_cfg = FlipConfig(
                enabled=paper.enabled, threshold=paper.threshold, window_s=paper.window_s,
                busy_threshold=paper.busy_threshold, cooldown_s=paper.cooldown_s,
                max_concurrent=paper.max_concurrent, min_per_role=config.min_per_role,
                decode_load=paper.decode_load, idle_by=paper.idle_by)
        else:  # the state machine only: this object decides
            flip_cfg = FlipConfig(enabled=False, min_per_role=config.min_per_role)
        self.flips = FlipPolicy(flip_cfg)
        self._smooth: dict[str, float] = {}  # instance id -> smoothed load in its current role
        self._smooth_at: dict[str, float] = {}
        self._last_decision = -math.inf
        self.timeline: list[tuple[float, int, int]] = []

    # ---- the FlipPolicy face (what the monitors call) ---------------------------------------------
    @property
    def records(self) -> list[FlipRecord]:
        return self.flips.records

    def role(self, instance_id: str) -> Role:
        return self.flips.role(instance_id)

    def state(self, instance_id: str) -> InstanceState:
        return self.flips.state(instance_id)

    def annotate(self, reports: Sequence[LoadReport]) -> list[LoadReport]:
        return self.flips.annotate(reports)

    def on_switched(self, instance_id: str, now: float) -> FlipRecord:
        record = self.flips.on_switched(instance_id, now)
        self._smooth.pop(instance_id, None)  # a new role: its old load says nothing
        self._note_split(now)
        return record

    def remove(self, instance_id: str) -> None:
        self.flips.remove(instance_id)
        self._smooth.pop(instance_id, None)
        self._smooth_at.pop(instance_id, None)

    # ---- decisions -----------------------------------------------------------------------------
    def load_of(self, report: LoadReport, role: Role) -> float:
        return (prefill_load(report, self.config.backlog_full_tokens) if role is Role.PREFILL
                else decode_load(report))

    def role_loads(self) -> dict[Role, float]:
        """Mean smoothed load of each role's ACTIVE instances (0 for a role with none)."""
        out = {}
        for role in (Role.PREFILL, Role.DECODE):
            vals = [v for iid, v in self._smooth.items()
                    if self.flips.role(iid) is role and self.flips.state(iid) is InstanceState.ACTIVE]
            out[role] = sum(vals) / len(vals) if vals else 0.0
        return out

    def observe(self, reports: Sequence[LoadReport], now: float) -> list[FlipCommand]:
        """One monitor round: switch commands for drained instances, and at most one new drain."""
        commands = self.flips.observe(reports, now)  # registers new instances; DRAINING -> FLIPPING
        if not self.timeline:
            self._note_split(now)
        cfg = self.config
        if cfg.policy != "adaptive":
            return commands
        self._update_smoothing(reports, now)
        if any(self.flips.state(i) is not InstanceState.ACTIVE for i in self._smooth):
            return commands
        if now - self._last_decision < cfg.dwell_s:
            return commands
        pick = self._choose(reports)
        if pick is not None:
            commands.append(self.flips.begin_drain(pick, now))
            self._last_decision = now
        return commands

    def _update_smoothing(self, reports: Sequence[LoadReport], now: float) -> None:
        tau = self.config.smoothing_s
        for r in reports:
            iid = r.instance_id
            try:
                role = self.flips.role(iid)
            except KeyError:
                continue
            x = self.load_of(r, role)
            if iid not in self._smooth or tau == 0:
                self._smooth[iid] = x
            else:
                dt = max(0.0, now - self._smooth_at[iid])
                a = 1.0 - math.exp(-dt / tau)
                self._smooth[iid] += a * (x - self._smooth[iid])
            self._smooth_at[iid] = now

    def _choose(self, reports: Sequence[LoadReport]) -> str | None:
        cfg = self.config
        seen = {r.instance_id for r in reports}
        loads = self.role_loads()
        for hot in (Role.DECODE, Role.PREFILL):
            donor = hot.other
            n_donor = self.flips.num_active(donor)
            if loads[hot] <= cfg.high or n_donor - 1 < cfg.min_per_role or self.flips.num_active(hot) == 0:
                continue
            if loads[donor] * n_donor / (n_donor - 1) >= cfg.low_after:
                continue
            cands = sorted((self._smooth[iid], iid) for iid in self._smooth
                           if iid in seen and self.flips.role(iid) is donor
                           and self.flips.state(iid) is InstanceState.ACTIVE)
            if cands:
                return cands[0][1]
        return None

    def _note_split(self, now: float) -> None:
        n_p, n_d = self.flips.num_active(Role.PREFILL), self.flips.num_active(Role.DECODE)
        if not self.timeline or self.timeline[-1][1:] != (n_p, n_d):
            self.timeline.append((now, n_p, n_d))
