"""The P:D controller: one policy object that keeps the prefill:decode split following the load.

Run by the cluster monitor (the runtime's and the simulator's alike) on every batch of load reports; pure
(time is passed in, no clock, no I/O). It owns each instance's role and flip state through a ``FlipPolicy``
(the drain -> switch state machine and its records) and decides *which* flips to start by one of three named
policies (``PD_POLICIES``):

- ``adaptive`` (the default of ``--mode tetriinfer``): picks the split that minimizes the requests in the
  system, i.e. mean JCT by Little's law (same arrival rate through both stages). From the reports, smoothed
  over ``smoothing_s`` (exponential moving average), counting work by kind wherever it runs (conditional
  disaggregation moves prompts to decode instances and decodes to prefill instances): ``N_P`` = requests
  waiting for prefill (prefill instances' queues and decode instances' local prompts), ``N_D`` = requests in
  decode (decode instances' running + queued handoffs, and the requests prefill instances hold), the prefill
  offered load ``A`` = prefill instances' busy fraction while prompts wait there + every instance's queued
  prompt tokens / ``backlog_full_tokens`` (capped at 1 each), the decode step inflation ``i``
  (``core.step_inflation``: a step at the current batch is ``1 / (1 - i)`` times a batch-1 step) and the
  decode KV pressure ``k`` (KV usage with queued requests counted, ``kv_pressure``). With ``p`` prefill and
  ``d`` decode instances (``p0``, ``d0`` now) the model is
  ``J(p, d) = N_P * fP(p) / fP(p0) + N_D * fD(d) / fD(d0)``, ``fP(p) = queue_factor(A / p)`` (an M/M/1 queue's
  time in system per unit of service, continued linearly past 90% load) and ``fD(d) = (1 + i / (1 - i) * d0 / d) * max(1, k * d0 / d)``
  (batching slowdown shrinks as the batch spreads over more instances; past a full KV pool requests wait in
  proportion). One instance flips toward the better neighbour split when it lowers ``J`` by at least the
  fraction ``margin`` and by ``min_gain`` requests. Under a constant load the model predicts no gain for the
  way back (it would need ``J`` to drop by ``margin`` again from a split it just judged worse), so the split
  settles (hysteresis); at most one flip is decided per ``dwell_s`` (minimum dwell), never while another is
  in progress, never below ``min_per_role`` ACTIVE instances per role; the least loaded instance of the
  donor role is the one chosen.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tetriinfer.core.flip_policy import FlipCommand, FlipConfig, FlipPolicy, FlipRecord
from tetriinfer.core.load import InstanceState, LoadReport, Role

PD_POLICIES = ("adaptive", "paper", "static")


@dataclass(frozen=True)
class PDControllerConfig:
    policy: str = "adaptive"
    margin: float = 0.2  # a flip must cut the modelled requests in the system by this fraction
    min_gain: float = 1.0  # ... and by at least this many requests (no flips over noise at light load)
    dwell_s: float = 5.0  # minimum time between two flip decisions
    smoothing_s: float = 2.0  # time constant of the load averages
    backlog_full_tokens: int = 4096  # prompt tokens queued at one prefill instance that count as one more load
    min_per_role: int = 1
    paper: FlipConfig = field(default_factory=FlipConfig)  # the 'paper' policy's rule

    def __post_init__(self) -> None:
        if self.policy not in PD_POLICIES:
            raise ValueError(f"P:D controller policy must be one of {', '.join(PD_POLICIES)}, got {self.policy!r}")
        if not 0.0 < self.margin < 1.0:
            raise ValueError(f"margin must be in (0, 1), got {self.margin}")
        if self.min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {self.min_gain}")
        if self.dwell_s < 0 or self.smoothing_s < 0:
            raise ValueError(f"dwell_s and smoothing_s must be >= 0, got {self.dwell_s}, {self.smoothing_s}")
        if self.backlog_full_tokens < 1:
            raise ValueError(f"backlog_full_tokens must be >= 1, got {self.backlog_full_tokens}")
        if self.min_per_role < 1:
            raise ValueError(f"min_per_role must be >= 1, got {self.min_per_role}")


@dataclass(frozen=True)
class TierState:
    """The smoothed state the adaptive model reads (see the module docstring)."""

    n_prefill: int
    n_decode: int
    waiting_prefill: float  # N_P
    in_decode: float  # N_D
    prefill_offered: float  # A
    inflation: float  # i, mean over decode instances
    kv_pressure: float  # k, mean over decode instances

    def cost(self, p: int, d: int) -> float:
        """``J(p, d)``: modelled requests in the system with ``p`` prefill and ``d`` decode instances."""
        if p < 1 or d < 1:
            raise ValueError(f"a split needs at least one instance per role, got {p}:{d}")
        def f_p(n: int) -> float:
            return queue_factor(self.prefill_offered / n)

        def f_d(n: int) -> float:
            i = min(self.inflation, 0.95)
            return (1.0 + i / (1.0 - i) * self.n_decode / n) * max(1.0, self.kv_pressure * self.n_decode / n)

        return (self.waiting_prefill * f_p(p) / f_p(self.n_prefill)
                + self.in_decode * f_d(d) / f_d(self.n_decode))


def queue_factor(rho: float) -> float:
    """Time in system per unit of service of an M/M/1 queue at utilization ``rho``, ``1 / (1 - rho)``, continued
    past ``rho = 0.9`` by its tangent there (an overloaded queue still gets worse the more it is overloaded)."""
    if rho <= 0.9:
        return 1.0 / (1.0 - max(0.0, rho))
    return 10.0 + 100.0 * (rho - 0.9)


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
        self._vec: dict[str, tuple[float, ...]] = {}  # instance id -> smoothed _features
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

    @property
    def states(self) -> Mapping[str, InstanceState]:
        """Every known instance's flip state (read-only; ``state(iid)`` defaults an unknown one to ACTIVE)."""
        return self.flips.states

    def annotate(self, reports: Sequence[LoadReport]) -> list[LoadReport]:
        return self.flips.annotate(reports)

    def on_switched(self, instance_id: str, now: float) -> FlipRecord:
        record = self.flips.on_switched(instance_id, now)
        self._smooth.pop(instance_id, None)  # a new role: its old load says nothing
        self._vec.pop(instance_id, None)
        self._note_split(now)
        return record

    def remove(self, instance_id: str) -> None:
        self.flips.remove(instance_id)
        self._smooth.pop(instance_id, None)
        self._vec.pop(instance_id, None)
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
        """One monitor pass: switch commands for drained instances, and at most one new drain."""
        commands = self.flips.observe(reports, now)  # registers new instances; DRAINING -> FLIPPING
        if not self.timeline:
            self._note_split(now)
        cfg = self.config
        if cfg.policy != "adaptive":
            return commands
        self._update_smoothing(reports, now)
        if now - self._last_decision < cfg.dwell_s:
            return commands
        states, active = self.flips.states, InstanceState.ACTIVE
        if any(states.get(i, active) is not active for i in self._smooth):  # a flip in progress
            return commands
        pick = self._choose(reports)
        if pick is not None:
            commands.append(self.flips.begin_drain(pick, now))
            self._last_decision = now
        return commands

    def _features(self, r: LoadReport, role: Role) -> tuple[float, float, float, float, float, float]:
        """(load in its role, prefill work offered here, requests waiting for prefill here, requests decoding
        here, step inflation, KV pressure) of one report.

        Work is counted by kind, not by the instance's role: with conditional disaggregation a prefill
        instance decodes the requests it keeps (``num_running`` counts them with the staged ones) and a decode
        instance prefills prompts locally (``num_prefill_tokens``). Counting a prefill instance's busy time
        spent on kept decodes as prefill load, and local prompts as decode work, hides a shift of the load
        from the model: the tier that should grow looks idle. So a prefill instance's busy fraction counts
        as prefill work only while prompts wait there (prefill has priority, so with none queued it was
        decoding), its held requests count as decodes, and a decode instance's local prompt backlog counts as
        prefill work."""
        backlog = min(1.0, r.num_prefill_tokens / self.config.backlog_full_tokens)
        if role is Role.PREFILL:
            busy = r.utilization if r.num_queued > 0 or r.num_running == 0 else 0.0
            return (r.utilization + backlog,  # ``prefill_load(r, backlog_full_tokens)``, its backlog term reused
                    busy + backlog, float(r.num_queued), float(r.num_running), 0.0, 0.0)
        queued, running = r.num_queued, r.num_running
        local = float(queued) if r.num_prefill_tokens > 0 else 0.0
        # ``kv_pressure(r)``, inline (the same operations): KV usage with the waiting requests counted
        used = r.num_used_blocks
        total = r.num_free_blocks + used  # ``r.num_blocks``
        usage = used / total if total else 0.0  # ``r.kv_usage``
        if running == 0:
            pressure = 1.0 if queued else usage
        else:
            pressure = min(2.0, usage * (running + queued) / running)
        inflation = r.step_inflation
        return (pressure if pressure >= inflation else inflation,  # ``decode_load(r)``: max(pressure, inflation)
                backlog, local, float(running + queued) - local, inflation, pressure)

    def _update_smoothing(self, reports: Sequence[LoadReport], now: float) -> None:
        tau = self.config.smoothing_s
        roles, features = self.flips.roles, self._features
        vecs, smooth, smooth_at = self._vec, self._smooth, self._smooth_at
        last_dt, a = None, 0.0  # the weight of the last time step seen (instances reported together share it)
        for r in reports:
            iid = r.instance_id
            role = roles.get(iid)
            if role is None:  # not known to the flip state machine: not smoothed
                continue
            x = features(r, role)
            old = vecs.get(iid)
            if old is None or tau == 0:
                vec = x
            elif old == x:  # at its input already: o + a * (x - o) is o exactly (no feature is ever -0.0 or NaN)
                vec = old
            else:
                dt = now - smooth_at[iid]
                if dt != last_dt:
                    last_dt, a = dt, 1.0 - math.exp(-max(0.0, dt) / tau)
                o0, o1, o2, o3, o4, o5 = old  # o + a * (n - o) per feature (six, as ``_features`` makes them)
                x0, x1, x2, x3, x4, x5 = x
                vec = (o0 + a * (x0 - o0), o1 + a * (x1 - o1), o2 + a * (x2 - o2), o3 + a * (x3 - o3),
                       o4 + a * (x4 - o4), o5 + a * (x5 - o5))
            vecs[iid] = vec
            smooth[iid] = vec[0]
            smooth_at[iid] = now

    def tier_state(self) -> TierState | None:
        """The smoothed inputs of the adaptive model (None before both roles have ACTIVE instances)."""
        roles, states = self.flips.roles, self.flips.states
        active, prefill = InstanceState.ACTIVE, Role.PREFILL
        pre: list[tuple[float, ...]] = []
        dec: list[tuple[float, ...]] = []
        for iid, v in self._vec.items():  # one pass; each list in the table's order
            if states.get(iid, active) is active:
                (pre if roles[iid] is prefill else dec).append(v)
        if not pre or not dec:
            return None
        both = pre + dec
        return TierState(
            n_prefill=len(pre), n_decode=len(dec), waiting_prefill=sum(v[2] for v in both),
            in_decode=sum(v[3] for v in both), prefill_offered=sum(v[1] for v in both),
            inflation=sum(v[4] for v in dec) / len(dec), kv_pressure=sum(v[5] for v in dec) / len(dec))

    def _choose(self, reports: Sequence[LoadReport]) -> str | None:
        cfg = self.config
        state = self.tier_state()
        if state is None:
            return None
        now_cost = state.cost(state.n_prefill, state.n_decode)
        best: tuple[float, Role] | None = None
        if state.n_prefill - 1 >= cfg.min_per_role:
            best = (state.cost(state.n_prefill - 1, state.n_decode + 1), Role.PREFILL)
        if state.n_decode - 1 >= cfg.min_per_role:
            cand = (state.cost(state.n_prefill + 1, state.n_decode - 1), Role.DECODE)
            best = cand if best is None or cand[0] < best[0] else best
        if best is None:
            return None
        new_cost, donor = best
        if new_cost > (1.0 - cfg.margin) * now_cost or now_cost - new_cost < cfg.min_gain:
            return None
        seen = {r.instance_id for r in reports}
        cands = sorted((self._smooth[iid], iid) for iid in self._smooth
                       if iid in seen and self.flips.role(iid) is donor
                       and self.flips.state(iid) is InstanceState.ACTIVE)
        return cands[0][1] if cands else None

    def _note_split(self, now: float) -> None:
        n_p, n_d = self.flips.num_active(Role.PREFILL), self.flips.num_active(Role.DECODE)
        if not self.timeline or self.timeline[-1][1:] != (n_p, n_d):
            self.timeline.append((now, n_p, n_d))
