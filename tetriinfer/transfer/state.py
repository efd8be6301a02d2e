"""Transfer state machine: the one place that decides which state changes are legal.

Invariants:
- A transfer starts PENDING and ends in exactly one terminal state, DONE or FAILED.
- Legal moves: PENDING -> TRANSFERRING | FAILED, TRANSFERRING -> DONE | FAILED. Nothing leaves a terminal state.
- A FAILED transfer always carries a non-empty human-readable reason; DONE never carries one.
- Only the owning backend's I/O thread moves a record to a terminal state (so buffers are never written after
  the caller has seen DONE/FAILED); callers only read records.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass


class TransferState(enum.Enum):
    """State of one transfer, as seen by one side (sender, receiver or reader)."""

    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


LEGAL_TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset({TransferState.TRANSFERRING, TransferState.FAILED}),
    TransferState.TRANSFERRING: frozenset({TransferState.DONE, TransferState.FAILED}),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """Raised when code tries a state change that LEGAL_TRANSITIONS forbids (a bug, never a network fault)."""


class Role(enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"
    READER = "reader"


@dataclass(frozen=True)
class TransferStatus:
    """Snapshot of one transfer, safe to hand to other threads."""

    transfer_id: str
    role: Role
    state: TransferState
    reason: str
    bytes_done: int
    bytes_total: int
    attempt: int
    elapsed_s: float


class TransferRecord:
    """Mutable state machine of one transfer on one side. Not thread-safe: the owner holds a lock.

    `deadline` is an inactivity deadline: every call to `touch(now)` (progress) moves it to now + timeout_s.
    """

    __slots__ = (
        "transfer_id", "role", "state", "reason", "bytes_done", "bytes_total", "attempt",
        "timeout_s", "created", "deadline", "ended",
    )

    def __init__(self, transfer_id: str, role: Role, timeout_s: float, now: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        now = time.monotonic() if now is None else now
        self.transfer_id = transfer_id
        self.role = role
        self.state = TransferState.PENDING
        self.reason = ""
        self.bytes_done = 0
        self.bytes_total = 0
        self.attempt = 0
        self.timeout_s = timeout_s
        self.created = now
        self.deadline = now + timeout_s
        self.ended: float | None = None

    def advance(self, new: TransferState, reason: str = "", now: float | None = None) -> None:
        """Move to `new`; raises IllegalTransition on a forbidden move and ValueError on a FAILED without reason."""
        if new not in LEGAL_TRANSITIONS[self.state]:
            raise IllegalTransition(f"transfer {self.transfer_id!r}: {self.state.name} -> {new.name} is illegal")
        if new is TransferState.FAILED and not reason:
            raise ValueError("a FAILED transfer needs a reason")
        now = time.monotonic() if now is None else now
        self.state = new
        if new is TransferState.FAILED:
            self.reason = reason
        if new.terminal:
            self.ended = now

    def fail(self, reason: str, now: float | None = None) -> bool:
        """FAILED from any live state; returns False (and does nothing) if already terminal."""
        if self.state.terminal:
            return False
        self.advance(TransferState.FAILED, reason, now)
        return True

    def start(self, now: float | None = None) -> None:
        """PENDING -> TRANSFERRING if still pending (idempotent)."""
        if self.state is TransferState.PENDING:
            self.advance(TransferState.TRANSFERRING, now=now)

    def touch(self, now: float) -> None:
        self.deadline = now + self.timeout_s

    def expired(self, now: float) -> bool:
        return not self.state.terminal and now > self.deadline

    def snapshot(self, now: float | None = None) -> TransferStatus:
        now = time.monotonic() if now is None else now
        end = self.ended if self.ended is not None else now
        return TransferStatus(
            transfer_id=self.transfer_id, role=self.role, state=self.state, reason=self.reason,
            bytes_done=self.bytes_done, bytes_total=self.bytes_total, attempt=self.attempt,
            elapsed_s=end - self.created,
        )


def inbound_reject_reason(tid: str, region_id: str, region_found: bool, region_owner: str | None,
                          tid_in_use: bool, where: str) -> str:
    """Why a receiver refuses a new inbound transfer `tid` into `region_id` ("" = accept). Shared by every
    backend so peers read the same reasons: the region must exist, a recv()-posted region (owner set) takes only
    its own transfer, and a transfer id is used once per receiver."""
    if not region_found:
        return f"no region {region_id!r} posted at {where}"
    if region_owner is not None and region_owner != tid:
        return f"region {region_id!r} belongs to transfer {region_owner!r}"
    if tid_in_use:
        return f"transfer id {tid!r} is in use at the receiver"
    return ""


def new_record(recs: dict[str, TransferRecord], tid: str, role: Role, timeout_s: float | None,
               default_timeout_s: float) -> TransferRecord:
    """Create and register the record of a new transfer id (every backend: ids are non-empty and used once)."""
    if not isinstance(tid, str) or not tid:
        raise ValueError("transfer_id must be a non-empty string")
    if tid in recs:
        raise ValueError(f"transfer id {tid!r} is already in use on this agent (release() it first)")
    rec = TransferRecord(tid, role, timeout_s or default_timeout_s)
    recs[tid] = rec
    return rec


def lookup_record(recs: dict[str, TransferRecord], tid: str) -> TransferRecord:
    """The record of ``tid``; KeyError for an unknown (or released) id."""
    rec = recs.get(tid)
    if rec is None:
        raise KeyError(f"unknown transfer {tid!r}")
    return rec


def append_slots(next_slot: int, num_buffers: int, slots: Sequence[int] | None) -> list[int]:
    """Slots an append fills: the next ``num_buffers`` after ``next_slot`` by default, else ``slots`` (checked)."""
    if slots is None:
        return list(range(next_slot, next_slot + num_buffers))
    slot_list = [int(s) for s in slots]
    if len(slot_list) != num_buffers:
        raise ValueError(f"{num_buffers} buffers but {len(slot_list)} slots")
    if any(s < 0 for s in slot_list):
        raise ValueError("slots must be >= 0")
    return slot_list
