"""Simulated links between instances: one FIFO pipe per (source, destination) pair.

The same model as the runtime's link emulation (``transfer.paced``): a payload of ``n`` bytes enters its link
when the link is free, occupies it ``n / bandwidth`` seconds, and arrives ``latency`` seconds after it left.
Invariants: payloads on one link arrive in the order they were sent; a link never carries two payloads at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tetriinfer.units import parse_bandwidth, parse_duration


@dataclass
class Links:
    bandwidth: str | float = "200Gbps"
    latency: str | float = 0.0
    # set in __post_init__ (not as field defaults: a compiled build's native class would leave them unset)
    bandwidth_Bps: float = field(init=False)
    latency_s: float = field(init=False)
    _free_at: dict[tuple[str, str], float] = field(init=False)  # (src, dst) -> when that link is next free
    bytes_sent: int = field(init=False)
    busy_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.bandwidth_Bps = parse_bandwidth(self.bandwidth)
        self.latency_s = parse_duration(self.latency)
        self._free_at = {}
        self.bytes_sent = 0
        self.busy_s = 0.0

    def send(self, src: str, dst: str, nbytes: int, now: float) -> float:
        """Put ``nbytes`` on the ``src -> dst`` link at ``now``; returns when they have all arrived."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        start = max(now, self._free_at.get((src, dst), 0.0))
        wire = nbytes / self.bandwidth_Bps
        self._free_at[(src, dst)] = start + wire
        self.bytes_sent += nbytes
        self.busy_s += wire
        return start + wire + self.latency_s

    def message(self, now: float) -> float:
        """When a small control message sent at ``now`` arrives (latency only; it does not queue)."""
        return now + self.latency_s
