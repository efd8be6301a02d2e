"""NIXL backend (optional): KV bytes move by NIXL (UCX) one-sided WRITE/READ; the same polled API as every backend.

Only usable when `import nixl` works (pin nixl==1.5.1; its bundled UCX moves CPU memory). Tests skip it otherwise.

Addresses and metadata. `address` is `nixl://<agent name>/<base64 connection metadata>`: a value that names the
agent and says how to reach it, so a peer needs no metadata server or listener socket. A RemoteRegion's `extra`
is a msgpack `NixlTarget`: the owner's name, partial agent metadata (connection info + the region's
registrations) and each slot's address, so a peer can load it and address the memory directly.

Control messages are NIXL notifications carrying msgspec/msgpack structs (`Notif`), never pickles:
  write/send  sender -> owner  Hello(tid, region, attempt, final, sender md)   [lazy for a RemoteRegion peer:
                                                                                sent with the first append]
              owner -> sender  Grant(ok | reason; slot sizes + NixlTarget when the peer was a bare address)
              sender: one NIXL WRITE per append, each carrying a Data(slots) notification that NIXL delivers
                      only after the bytes landed; the last one carries the Close (else a Close notification)
              owner:  TRANSFERRING at the first Data; once it has every Data the Close announced, DONE if every
                      slot was filled (Ack ok), else FAILED "sender closed after filling k of n slots" (Ack !ok)
              sender: DONE on Ack ok (and its WRITEs complete locally); FAILED "receiver rejected: ..." else
  read        reader -> owner  ReadReq(tid, region, slots, reader md); owner -> reader ReadGrant(ok | reason);
              reader: one NIXL READ, DONE when it completes, then ReadDone (the owner unpins the region)
Retries mirror the zmq agent: a rejected or aborted attempt that is not the sender's last one resets the receiver.
The owner's grant is what makes one-sided writes safe: it refuses regions that are gone (deregistered,
cancelled, timed out) before any byte moves. (UCX on one host may move bytes with process_vm_writev, which
does not check registrations, so a stale descriptor alone would not stop a write.)

First contact between two agents costs UCX endpoint creation and wireup (tens of ms each way here); `connect()`
pays it ahead of time. After that a control hop takes well under a millisecond plus the progress loop's nap.

Progress: NIXL's own progress thread busy-polls a core, so it is off; one daemon thread per backend polls NIXL
notifications and posted transfers (sub-millisecond while anything is live) and enforces timeouts. Every NIXL call
and every record change happens under one lock, from that thread or the caller's.

Invariants:
- Every transfer ends DONE or FAILED within its inactivity timeout; a FAILED one carries a reason.
- On every terminal state the backend deregisters the transfer's NIXL memory and drops its buffer references;
  `stats()` and `registrations` count what is left (all zero once every transfer is released).
- A region dropped while a granted writer or reader may still move bytes keeps its buffers referenced
  (quarantine) for one timeout, so their memory is not freed under a late RDMA operation.
Memory pool. A sender must load every region's descriptors into its NIXL agent, and NIXL keeps them (no
per-descriptor unload): measured here, 3000 loads of 64 fresh descriptors took ~50 ms per load on average (growing
with the count) and grew the agent by ~280 B per descriptor. So `alloc()` / `alloc_like()` carve buffers from a
few large slabs registered once: a recv() into such buffers registers nothing, and its metadata names the slabs,
not the buffers, so the bytes repeat and a sender loads them once. Decode side, per request (as decode_worker
does): `staging = backend.alloc_like(shapes, dtype)`, `backend.recv(tid, staging)`, drop `staging` after use (it
returns to the pool when its last view is gone; the pool keeps its slabs until shutdown). recv() into other
memory works too, at the cost above.
"""

from __future__ import annotations

import base64
import bisect
import ctypes
import hashlib
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from tetriinfer.transfer.base import AgentConfig, Peer, TransferStats
from tetriinfer.transfer.buffers import Buffer, as_byte_views
from tetriinfer.transfer.messages import RemoteRegion
from tetriinfer.transfer.nixl_messages import (
    ADDRESS_PREFIX,
    ENCODER,
    NAME_RE,
    NOTIF_DECODER,
    TARGET_DECODER,
    Abort,
    Ack,
    Close,
    Data,
    Grant,
    Hello,
    Hi,
    NixlTarget,
    Notif,
    ReadDone,
    ReadGrant,
    ReadReq,
    merged_ranges,
    parse_address,
)
from tetriinfer.transfer.nixl_pool import ALIGN, Slab
from tetriinfer.transfer.state import (
    Role,
    TransferRecord,
    TransferState,
    TransferStatus,
    append_slots,
    inbound_reject_reason,
    lookup_record,
    new_record,
)

try:  # pragma: no cover - depends on the optional package
    import nixl._bindings as _nixl_bindings
    from nixl._api import nixl_agent, nixl_agent_config

    NIXL_AVAILABLE = True
    NIXL_IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - any import failure means "not available"
    NIXL_AVAILABLE = False
    NIXL_IMPORT_ERROR = f"{type(e).__name__}: {e}"

log = logging.getLogger(__name__)

_ACTIVE_SLEEP_S = 0.0002  # progress-loop nap while a NIXL transfer is posted
_WAIT_SLEEP_S = 0.0005  # ... while transfers are live but nothing is posted (waiting for notifications)
_MD_CACHE = 4096  # region metadata blobs remembered as loaded (beyond this the set restarts)


# ---------------------------------------------------------------------------------------------- records
@dataclass
class _Post:
    """One posted NIXL transfer (handle None: nothing to move) with the registration of its local memory."""

    handle: Any
    reg: Any
    views: list[np.ndarray]
    nbytes: int
    done: bool = False


@dataclass
class _Region:
    region_id: str
    views: list[np.ndarray]
    reg: Any
    owner_tid: str | None  # set for regions posted by recv(); None for register()ed ones
    target: bytes  # encoded NixlTarget
    readers: dict[tuple[str, str], float] = field(default_factory=dict)  # (peer, tid) -> pin deadline


