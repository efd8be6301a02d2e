"""Queue rebalancing: move requests that have not started yet from a backed-up instance to an idle one.

Routing places each request once, on the load reports of that moment; reports lag, bursts pile onto one
instance, and an instance added by scale-out (or a flip) starts empty while its peers hold queues that would
otherwise drain at their own pace. The rebalancer evens such queues out, within one tier: prefill instances
among themselves, colocated instances among themselves (a decode instance holds no unstarted request it could
give away: everything it holds already has KV).

Rule, per tier, on every monitor round (``plan(reports, roles)``): the ACTIVE instance with the most queued
requests (the donor; ties: lowest id) gives ``min(max_move, q_donor // 2)`` of them if it has
at least ``min_queued`` queued and some other ACTIVE instance of the tier (the receiver) has an empty queue;
the front end asks the donor to hand back that many (``Yield``), the donor returns the newest requests that
made no progress there (nothing computed, no output, no KV; ``take_unstarted`` of the schedulers), and the
front end routes them again, the donor excluded. Only one request for a donor is in flight at a time
(``done(donor)`` clears it; ``forget(instance)`` when it leaves the pool).

Invariants: a move never names a non-ACTIVE instance as donor, never asks for fewer than 1 or more than
``max_move`` requests, and never starts while the tier has no empty-queued receiver; moving a request that has
not started is invisible to its client (no token was produced, no KV exists), so every request still ends
exactly once. Pure: no clock, no I/O; deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tetriinfer.core.load import InstanceState, LoadReport

REBALANCE_ROLES = ("prefill", "colocated")


@dataclass(frozen=True)
class RebalanceConfig:
    enabled: bool = False
    min_queued: int = 2  # a donor needs at least this many queued requests
    max_move: int = 16  # most requests one move hands over

    def __post_init__(self) -> None:
        if self.min_queued < 1:
            raise ValueError(f"rebalance min_queued must be >= 1, got {self.min_queued}")
        if self.max_move < 1:
            raise ValueError(f"rebalance max_move must be >= 1, got {self.max_move}")


@dataclass(frozen=True)
class Move:
    donor: str
    count: int  # how many unstarted requests to hand back (it may have fewer by the time it is asked)
    role: str


class Rebalancer:
    def __init__(self, config: RebalanceConfig) -> None:
        self.config = config
        self._pending: set[str] = set()  # donors asked and not yet answered
        self.num_moves = 0

    def plan(self, reports: Sequence[LoadReport], roles: Mapping[str, str]) -> list[Move]:
        """``roles``: instance id -> role (``prefill``, ``decode``, ``colocated``) of every pool member."""
        if not self.config.enabled:
            return []
        tiers: dict[str, list[LoadReport]] = {}
        for r in reports:
            role = roles.get(r.instance_id)
            if role in REBALANCE_ROLES and r.state is InstanceState.ACTIVE:
                tiers.setdefault(role, []).append(r)
        moves = []
        for role in sorted(tiers):
            tier = sorted(tiers[role], key=lambda r: r.instance_id)
            if len(tier) < 2:
                continue
            donor = max(tier, key=lambda r: (r.num_queued, -tier.index(r)))
            receiver_queue = min(r.num_queued for r in tier if r is not donor)
            if donor.instance_id in self._pending or donor.num_queued < self.config.min_queued or receiver_queue:
                continue
            count = min(self.config.max_move, donor.num_queued // 2)
            if count < 1:
                continue
            self._pending.add(donor.instance_id)
            self.num_moves += 1
            moves.append(Move(donor.instance_id, count, role))
        return moves

    def done(self, donor: str) -> None:
        """The donor answered (with however many requests it could give)."""
        self._pending.discard(donor)

    def forget(self, instance_id: str) -> None:
        """The instance left the pool (retired, died): never wait for its answer."""
        self._pending.discard(instance_id)

    @property
    def pending(self) -> frozenset[str]:
        return frozenset(self._pending)
