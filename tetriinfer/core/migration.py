"""Live migration of running decodes between decode instances (Llumnix-style), decided here, carried out by the
instances.

Routing and dispatch place a request once, on the load reports of that moment; a decode can then run for
minutes. Two situations leave running requests on the wrong instance, and only moving them (with their KV)
helps: an instance that must empty (scale-in, or a decode -> prefill flip) would otherwise wait for its longest
decode to finish; and decode instances drift apart (bursts, mispredicted lengths) until one preempts or runs
large, slow batches while another idles.

A move: the front end tells the *source* ``Migrate(target, count)``; the source picks ``count`` of its running
decodes (``pick_migrants``: fewest tokens first, the cheapest to copy), takes them out of its batch between two
steps (their blocks stay held), and hands each to the target like a prefilled request (prompt + the outputs so
far, KV for every token but the last); the target admits it at once or refuses, receives the KV and decodes on
from the next output index. Only when the target confirms does the source free the blocks; a refusal or failed
transfer puts the request back into the source's batch. The client sees one stream: tokens carry their output
index, and no token is produced twice or skipped.

Rule (``MigrationPlanner.plan``), on every monitor round, within each tier (``roles``: decode instances among
themselves, colocated instances among themselves):
- **evacuate**: each instance in ``evacuate`` (retiring or flipping) with running requests spreads all of them
  over the ACTIVE, non-evacuating decode instances, most free blocks first, charging each target the source's
  mean blocks per request and never filling one beyond ``high``;
- **balance** (``signal``): ``kv``: an ACTIVE instance with KV usage above ``high`` sheds to the least-used
  one when that is below ``low``, enough requests to bring the source to the pair's mean, at most
  ``max_per_move``; ``running``: the instance running the most requests sheds half the gap to the one running
  the fewest when the gap is at least ``min_gap`` (batch size, not memory, is what slows a step on some
  hardware), provided the target's KV usage stays at or below ``high``.
A source has one move in flight at a time (``done(source)`` when its instance reports the move finished;
``forget(instance)`` when it leaves); a target is charged within a round, so two sources never herd onto it.

Invariants: never a move across tiers or from or to a prefill instance, from an instance to itself, or to an evacuating or
non-ACTIVE one; ``1 <= count`` (and ``<= max_per_move`` when balancing); a source with a move in flight is never
asked again. Pure: no clock, no I/O; deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.load import InstanceState, LoadReport
from tetriinfer.core.request import Request
from tetriinfer.core.request_table import RequestTable

MIGRATION_ROLES = ("decode", "colocated")  # each its own tier: decode among decode, colocated among colocated
SIGNALS = ("kv", "running")


@dataclass(frozen=True)
class MigrationConfig:
    enabled: bool = False
    signal: str = "kv"  # what balancing evens out: "kv" usage or "running" requests
    high: float = 0.85  # kv: a source's usage is above this; any target stays at or below it
    low: float = 0.6  # kv: a target's usage is below this
    min_gap: int = 4  # running: the most- and least-running instances differ by at least this many
    max_per_move: int = 8  # most requests one balancing move hands over (evacuation moves everything)

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"migration signal must be one of {SIGNALS}, got {self.signal!r}")
        if not 0.0 < self.low < self.high <= 1.0:
            raise ValueError(f"migration needs 0 < low < high <= 1, got low={self.low}, high={self.high}")
        if self.min_gap < 2:
            raise ValueError(f"migration min_gap must be >= 2, got {self.min_gap}")
        if self.max_per_move < 1:
            raise ValueError(f"migration max_per_move must be >= 1, got {self.max_per_move}")


@dataclass(frozen=True)
class MigrateCommand:
    """Move ``count`` running requests from ``source`` to each ``(target, count)`` of ``targets`` (the source may
    have fewer by the time it is asked). One command per source: it answers once, when all of it is done."""

    source: str
    targets: tuple[tuple[str, int], ...]
    reason: str  # "evacuate" | "balance"

    @property
    def count(self) -> int:
        return sum(n for _, n in self.targets)


def pick_migrants(running: Sequence[Request], count: int) -> list[Request]:
    """The running decodes a source hands over: decode phase only (a first token exists and every token but
    the last is computed), not about to finish (two or more output tokens left), fewest tokens first (the
    least KV to copy; ties: request id). At most ``count``."""
    eligible = [
        r for r in running
        if r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1 and not r.is_finished
        and r.sampling_params.max_tokens - r.num_output_tokens >= 2
    ]
    eligible.sort(key=lambda r: (r.num_tokens, r.request_id))
    return eligible[: max(0, count)]


class Detachable:
    """The source side of a migration, for a scheduler with ``running`` (list), ``migrating`` (dict), ``kv`` and
    ``_table``: ``detach`` takes a running decode out of the batch between steps, its blocks still held, while its
    KV is copied elsewhere; ``release_migrated`` then frees them (the request leaves unfinished: it goes on
    elsewhere, nothing is reported here); ``reattach`` puts it back into the batch (the move failed)."""

    running: list[Request]
    migrating: dict[str, Request]
    kv: KVCacheManager
    _table: RequestTable

    def detach(self, request_id: str) -> Request:
        """KeyError: not running here; ValueError: not decoding (prefill unfinished or mid-step)."""
        req = next((r for r in self.running if r.request_id == request_id), None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not running at this instance")
        if not req.output_token_ids or req.num_computed_tokens != req.num_tokens - 1:
            raise ValueError(f"request {request_id!r} is not decoding (prefill unfinished or mid-step)")
        self.running.remove(req)
        self.migrating[request_id] = req
        return req

    def reattach(self, request_id: str) -> None:
        """The request decodes here again from the next step (as the youngest)."""
        req = self.migrating.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not migrating from this instance")
        self.running.append(req)

    def release_migrated(self, request_id: str) -> Request:
        req = self.migrating.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not migrating from this instance")
        self.kv.free_request(request_id)
        self._table.remove(request_id)
        self._released(request_id)
        return req

    def _released(self, request_id: str) -> None:
        """Hook: per-request state the scheduler drops when a request has left."""


@dataclass
class _Room:
    """A target's projected state within one planning round."""

    report: LoadReport
    used: int
    running: int

    @property
    def usage(self) -> float:
        total = self.report.num_blocks
        return self.used / total if total else 1.0