@dataclass
class _Out:
    rec: TransferRecord
    peer: str  # owner agent name
    region_id: str
    final: bool
    by_address: bool
    slot_sizes: list[int] | None = None
    addrs: list[int] | None = None
    hello_sent: bool = False
    granted: bool = False
    acked: bool = False
    queued: list[tuple[list[np.ndarray], list[int]]] = field(default_factory=list)
    posts: list[_Post] = field(default_factory=list)
    next_slot: int = 0
    closed: bool = False
    close_sent: bool = False
    ndata: int = 0


@dataclass
class _In:
    rec: TransferRecord
    region: _Region
    posted: bool  # recv()ed (the caller polls and releases it) vs a passive write into a register()ed region
    peer: str | None = None
    final: bool = True
    rejected_attempt: int = -1
    filled: set[int] = field(default_factory=set)
    ndata: int = 0
    close_ndata: int = -1


@dataclass
class _Read:
    rec: TransferRecord
    peer: str
    region_id: str
    slots: list[int]
    into: list[np.ndarray]
    addrs: list[int]
    requested: bool = False  # the ReadReq went out (the owner may have pinned the region for us)
    post: _Post | None = None


class NixlBackend:
    """One endpoint of the transfer API over NIXL (see the module docstring for the protocol).

    `name` must be unique among the agents that talk to each other (default: random). `backends` are NIXL
    plugins (UCX moves CPU memory). A transfer id is unique per backend while its record exists.
    """

    kind = "nixl"

    def __init__(self, *, name: str | None = None, config: AgentConfig | None = None,
                 backends: Sequence[str] = ("UCX",), slab_bytes: int = 64 << 20) -> None:
        if not NIXL_AVAILABLE:
            raise RuntimeError(f"nixl is not installed ({NIXL_IMPORT_ERROR}); pip install nixl==1.5.1")
        self.config = config or AgentConfig()
        self.name = name or f"tetri-{uuid.uuid4().hex[:12]}"
        if not NAME_RE.match(self.name):
            raise ValueError(f"nixl agent name must match {NAME_RE.pattern}, got {self.name!r}")
        if not backends:
            raise ValueError("backends must name at least one NIXL plugin")
        if slab_bytes < ALIGN:
            raise ValueError(f"slab_bytes must be >= {ALIGN}, got {slab_bytes}")
        self.slab_bytes = -(-slab_bytes // ALIGN) * ALIGN
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False,
                                                              backends=list(backends)))
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(f"NIXL plugins not available: {missing}")
        self._conn_md: bytes = self._agent.get_partial_agent_metadata(
            _nixl_bindings.nixlRegDList(_nixl_bindings.DRAM_SEG), True)
        self._address = ADDRESS_PREFIX + self.name + "/" + \
            base64.urlsafe_b64encode(self._conn_md).decode().rstrip("=")
        self._lock = threading.RLock()
        self._recs: dict[str, TransferRecord] = {}
        self._out: dict[str, _Out] = {}
        self._in: dict[str, _In] = {}
        self._reads: dict[str, _Read] = {}
        self._regions: dict[str, _Region] = {}
        self._peers: set[str] = set()  # agents whose connection metadata is loaded
        self._heard: set[str] = set()  # agents we received a notification from (the link works both ways)
        self._loaded_md: set[bytes] = set()  # digests of region metadata already loaded
        self._zombies: list[_Post] = []  # posts whose handle could not be released yet
        self._quarantine: list[tuple[float, list[np.ndarray]]] = []
        self._nregs = 0
        self._slabs: list[Slab] = []  # sorted by base address
        self._freed: deque[tuple[Slab, int, int]] = deque()  # filled by allocation finalizers (no lock)
        self._pool_md: dict[tuple[int, ...], bytes] = {}  # slab set -> partial metadata naming those slabs
        self._pool_allocs = 0
        self._pool_bytes = 0
        self._next_sweep = 0.0
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=f"xfer-nixl-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller API
    @property
    def address(self) -> str:
        return self._address

    @property
    def registrations(self) -> int:
        """NIXL memory registrations this backend holds (regions, in-flight payloads); 0 when idle."""
        with self._lock:
            return self._nregs

    def connect(self, address: str) -> None:
        """Wire up the link to the backend at `address` ahead of the first transfer (asynchronous; see
        `connected`). First contact between two UCX agents costs tens of milliseconds each way (endpoint
        creation and wireup); a runtime can pay it at startup instead of on a request's first chunk."""
        self._check_running()
        name, md = parse_address(address)
        with self._lock:
            reason = self._learn_peer(name, md) or self._notify(name, Hi(self._conn_md, True))
        if reason is not None:
            raise RuntimeError(f"cannot connect to {name!r}: {reason}")

    def connected(self, address: str) -> bool:
        """True once the peer at `address` has loaded our metadata and answered (both directions wired)."""
        name, _ = parse_address(address)
        with self._lock:
            return name in self._peers and name in self._heard

    def _check_running(self) -> None:
        if not self._running:
            raise RuntimeError("transfer backend is shut down")

    def alloc(self, shape: Sequence[int], dtype: Any) -> Buffer:
        """A buffer (torch tensor for a torch dtype, else numpy array) in this backend's NIXL-registered pool: a
        recv() into it registers nothing and its metadata repeats, so senders load it once. Freed to the pool when
        the last view of it is dropped. Contents are undefined."""
        self._check_running()
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must be non-negative, got {shape}")
        count = int(np.prod(shape, dtype=np.int64))
        torch_dtype = type(dtype).__module__.split(".")[0] == "torch"
        if torch_dtype:
            import torch

            itemsize = torch.empty((), dtype=dtype).element_size()
        else:
            np_dtype = np.dtype(dtype)
            if np_dtype.hasobject:
                raise ValueError("object dtypes cannot be transferred")
            itemsize = np_dtype.itemsize
        nbytes = count * itemsize
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            self._collect_pool()
            slab, off = self._place(size)
            self._pool_allocs += 1
            self._pool_bytes += size
            # a per-allocation ctypes owner: every numpy/torch view keeps it alive (numpy collapses view chains
            # only down to it), so its finalizer runs exactly when the last view is gone
            owner = (ctypes.c_uint8 * max(nbytes, 1)).from_buffer(slab.arr, off)
        weakref.finalize(owner, self._freed.append, (slab, off, size))
        raw = np.frombuffer(owner, dtype=np.uint8)[:nbytes]
        if torch_dtype:
            return torch.from_numpy(raw).view(dtype).view(shape)
        return raw.view(np_dtype).reshape(shape)

    def alloc_like(self, shapes: Sequence[Sequence[int]], dtype: Any) -> list[Buffer]:
        return [self.alloc(s, dtype) for s in shapes]

    def _new_record(self, tid: str, role: Role, timeout_s: float | None) -> TransferRecord:
        return new_record(self._recs, tid, role, timeout_s, self.config.timeout_s)

    def _make_region(self, region_id: str, views: list[np.ndarray], owner_tid: str | None) -> RemoteRegion:
        if region_id in self._regions:
            raise ValueError(f"region {region_id!r} already exists on this agent")
        self._collect_pool()
        outside = [v for v in views if v.nbytes and self._slab_of(v) is None]
        slabs = tuple(sorted({s.base for v in views if v.nbytes and (s := self._slab_of(v)) is not None}))
        reg = self._register(outside)
        if not outside and slabs in self._pool_md:
            md = self._pool_md[slabs]
        else:
            by_base = {s.base: s for s in self._slabs}
            descs = [(b, by_base[b].size, 0, "") for b in slabs] + [(a, n, 0, "") for a, n in merged_ranges(outside)]
            try:
                dlist = self._agent.get_reg_descs(descs, "DRAM") if descs else \
                    _nixl_bindings.nixlRegDList(_nixl_bindings.DRAM_SEG)
                md = self._agent.get_partial_agent_metadata(dlist, True)
            except Exception:
                self._deregister(reg)
                raise
            if not outside:
                self._pool_md[slabs] = md
        target = ENCODER.encode(NixlTarget(self.name, md, [int(v.ctypes.data) if v.nbytes else 0 for v in views]))
        self._regions[region_id] = _Region(region_id, views, reg, owner_tid, target)
        return RemoteRegion(self._address, region_id, [v.nbytes for v in views], backend=self.kind, extra=target)

    def recv(self, transfer_id: str, into_buffers: Sequence[Buffer], *,
             timeout_s: float | None = None) -> RemoteRegion:
        """Post (register) `into_buffers` for `transfer_id`; returns the descriptor a sender writes into."""
        self._check_running()
        views = as_byte_views(into_buffers, writable=True)
        with self._lock:
            if transfer_id in self._regions:
                raise ValueError(f"region {transfer_id!r} already exists on this agent")
            rec = self._new_record(transfer_id, Role.RECEIVER, timeout_s)
            rec.bytes_total = sum(v.nbytes for v in views)
            try:
                region = self._make_region(transfer_id, views, transfer_id)
            except Exception:
                del self._recs[transfer_id]
                raise
            self._in[transfer_id] = _In(rec, self._regions[transfer_id], posted=True)
            return region

    def register(self, region_id: str, buffers: Sequence[Buffer]) -> RemoteRegion:
        """Expose long-lived memory (e.g. KV blocks) for one-sided write()/read() by peers."""
        self._check_running()
        views = as_byte_views(buffers, writable=True)
        with self._lock:
            return self._make_region(region_id, views, None)

    def deregister(self, region_id: str) -> None:
        """Drop a register()ed region; writes in flight into it fail, later requests are refused."""
        self._check_running()
        with self._lock:
            region = self._regions.get(region_id)
            if region is None:
                raise KeyError(f"unknown region {region_id!r}")
            if region.owner_tid is not None:
                raise ValueError(f"region {region_id!r} belongs to transfer {region.owner_tid!r}; release that")
            passive = [i for i in self._in.values() if i.region is region and not i.posted]
            for inb in passive:
                self._end_in(inb, f"region {region_id!r} deregistered", tell=True)
            self._drop_region(region, granted=bool(passive))

    def open(self, transfer_id: str, peer: Peer, *, timeout_s: float | None = None,
             attempt: int = 0, max_attempts: int = 1) -> None:
        """Start a sending transfer to `peer`: an address (two-sided: the owner's posted recv(transfer_id)) or a
        RemoteRegion (one-sided write). PENDING until the first bytes move."""
        self._check_running()
        if not 0 <= attempt < max_attempts:
            raise ValueError(f"need 0 <= attempt < max_attempts, got {attempt}, {max_attempts}")
        if isinstance(peer, RemoteRegion):
            if peer.backend != self.kind:
                raise ValueError(f"region comes from a {peer.backend or 'non-nixl'} backend, not nixl")
            target = self._decode_target(peer)
        elif isinstance(peer, str):
            target = None
            name, md = parse_address(peer)
        else:
            raise ValueError(f"peer must be an address or a RemoteRegion, got {type(peer).__name__}")
        with self._lock:
            rec = self._new_record(transfer_id, Role.SENDER, timeout_s)
            rec.attempt = attempt
            final = attempt + 1 >= max_attempts
            if target is not None:
                assert isinstance(peer, RemoteRegion)
                out = _Out(rec, target.agent, peer.region_id, final, by_address=False,
                           slot_sizes=list(peer.slot_nbytes), addrs=list(target.addrs))
                self._out[transfer_id] = out
                if (reason := self._load_target(target)) is not None:
                    rec.fail(reason)
            else:
                out = _Out(rec, name, transfer_id, final, by_address=True)
                self._out[transfer_id] = out
                if (reason := self._learn_peer(name, md)) is not None:
                    rec.fail(reason)
                else:
                    self._hello(out)

    def append(self, transfer_id: str, buffers: Sequence[Buffer], *,
               slots: Sequence[int] | None = None) -> None:
        """Write `buffers` into the receiver's `slots` (default: the next ones in order). Never waits for the
        peer. The buffers must stay unchanged until the transfer is terminal; appending to a failed transfer
        is a no-op (poll() reports the failure)."""
        self._check_running()
        views = as_byte_views(buffers)
        with self._lock:
            out = self._out.get(transfer_id)
            if out is None:
                raise KeyError(f"no open sending transfer {transfer_id!r}")
            if out.closed:
                raise ValueError(f"transfer {transfer_id!r} is closed; open a new one")
            slot_list = append_slots(out.next_slot, len(views), slots)
            if out.rec.state.terminal:
                return
            if slot_list:
                out.next_slot = max(out.next_slot, max(slot_list) + 1)
            out.rec.bytes_total += sum(v.nbytes for v in views)
            if out.slot_sizes is not None and not self._check_sizes(out, views, slot_list):
                return
            out.queued.append((views, slot_list))
            if not out.hello_sent:
                self._hello(out)
            self._flush(out)

    def close(self, transfer_id: str) -> None:
        """No more appends: the receiver completes once every byte has landed and every slot was filled."""
        self._check_running()
        with self._lock:
            out = self._out.get(transfer_id)
            if out is None:
                raise KeyError(f"no open sending transfer {transfer_id!r}")
            if out.closed:
                return
            out.closed = True
            if out.rec.state.terminal:
                return
            if not out.hello_sent:
                self._hello(out)
            self._flush(out)

    def send(self, transfer_id: str, buffers: Sequence[Buffer], peer: Peer, *,
             timeout_s: float | None = None) -> None:
        """Two-sided send of a whole payload (= open + append + close)."""
        self.open(transfer_id, peer, timeout_s=timeout_s)
        self.append(transfer_id, buffers)
        self.close(transfer_id)

    def write(self, transfer_id: str, remote_region: RemoteRegion, buffers: Sequence[Buffer], *,
              slots: Sequence[int] | None = None, timeout_s: float | None = None) -> None:
        """One-sided write of `buffers` into `remote_region` (slot sizes are checked before bytes move)."""
        self.open(transfer_id, remote_region, timeout_s=timeout_s)
        self.append(transfer_id, buffers, slots=slots)
        self.close(transfer_id)

    def read(self, transfer_id: str, remote_region: RemoteRegion, into_buffers: Sequence[Buffer], *,
             slots: Sequence[int] | None = None, timeout_s: float | None = None) -> None:
        """One-sided read of `remote_region`'s slots (default: all) into `into_buffers`."""
        self._check_running()
        views = as_byte_views(into_buffers, writable=True)
        slot_list = list(range(len(remote_region.slot_nbytes))) if slots is None else [int(s) for s in slots]
        if len(slot_list) != len(views):
            raise ValueError(f"{len(views)} destination buffers but {len(slot_list)} slots")
        if remote_region.backend != self.kind:
            raise ValueError(f"region comes from a {remote_region.backend or 'non-nixl'} backend, not nixl")
        target = self._decode_target(remote_region)
        with self._lock:
            rec = self._new_record(transfer_id, Role.READER, timeout_s)
            rec.bytes_total = sum(v.nbytes for v in views)
            rd = _Read(rec, target.agent, remote_region.region_id, slot_list, views, list(target.addrs))
            self._reads[transfer_id] = rd
            sizes = remote_region.slot_nbytes
            for i, (s, v) in enumerate(zip(slot_list, views, strict=True)):
                if not 0 <= s < len(sizes):
                    self._end_read(rd, f"slot {s} out of range: region has {len(sizes)} slots")
                    return
                if v.nbytes != sizes[s]:
                    self._end_read(rd, f"length mismatch in buffer {i}: reader has {v.nbytes} bytes, "
                                       f"region slot has {sizes[s]}")
                    return
            reason = self._load_target(target)
            if reason is None:
                reason = self._notify(rd.peer, ReadReq(transfer_id, rd.region_id, slot_list, self._conn_md))
            if reason is not None:
                self._end_read(rd, reason)
                return
            rd.requested = True

    def poll(self, transfer_id: str) -> TransferState:
        """Current state; never waits for the peer. Raises KeyError for an unknown (or released) id."""
        with self._lock:
            return lookup_record(self._recs, transfer_id).state

    def status(self, transfer_id: str) -> TransferStatus:
        with self._lock:
            return lookup_record(self._recs, transfer_id).snapshot()

    def release(self, transfer_id: str) -> None:
        """Forget a transfer; a live one is cancelled first (FAILED 'cancelled by caller', peer told)."""
        with self._lock:
            if transfer_id not in self._recs:
                return
            self._cancel(transfer_id, "cancelled by caller")
            self._recs.pop(transfer_id, None)
            self._out.pop(transfer_id, None)
            self._in.pop(transfer_id, None)
            self._reads.pop(transfer_id, None)

    def stats(self) -> TransferStats:
        with self._lock:
            self._collect_pool()
            return TransferStats(
                records=len(self._recs),
                active=sum(1 for r in self._recs.values() if not r.state.terminal),
                regions=len(self._regions),
                pinned_payloads=sum(sum(1 for p in o.posts if not p.done) + len(o.queued)
                                    for o in self._out.values())
                + sum(1 for r in self._reads.values() if r.into),
                staging_segments=0,
                pooled_segments=0,
                peers=len(self._peers),
                arena_segments=len(self._slabs),
                arena_allocations=self._pool_allocs,
                arena_bytes=self._pool_bytes,
            )

    def shutdown(self) -> None:
        """Fail every live transfer (telling peers), stop the progress thread, drop every registration.
        Idempotent."""
        with self._lock:
            if not self._running:
                return
            for tid in list(self._recs):
                self._cancel(tid, "transfer backend shut down")
            self._running = False
        self._thread.join(timeout=5)
        with self._lock:
            for region in list(self._regions.values()):
                self._drop_region(region, granted=False)
            deadline = time.monotonic() + self.config.cancel_wait_s
            while self._zombies and time.monotonic() < deadline:
                self._reap_zombies()
                time.sleep(_ACTIVE_SLEEP_S)
            self._quarantine.clear()
            for slab in self._slabs:  # buffers handed out stay valid memory; only NIXL forgets the slabs
                try:
                    self._agent.deregister_memory(slab.reg)
                except Exception:  # noqa: BLE001 - NIXL raises its own exception types
                    log.exception("nixl deregister_memory (pool slab) failed")
            self._slabs = []
            self._pool_md.clear()

    def __enter__(self) -> NixlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ NIXL plumbing (lock held)
    # --- pool (lock held)
    def _slab_of(self, view: np.ndarray) -> Slab | None:
        addr = int(view.ctypes.data)
        i = bisect.bisect_right([s.base for s in self._slabs], addr) - 1
        if i >= 0:
            slab = self._slabs[i]
            if addr + view.nbytes <= slab.base + slab.size:
                return slab
        return None

    def _place(self, size: int) -> tuple[Slab, int]:
        for slab in self._slabs:
            off = slab.take(size)
            if off is not None:
                return slab, off
        slab = Slab(max(self.slab_bytes, -(-size // (2 << 20)) * (2 << 20)))
        slab.reg = self._agent.register_memory([(slab.base, slab.size, 0, "")], "DRAM")
        bisect.insort(self._slabs, slab, key=lambda s: s.base)
        off = slab.take(size)
        assert off == 0
        return slab, off

    def _collect_pool(self) -> None:
        while self._freed:
            slab, off, size = self._freed.popleft()
            slab.give(off, size)
            self._pool_allocs -= 1
            self._pool_bytes -= size

    def _register(self, views: Sequence[np.ndarray]) -> Any:
        """Register the views' memory (merged ranges) unless it lies in the pool; None when nothing to do."""
        views = [v for v in views if v.nbytes and self._slab_of(v) is None]
        ranges = merged_ranges(views)
        if not ranges:
            return None
        reg = self._agent.register_memory([(a, n, 0, "") for a, n in ranges], "DRAM")
        self._nregs += 1
        return reg

    def _deregister(self, reg: Any) -> None:
        if reg is None:
            return
        self._nregs -= 1
        try:
            self._agent.deregister_memory(reg)
        except Exception:  # noqa: BLE001 - NIXL raises its own exception types; nothing more to undo
            log.exception("nixl deregister_memory failed")

    def _decode_target(self, region: RemoteRegion) -> NixlTarget:
        try:
            target = TARGET_DECODER.decode(region.extra)
        except msgspec.DecodeError as e:
            raise ValueError(f"region {region.region_id!r} carries no nixl metadata: {e}") from e
        if len(target.addrs) != len(region.slot_nbytes) or not NAME_RE.match(target.agent):
            raise ValueError(f"region {region.region_id!r}: malformed nixl metadata")
        return target

    def _load_target(self, target: NixlTarget) -> str | None:
        """Load a region's metadata (connection + registrations) unless already loaded; returns a failure
        reason or None."""
        if target.agent == self.name:
            return "cannot address this backend's own region (no loopback)"
        digest = hashlib.blake2b(target.md, digest_size=16).digest()
        if digest in self._loaded_md:
            return None
        try:
            name = self._agent.add_remote_agent(target.md)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            return f"cannot load nixl metadata of {target.agent!r}: {type(e).__name__}: {e}"
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != target.agent:
            return f"nixl metadata names agent {name!r}, region says {target.agent!r}"
        if len(self._loaded_md) >= _MD_CACHE:
            self._loaded_md.clear()
        self._loaded_md.add(digest)
        self._peers.add(name)
        return None

    def _learn_peer(self, name: str, md: bytes) -> str | None:
        """Load a peer's connection metadata once; returns a failure reason or None."""
        if name in self._peers:
            return None
        if name == self.name:
            return "cannot send to this backend's own address (no loopback)"
        try:
            loaded = self._agent.add_remote_agent(md)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            return f"cannot load nixl metadata of {name!r}: {type(e).__name__}: {e}"
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            return f"nixl metadata names agent {loaded!r}, expected {name!r}"
        self._peers.add(name)
        return None

    def _notify(self, peer: str, msg: Notif) -> str | None:
        """Send one control notification; returns a failure reason or None."""
        try:
            self._agent.send_notif(peer, ENCODER.encode(msg))
            return None
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            return f"notification to {peer!r} failed: {type(e).__name__}: {e}"

    def _post(self, op: str, peer: str, local: list[np.ndarray], remote: list[int], notif: Notif | None
              ) -> _Post | str:
        """Post one WRITE/READ of `local[i]` <-> remote address `remote[i]` (empty views move nothing) with
        `notif` delivered to the peer after completion. Returns the post, or a failure reason."""
        pairs = [(v, a) for v, a in zip(local, remote, strict=True) if v.nbytes]
        nbytes = sum(v.nbytes for v, _ in pairs)
        if not pairs:
            reason = self._notify(peer, notif) if notif is not None else None
            return reason if reason is not None else _Post(None, None, [], 0, done=True)
        reg = self._register([v for v, _ in pairs])
        try:
            ld = self._agent.get_xfer_descs([(int(v.ctypes.data), v.nbytes, 0) for v, _ in pairs], "DRAM")
            rd = self._agent.get_xfer_descs([(a, v.nbytes, 0) for v, a in pairs], "DRAM")
            handle = self._agent.initialize_xfer(op, ld, rd, peer, ENCODER.encode(notif) if notif else b"")
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            self._deregister(reg)
            return f"nixl {op} to {peer!r} could not be prepared: {type(e).__name__}: {e}"
        post = _Post(handle, reg, [v for v, _ in pairs], nbytes)
        try:
            state = self._agent.transfer(handle)
        except Exception as e:  # noqa: BLE001
            state = f"ERR ({type(e).__name__}: {e})"
        if state.startswith("ERR"):
            self._retire(post)
            return f"nixl {op} to {peer!r} could not be posted: {state}"
        return post

    def _check_post(self, post: _Post) -> str | None:
        """Progress `post`; returns 'DONE', 'PROC' or a failure reason."""
        if post.done:
            return "DONE"
        try:
            state = self._agent.check_xfer_state(post.handle)
        except Exception as e:  # noqa: BLE001
            state = f"ERR ({type(e).__name__}: {e})"
        if state == "DONE":
            post.done = True
            self._retire(post)
        return state

    def _retire(self, post: _Post) -> None:
        """Release a post's handle and registration; one that cannot be cancelled yet becomes a zombie (its
        memory stays registered and referenced until NIXL lets it go)."""
        if post.handle is not None:
            try:
                post.handle.release()
            except Exception:  # noqa: BLE001 - still in flight and not cancellable: retry later
                self._zombies.append(post)
                return
            post.handle = None
        self._deregister(post.reg)
        post.reg = None
        post.views = []

    def _reap_zombies(self) -> None:
        zombies, self._zombies = self._zombies, []
        for post in zombies:
            self._retire(post)

    # ------------------------------------------------------------------ sender side (lock held)
    def _check_sizes(self, out: _Out, views: list[np.ndarray], slots: list[int]) -> bool:
        sizes = out.slot_sizes
        assert sizes is not None
        for s, v in zip(slots, views, strict=True):
            if s >= len(sizes):
                self._fail_out(out, f"slot {s} out of range: remote region has {len(sizes)} slots")
                return False
            if v.nbytes != sizes[s]:
                self._fail_out(out, f"length mismatch in slot {s}: remote region reserved {sizes[s]} bytes, "
                                    f"sender has {v.nbytes}")
                return False
        return True

    def _hello(self, out: _Out) -> None:
        out.hello_sent = True
        msg = Hello(out.rec.transfer_id, out.region_id, out.rec.attempt, out.final, self._conn_md, out.by_address)
        if (reason := self._notify(out.peer, msg)) is not None:
            self._fail_out(out, reason, tell=False)

    def _flush(self, out: _Out) -> None:
        """Post queued appends (once granted) and the Close (once closed and every write completed)."""
        if out.rec.state.terminal or not out.granted:
            return
        assert out.addrs is not None
        while out.queued:
            views, slots = out.queued.pop(0)
            fold = out.closed and not out.queued
            out.ndata += 1
            data = Data(out.rec.transfer_id, out.rec.attempt, slots, [v.nbytes for v in views],
                        out.ndata if fold else -1)
            post = self._post("WRITE", out.peer, views, [out.addrs[s] for s in slots], data)
            if isinstance(post, str):
                self._fail_out(out, post)
                return
            out.posts.append(post)
            if fold:
                out.close_sent = True
            now = time.monotonic()
            out.rec.start(now)
            out.rec.touch(now)
            if post.done:
                out.rec.bytes_done += post.nbytes
        if out.closed and not out.close_sent and all(p.done for p in out.posts):
            out.close_sent = True
            if (reason := self._notify(out.peer, Close(out.rec.transfer_id, out.rec.attempt, out.ndata))):
                self._fail_out(out, reason, tell=False)

    def _finish_out(self, out: _Out) -> None:
        """Terminal sender: release its posts (unpins payloads, deregisters memory)."""
        for post in out.posts:
            if not post.done:
                self._retire(post)
        out.posts = []
        out.queued = []

    def _fail_out(self, out: _Out, reason: str, *, tell: bool = True) -> None:
        if not out.rec.fail(reason):
            return
        self._finish_out(out)
        if tell and out.hello_sent:
            self._notify(out.peer, Abort(out.rec.transfer_id, out.rec.attempt, out.final, reason))

    def _progress_out(self, out: _Out) -> bool:
        """Check posted writes; returns True while any is in flight."""
        busy = False
        for post in out.posts:
            if post.done:
                continue
            state = self._check_post(post)
            if state == "DONE":
                now = time.monotonic()
                out.rec.bytes_done += post.nbytes
                out.rec.touch(now)
            elif state == "PROC":
                busy = True
            else:
                self._fail_out(out, f"nixl WRITE to {out.peer!r} failed: {state}")
                return False
        if not busy:
            self._flush(out)
            if out.acked and not out.rec.state.terminal and all(p.done for p in out.posts):
                out.rec.start()
                out.rec.advance(TransferState.DONE)
                self._finish_out(out)
        return busy

    def _on_grant(self, peer: str, msg: Grant) -> None:
        out = self._out.get(msg.tid)
        if out is None or out.peer != peer or msg.attempt != out.rec.attempt or out.rec.state.terminal:
            return
        if out.granted:
            return
        if not msg.ok:
            self._fail_out(out, f"receiver rejected: {msg.reason}", tell=False)
            return
        if out.by_address:
            try:
                target = TARGET_DECODER.decode(msg.target)
            except msgspec.DecodeError as e:
                self._fail_out(out, f"receiver sent malformed nixl metadata: {e}")
                return
            if target.agent != peer or len(target.addrs) != len(msg.slot_nbytes):
                self._fail_out(out, "receiver sent inconsistent nixl metadata")
                return
            if (reason := self._load_target(target)) is not None:
                self._fail_out(out, reason)
                return
            out.slot_sizes, out.addrs = list(msg.slot_nbytes), list(target.addrs)
            for views, slots in out.queued:
                if not self._check_sizes(out, views, slots):
                    return
        out.granted = True
        out.rec.touch(time.monotonic())
        self._flush(out)

    def _on_ack(self, peer: str, msg: Ack) -> None:
        out = self._out.get(msg.tid)
        if out is None or out.peer != peer or msg.attempt != out.rec.attempt or out.rec.state.terminal:
            return
        if not msg.ok:
            self._fail_out(out, f"receiver rejected: {msg.reason}", tell=False)
            return
        out.acked = True
        self._progress_out(out)

    # ------------------------------------------------------------------ owner side (lock held)
    def _drop_region(self, region: _Region, *, granted: bool) -> None:
        """Forget a region and deregister its memory. One that a granted writer (`granted`: a writer was let in
        and did not finish cleanly) or reader may still touch keeps its buffers referenced for one timeout."""
        if self._regions.get(region.region_id) is region:
            del self._regions[region.region_id]
        self._deregister(region.reg)
        region.reg = None
        if region.readers or granted:
            self._quarantine.append((time.monotonic() + self.config.timeout_s, region.views))
        region.readers.clear()
        region.views = []

    def _end_in(self, inb: _In, reason: str | None, *, tell: bool, peer_reason: str | None = None) -> None:
        """Terminal receiver: DONE (reason None) or FAILED; tell the sender (Ack, with `peer_reason` if given)
        when asked and known; drop a transfer-owned region and forget a passive record."""
        if reason is None:
            inb.rec.start()
            inb.rec.advance(TransferState.DONE)
        elif not inb.rec.fail(reason):
            return
        tid = inb.rec.transfer_id
        if tell and inb.peer is not None:
            self._notify(inb.peer, Ack(tid, inb.rec.attempt, reason is None, peer_reason or reason or ""))
        if inb.region.owner_tid == tid:
            self._drop_region(inb.region, granted=reason is not None and inb.peer is not None)
        if not inb.posted:
            self._in.pop(tid, None)
            self._recs.pop(tid, None)

    def _reject(self, inb: _In, attempt: int, reason: str) -> None:
        """A failed attempt: final -> FAILED; otherwise reset and wait for the sender's next attempt."""
        if inb.final:
            self._end_in(inb, reason, tell=True)
            return
        if inb.peer is not None:
            self._notify(inb.peer, Ack(inb.rec.transfer_id, attempt, False, reason))
        self._reset_in(inb, attempt)

    @staticmethod
    def _reset_in(inb: _In, rejected_attempt: int) -> None:
        inb.rejected_attempt = rejected_attempt
        inb.filled.clear()
        inb.ndata = 0
        inb.close_ndata = -1
        inb.rec.bytes_done = 0

    def _on_hello(self, peer: str, msg: Hello) -> None:
        if self._learn_peer(peer, msg.md) is not None:
            return
        tid = msg.tid
        inb = self._in.get(tid)
        region = self._regions.get(msg.region_id)
        if inb is None:
            reason = inbound_reject_reason(tid, msg.region_id, region is not None,
                                           region.owner_tid if region is not None else None,
                                           tid in self._recs, self.name)
            if reason:
                self._notify(peer, Grant(tid, msg.attempt, False, reason))
                return
            assert region is not None
            rec = TransferRecord(tid, Role.RECEIVER, self.config.timeout_s)
            rec.bytes_total = sum(v.nbytes for v in region.views)
            self._recs[tid] = rec
            inb = _In(rec, region, posted=False)
            self._in[tid] = inb
        if inb.rec.state.terminal or msg.attempt < inb.rec.attempt or msg.attempt == inb.rejected_attempt:
            self._notify(peer, Grant(tid, msg.attempt, False, f"transfer {tid!r} is "
                                     f"{inb.rec.state.value} at the receiver (attempt {inb.rec.attempt})"))
            return
        if inb.region.region_id != msg.region_id:
            self._notify(peer, Grant(tid, msg.attempt, False,
                                     f"transfer {tid!r} targets region {inb.region.region_id!r}, "
                                     f"not {msg.region_id!r}"))
            return
        if inb.peer is not None and inb.peer != peer and msg.attempt == inb.rec.attempt:
            self._notify(peer, Grant(tid, msg.attempt, False, f"transfer {tid!r} is being written by another "
                                                             "sender"))
            return
        if msg.attempt > inb.rec.attempt:
            inb.rec.attempt = msg.attempt
            self._reset_in(inb, inb.rejected_attempt)
        inb.peer = peer
        inb.final = msg.final
        inb.rec.touch(time.monotonic())
        region = inb.region
        if msg.want_target:
            grant = Grant(tid, msg.attempt, True, "", [v.nbytes for v in region.views], region.target)
        else:
            grant = Grant(tid, msg.attempt, True)
        self._notify(peer, grant)

    def _inbound(self, peer: str, tid: str, attempt: int) -> _In | None:
        inb = self._in.get(tid)
        if inb is None or inb.peer != peer or inb.rec.state.terminal:
            return None
        if attempt != inb.rec.attempt or attempt == inb.rejected_attempt:
            return None  # stale attempt
        return inb

    def _unknown_close(self, peer: str, tid: str, attempt: int) -> None:
        """A Close for a transfer we no longer track (released, or never granted): say so, so the sender fails
        now instead of at its timeout. Stale attempts of a live transfer are ignored."""
        if tid not in self._in and peer in self._peers:
            self._notify(peer, Ack(tid, attempt, False, f"no transfer {tid!r} at the receiver"))

    def _on_data(self, peer: str, msg: Data) -> None:
        inb = self._inbound(peer, msg.tid, msg.attempt)
        if inb is None:
            if msg.close_ndata >= 0:
                self._unknown_close(peer, msg.tid, msg.attempt)
            return
        views = inb.region.views
        if len(msg.slots) != len(msg.nbytes):
            self._reject(inb, msg.attempt, f"malformed data: {len(msg.slots)} slots, {len(msg.nbytes)} sizes")
            return
        for s, n in zip(msg.slots, msg.nbytes, strict=True):
            if not 0 <= s < len(views):
                self._reject(inb, msg.attempt, f"slot {s} out of range: region has {len(views)} slots")
                return
            if n != views[s].nbytes:
                self._reject(inb, msg.attempt, f"length mismatch in slot {s}: receiver reserved "
                                               f"{views[s].nbytes} bytes, got {n}")
                return
        now = time.monotonic()
        inb.rec.start(now)
        for s, n in zip(msg.slots, msg.nbytes, strict=True):
            if s not in inb.filled:
                inb.filled.add(s)
                inb.rec.bytes_done += n
        inb.ndata += 1
        inb.rec.touch(now)
        if msg.close_ndata >= 0:
            inb.close_ndata = msg.close_ndata
        self._maybe_complete(inb)

    def _on_close(self, peer: str, msg: Close) -> None:
        inb = self._inbound(peer, msg.tid, msg.attempt)
        if inb is None:
            self._unknown_close(peer, msg.tid, msg.attempt)
            return
        inb.close_ndata = msg.ndata
        inb.rec.touch(time.monotonic())
        self._maybe_complete(inb)

    def _maybe_complete(self, inb: _In) -> None:
        """Judge a closed attempt once every Data it announced has arrived (notifications may reorder)."""
        if inb.close_ndata < 0 or inb.ndata < inb.close_ndata:
            return
        n = len(inb.region.views)
        if len(inb.filled) != n:
            self._reject(inb, inb.rec.attempt, f"sender closed after filling {len(inb.filled)} of {n} slots")
            return
        self._end_in(inb, None, tell=True)

    def _on_abort(self, peer: str, msg: Abort) -> None:
        inb = self._in.get(msg.tid)
        if inb is None or inb.peer != peer or inb.rec.state.terminal or msg.attempt < inb.rec.attempt:
            return
        if msg.final:
            self._end_in(inb, f"aborted by sender: {msg.reason}", tell=False)
        else:
            self._reset_in(inb, msg.attempt)

    def _on_read_req(self, peer: str, msg: ReadReq) -> None:
        if self._learn_peer(peer, msg.md) is not None:
            return
        region = self._regions.get(msg.region_id)
        if region is None:
            self._notify(peer, ReadGrant(msg.tid, False, f"no region {msg.region_id!r} at {self.name}"))
            return
        if any(not 0 <= s < len(region.views) for s in msg.slots):
            self._notify(peer, ReadGrant(msg.tid, False, f"slot out of range: region has "
                                                         f"{len(region.views)} slots"))
            return
        region.readers[(peer, msg.tid)] = time.monotonic() + self.config.timeout_s
        self._notify(peer, ReadGrant(msg.tid, True))

    def _on_read_done(self, peer: str, msg: ReadDone) -> None:
        for region in self._regions.values():
            region.readers.pop((peer, msg.tid), None)

    # ------------------------------------------------------------------ reader side (lock held)
    def _end_read(self, rd: _Read, reason: str | None) -> None:
        if reason is None:
            rd.rec.start()
            rd.rec.bytes_done = rd.rec.bytes_total
            rd.rec.advance(TransferState.DONE)
        elif not rd.rec.fail(reason):
            return
        if rd.post is not None and not rd.post.done:
            self._retire(rd.post)
        rd.post = None
        rd.into = []
        if rd.requested:
            rd.requested = False
            self._notify(rd.peer, ReadDone(rd.rec.transfer_id))

    def _on_read_grant(self, peer: str, msg: ReadGrant) -> None:
        rd = self._reads.get(msg.tid)
        if rd is None or rd.peer != peer or rd.rec.state.terminal or rd.post is not None:
            return
        if not msg.ok:
            self._end_read(rd, f"region owner rejected: {msg.reason}")
            return
        post = self._post("READ", peer, rd.into, [rd.addrs[s] for s in rd.slots], None)
        if isinstance(post, str):
            self._end_read(rd, post)
            return
        rd.post = post
        now = time.monotonic()
        rd.rec.start(now)
        rd.rec.touch(now)
        if post.done:
            self._end_read(rd, None)

    def _progress_read(self, rd: _Read) -> bool:
        if rd.post is None or rd.rec.state.terminal:
            return False
        state = self._check_post(rd.post)
        if state == "DONE":
            self._end_read(rd, None)
            return False
        if state == "PROC":
            return True
        self._end_read(rd, f"nixl READ from {rd.peer!r} failed: {state}")
        return False

    # ------------------------------------------------------------------ cancel, sweep, loop (lock held)
    def _cancel(self, tid: str, reason: str) -> None:
        rec = self._recs.get(tid)
        if rec is None or rec.state.terminal:
            return
        if (out := self._out.get(tid)) is not None:
            self._fail_out(out, reason)
        elif (inb := self._in.get(tid)) is not None:
            self._end_in(inb, reason, tell=True, peer_reason=f"receiver: {reason}")
        elif (rd := self._reads.get(tid)) is not None:
            self._end_read(rd, reason)

    def _sweep(self, now: float) -> None:
        for tid, rec in list(self._recs.items()):
            if rec.expired(now):
                self._cancel(tid, f"timed out after {rec.timeout_s:g} s without progress "
                                  f"(state {rec.state.name})")
        for region in self._regions.values():
            for key, deadline in list(region.readers.items()):
                if now > deadline:
                    del region.readers[key]
        if self._quarantine:
            self._quarantine = [(d, v) for d, v in self._quarantine if d > now]
        if self._zombies:
            self._reap_zombies()

    def _step(self) -> tuple[bool, bool]:
        """One progress round: notifications, posted transfers, timeouts. Returns (worked, in_flight)."""
        worked = False
        try:
            notifs = self._agent.get_new_notifs()
        except Exception:  # noqa: BLE001 - NIXL raises its own exception types
            log.exception("nixl get_new_notifs failed")
            notifs = {}
        for peer, msgs in notifs.items():
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            self._heard.add(peer)
            for raw in msgs:
                worked = True
                try:
                    msg = NOTIF_DECODER.decode(raw)
                except msgspec.DecodeError:
                    log.warning("dropping malformed nixl notification from %s", peer)
                    continue
                try:
                    self._dispatch(peer, msg)
                except Exception:  # a bug or a malformed peer must not kill the progress thread
                    log.exception("nixl notification from %s failed", peer)
        in_flight = False
        for out in list(self._out.values()):
            if not out.rec.state.terminal and (out.posts or out.acked or out.closed):
                in_flight |= self._progress_out(out)
        for rd in list(self._reads.values()):
            in_flight |= self._progress_read(rd)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.config.sweep_interval_s
            self._sweep(now)
        return worked, in_flight

    def _dispatch(self, peer: str, msg: Notif) -> None:
        if isinstance(msg, Data):
            self._on_data(peer, msg)
        elif isinstance(msg, Hello):
            self._on_hello(peer, msg)
        elif isinstance(msg, Grant):
            self._on_grant(peer, msg)
        elif isinstance(msg, Close):
            self._on_close(peer, msg)
        elif isinstance(msg, Ack):
            self._on_ack(peer, msg)
        elif isinstance(msg, Abort):
            self._on_abort(peer, msg)
        elif isinstance(msg, ReadReq):
            self._on_read_req(peer, msg)
        elif isinstance(msg, ReadGrant):
            self._on_read_grant(peer, msg)
        elif isinstance(msg, ReadDone):
            self._on_read_done(peer, msg)
        elif isinstance(msg, Hi):
            if msg.md and self._learn_peer(peer, msg.md) is None and msg.reply:
                self._notify(peer, Hi(b"", False))

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._running:
                    return
                try:
                    worked, in_flight = self._step()
                except Exception:  # keep progressing whatever one step did
                    log.exception("nixl progress step failed")
                    worked, in_flight = False, False
                live = bool(self._recs) and any(not r.state.terminal for r in self._recs.values())
                held = bool(self._zombies or self._quarantine)
            if worked:
                time.sleep(0)  # let callers take the lock between bursts of notifications
                continue
            if in_flight:
                time.sleep(_ACTIVE_SLEEP_S)
            elif live or held:
                time.sleep(_WAIT_SLEEP_S)
            else:
                time.sleep(self.config.sweep_interval_s)
