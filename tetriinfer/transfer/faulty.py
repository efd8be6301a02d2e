"""Fault injection around any backend (tests, chaos runs): drop, delay or corrupt a transfer attempt.

The fault of an attempt is drawn once, at open(), from a RNG seeded by (seed, transfer_id, attempt), so a run is
reproducible. Faults act on the sending path only:
- drop:    open is forwarded, every append/close is swallowed -> the inner transfer times out -> FAILED.
- delay:   appends/close reach the inner backend `delay_s` later -> DONE after the delay.
- corrupt: the first appended payload loses its last byte -> the receiver rejects the length -> FAILED with
           a "length mismatch" reason on both sides (on the receiver only when it is the last attempt).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tetriinfer.transfer.base import Peer, TransferBackend
from tetriinfer.transfer.buffers import Buffer, as_byte_views
from tetriinfer.transfer.wrappers import DeliveryTimer, SendPathWrapper

FAULTS = ("none", "drop", "delay", "corrupt")


@dataclass(frozen=True)
class FaultPlan:
    """Probabilities of each fault per attempt (they must sum to <= 1); `faulty_attempts` limits faults to the
    first N attempts of a transfer (None: all)."""

    drop_p: float = 0.0
    delay_p: float = 0.0
    corrupt_p: float = 0.0
    delay_s: float = 0.05
    seed: int = 0
    faulty_attempts: int | None = None

    def __post_init__(self) -> None:
        for name in ("drop_p", "delay_p", "corrupt_p"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {p}")
        if self.drop_p + self.delay_p + self.corrupt_p > 1.0 + 1e-9:
            raise ValueError("drop_p + delay_p + corrupt_p must be <= 1")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if self.faulty_attempts is not None and self.faulty_attempts < 0:
            raise ValueError(f"faulty_attempts must be >= 0, got {self.faulty_attempts}")

    def draw(self, transfer_id: str, attempt: int) -> str:
        if self.faulty_attempts is not None and attempt >= self.faulty_attempts:
            return "none"
        u = random.Random(f"{self.seed}:{transfer_id}:{attempt}").random()
        for fault, p in (("drop", self.drop_p), ("corrupt", self.corrupt_p), ("delay", self.delay_p)):
            if u < p:
                return fault
            u -= p
        return "none"


class FaultyBackend(SendPathWrapper):
    kind = "faulty"

    def __init__(self, inner: TransferBackend, plan: FaultPlan | None = None) -> None:
        super().__init__(inner)
        self.plan = plan or FaultPlan()
        self.injected: Counter[str] = Counter()
        self._fault: dict[str, str] = {}
        self._corrupted: set[str] = set()
        self._last_due: dict[str, float] = {}
        self._lock = threading.Lock()
        self._timer = DeliveryTimer("xfer-faulty")

    def fault_of(self, transfer_id: str) -> str:
        """The fault drawn for the current attempt of `transfer_id` ('none' if unknown)."""
        with self._lock:
            return self._fault.get(transfer_id, "none")

    def open(self, transfer_id: str, peer: Peer, *, timeout_s: float | None = None,
             attempt: int = 0, max_attempts: int = 1) -> None:
        self.inner.open(transfer_id, peer, timeout_s=timeout_s, attempt=attempt, max_attempts=max_attempts)
        fault = self.plan.draw(transfer_id, attempt)
        with self._lock:
            self._fault[transfer_id] = fault
            self._corrupted.discard(transfer_id)
            self._last_due.pop(transfer_id, None)
            self.injected[fault] += 1

    def _later(self, transfer_id: str, fn: object) -> None:
        with self._lock:
            due = max(self._last_due.get(transfer_id, 0.0), time.monotonic() + self.plan.delay_s)
            self._last_due[transfer_id] = due
        self._timer.at(due, transfer_id, fn)  # type: ignore[arg-type]

    def append(self, transfer_id: str, buffers: Sequence[Buffer], *,
               slots: Sequence[int] | None = None) -> None:
        fault = self.fault_of(transfer_id)
        if fault == "drop":
            return
        if fault == "corrupt":
            with self._lock:
                first = transfer_id not in self._corrupted
                self._corrupted.add(transfer_id)
            if first:
                views = as_byte_views(buffers)
                idx = next((i for i in range(len(views) - 1, -1, -1) if views[i].nbytes > 0), None)
                if idx is None:
                    views.append(np.zeros(1, dtype=np.uint8))
                else:
                    views[idx] = views[idx][:-1]
                buffers = views
        if fault == "delay":
            self._later(transfer_id, lambda: self.inner.append(transfer_id, buffers, slots=slots))
            return
        self.inner.append(transfer_id, buffers, slots=slots)

    def close(self, transfer_id: str) -> None:
        fault = self.fault_of(transfer_id)
        if fault == "drop":
            return
        if fault == "delay":
            self._later(transfer_id, lambda: self.inner.close(transfer_id))
            return
        self.inner.close(transfer_id)

    def release(self, transfer_id: str) -> None:
        self._timer.cancel(transfer_id)
        with self._lock:
            self._fault.pop(transfer_id, None)
            self._corrupted.discard(transfer_id)
            self._last_due.pop(transfer_id, None)
        self.inner.release(transfer_id)

    def shutdown(self) -> None:
        self._timer.shutdown()
        self.inner.shutdown()
