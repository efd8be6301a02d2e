"""Link emulation: pace any backend's sending path to a bandwidth and a one-way latency.

Model (store-and-forward, one link per PacedLink): appended payloads are serialized back to back; a payload of
n bytes enters the link when it is free, occupies it n / bandwidth seconds, and is handed to the inner backend
`latency_s` after it left. Close follows the last payload. The inner backend's own time adds on top, so use a
fast inner backend (inproc/shm) to emulate a slower link. Presets: the paper's 200 Gbps RoCE and 300 GB/s NVLink.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from tetriinfer.transfer.base import TransferBackend
from tetriinfer.transfer.buffers import Buffer, as_byte_views
from tetriinfer.transfer.wrappers import DeliveryTimer, SendPathWrapper
from tetriinfer.units import LINK_PRESETS, parse_bandwidth, parse_duration

__all__ = ["LINK_PRESETS", "PacedLink", "parse_bandwidth", "parse_duration"]


class PacedLink(SendPathWrapper):
    """Wraps `inner` so that its sends take at least bytes / bandwidth + latency (one shared link)."""

    kind = "paced"

    def __init__(self, inner: TransferBackend, bandwidth: str | float = "200Gbps",
                 latency: str | float = 0.0) -> None:
        super().__init__(inner)
        self.bandwidth_Bps = parse_bandwidth(bandwidth)
        self.latency_s = parse_duration(latency)
        self._lock = threading.Lock()
        self._link_free_at = 0.0
        self._last_due: dict[str, float] = {}
        self._timer = DeliveryTimer("xfer-paced")

    def transfer_time(self, nbytes: int) -> float:
        """Ideal seconds to move `nbytes` over an idle link."""
        return nbytes / self.bandwidth_Bps + self.latency_s

    def append(self, transfer_id: str, buffers: Sequence[Buffer], *,
               slots: Sequence[int] | None = None) -> None:
        views = as_byte_views(buffers)
        nbytes = sum(v.nbytes for v in views)
        with self._lock:
            now = time.monotonic()
            start = max(now, self._link_free_at)
            self._link_free_at = start + nbytes / self.bandwidth_Bps
            due = self._link_free_at + self.latency_s
            self._last_due[transfer_id] = max(due, self._last_due.get(transfer_id, 0.0))
        self._timer.at(due, transfer_id, lambda: self.inner.append(transfer_id, views, slots=slots))

    def close(self, transfer_id: str) -> None:
        with self._lock:
            due = max(self._last_due.pop(transfer_id, 0.0), time.monotonic() + self.latency_s)
        self._timer.at(due, transfer_id, lambda: self.inner.close(transfer_id))

    def release(self, transfer_id: str) -> None:
        self._timer.cancel(transfer_id)
        with self._lock:
            self._last_due.pop(transfer_id, None)
        self.inner.release(transfer_id)

    def shutdown(self) -> None:
        self._timer.shutdown()
        self.inner.shutdown()