class MigrationPlanner:
    def __init__(self, config: MigrationConfig) -> None:
        self.config = config
        self._pending: set[str] = set()  # sources asked and not yet finished
        self.num_moves = 0

    def plan(self, reports: Sequence[LoadReport], roles: Mapping[str, str],
             evacuate: Collection[str] = ()) -> list[MigrateCommand]:
        """``roles``: instance id -> role of every pool member; ``evacuate``: instances that must empty."""
        if not self.config.enabled:
            return []
        moves: list[MigrateCommand] = []
        for role in MIGRATION_ROLES:
            tier = sorted((r for r in reports if roles.get(r.instance_id) == role), key=lambda r: r.instance_id)
            moves.extend(self._plan_tier(tier, evacuate))
        return moves

    def _plan_tier(self, tier: list[LoadReport], evacuate: Collection[str]) -> list[MigrateCommand]:
        rooms = {r.instance_id: _Room(r, r.num_used_blocks, r.num_running) for r in tier
                 if r.state is InstanceState.ACTIVE and r.instance_id not in evacuate and r.num_blocks}
        moves: list[MigrateCommand] = []
        for src in tier:
            if src.instance_id in evacuate and src.num_running and src.instance_id not in self._pending:
                move = self._evacuate(src, rooms)
                if move is not None:
                    moves.append(move)
        for src in tier:
            charged = {t for m in moves for t, _ in m.targets}
            if src.instance_id in self._pending or src.instance_id not in rooms or src.instance_id in charged:
                continue
            move = self._balance(src, {iid: m for iid, m in rooms.items() if iid not in self._sources(moves)})
            if move is not None:
                moves.append(move)
        return moves

    @staticmethod
    def _sources(moves: Sequence[MigrateCommand]) -> set[str]:
        return {m.source for m in moves}

    def _evacuate(self, src: LoadReport, rooms: dict[str, _Room]) -> MigrateCommand | None:
        per_request = max(1, math.ceil(src.num_used_blocks / max(1, src.num_running)))
        counts: dict[str, int] = {}
        for _ in range(src.num_running):
            fits = [room for room in rooms.values()
                    if (room.used + per_request) / room.report.num_blocks <= self.config.high]
            if not fits:
                break
            room = max(fits, key=lambda m: (m.report.num_blocks - m.used, -m.running, m.report.instance_id))
            room.used += per_request
            room.running += 1
            counts[room.report.instance_id] = counts.get(room.report.instance_id, 0) + 1
        if not counts:
            return None
        self._pending.add(src.instance_id)
        self.num_moves += 1
        return MigrateCommand(src.instance_id, tuple(sorted(counts.items())), "evacuate")

    def _balance(self, src: LoadReport, rooms: dict[str, _Room]) -> MigrateCommand | None:
        me = rooms[src.instance_id]
        others = [room for iid, room in rooms.items() if iid != src.instance_id]
        if not others or me.running < 2:
            return None
        per_request = max(1, math.ceil(me.used / max(1, me.running)))
        high = self.config.high
        if self.config.signal == "kv":
            target = min(others, key=lambda m: (m.usage, m.report.instance_id))
            if me.usage <= high or target.usage >= self.config.low:
                return None
            mean = (me.used + target.used) / 2
            count = math.floor((me.used - mean) / per_request)
        else:
            target = min(others, key=lambda m: (m.running, m.usage, m.report.instance_id))
            gap = me.running - target.running
            if gap < self.config.min_gap:
                return None
            count = gap // 2
        room_left = math.floor((high * target.report.num_blocks - target.used) / per_request)
        count = min(count, self.config.max_per_move, room_left, me.running - 1)
        if count < 1:
            return None
        target.used += count * per_request
        target.running += count
        me.used -= count * per_request
        me.running -= count
        self._pending.add(src.instance_id)
        self.num_moves += 1
        return MigrateCommand(src.instance_id, ((target.report.instance_id, count),), "balance")

    def done(self, source: str) -> None:
        """The source finished a move (every request it picked moved, came back, or ended)."""
        self._pending.discard(source)

    def forget(self, instance_id: str) -> None:
        """The instance left the pool: never wait for its answer."""
        self._pending.discard(instance_id)

    @property
    def pending(self) -> frozenset[str]:
        return frozenset(self._pending)
