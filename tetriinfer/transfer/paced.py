"""Link emulation: pace any backend's sending path to a bandwidth and a one-way latency.

Model (store-and-forward, one link per PacedLink): appended payloads are serialized back to back; a payload of
n bytes enters the link when it is free, occupies it n / bandwidth seconds, and is handed to the inner backend
`latency_s` after it left. Close follows the last payload. The inner backend's own time adds on top, so use a
fast inner backend (inproc/shm) to emulate a slower link. Presets: the paper's 200 Gbps RoCE and 300 GB/s NVLink.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence

from tetriinfer.transfer.base import TransferBackend
from tetriinfer.transfer.buffers import Buffer, as_byte_views
from tetriinfer.transfer.wrappers import DeliveryTimer, SendPathWrapper

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BW_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bps|b/s|bit/s|gbit|B/s|Bps|B)\s*$",
                    re.IGNORECASE)
_T_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)?\s*$")

LINK_PRESETS: dict[str, str] = {
    "roce-200g": "200Gbps",  # the paper's emulated RDMA NIC link
    "nvlink-300": "300GB/s",  # the paper's emulated NVLink
    "eth-10g": "10Gbps",
}


def parse_bandwidth(spec: str | float | int) -> float:
    """Bytes per second from '200Gbps' (bits), '300GB/s' or '300GBps' (bytes), '10gbit', or a number (bytes/s).

    A lowercase 'b' before 'ps'/'/s' means bits, an uppercase 'B' means bytes; 'Gbps' is always bits."""
    if isinstance(spec, int | float):
        value = float(spec)
    else:
        s = LINK_PRESETS.get(spec.strip().lower(), spec)
        match = _BW_RE.match(s)
        if not match:
            raise ValueError(f"cannot parse bandwidth {spec!r}; use e.g. '200Gbps', '300GB/s', '10Gbps'")
        number, prefix, unit = match.groups()
        is_bytes = unit.startswith("B")
        value = float(number) * _UNITS[prefix.lower()] / (1.0 if is_bytes else 8.0)
    if not value > 0:
        raise ValueError(f"bandwidth must be > 0, got {spec!r}")
    return value


def parse_duration(spec: str | float | int) -> float:
    """Seconds from '5us', '1.5ms', '0.2s' or a number of seconds."""
    if isinstance(spec, int | float):
        value = float(spec)
    else:
        match = _T_RE.match(spec)
        if not match:
            raise ValueError(f"cannot parse duration {spec!r}; use e.g. '5us', '2ms', '0.1s'")
        number, unit = match.groups()
        value = float(number) * {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[unit]
    if value < 0:
        raise ValueError(f"duration must be >= 0, got {spec!r}")
    return value


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
