"""Instance flip policy and state machine (TetriInfer section 3.5), run by the cluster monitor.

Roles are virtual: an instance switches between prefill and decode in place (no model reload).
Per instance: ``ACTIVE(role) -> DRAINING -> FLIPPING -> ACTIVE(other role)``.

- ``observe(reports, now)``: an ACTIVE instance whose load (``LoadReport.load``) has stayed below
  ``threshold`` for ``window_s`` while the other role is loaded (mean load of the other role's ACTIVE
  instances >= ``busy_threshold``) is chosen: a ``drain`` command is emitted and it becomes DRAINING.
  DRAINING instances get no new work: ``annotate`` stamps the monitor's state on the reports it
  broadcasts, so the global policy stops routing to a draining prefill instance and the dispatchers
  stop sending to a draining decode instance. Once a DRAINING instance reports empty (nothing queued or
  running, no KV block held: prefill queue drained and KV handed over; decodes finished), a ``switch``
  command is emitted and it becomes FLIPPING.
- ``on_switched(instance_id, now)``: the instance switched role; it is ACTIVE in its new role.

What "load" means (``decode_load``): by default ``LoadReport.load`` = max(busy fraction, KV usage) for every
instance. A decode instance is busy whenever it holds any request (it steps back to back), so under that measure
decode looks loaded at any batch and an idle prefill instance gets flipped to decode even while prompts are the
bottleneck. ``decode_load="kv"`` judges decode instances by KV usage only (memory bounds a decode instance on an
accelerator, but a compute-bound one can be saturated well below full KV); ``decode_load="inflation"`` by
max(KV usage, ``LoadReport.step_inflation``): how much batching slows each token (``core.step_inflation``).
Prefill instances keep the busy fraction in every mode.

"Idle for a window" (``idle_by``): by default the load must stay below ``threshold`` in every report of
``window_s``; at 100 ms reports a prefill instance serving a trickle of short prompts spikes above it with each
one and never qualifies. ``idle_by="mean"``: the mean load over the last ``window_s`` (the instance ACTIVE in its
role for at least that long) is below ``threshold``.

Invariants: never flips an instance if fewer than ``min_per_role`` ACTIVE instances of its role would
remain (never the last one); at most ``max_concurrent`` flips in progress; an instance flipped back to
ACTIVE is not chosen again for ``cooldown_s``; every flip is recorded with its ``now`` timestamps.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tetriinfer.core.load import InstanceState, LoadReport, Role

DECODE_LOADS = ("busy", "kv", "inflation")


@dataclass(frozen=True)
class FlipConfig:
    enabled: bool = True
    threshold: float = 0.10
    window_s: float = 1.0
    busy_threshold: float = 0.5
    cooldown_s: float = 5.0
    max_concurrent: int = 1
    min_per_role: int = 1
    decode_load: str = "busy"  # busy | kv | inflation (see the module docstring)
    idle_by: str = "every"  # every: below threshold in every report of the window; mean: on average over it

    def __post_init__(self) -> None:
        if self.idle_by not in ("every", "mean"):
            raise ValueError(f"idle_by must be 'every' or 'mean', got {self.idle_by!r}")
        if self.decode_load not in DECODE_LOADS:
            raise ValueError(f"decode_load must be one of {', '.join(DECODE_LOADS)}, got {self.decode_load!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"flip threshold must be in (0, 1], got {self.threshold}")
        if not 0.0 <= self.busy_threshold <= 1.0:
            raise ValueError(f"busy_threshold must be in [0, 1], got {self.busy_threshold}")
        if self.window_s < 0 or self.cooldown_s < 0:
            raise ValueError("flip window_s and cooldown_s must be >= 0")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        if self.min_per_role < 1:
            raise ValueError(f"min_per_role must be >= 1, got {self.min_per_role}")


class FlipAction(enum.Enum):
    DRAIN = "drain"  # stop routing to it; let it finish its work
    SWITCH = "switch"  # it is empty: switch role now


@dataclass(frozen=True)
class FlipCommand:
    action: FlipAction
    instance_id: str
    from_role: Role
    to_role: Role
    time: float


@dataclass(frozen=True)
class FlipRecord:
    instance_id: str
    from_role: Role
    to_role: Role
    decided_at: float
    drained_at: float
    switched_at: float

    @property
    def drain_s(self) -> float:
        return self.drained_at - self.decided_at

    @property
    def switch_s(self) -> float:
        return self.switched_at - self.drained_at

    @property
    def total_s(self) -> float:
        return self.switched_at - self.decided_at


class FlipPolicy:
    """Owns each instance's role and flip state as the monitor sees it."""

    def __init__(self, config: FlipConfig) -> None:
        self.config = config
        self._role: dict[str, Role] = {}
        self._state: dict[str, InstanceState] = {}
        self._low_since: dict[str, float] = {}
        self._history: dict[str, list[tuple[float, float]]] = {}  # idle_by="mean": (time, load) within the window
        self._seen_since: dict[str, float] = {}  # idle_by="mean": ACTIVE in its current role since
        self._cooldown_until: dict[str, float] = {}
        self._decided_at: dict[str, float] = {}
        self._drained_at: dict[str, float] = {}
        self.records: list[FlipRecord] = []

    def role(self, instance_id: str) -> Role:
        return self._role[instance_id]

    @property
    def roles(self) -> Mapping[str, Role]:
        """Every known instance's role (read-only view; ``role(iid)`` for one)."""
        return self._role

    @property
    def states(self) -> Mapping[str, InstanceState]:
        """Every known instance's flip state (read-only view; ``state(iid)`` defaults an unknown one to ACTIVE)."""
        return self._state

    def state(self, instance_id: str) -> InstanceState:
        return self._state.get(instance_id, InstanceState.ACTIVE)

    def load(self, report: LoadReport) -> float:
        """The load the policy judges an instance by, in [0, 1] (``FlipConfig.decode_load``)."""
        role = self._role.get(report.instance_id, report.role)
        if role is Role.DECODE and self.config.decode_load == "kv":
            return report.kv_usage
        if role is Role.DECODE and self.config.decode_load == "inflation":
            return max(report.kv_usage, report.step_inflation)
        return report.load

    def num_active(self, role: Role) -> int:
        return sum(1 for i, r in self._role.items() if r is role and self._state[i] is InstanceState.ACTIVE)

    def annotate(self, reports: Sequence[LoadReport]) -> list[LoadReport]:
        """The reports with the monitor's role and state stamped on them (what gets broadcast)."""
        out = []
        roles, states = self._role, self._state
        for r in reports:
            role = roles.get(r.instance_id)
            if role is not None and (role is not r.role or states[r.instance_id] is not r.state):
                r = dataclasses.replace(r, role=role, state=states[r.instance_id])  # equal values: the same report
            out.append(r)
        return out

    def observe(self, reports: Sequence[LoadReport], now: float) -> list[FlipCommand]:
        cfg = self.config
        commands: list[FlipCommand] = []
        role_of, state_of = self._role, self._state
        for r in reports:
            if r.instance_id not in role_of:
                role_of[r.instance_id] = r.role
                state_of[r.instance_id] = InstanceState.ACTIVE
        draining = InstanceState.DRAINING
        if not cfg.enabled and draining not in state_of.values():  # nothing below to do (``_candidate`` is off)
            return commands
        by_id = {r.instance_id: r for r in reports}
        # DRAINING -> FLIPPING once the instance reports empty.
        for iid, rep in by_id.items():
            if state_of[iid] is draining and rep.is_empty:
                self._state[iid] = InstanceState.FLIPPING
                self._drained_at[iid] = now
                role = self._role[iid]
                commands.append(FlipCommand(FlipAction.SWITCH, iid, role, role.other, now))
        if not cfg.enabled:  # the low-load timers below feed only this policy's own picks (``_candidate``)
            return commands
        # Low-load timers of ACTIVE instances.
        for iid, rep in by_id.items():
            if self._state[iid] is not InstanceState.ACTIVE:
                self._low_since.pop(iid, None)
                self._history.pop(iid, None)
                continue
            load = self.load(rep)
            if cfg.idle_by == "mean":
                hist = self._history.setdefault(iid, [])
                hist.append((now, load))
                while hist and hist[0][0] < now - cfg.window_s:
                    hist.pop(0)
                seen_since = self._seen_since.setdefault(iid, now)
                if now - seen_since >= cfg.window_s and sum(x for _, x in hist) / len(hist) < cfg.threshold:
                    self._low_since[iid] = now - cfg.window_s  # idle on average over a whole window
                else:
                    self._low_since.pop(iid, None)
            elif load < cfg.threshold:
                self._low_since.setdefault(iid, now)
            else:
                self._low_since.pop(iid, None)
        in_progress = sum(1 for s in self._state.values() if s is not InstanceState.ACTIVE)
        while in_progress < cfg.max_concurrent:
            pick = self._candidate(by_id, now)
            if pick is None:
                break
            role = self._role[pick]
            self._state[pick] = InstanceState.DRAINING
            self._decided_at[pick] = now
            self._low_since.pop(pick, None)
            commands.append(FlipCommand(FlipAction.DRAIN, pick, role, role.other, now))
            in_progress += 1
        return commands

    def begin_drain(self, instance_id: str, now: float) -> FlipCommand:
        """Start flipping an ACTIVE instance chosen by someone else (``core.pd_controller``): it becomes
        DRAINING (no new work) and switches once it reports empty, as for the instances this policy picks."""
        if self.state(instance_id) is not InstanceState.ACTIVE:
            raise ValueError(f"instance {instance_id!r} is not active (state {self.state(instance_id).value})")
        role = self._role[instance_id]
        if self.num_active(role) - 1 < self.config.min_per_role:
            raise ValueError(f"flipping {instance_id!r} would leave fewer than {self.config.min_per_role} "
                             f"active {role.value} instances")
        self._state[instance_id] = InstanceState.DRAINING
        self._decided_at[instance_id] = now
        self._low_since.pop(instance_id, None)
        return FlipCommand(FlipAction.DRAIN, instance_id, role, role.other, now)

    def _other_role_loaded(self, role: Role, by_id: dict[str, LoadReport]) -> bool:
        loads = [
            self.load(rep) for iid, rep in by_id.items()
            if self._role[iid] is role.other and self._state[iid] is InstanceState.ACTIVE
        ]
        return bool(loads) and sum(loads) / len(loads) >= self.config.busy_threshold

    def _candidate(self, by_id: dict[str, LoadReport], now: float) -> str | None:
        cfg = self.config
        eligible = []
        for iid, since in self._low_since.items():
            if iid not in by_id or self._state[iid] is not InstanceState.ACTIVE:
                continue
            role = self._role[iid]
            if now - since < cfg.window_s or now < self._cooldown_until.get(iid, float("-inf")):
                continue
            if self.num_active(role) - 1 < cfg.min_per_role:
                continue
            if not self._other_role_loaded(role, by_id):
                continue
            eligible.append((since, iid))
        return min(eligible)[1] if eligible else None

    def on_switched(self, instance_id: str, now: float) -> FlipRecord:
        """The instance finished switching role in place; it is ACTIVE in its new role."""
        if self.state(instance_id) is not InstanceState.FLIPPING:
            raise ValueError(f"instance {instance_id!r} is not flipping (state {self.state(instance_id).value})")
        old = self._role[instance_id]
        self._role[instance_id] = old.other
        self._state[instance_id] = InstanceState.ACTIVE
        self._cooldown_until[instance_id] = now + self.config.cooldown_s
        self._low_since.pop(instance_id, None)
        self._history.pop(instance_id, None)
        self._seen_since[instance_id] = now
        record = FlipRecord(
            instance_id, old, old.other, self._decided_at.pop(instance_id), self._drained_at.pop(instance_id), now
        )
        self.records.append(record)
        return record

    def remove(self, instance_id: str) -> None:
        """Forget an instance (removed from the cluster)."""
        for table in (self._role, self._state, self._low_since, self._history, self._seen_since, self._cooldown_until,
                      self._decided_at,
                      self._drained_at):
            table.pop(instance_id, None)
