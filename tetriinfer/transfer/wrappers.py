"""Base for backends that wrap another backend's sending path (faulty, paced), and their delivery timer.

Invariant: a wrapper owns no transfer state of its own; poll/status/recv/read go straight to the inner backend,
so the inner backend's state machine and timeouts stay the single source of truth.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tetriinfer.transfer.base import Peer, TransferBackend, TransferStats
from tetriinfer.transfer.buffers import Buffer
from tetriinfer.transfer.messages import RemoteRegion
from tetriinfer.transfer.state import TransferState, TransferStatus

log = logging.getLogger(__name__)


class DeliveryTimer:
    """Runs callbacks at given monotonic times, in (time, submission) order, on one daemon thread."""

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._cancelled: set[str] = set()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def at(self, due: float, key: str, fn: Callable[[], None]) -> None:
        with self._cv:
            self._cancelled.discard(key)
            heapq.heappush(self._heap, (due, next(self._seq), key, fn))
            self._cv.notify()

    def cancel(self, key: str) -> None:
        """Drop every not-yet-run callback for `key`."""
        with self._cv:
            if any(k == key for _, _, k, _ in self._heap):
                self._cancelled.add(key)

    def pending(self) -> int:
        with self._cv:
            return len(self._heap)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._running and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic())
                    self._cv.wait(wait)
                if not self._running:
                    return
                _, _, key, fn = heapq.heappop(self._heap)
                skip = key in self._cancelled
                if not any(k == key for _, _, k, _ in self._heap):
                    self._cancelled.discard(key)
            if skip:
                continue
            try:
                fn()
            except (KeyError, ValueError, RuntimeError) as e:  # transfer released/closed meanwhile
                log.debug("delayed delivery for %s dropped: %s", key, e)

    def shutdown(self) -> None:
        with self._cv:
            self._running = False
            self._heap.clear()
            self._cv.notify()
        self._thread.join(timeout=5)


class SendPathWrapper:
    """Delegates the whole TransferBackend API to `inner`; subclasses override open/append/close."""

    kind = "wrapper"

    def __init__(self, inner: TransferBackend) -> None:
        self.inner = inner

    @property
    def address(self) -> str:
        return self.inner.address

    def alloc(self, shape: Sequence[int], dtype: Any) -> Buffer:
        return self.inner.alloc(shape, dtype)

    def alloc_like(self, shapes: Sequence[Sequence[int]], dtype: Any) -> list[Buffer]:
        return self.inner.alloc_like(shapes, dtype)

    def recv(self, transfer_id: str, into_buffers: Sequence[Buffer], *,
             timeout_s: float | None = None) -> RemoteRegion:
        return self.inner.recv(transfer_id, into_buffers, timeout_s=timeout_s)

    def register(self, region_id: str, buffers: Sequence[Buffer]) -> RemoteRegion:
        return self.inner.register(region_id, buffers)

    def deregister(self, region_id: str) -> None:
        self.inner.deregister(region_id)

    def open(self, transfer_id: str, peer: Peer, *, timeout_s: float | None = None,
             attempt: int = 0, max_attempts: int = 1) -> None:
        self.inner.open(transfer_id, peer, timeout_s=timeout_s, attempt=attempt, max_attempts=max_attempts)

    def append(self, transfer_id: str, buffers: Sequence[Buffer], *,
               slots: Sequence[int] | None = None) -> None:
        self.inner.append(transfer_id, buffers, slots=slots)

    def close(self, transfer_id: str) -> None:
        self.inner.close(transfer_id)

    def send(self, transfer_id: str, buffers: Sequence[Buffer], peer: Peer, *,
             timeout_s: float | None = None) -> None:
        self.open(transfer_id, peer, timeout_s=timeout_s)
        self.append(transfer_id, buffers)
        self.close(transfer_id)

    def write(self, transfer_id: str, remote_region: RemoteRegion, buffers: Sequence[Buffer], *,
              slots: Sequence[int] | None = None, timeout_s: float | None = None) -> None:
        self.open(transfer_id, remote_region, timeout_s=timeout_s)
        self.append(transfer_id, buffers, slots=slots)
        self.close(transfer_id)

    def read(self, transfer_id: str, remote_region: RemoteRegion, into_buffers: Sequence[Buffer], *,
             slots: Sequence[int] | None = None, timeout_s: float | None = None) -> None:
        self.inner.read(transfer_id, remote_region, into_buffers, slots=slots, timeout_s=timeout_s)

    def poll(self, transfer_id: str) -> TransferState:
        return self.inner.poll(transfer_id)

    def status(self, transfer_id: str) -> TransferStatus:
        return self.inner.status(transfer_id)

    def release(self, transfer_id: str) -> None:
        self.inner.release(transfer_id)

    def stats(self) -> TransferStats:
        return self.inner.stats()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __enter__(self) -> SendPathWrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
