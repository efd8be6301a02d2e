"""The one transfer API every link implements, plus its config and leak counters.

Two-sided:   receiver `recv(tid, into)` posts (reserves) buffers and returns a RemoteRegion;
             sender `send(tid, buffers, peer)` fills them (peer = receiver address or that RemoteRegion).
One-sided:   owner `register(region_id, buffers)` exposes memory; peers `write(tid, region, buffers)` into it or
             `read(tid, region, into)` from it without the owner doing anything per transfer.
Chunk-wise:  `open(tid, peer)`, then `append(tid, buffers)` as each prefill chunk completes, then `close(tid)`;
             the receiver reaches DONE only after close and once every posted slot was filled.
Memory:      `alloc(shape, dtype)` / `alloc_like(shapes, dtype)` give receive buffers the link fills best: on shm
             they live in a shared-memory arena, so `recv()` into them lets the sender copy each byte once,
             straight into them (other links return ordinary memory). Drop the last reference to free them.
Completion:  `poll(tid) -> TransferState` (never blocks), `status(tid)` for reason/bytes, `release(tid)` to
             forget a finished transfer (or cancel a live one).

Invariants: a sender's buffers must stay unchanged until its transfer is terminal; a receiver's buffers are not
written after its transfer is terminal; every transfer ends DONE or FAILED within its (inactivity) timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tetriinfer.transfer.buffers import Buffer
from tetriinfer.transfer.messages import RemoteRegion
from tetriinfer.transfer.state import TransferState, TransferStatus

Peer = str | RemoteRegion


@dataclass(frozen=True)
class AgentConfig:
    """Settings shared by all backends. `timeout_s` is the default per-transfer inactivity timeout."""

    timeout_s: float = 30.0
    sweep_interval_s: float = 0.005
    cancel_wait_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not 0 < self.sweep_interval_s <= 1:
            raise ValueError(f"sweep_interval_s must be in (0, 1], got {self.sweep_interval_s}")
        if not self.cancel_wait_s > 0:
            raise ValueError(f"cancel_wait_s must be > 0, got {self.cancel_wait_s}")


@dataclass(frozen=True)
class TransferStats:
    """Live resources of one backend, for leak checks: all zero-ish after every transfer is released."""

    records: int  # transfer records not yet released (terminal ones included)
    active: int  # transfers not yet terminal
    regions: int  # posted/registered regions still holding buffer references
    pinned_payloads: int  # sender payload lists still referenced
    staging_segments: int  # shared-memory staging segments in use (shm backend)
    pooled_segments: int  # idle staging segments kept for reuse
    peers: int  # outbound sockets
    arena_segments: int = 0  # shared-memory arena segments (shm backend; alloc() memory)
    arena_allocations: int = 0  # arena buffers still referenced by the caller (0 once all are dropped)
    arena_bytes: int = 0  # bytes of those buffers (page-rounded)


@runtime_checkable
class TransferBackend(Protocol):
    """Structural type of every backend and wrapper (inproc, shm, tcp, nixl, faulty, paced)."""

    kind: str

    @property
    def address(self) -> str: ...

    # memory: buffers the link can fill with the fewest copies (shm: shared-memory arena; others: plain)
    def alloc(self, shape: Sequence[int], dtype: Any) -> Buffer: ...
    def alloc_like(self, shapes: Sequence[Sequence[int]], dtype: Any) -> list[Buffer]: ...

    # receiver / region owner
    def recv(self, transfer_id: str, into_buffers: Sequence[Buffer], *,
             timeout_s: float | None = None) -> RemoteRegion: ...
    def register(self, region_id: str, buffers: Sequence[Buffer]) -> RemoteRegion: ...
    def deregister(self, region_id: str) -> None: ...

    # sender
    def open(self, transfer_id: str, peer: Peer, *, timeout_s: float | None = None,
             attempt: int = 0, max_attempts: int = 1) -> None: ...
    def append(self, transfer_id: str, buffers: Sequence[Buffer], *,
               slots: Sequence[int] | None = None) -> None: ...
    def close(self, transfer_id: str) -> None: ...
    def send(self, transfer_id: str, buffers: Sequence[Buffer], peer: Peer, *,
             timeout_s: float | None = None) -> None: ...
    def write(self, transfer_id: str, remote_region: RemoteRegion, buffers: Sequence[Buffer], *,
              slots: Sequence[int] | None = None, timeout_s: float | None = None) -> None: ...

    # reader
    def read(self, transfer_id: str, remote_region: RemoteRegion, into_buffers: Sequence[Buffer], *,
             slots: Sequence[int] | None = None, timeout_s: float | None = None) -> None: ...

    # completion
    def poll(self, transfer_id: str) -> TransferState: ...
    def status(self, transfer_id: str) -> TransferStatus: ...
    def release(self, transfer_id: str) -> None: ...
    def stats(self) -> TransferStats: ...
    def shutdown(self) -> None: ...
