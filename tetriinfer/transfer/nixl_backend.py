"""NIXL adapter (optional): one-sided RDMA-style WRITE/READ through `nixl` (UCX), with the same API.

Only usable when `import nixl` works (pin nixl==1.5.1). Not exercised in CI here (nixl is not installed); the
tests skip it with that reason. Progress is driven by poll(): each call checks the posted NIXL transfers and the
notifications. A RemoteRegion's `extra` carries msgspec-encoded agent metadata and slot addresses, so a peer can
load the agent and address the memory without any other exchange. Invariant, as for every backend: records end
DONE or FAILED within their inactivity timeout, and registrations are dropped on every terminal state.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from tetriinfer.transfer.base import AgentConfig, Peer, TransferStats
from tetriinfer.transfer.buffers import Buffer, as_byte_views, plain_alloc
from tetriinfer.transfer.messages import RemoteRegion
from tetriinfer.transfer.state import Role, TransferRecord, TransferState, TransferStatus

try:  # pragma: no cover - depends on the optional package
    from nixl._api import nixl_agent, nixl_agent_config

    NIXL_AVAILABLE = True
    NIXL_IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - any import failure means "not available"
    NIXL_AVAILABLE = False
    NIXL_IMPORT_ERROR = f"{type(e).__name__}: {e}"


class _NixlExtra(msgspec.Struct, frozen=True):
    agent: str
    meta: bytes
    addrs: list[int]


@dataclass
class _Xfer:
    rec: TransferRecord
    remote_agent: str = ""
    remote_addrs: list[int] = field(default_factory=list)
    slot_sizes: list[int] = field(default_factory=list)
    next_slot: int = 0
    closed: bool = False
    handles: list[Any] = field(default_factory=list)
    regs: list[Any] = field(default_factory=list)
    notified: bool = False


class NixlBackend:  # pragma: no cover - requires nixl
    kind = "nixl"

    def __init__(self, *, name: str | None = None, config: AgentConfig | None = None,
                 backends: Sequence[str] = ("UCX",)) -> None:
        if not NIXL_AVAILABLE:
            raise RuntimeError(f"nixl is not installed ({NIXL_IMPORT_ERROR}); pip install nixl==1.5.1")
        self.config = config or AgentConfig()
        self.name = name or f"tetri-{uuid.uuid4().hex[:10]}"
        self._agent = nixl_agent(self.name, nixl_agent_config(backends=list(backends)))
        self._x: dict[str, _Xfer] = {}
        self._regions: dict[str, tuple[list[np.ndarray], Any]] = {}
        self._known: set[str] = set()
        self._notifs: set[str] = set()

    @property
    def address(self) -> str:
        return f"nixl://{self.name}"

    def _descs(self, views: list[np.ndarray]) -> list[tuple[int, int, int]]:
        return [(int(v.ctypes.data), int(v.nbytes), 0) for v in views]

    def _region(self, region_id: str, views: list[np.ndarray]) -> RemoteRegion:
        reg = self._agent.register_memory([(a, n, d, "") for a, n, d in self._descs(views)], "DRAM")
        self._regions[region_id] = (views, reg)
        extra = _NixlExtra(self.name, self._agent.get_agent_metadata(), [a for a, _, _ in self._descs(views)])
        return RemoteRegion(self.address, region_id, [v.nbytes for v in views], backend=self.kind,
                            extra=msgspec.msgpack.encode(extra))

    def _new(self, tid: str, role: Role, timeout_s: float | None) -> _Xfer:
        if tid in self._x:
            raise ValueError(f"transfer id {tid!r} is already in use on this agent")
        x = _Xfer(TransferRecord(tid, role, timeout_s or self.config.timeout_s))
        self._x[tid] = x
        return x

    def alloc(self, shape: Sequence[int], dtype: Any) -> Buffer:
        """Ordinary memory (NIXL registers whatever recv() is given)."""
        return plain_alloc(shape, dtype)

    def alloc_like(self, shapes: Sequence[Sequence[int]], dtype: Any) -> list[Buffer]:
        return [plain_alloc(s, dtype) for s in shapes]

    def recv(self, transfer_id: str, into_buffers: Sequence[Buffer], *,
             timeout_s: float | None = None) -> RemoteRegion:
        views = as_byte_views(into_buffers, writable=True)
        x = self._new(transfer_id, Role.RECEIVER, timeout_s)
        x.rec.bytes_total = sum(v.nbytes for v in views)
        return self._region(transfer_id, views)

    def register(self, region_id: str, buffers: Sequence[Buffer]) -> RemoteRegion:
        return self._region(region_id, as_byte_views(buffers, writable=True))

    def deregister(self, region_id: str) -> None:
        _, reg = self._regions.pop(region_id)
        self._agent.deregister_memory(reg)

    def _load_peer(self, region: RemoteRegion) -> _NixlExtra:
        extra = msgspec.msgpack.decode(region.extra, type=_NixlExtra)
        if extra.agent not in self._known:
            self._agent.add_remote_agent(extra.meta)
            self._known.add(extra.agent)
        return extra

    def open(self, transfer_id: str, peer: Peer, *, timeout_s: float | None = None,
             attempt: int = 0, max_attempts: int = 1) -> None:
        if not isinstance(peer, RemoteRegion):
            raise ValueError("the nixl backend is one-sided: pass the receiver's RemoteRegion, not an address")
        extra = self._load_peer(peer)
        x = self._new(transfer_id, Role.SENDER, timeout_s)
        x.rec.attempt = attempt
        x.remote_agent, x.remote_addrs, x.slot_sizes = extra.agent, list(extra.addrs), list(peer.slot_nbytes)

    def _post(self, x: _Xfer, op: str, local: list[np.ndarray], slots: list[int]) -> None:
        for s, v in zip(slots, local, strict=True):
            if s >= len(x.slot_sizes) or v.nbytes != x.slot_sizes[s]:
                x.rec.fail(f"length mismatch in slot {s}: remote region reserved "
                           f"{x.slot_sizes[s] if s < len(x.slot_sizes) else 'no'} bytes, local has {v.nbytes}")
                self._cleanup(x)
                return
        x.regs.append(self._agent.register_memory([(a, n, d, "") for a, n, d in self._descs(local)], "DRAM"))
        local_d = self._agent.get_xfer_descs(self._descs(local), "DRAM")
        remote_d = self._agent.get_xfer_descs([(x.remote_addrs[s], x.slot_sizes[s], 0) for s in slots], "DRAM")
        handle = self._agent.initialize_xfer(op, local_d, remote_d, x.remote_agent, b"")
        if self._agent.transfer(handle) == "ERR":
            x.rec.fail(f"nixl {op} could not be posted")
            self._cleanup(x)
            return
        x.handles.append(handle)
        x.rec.start()
        x.rec.touch(time.monotonic())

    def append(self, transfer_id: str, buffers: Sequence[Buffer], *,
               slots: Sequence[int] | None = None) -> None:
        x = self._x[transfer_id]
        if x.rec.state.terminal:
            return
        views = as_byte_views(buffers)
        slot_list = list(range(x.next_slot, x.next_slot + len(views))) if slots is None else list(slots)
        if slot_list:
            x.next_slot = max(x.next_slot, max(slot_list) + 1)
        x.rec.bytes_total += sum(v.nbytes for v in views)
        self._post(x, "WRITE", views, slot_list)

    def close(self, transfer_id: str) -> None:
        self._x[transfer_id].closed = True
        self.poll(transfer_id)

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
        extra = self._load_peer(remote_region)
        x = self._new(transfer_id, Role.READER, timeout_s)
        x.remote_agent, x.remote_addrs = extra.agent, list(extra.addrs)
        x.slot_sizes = list(remote_region.slot_nbytes)
        views = as_byte_views(into_buffers, writable=True)
        x.rec.bytes_total = sum(v.nbytes for v in views)
        x.closed = True
        x.notified = True  # nothing to tell the passive owner
        self._post(x, "READ", views, list(range(len(views))) if slots is None else list(slots))

    def _cleanup(self, x: _Xfer) -> None:
        for h in x.handles:
            self._agent.release_xfer_handle(h)
        x.handles.clear()
        for r in x.regs:
            self._agent.deregister_memory(r)
        x.regs.clear()
        if x.rec.role is Role.RECEIVER and x.rec.transfer_id in self._regions:
            self.deregister(x.rec.transfer_id)

    def _progress(self, x: _Xfer) -> None:
        now = time.monotonic()
        if x.rec.state.terminal:
            return
        if x.rec.role is Role.RECEIVER:
            for msgs in self._agent.get_new_notifs().values():
                self._notifs.update(m.decode() if isinstance(m, bytes) else str(m) for m in msgs)
            if f"done:{x.rec.transfer_id}" in self._notifs:
                self._notifs.discard(f"done:{x.rec.transfer_id}")
                x.rec.start()
                x.rec.bytes_done = x.rec.bytes_total
                x.rec.advance(TransferState.DONE)
                self._cleanup(x)
        else:
            states = [self._agent.check_xfer_state(h) for h in x.handles]
            if "ERR" in states:
                x.rec.fail("nixl transfer reported ERR")
                self._cleanup(x)
                return
            if x.closed and all(s == "DONE" for s in states):
                if not x.notified:
                    self._agent.send_notif(x.remote_agent, f"done:{x.rec.transfer_id}".encode())
                    x.notified = True
                x.rec.start()
                x.rec.bytes_done = x.rec.bytes_total
                x.rec.advance(TransferState.DONE)
                self._cleanup(x)
                return
        if x.rec.expired(now):
            x.rec.fail(f"timed out after {x.rec.timeout_s:g} s without progress")
            self._cleanup(x)

    def poll(self, transfer_id: str) -> TransferState:
        x = self._x[transfer_id]
        self._progress(x)
        return x.rec.state

    def status(self, transfer_id: str) -> TransferStatus:
        x = self._x[transfer_id]
        self._progress(x)
        return x.rec.snapshot()

    def release(self, transfer_id: str) -> None:
        x = self._x.pop(transfer_id, None)
        if x is not None:
            x.rec.fail("cancelled by caller")
            self._cleanup(x)

    def stats(self) -> TransferStats:
        return TransferStats(records=len(self._x), active=sum(not x.rec.state.terminal for x in self._x.values()),
                             regions=len(self._regions), pinned_payloads=sum(len(x.regs) for x in self._x.values()),
                             staging_segments=0, pooled_segments=0, peers=len(self._known))

    def shutdown(self) -> None:
        for tid in list(self._x):
            self.release(tid)
        for rid in list(self._regions):
            self.deregister(rid)
