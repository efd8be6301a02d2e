"""Autoscaling: when to add an instance of a role, or remove one, from the instances' load reports.

The flip policy moves capacity between roles inside a fixed pool; this one changes the pool (the runtime's
``add_instance`` / ``remove_instance``: scale-out starts a process, scale-in drains one without losing a request).

Per role (``prefill``, ``decode``, ``colocated``), every ``observe(reports, roles, now)`` records the mean load of
that role's ACTIVE instances. Load, in [0, 1]:
- prefill: ``LoadReport.load`` (max of busy fraction and KV usage): a prefill instance idles without prompts;
- colocated: max(KV usage, queue pressure, step inflation); queue pressure = waiting / (waiting + running)
  requests, step inflation = how much batching slows its decode steps vs batch 1 (``core.step_inflation``). Not
  the busy fraction: an instance that holds one decoding request steps all the time, so busy time says nothing
  about whether another instance would help; waiting requests (TTFT), a filling KV pool (preemptions) and
  slowing steps (TPOT) do;
- decode: max(queue pressure, the ``decode_load`` measure: ``busy`` = ``LoadReport.load``, ``kv`` = KV usage,
  ``inflation`` = max(KV usage, how much batching slows each step vs batch 1)).

Rules, evaluated once the role's samples span ``window_s``:
- ADD instances of a role whose mean load over the window is >= ``high`` -- ``decode`` first when it is hot
  (downstream: while decode is saturated, more prefill only moves the queue from prompts to prefilled requests
  waiting for a decode slot), else the higher mean -- if the pool has fewer than ``max_instances`` ACTIVE members:
  as many as bring the role's mean to the middle of the band, ``ceil(n x mean / ((high + low) / 2)) - n`` for
  ``n`` active instances (at least 1; at most ``max_step`` and what ``max_instances`` leaves). Loads saturate at
  1, so under heavy overload this is a lower bound: a later window adds more;
- at ``max_instances`` with a hot role: REMOVE the least-loaded instance of another role that can lose one
  without turning hot itself (``n x mean / (n - 1) < high``, more than ``min_per_role`` instances); a later
  window adds to the hot role in its place, so the mix follows the load even at the cap;
- else REMOVE one instance: the least-loaded (latest report; ties: the youngest id) of a role whose mean load over
  the window is <= ``low`` and which has more than ``min_per_role`` ACTIVE instances.

At most one command at a time: after issuing one, ``observe`` returns nothing until the runtime calls
``finished(now)`` -- after an ADD's instances serve, and as soon as a REMOVE's instance is draining (a drain can
take long: waiting for it would freeze scaling; a draining instance is not ACTIVE, so it does not count toward
``max_instances`` and the pool may exceed it while one drains) -- then nothing for ``cooldown_s`` more; every
role's history restarts then (the new membership changes every load). Pure: no clock (``now`` is passed in), no
I/O; deterministic.

Invariants: the ACTIVE pool never goes above ``max_instances`` or a role below ``min_per_role`` through this
policy; a command is never issued for a role with no report; ``low < high`` (so a load cannot both add and
remove).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tetriinfer.core.load import InstanceState, LoadReport

SCALE_ROLES = ("prefill", "decode", "colocated")


class ScaleAction(enum.Enum):
    ADD = "add"
    REMOVE = "remove"


@dataclass(frozen=True)
class ScaleCommand:
    action: ScaleAction
    role: str
    instance_id: str | None = None  # REMOVE: which one
    count: int = 1  # ADD: how many instances
    mean_load: float = 0.0  # the window mean that triggered it


@dataclass(frozen=True)
class ScaleConfig:
    enabled: bool = False
    high: float = 0.8
    low: float = 0.2
    window_s: float = 5.0
    cooldown_s: float = 10.0
    min_per_role: int = 1
    max_instances: int = 8
    decode_load: str = "inflation"  # busy | kv | inflation
    max_step: int = 4  # most instances one ADD starts

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high <= 1:
            raise ValueError(f"autoscale needs 0 <= low < high <= 1, got low={self.low}, high={self.high}")
        if self.window_s <= 0 or self.cooldown_s < 0:
            raise ValueError("autoscale window_s must be > 0 and cooldown_s >= 0")
        if self.min_per_role < 1:
            raise ValueError(f"autoscale min_per_role must be >= 1, got {self.min_per_role}")
        if self.max_instances < 1:
            raise ValueError(f"autoscale max_instances must be >= 1, got {self.max_instances}")
        if self.max_step < 1:
            raise ValueError(f"autoscale max_step must be >= 1, got {self.max_step}")
        if self.decode_load not in ("busy", "kv", "inflation"):
            raise ValueError(f"autoscale decode_load must be busy, kv or inflation, got {self.decode_load!r}")


class ScalePolicy:
    def __init__(self, config: ScaleConfig) -> None:
        self.config = config
        self._history: dict[str, deque[tuple[float, float]]] = {}
        self._in_flight = False
        self._quiet_until = float("-inf")

    def load(self, report: LoadReport, role: str) -> float:
        if role == "prefill":
            return report.load
        held = report.num_queued + report.num_running
        queue = report.num_queued / held if held else 0.0
        if role == "colocated":
            return max(report.kv_usage, queue, report.step_inflation)
        if self.config.decode_load == "kv":
            measure = report.kv_usage
        elif self.config.decode_load == "inflation":
            measure = max(report.kv_usage, report.step_inflation)
        else:
            measure = report.load
        return max(measure, queue)

    def finished(self, now: float) -> None:
        """The last command has completed (or failed): cool down, then judge the new membership afresh."""
        self._in_flight = False
        self._quiet_until = now + self.config.cooldown_s
        self._history.clear()

    def observe(self, reports: Sequence[LoadReport], roles: Mapping[str, str], now: float) -> list[ScaleCommand]:
        """``roles``: instance id -> role name for every instance in the pool (reports may lag behind it)."""
        if not self.config.enabled or self._in_flight or now < self._quiet_until:
            return []
        active = [r for r in reports if r.state is InstanceState.ACTIVE and r.instance_id in roles]
        by_role: dict[str, list[LoadReport]] = {}
        for r in active:
            by_role.setdefault(roles[r.instance_id], []).append(r)
        means: dict[str, float] = {}
        for role, reps in by_role.items():
            hist = self._history.setdefault(role, deque())
            hist.append((now, sum(self.load(r, role) for r in reps) / len(reps)))
            while len(hist) > 1 and hist[1][0] <= now - self.config.window_s:
                hist.popleft()  # keep one sample at or before the window's start
            if now - hist[0][0] >= self.config.window_s:
                in_window = [load for t, load in hist if t >= now - self.config.window_s]
                means[role] = sum(in_window) / len(in_window)
        cmd = self._decide(means, by_role, roles)
        if cmd is not None:
            self._in_flight = True
        return [cmd] if cmd is not None else []

    def _decide(self, means: dict[str, float], by_role: dict[str, list[LoadReport]],
                roles: Mapping[str, str]) -> ScaleCommand | None:
        c = self.config
        middle = (c.high + c.low) / 2
        hot = [(role == "decode", m, role) for role, m in means.items() if m >= c.high]
        if hot and len(roles) < c.max_instances:
            _, m, role = max(hot)
            n = len(by_role[role])
            want = math.ceil(n * m / middle - 1e-9) - n
            count = max(1, min(want, c.max_step, c.max_instances - len(roles)))
            return ScaleCommand(ScaleAction.ADD, role, mean_load=m, count=count)
        if hot:  # at the cap: make room in a role that can spare an instance
            _, _, hot_role = max(hot)
            for role, m in sorted(means.items(), key=lambda kv: kv[1]):
                reps = by_role[role]
                n = len(reps)
                if role != hot_role and n > c.min_per_role and n * m / (n - 1) < c.high:
                    return ScaleCommand(ScaleAction.REMOVE, role, self._victim(reps, role), mean_load=m)
        for role, m in sorted(means.items(), key=lambda kv: kv[1]):
            reps = by_role[role]
            if m <= c.low and len(reps) > c.min_per_role:
                return ScaleCommand(ScaleAction.REMOVE, role, self._victim(reps, role), mean_load=m)
        return None

    def _victim(self, reps: list[LoadReport], role: str) -> str:
        return min(reps, key=lambda r: (self.load(r, role), _newest_first(r.instance_id))).instance_id


def _newest_first(instance_id: str) -> tuple[int, str]:
    """Sort key that puts the highest-numbered (youngest) id first: ``decode-3`` before ``decode-1``."""
    tail = instance_id.rsplit("-", 1)[-1]
    return (-int(tail) if tail.isdigit() else 0, instance_id)
