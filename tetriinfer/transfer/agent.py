"""ZmqAgent: the transfer engine behind the inproc, shm and tcp backends.

Each agent binds one ROUTER socket (its `address`) and opens one DEALER per peer it sends to. A single I/O thread
owns every socket; callers only touch records under a lock and queue commands for that thread.

Per-transfer lifecycle (sender side; receiver mirrors it):
  open -> PENDING -> first Data sent -> TRANSFERRING -> Close sent -> Ack(ok) -> DONE
                                                                   -> Ack(!ok) | timeout | cancel -> FAILED
Receiver: recv() posts a region (PENDING) -> first Data -> TRANSFERRING -> Close with every slot filled -> DONE.
A rejected attempt that is not the sender's last one resets the receiver (it waits for the next attempt);
a final rejection, a final Abort or the inactivity timeout make it FAILED.

Invariants:
- Only the I/O thread moves records to terminal states and writes into receiver buffers, so once a caller sees
  DONE/FAILED its buffers are never touched again.
- On every terminal state the agent drops its references to the caller's buffers (region, pinned payloads) and
  returns shm staging to the pool; `stats()` exposes the counts.
- Headers are msgspec structs; payload bytes are raw zmq frames (zero-copy) or shm references.

shm fast paths (one memcpy per byte instead of two; see `tetriinfer.transfer.arena`):
- push: receive buffers from `alloc()` live in this agent's arena; `recv()` advertises where (RemoteRegion.extra,
  a DirectTarget) and the sender copies straight into them, re-checking the region's fence word before every
  piece, then sends one `Data(inplace=True)` header (carrying the Close too when it comes from send()).
- pull: a sender whose buffers come from its own `alloc()` sends refs to them instead of staging a copy.
Control messages: send() = one Data (Close folded in) + one Ack for payloads up to MESSAGE_BYTES or in place.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from tetriinfer.net import url_host
from tetriinfer.transfer import messages as m
from tetriinfer.transfer.arena import PIECE_BYTES, ShmArena
from tetriinfer.transfer.base import AgentConfig, Peer, TransferStats
from tetriinfer.transfer.buffers import Buffer, as_byte_views, plain_alloc
from tetriinfer.transfer.messages import RemoteRegion, ShmRef
from tetriinfer.transfer.staging import ShmMapper, ShmStager, _Segment
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

log = logging.getLogger(__name__)

MESSAGE_BYTES = 8 << 20  # payload bytes per Data message (whole arrays; a larger single array goes alone)
INLINE_DIRECT_BYTES = 2 << 20  # in-place appends up to this size are copied by the caller (no thread hand-off)
MAINTENANCE_S = 0.5  # how often the I/O thread unmaps peers' unlinked segments and trims the arena


@dataclass
class _Region:
    region_id: str
    slots: list[np.ndarray]
    owner_tid: str | None  # set for regions posted by recv(); None for long-lived register()ed ones
    direct: list[ShmRef | None] | None = None  # arena location of each slot, when advertised for direct writes
    fence: int | None = None  # this region's fence word in the arena while it is open
    extra: bytes = b""  # the encoded DirectTarget shipped in the RemoteRegion


@dataclass
class _Out:
    rec: TransferRecord
    address: str
    region_id: str
    final: bool
    slot_sizes: list[int] | None
    next_slot: int = 0
    closed: bool = False
    sent_any: bool = False
    seq: int = 0
    payloads: list[list[np.ndarray]] = field(default_factory=list)
    staged: dict[int, _Segment] = field(default_factory=dict)
    direct: m.DirectTarget | None = None  # the receiver's arena slots (shm), written in place
    pending: int = 0  # appends queued for the I/O thread, not yet sent
    close_sent: bool = False  # the Close went out folded into the last Data


@dataclass
class _In:
    rec: TransferRecord
    region: _Region
    posted: bool
    final: bool = True
    identity: bytes | None = None
    rejected_attempt: int = -1
    filled: set[int] = field(default_factory=set)


@dataclass
class _Read:
    rec: TransferRecord
    address: str
    region_id: str
    into: list[np.ndarray]
    slots: list[int]


class ZmqAgent:
    """One endpoint of the transfer API over ZeroMQ (see `tetriinfer.transfer.base` for the contract).

    `use_shm=True` moves payloads through /dev/shm staging segments instead of zmq frames (same-host only).
    A transfer id is unique per agent while its record exists (release() it to reuse the id).
    """

    kind = "zmq"
    # caller buffers -> flat byte views; a backend whose payloads are not numpy views (torchdist) overrides it
    _byte_views = staticmethod(as_byte_views)

    def __init__(self, bind_url: str, *, config: AgentConfig | None = None, use_shm: bool = False,
                 shm_pool_bytes: int = 256 << 20, advertise: str | None = None,
                 arena_segment_bytes: int = 64 << 20, arena_keep_bytes: int = 512 << 20) -> None:
        self.config = config or AgentConfig()
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.SNDHWM, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        if "[" in bind_url:  # an IPv6 literal (IPv4 sockets stay plain: their endpoints read as given)
            self._router.setsockopt(zmq.IPV6, 1)
        self._router.bind(bind_url)
        endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        if advertise:
            endpoint = endpoint.replace(endpoint.split("://", 1)[1].rsplit(":", 1)[0], url_host(advertise), 1)
        self._address = endpoint
        self._stager = ShmStager(shm_pool_bytes) if use_shm else None
        self._mapper = ShmMapper() if use_shm else None
        self._arena: ShmArena | None = None  # created on first alloc() (shm only)
        self._arena_opts = {"segment_bytes": arena_segment_bytes, "keep_bytes": arena_keep_bytes,
                            "quarantine_s": max(1.0, self.config.cancel_wait_s)}
        self._arena_lock = threading.Lock()
        self._next_maintenance = 0.0
        self._dealers: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._recs: dict[str, TransferRecord] = {}
        self._out: dict[str, _Out] = {}
        self._in: dict[str, _In] = {}
        self._reads: dict[str, _Read] = {}
        self._regions: dict[str, _Region] = {}
        self._read_staging: dict[tuple[bytes, str], tuple[_Segment, float]] = {}
        self._running = True
        self._woken = False  # a wake-up byte is in flight: later submits need not write another
        self._thread = threading.Thread(target=self._io_loop, name=f"xfer-io-{self.kind}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller API
    @property
    def address(self) -> str:
        return self._address

    def _check_running(self) -> None:
        if not self._running:
            raise RuntimeError("transfer backend is shut down")

    def _new_record(self, tid: str, role: Role, timeout_s: float | None) -> TransferRecord:
        return new_record(self._recs, tid, role, timeout_s, self.config.timeout_s)

    def _region_descriptor(self, region: _Region) -> RemoteRegion:
        return RemoteRegion(self._address, region.region_id, [s.nbytes for s in region.slots], backend=self.kind,
                            extra=region.extra)

    def alloc(self, shape: Sequence[int], dtype: Any) -> Buffer:
        """A receive (or send) buffer of `shape`/`dtype` (torch dtype -> tensor, numpy dtype -> array) that this
        link fills with the fewest copies: on shm it lives in a pooled shared-memory arena, so a `recv()` into
        it (or any slice of it) lets a same-host sender write it directly. Freed when the last view is dropped.
        Other links return ordinary memory."""
        self._check_running()
        if self._stager is None:
            return plain_alloc(shape, dtype)
        with self._arena_lock:
            if self._arena is None:
                self._arena = ShmArena(f"{self._stager.tag}arena-", **self._arena_opts)  # type: ignore[arg-type]
        return self._arena.alloc(shape, dtype)

    def alloc_like(self, shapes: Sequence[Sequence[int]], dtype: Any) -> list[Buffer]:
        """`[alloc(s, dtype) for s in shapes]`, e.g. the 2 * num_layers KV staging tensors of one request; on shm
        carved from one arena allocation (`ShmArena.alloc_many`)."""
        self._check_running()
        if self._stager is None:
            return [plain_alloc(s, dtype) for s in shapes]
        with self._arena_lock:
            if self._arena is None:
                self._arena = ShmArena(f"{self._stager.tag}arena-", **self._arena_opts)  # type: ignore[arg-type]
        return self._arena.alloc_many(shapes, dtype)

    def _advertise_locked(self, region: _Region) -> None:
        """Give a region whose slots lie in our arena a fence word and a DirectTarget (caller holds the lock)."""
        arena = self._arena
        if arena is None:
            return
        refs = arena.locate(region.slots)
        if not any(r is not None for r in refs):
            return
        fence = arena.open_fence()
        if fence is None:  # every fence word is taken: this region uses the staging path
            return
        region.direct, region.fence = refs, fence[0]
        region.extra = msgspec.msgpack.encode(m.DirectTarget(arena.fence_name, fence[0], fence[1], refs))

    def _drop_region_locked(self, region: _Region, ok: bool) -> None:
        """Forget a region (caller holds the lock). Its fence closes first, so direct writers stop; the arena
        ranges of a region that did not end DONE are quarantined when freed (a last piece may still land)."""
        if self._regions.get(region.region_id) is region:
            del self._regions[region.region_id]
        if region.fence is not None and self._arena is not None:
            self._arena.close_fence(region.fence)
            region.fence = None
            if not ok and region.direct:
                self._arena.taint([r for r in region.direct if r is not None])

    def recv(self, transfer_id: str, into_buffers: Sequence[Buffer], *,
             timeout_s: float | None = None) -> RemoteRegion:
        """Post `into_buffers` for `transfer_id`; returns the region descriptor a sender may write into."""
        self._check_running()
        views = self._byte_views(into_buffers, writable=True)
        with self._lock:
            if transfer_id in self._regions:
                raise ValueError(f"region {transfer_id!r} already exists on this agent")
            rec = self._new_record(transfer_id, Role.RECEIVER, timeout_s)
            rec.bytes_total = sum(v.nbytes for v in views)
            region = _Region(transfer_id, views, owner_tid=transfer_id)
            self._advertise_locked(region)
            self._regions[transfer_id] = region
            self._in[transfer_id] = _In(rec, region, posted=True)
            return self._region_descriptor(region)

    def register(self, region_id: str, buffers: Sequence[Buffer]) -> RemoteRegion:
        """Expose long-lived memory (e.g. KV blocks) for one-sided write()/read() by peers."""
        self._check_running()
        views = self._byte_views(buffers, writable=True)
        with self._lock:
            if region_id in self._regions:
                raise ValueError(f"region {region_id!r} already exists on this agent")
            region = _Region(region_id, views, owner_tid=None)
            self._advertise_locked(region)
            self._regions[region_id] = region
            return self._region_descriptor(region)

    def deregister(self, region_id: str) -> None:
        """Drop a register()ed region; in-flight writes into it are rejected from then on."""
        self._check_running()
        with self._lock:
            region = self._regions.get(region_id)
            if region is None:
                raise KeyError(f"unknown region {region_id!r}")
            if region.owner_tid is not None:
                raise ValueError(f"region {region_id!r} belongs to transfer {region.owner_tid!r}; release that")
        self._call_io(lambda: self._io_deregister(region_id))

    def open(self, transfer_id: str, peer: Peer, *, timeout_s: float | None = None,
             attempt: int = 0, max_attempts: int = 1) -> None:
        """Start a sending transfer to `peer` (an address, or a RemoteRegion to write into); PENDING."""
        self._check_running()
        if not 0 <= attempt < max_attempts:
            raise ValueError(f"need 0 <= attempt < max_attempts, got {attempt}, {max_attempts}")
        direct = None
        if isinstance(peer, RemoteRegion):
            address, region_id, sizes = peer.address, peer.region_id, list(peer.slot_nbytes)
            direct = self._direct_target(peer)
        elif isinstance(peer, str):
            address, region_id, sizes = peer, transfer_id, None
        else:
            raise ValueError(f"peer must be an address or a RemoteRegion, got {type(peer).__name__}")
        with self._lock:
            rec = self._new_record(transfer_id, Role.SENDER, timeout_s)
            rec.attempt = attempt
            self._out[transfer_id] = _Out(rec, address, region_id, attempt + 1 >= max_attempts, sizes,
                                          direct=direct)

    def append(self, transfer_id: str, buffers: Sequence[Buffer], *,
               slots: Sequence[int] | None = None) -> None:
        """Queue `buffers` for the receiver's slots (`slots`, default: the next ones in order). Never blocks.

        The buffers must stay unchanged until the transfer is terminal. Appending to a transfer that has
        already failed is a no-op (poll() reports the failure). Never waits for the peer; on shm, an append of at
        most INLINE_DIRECT_BYTES into the receiver's arena is copied here, in the caller's thread."""
        self._append(transfer_id, buffers, slots, close=False)

    def _append(self, transfer_id: str, buffers: Sequence[Buffer], slots: Sequence[int] | None, *,
                close: bool) -> None:
        self._check_running()
        views = self._byte_views(buffers)
        with self._lock:
            out = self._out.get(transfer_id)
            if out is None:
                raise KeyError(f"no open sending transfer {transfer_id!r}")
            if out.closed:
                raise ValueError(f"transfer {transfer_id!r} is closed; open a new one")
            if out.rec.state.terminal:
                return
            slot_list = append_slots(out.next_slot, len(views), slots)
            if slot_list:
                out.next_slot = max(out.next_slot, max(slot_list) + 1)
            out.payloads.append(views)
            out.rec.bytes_total += sum(v.nbytes for v in views)
            out.pending += 1
            if close:  # send(): the I/O thread folds the Close into the last Data message
                out.closed = True
            # only when nothing earlier is still queued: a queued append to the same slot must not land later
            refs = self._inline_refs(out, views, slot_list) if out.pending == 1 else None
        written: str | None = None
        if refs is not None:  # small, wholly in-place append: copy now, in the caller's thread (no hand-off)
            written = self._write_direct(out, refs, views) or ""
        if close:  # one command, one wake-up: data, then the Close unless it was folded into the data
            self._submit(lambda: (self._io_send_data(transfer_id, views, slot_list, written),
                                  self._io_send_close(transfer_id)))
        else:
            self._submit(lambda: self._io_send_data(transfer_id, views, slot_list, written))

    @staticmethod
    def _inline_refs(out: _Out, views: list[np.ndarray], slots: list[int]) -> list[ShmRef] | None:
        """The receiver's arena refs for `slots` when this append can be written in the caller's thread: every
        slot advertised with a matching size and at most INLINE_DIRECT_BYTES in all (else None)."""
        d = out.direct
        if d is None or not views or sum(v.nbytes for v in views) > INLINE_DIRECT_BYTES:
            return None
        refs = []
        for s, v in zip(slots, views, strict=True):
            r = d.slots[s] if s < len(d.slots) else None
            if r is None or r.nbytes != v.nbytes:
                return None
            refs.append(r)
        return refs

    def close(self, transfer_id: str) -> None:
        """No more appends: the receiver completes once everything arrived."""
        self._check_running()
        with self._lock:
            out = self._out.get(transfer_id)
            if out is None:
                raise KeyError(f"no open sending transfer {transfer_id!r}")
            if out.closed:
                return
            out.closed = True
        self._submit(lambda: self._io_send_close(transfer_id))

    def send(self, transfer_id: str, buffers: Sequence[Buffer], peer: Peer, *,
             timeout_s: float | None = None) -> None:
        """Two-sided send of a whole payload (= open + append + close, sent as one Data+Close message when the
        payload is in place or fits in one message)."""
        self.open(transfer_id, peer, timeout_s=timeout_s)
        self._append(transfer_id, buffers, None, close=True)

    def write(self, transfer_id: str, remote_region: RemoteRegion, buffers: Sequence[Buffer], *,
              slots: Sequence[int] | None = None, timeout_s: float | None = None) -> None:
        """One-sided write of `buffers` into `remote_region` (slot sizes are checked before bytes move)."""
        self.open(transfer_id, remote_region, timeout_s=timeout_s)
        self._append(transfer_id, buffers, slots, close=True)

    def read(self, transfer_id: str, remote_region: RemoteRegion, into_buffers: Sequence[Buffer], *,
             slots: Sequence[int] | None = None, timeout_s: float | None = None) -> None:
        """One-sided read of `remote_region`'s slots (default: all) into `into_buffers`."""
        self._check_running()
        views = self._byte_views(into_buffers, writable=True)
        slot_list = list(range(len(remote_region.slot_nbytes))) if slots is None else [int(s) for s in slots]
        if len(slot_list) != len(views):
            raise ValueError(f"{len(views)} destination buffers but {len(slot_list)} slots")
        direct = self._direct_target(remote_region)
        refs = None if direct is None else [direct.slots[s] if 0 <= s < len(direct.slots) else None
                                            for s in slot_list]
        with self._lock:
            rec = self._new_record(transfer_id, Role.READER, timeout_s)
            rec.bytes_total = sum(v.nbytes for v in views)
            if refs is None or any(r is None for r in refs):
                self._reads[transfer_id] = _Read(rec, remote_region.address, remote_region.region_id, views,
                                                 slot_list)
        if refs is None or any(r is None for r in refs):
            self._submit(lambda: self._io_send_read_req(transfer_id))
            return
        assert direct is not None
        reason = self._read_direct(direct, refs, views)  # type: ignore[arg-type]
        with self._lock:
            rec.start()
            if reason is None:
                rec.bytes_done = rec.bytes_total
                rec.advance(TransferState.DONE)
            else:
                rec.fail(reason)

    def _direct_target(self, region: RemoteRegion) -> m.DirectTarget | None:
        """Where `region`'s slots lie in its owner's shared-memory arena, if it advertised that and this agent can
        map it (shm backend: same host); None otherwise (the bytes then go through the owner's I/O thread)."""
        if self._mapper is None or region.backend != "shm" or not region.extra:
            return None
        try:
            direct = msgspec.msgpack.decode(region.extra, type=m.DirectTarget)
        except msgspec.DecodeError:
            return None  # not ours to read: use the staging path
        return direct if len(direct.slots) == len(region.slot_nbytes) else None

    def _read_direct(self, d: m.DirectTarget, refs: list[ShmRef], into: list[np.ndarray]) -> str | None:
        """One-sided read with no work at the owner: copy straight out of its arena, in the caller's thread.

        The owner closes a region's fence word before it frees or reuses the memory, and every opening takes a
        fresh token, so a piece copied while the word still holds our token *after* the copy is the region's
        data; a changed word fails the read (the bytes may be torn). Returns a failure reason or None."""
        assert self._mapper is not None
        try:
            fence = self._fence_words(d)
            srcs = self._mapper.views(refs)
        except (ValueError, OSError) as e:
            return f"cannot map the region owner's memory: {e}"
        closed = "region owner closed the region (deregistered or shut down)"
        reason = _copy_fenced(fence, d, into, srcs, closed)
        return reason if reason is not None or fence[d.fence_index] == d.token else closed

    def poll(self, transfer_id: str) -> TransferState:
        """Current state; never blocks. Raises KeyError for an unknown (or released) id."""
        with self._lock:
            return lookup_record(self._recs, transfer_id).state

    def status(self, transfer_id: str) -> TransferStatus:
        with self._lock:
            return lookup_record(self._recs, transfer_id).snapshot()

    def release(self, transfer_id: str) -> None:
        """Forget a transfer. A live one is cancelled first (FAILED 'cancelled'), waiting for the I/O thread
        so that its buffers are untouched once this returns."""
        with self._lock:
            rec = self._recs.get(transfer_id)
            if rec is None:
                return
            live = not rec.state.terminal
        if live and self._running:
            self._call_io(lambda: self._io_cancel(transfer_id, "cancelled by caller"))
        with self._lock:
            self._recs.pop(transfer_id, None)
            self._out.pop(transfer_id, None)
            self._reads.pop(transfer_id, None)
            self._in.pop(transfer_id, None)

    def stats(self) -> TransferStats:
        arena = self._arena.counts() if self._arena is not None else (0, 0, 0)
        with self._lock:
            return TransferStats(
                records=len(self._recs),
                active=sum(1 for r in self._recs.values() if not r.state.terminal),
                regions=len(self._regions),
                pinned_payloads=sum(len(o.payloads) for o in self._out.values())
                + sum(1 for r in self._reads.values() if r.into),
                staging_segments=self._stager.in_use if self._stager else 0,
                pooled_segments=self._stager.pooled if self._stager else 0,
                peers=len(self._dealers),
                arena_segments=arena[0],
                arena_allocations=arena[1],
                arena_bytes=arena[2],
            )

    @property
    def shm_tag(self) -> str | None:
        """Prefix of this agent's /dev/shm files (for leak checks), or None when shm is not used."""
        return self._stager.tag if self._stager else None

    def shutdown(self) -> None:
        """Fail every live transfer, stop the I/O thread, close sockets and unlink shm segments. Idempotent."""
        if not self._running:
            return
        try:
            self._call_io(self._io_fail_all)
        finally:  # even if the I/O thread is stuck: stop it and unlink every /dev/shm file we created
            self._running = False
            self._wake()
            self._thread.join(timeout=5)
            if self._arena is not None:
                self._arena.shutdown()  # zeroes the fences first: direct writers stop at their next piece
            if self._stager:
                self._stager.shutdown()
            if self._mapper:
                self._mapper.shutdown()
            if not self._thread.is_alive():  # sockets belong to the I/O thread while it runs
                for d in self._dealers.values():
                    d.close(linger=0)
                self._dealers.clear()
                self._router.close(linger=0)
                os.close(self._wake_r)
                os.close(self._wake_w)

    def __enter__(self) -> ZmqAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ command plumbing
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _submit(self, fn: Callable[[], None]) -> None:
        self._cmds.put(fn)
        if not self._woken:  # the I/O thread clears this before draining commands, so none is ever missed
            self._woken = True
            self._wake()

    def _call_io(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the I/O thread and wait for it (bounded by config.cancel_wait_s)."""
        if threading.current_thread() is self._thread:
            fn()
            return
        done = threading.Event()

        def wrapped() -> None:
            try:
                fn()
            finally:
                done.set()

        self._submit(wrapped)
        if not done.wait(self.config.cancel_wait_s):
            raise TimeoutError("transfer I/O thread did not respond")

    # ------------------------------------------------------------------ I/O thread
    def _io_loop(self) -> None:
        timeout_ms = max(1, int(self.config.sweep_interval_s * 1000))
        next_sweep = 0.0
        while self._running:
            try:
                events = dict(self._poller.poll(timeout_ms))
            except zmq.ZMQError:
                break
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            self._woken = False
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                self._guard(cmd)
            if self._router in events:
                self._drain(self._router, self._on_router)
            for addr, dealer in list(self._dealers.items()):
                if dealer in events:
                    self._drain(dealer, lambda parts, a=addr: self._on_dealer(a, parts))
            now = time.monotonic()
            if now >= next_sweep:
                self._guard(self._io_sweep)
                next_sweep = now + self.config.sweep_interval_s

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a bug or a malformed peer must not kill the I/O thread
            log.exception("transfer I/O step failed")

    def _drain(self, sock: zmq.Socket, handler: Callable[[list[zmq.Frame]], None]) -> None:
        for _ in range(256):
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._guard(lambda p=parts: handler(p))

    def _dealer_endpoint(self, address: str) -> str:
        """The zmq endpoint a DEALER dials for a peer's agent address (backends with richer addresses override)."""
        return address

    def _dealer_identity(self) -> bytes | None:
        """The routing id our DEALERs present (None: zmq picks one); backends that identify peers override."""
        return None

    def _dealer(self, address: str) -> zmq.Socket:
        d = self._dealers.get(address)
        if d is None:
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.SNDHWM, 0)
            d.setsockopt(zmq.RCVHWM, 0)
            endpoint = self._dealer_endpoint(address)
            if "[" in endpoint:
                d.setsockopt(zmq.IPV6, 1)
            if (identity := self._dealer_identity()) is not None:
                d.setsockopt(zmq.ROUTING_ID, identity)
            d.connect(endpoint)
            self._poller.register(d, zmq.POLLIN)
            self._dealers[address] = d
        return d

    def _to_peer(self, address: str, msg: m.Message, frames: Sequence[np.ndarray] = ()) -> None:
        self._dealer(address).send_multipart([m.encode(msg), *frames], copy=False, flags=zmq.NOBLOCK)

    def _reply(self, identity: bytes, msg: m.Message, frames: Sequence[np.ndarray] = ()) -> None:
        try:
            self._router.send_multipart([identity, m.encode(msg), *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # peer gone: replies are best-effort, the peer's timeout covers it
            pass

    def _sources(self, shm: list[m.ShmRef] | None, frames: Sequence[zmq.Frame]) -> list[np.ndarray]:
        if shm is not None:
            if self._mapper is None:
                raise ValueError("peer sent shared-memory refs to an agent without shm")
            return self._mapper.views(shm)
        return [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]

    # --- sender side
    def _finish_out_locked(self, out: _Out) -> None:
        """Terminal sender (lock held, same section as the transition): unpin payloads, return staging."""
        out.payloads.clear()
        if self._stager:
            for seg in out.staged.values():
                self._stager.release(seg)
        out.staged.clear()

    def _fail_out(self, out: _Out, reason: str, *, tell_peer: bool) -> None:
        with self._lock:
            changed = out.rec.fail(reason)
            self._finish_out_locked(out)
        if changed and tell_peer and out.sent_any:
            try:
                self._to_peer(out.address, m.Abort(out.rec.transfer_id, out.region_id, out.rec.attempt,
                                                   out.final, reason))
            except zmq.ZMQError:
                pass

    def _io_send_data(self, tid: str, views: list[np.ndarray], slots: list[int],
                      written: str | None = None) -> None:
        """Send one append. `written` is "" when the caller already copied every slot in place, a failure
        reason when that copy failed, None when nothing was copied yet."""
        out = self._out.get(tid)
        if out is None:
            return
        with self._lock:
            out.pending -= 1
        if out.rec.state.terminal:
            return
        if out.slot_sizes is not None:
            for s, v in zip(slots, views, strict=True):
                if s >= len(out.slot_sizes):
                    self._fail_out(out, f"slot {s} out of range: remote region has {len(out.slot_sizes)} "
                                        "slots", tell_peer=True)
                    return
                if v.nbytes != out.slot_sizes[s]:
                    self._fail_out(out, f"length mismatch in slot {s}: remote region reserved "
                                        f"{out.slot_sizes[s]} bytes, sender has {v.nbytes}", tell_peer=True)
                    return
        # Slots the receiver advertised in its arena are written in place (one memcpy); the rest move as frames
        # or through shm staging, split into messages of <= MESSAGE_BYTES (whole arrays) so the receiver copies
        # early arrays while later ones are still being staged / on the wire.
        direct_s: list[int] = []
        direct_v: list[np.ndarray] = []
        rest: list[tuple[int, np.ndarray]] = []
        targets = out.direct.slots if out.direct is not None else []
        for s, v in zip(slots, views, strict=True):
            if s < len(targets) and targets[s] is not None:
                direct_s.append(s)
                direct_v.append(v)
            else:
                rest.append((s, v))
        groups: list[tuple[list[int], list[np.ndarray]]] = []
        cur_s: list[int] = []
        cur_v: list[np.ndarray] = []
        size = 0
        for s, v in rest:
            if cur_v and size + v.nbytes > MESSAGE_BYTES:
                groups.append((cur_s, cur_v))
                cur_s, cur_v, size = [], [], 0
            cur_s.append(s)
            cur_v.append(v)
            size += v.nbytes
        if cur_v or (not groups and not direct_v):
            groups.append((cur_s, cur_v))
        for i, (g_slots, g_views) in enumerate(groups):
            last = i == len(groups) - 1 and not direct_v
            seq = out.seq
            out.seq += 1
            shm, consumed = None, True
            frames: Sequence[np.ndarray] = g_views
            if self._stager is not None:
                shm = self._own_arena_refs(g_views)
                if shm is not None:  # pull: the receiver copies straight out of our arena
                    consumed = False
                else:
                    seg, shm = self._stager.stage(g_views)
                    out.staged[seq] = seg
                frames = ()
            if not self._emit(out, seq, g_slots, g_views, frames, shm=shm, consumed=consumed, last=last):
                return
        if direct_v:
            if written is None:
                reason = self._write_direct(out, [targets[s] for s in direct_s], direct_v)  # type: ignore[misc]
            else:
                reason = written or None
            if reason is not None:
                self._fail_out(out, reason, tell_peer=True)
                return
            seq = out.seq
            out.seq += 1
            self._emit(out, seq, direct_s, direct_v, (), inplace=True, last=True)

    def _count_sent(self, out: _Out, nbytes: int, last: bool) -> int:
        """One locked section per Data message: count its bytes as sent and, when it is the last of a closed
        transfer with nothing else queued, fold the Close in. Returns the Close's slot count, or -1."""
        close_nslots = -1
        now = time.monotonic()
        with self._lock:
            if last and out.closed and out.pending == 0 and not out.close_sent:
                out.close_sent = True
                close_nslots = out.next_slot
            out.sent_any = True
            out.rec.start(now)
            out.rec.bytes_done += nbytes
            out.rec.touch(now)
        return close_nslots

    def _emit(self, out: _Out, seq: int, slots: list[int], views: list[np.ndarray], frames: Sequence[np.ndarray],
              *, shm: list[ShmRef] | None = None, consumed: bool = True, inplace: bool = False,
              last: bool) -> bool:
        """Send one Data header (+ frames); the last one of a closed transfer carries its Close. False: failed."""
        nbytes = [v.nbytes for v in views]
        close_nslots = self._count_sent(out, sum(nbytes), last)
        msg = m.Data(out.rec.transfer_id, out.region_id, out.rec.attempt, out.final, seq, slots, nbytes, shm,
                     consumed, inplace, close_nslots)
        try:
            self._to_peer(out.address, msg, frames)
        except zmq.ZMQError as e:
            self._fail_out(out, f"send to {out.address} failed: {e}", tell_peer=False)
            return False
        return True

    def _own_arena_refs(self, views: list[np.ndarray]) -> list[ShmRef] | None:
        """Where `views` lie in our own arena, if every one of them does (else None: stage a copy)."""
        if self._arena is None or not views:
            return None
        refs = self._arena.locate(views)
        return None if any(r is None for r in refs) else refs  # type: ignore[return-value]

    def _write_direct(self, out: _Out, refs: list[ShmRef], views: list[np.ndarray]) -> str | None:
        """Copy `views` straight into the receiver's arena, piece by piece, checking its fence before each piece.
        Returns a failure reason, or None when every byte is in place."""
        d = out.direct
        assert d is not None and self._mapper is not None
        try:
            fence = self._fence_words(d)
            dsts = [self._mapper.target(r) for r in refs]
        except (ValueError, OSError) as e:
            return f"cannot map the receiver's memory: {e}"
        return _copy_fenced(fence, d, dsts, views, "receiver closed the region (cancelled, failed or timed out)")

    def _fence_words(self, d: m.DirectTarget) -> np.ndarray:
        """The peer's fence words, with `d`'s index checked (ValueError/OSError when unusable)."""
        assert self._mapper is not None
        fence = self._mapper.words(d.fence_name)
        if not 0 <= d.fence_index < len(fence):
            raise ValueError(f"fence index {d.fence_index} out of range")
        return fence

    def _io_send_close(self, tid: str) -> None:
        out = self._out.get(tid)
        if out is None or out.rec.state.terminal or out.close_sent:
            return
        out.close_sent = True
        try:
            self._to_peer(out.address, m.Close(tid, out.region_id, out.rec.attempt, out.final, out.next_slot))
        except zmq.ZMQError as e:
            self._fail_out(out, f"send to {out.address} failed: {e}", tell_peer=False)
            return
        now = time.monotonic()
        with self._lock:
            out.sent_any = True
            out.rec.start(now)
            out.rec.touch(now)

    def _on_dealer(self, address: str, parts: list[zmq.Frame]) -> None:
        msg = m.decode(parts[0].buffer)
        if isinstance(msg, m.Ack):
            out = self._out.get(msg.tid)
            if out is None or out.rec.state.terminal or msg.attempt != out.rec.attempt:
                return
            if msg.ok:
                with self._lock:
                    out.rec.start()
                    out.rec.advance(TransferState.DONE)
                    self._finish_out_locked(out)
            else:
                self._fail_out(out, f"receiver rejected: {msg.reason}", tell_peer=False)
        elif isinstance(msg, m.Consumed):
            out = self._out.get(msg.tid)
            if out is not None and self._stager is not None:
                with self._lock:
                    seg = out.staged.pop(msg.seq, None)
                    if seg is not None:
                        self._stager.release(seg)
        elif isinstance(msg, m.ReadResp):
            self._on_read_resp(address, msg, parts[1:])

    # --- receiver side
    def _finish_in_locked(self, inb: _In) -> None:
        """Terminal receiver (caller holds the lock, in the same section that made it terminal): drop the
        region (if transfer-owned) and, for passive writes, the record."""
        tid = inb.rec.transfer_id
        if inb.region.owner_tid == tid:
            self._drop_region_locked(inb.region, ok=inb.rec.state is TransferState.DONE)
        if not inb.posted:
            self._in.pop(tid, None)
            self._recs.pop(tid, None)

    def _reject(self, inb: _In, attempt: int, reason: str) -> None:
        if inb.identity is not None:
            self._reply(inb.identity, m.Ack(inb.rec.transfer_id, attempt, False, reason))
        if inb.final:
            with self._lock:
                inb.rec.fail(reason)
                self._finish_in_locked(inb)
        else:  # the sender will retry: forget this attempt's bytes and wait
            with self._lock:
                inb.rejected_attempt = attempt
                inb.filled.clear()
                inb.rec.bytes_done = 0

    def _inbound(self, identity: bytes, tid: str, region_id: str, attempt: int, final: bool) -> _In | None:
        """Find (or, for register()ed regions, create) the receiving side of `tid`; None means ignore."""
        with self._lock:
            inb = self._in.get(tid)
            region = self._regions.get(region_id)
            if inb is None:
                reason = inbound_reject_reason(tid, region_id, region is not None,
                                               region.owner_tid if region is not None else None,
                                               tid in self._recs, self._address)
                if reason:
                    self._reply(identity, m.Ack(tid, attempt, False, reason))
                    return None
                assert region is not None
                rec = TransferRecord(tid, Role.RECEIVER, self.config.timeout_s)
                rec.bytes_total = sum(s.nbytes for s in region.slots)
                self._recs[tid] = rec
                inb = _In(rec, region, posted=False)
                self._in[tid] = inb
            if inb.rec.state.terminal or attempt < inb.rec.attempt or attempt == inb.rejected_attempt:
                return None  # stale or already-judged attempt
            if inb.region.region_id != region_id:
                self._reply(identity, m.Ack(tid, attempt, False, f"transfer {tid!r} targets region "
                                                                 f"{inb.region.region_id!r}, not {region_id!r}"))
                return None
            if attempt > inb.rec.attempt:
                inb.rec.attempt = attempt
                inb.filled.clear()
                inb.rec.bytes_done = 0
            inb.identity = identity
            inb.final = final
            return inb

    def _on_router(self, parts: list[zmq.Frame]) -> None:
        identity = parts[0].bytes
        try:
            msg = m.decode(parts[1].buffer)
        except (msgspec.DecodeError, IndexError):
            log.warning("dropping malformed message on %s", self._address)
            return
        if isinstance(msg, m.Data):
            self._on_data(identity, msg, parts[2:])
            if msg.close_nslots >= 0:
                self._on_close(identity, msg.tid, msg.region_id, msg.attempt, msg.final)
        elif isinstance(msg, m.Close):
            self._on_close(identity, msg.tid, msg.region_id, msg.attempt, msg.final)
        elif isinstance(msg, m.Abort):
            with self._lock:
                inb = self._in.get(msg.tid)
            if inb is None or inb.rec.state.terminal or msg.attempt < inb.rec.attempt:
                return
            if msg.final:
                with self._lock:
                    inb.rec.fail(f"aborted by sender: {msg.reason}")
                    self._finish_in_locked(inb)
            else:
                with self._lock:
                    inb.rejected_attempt = msg.attempt
                    inb.filled.clear()
                    inb.rec.bytes_done = 0
        elif isinstance(msg, m.ReadReq):
            self._on_read_req(identity, msg)
        elif isinstance(msg, m.Consumed):  # a reader finished with our read staging
            entry = self._read_staging.pop((identity, msg.tid), None)
            if entry is not None and self._stager is not None:
                self._stager.release(entry[0])

    def _on_close(self, identity: bytes, tid: str, region_id: str, attempt: int, final: bool) -> None:
        inb = self._inbound(identity, tid, region_id, attempt, final)
        if inb is None:
            return
        n = len(inb.region.slots)
        if len(inb.filled) != n:
            self._reject(inb, attempt, f"sender closed after filling {len(inb.filled)} of {n} slots")
            return
        with self._lock:
            inb.rec.start()
            inb.rec.advance(TransferState.DONE)
            self._finish_in_locked(inb)
        self._reply(identity, m.Ack(tid, attempt, True))

    def _on_inplace(self, inb: _In, msg: m.Data) -> None:
        """The sender already wrote these slots of our arena: check they were advertised, then count them."""
        region = inb.region
        for slot, n in zip(msg.slots, msg.nbytes, strict=True):
            if not 0 <= slot < len(region.slots) or region.direct is None or region.direct[slot] is None:
                self._reject(inb, msg.attempt, f"slot {slot} was not advertised for direct writes")
                return
            if n != region.slots[slot].nbytes:
                self._reject(inb, msg.attempt, f"length mismatch in slot {slot}: receiver reserved "
                                               f"{region.slots[slot].nbytes} bytes, got {n}")
                return
        now = time.monotonic()
        with self._lock:
            inb.rec.start(now)
            for slot, n in zip(msg.slots, msg.nbytes, strict=True):
                if slot not in inb.filled:
                    inb.filled.add(slot)
                    inb.rec.bytes_done += n
            inb.rec.touch(now)

    def _on_data(self, identity: bytes, msg: m.Data, frames: Sequence[zmq.Frame]) -> None:
        try:
            inb = self._inbound(identity, msg.tid, msg.region_id, msg.attempt, msg.final)
            if inb is None:
                return
            if len(msg.slots) != len(msg.nbytes):
                self._reject(inb, msg.attempt, f"malformed data: {len(msg.slots)} slots, {len(msg.nbytes)} sizes")
                return
            if msg.inplace:
                self._on_inplace(inb, msg)
                return
            try:
                srcs = self._sources(msg.shm, frames)
            except (ValueError, OSError) as e:
                self._reject(inb, msg.attempt, f"unreadable payload: {e}")
                return
            if not (len(msg.slots) == len(msg.nbytes) == len(srcs)):
                self._reject(inb, msg.attempt, f"malformed data: {len(msg.slots)} slots, {len(msg.nbytes)} "
                                               f"sizes, {len(srcs)} buffers")
                return
            region = inb.region.slots
            for slot, n, src in zip(msg.slots, msg.nbytes, srcs, strict=True):
                if not 0 <= slot < len(region):
                    self._reject(inb, msg.attempt, f"slot {slot} out of range: region has {len(region)} slots")
                    return
                if src.nbytes != region[slot].nbytes or n != region[slot].nbytes:
                    self._reject(inb, msg.attempt, f"length mismatch in slot {slot}: receiver reserved "
                                                   f"{region[slot].nbytes} bytes, got {src.nbytes}")
                    return
            with self._lock:
                inb.rec.start()
            for slot, src in zip(msg.slots, srcs, strict=True):
                np.copyto(region[slot], src)
            del srcs
            now = time.monotonic()
            with self._lock:
                for slot, n in zip(msg.slots, msg.nbytes, strict=True):
                    if slot not in inb.filled:
                        inb.filled.add(slot)
                        inb.rec.bytes_done += n
                inb.rec.touch(now)
        finally:
            if msg.shm is not None and msg.consumed:
                self._reply(identity, m.Consumed(msg.tid, msg.seq))

    # --- one-sided read
    def _io_send_read_req(self, tid: str) -> None:
        rd = self._reads.get(tid)
        if rd is None or rd.rec.state.terminal:
            return
        try:
            self._to_peer(rd.address, m.ReadReq(tid, rd.region_id, rd.slots))
        except zmq.ZMQError as e:
            self._end_read(rd, f"send to {rd.address} failed: {e}")
            return
        with self._lock:
            rd.rec.start()

    def _end_read(self, rd: _Read, reason: str | None) -> None:
        with self._lock:
            if reason is None:
                rd.rec.start()
                rd.rec.advance(TransferState.DONE)
            else:
                rd.rec.fail(reason)
            rd.into = []

    def _on_read_req(self, identity: bytes, msg: m.ReadReq) -> None:
        with self._lock:
            region = self._regions.get(msg.region_id)
        if region is None:
            self._reply(identity, m.ReadResp(msg.tid, False, f"no region {msg.region_id!r} at {self._address}",
                                             []))
            return
        if any(not 0 <= s < len(region.slots) for s in msg.slots):
            self._reply(identity, m.ReadResp(msg.tid, False, f"slot out of range: region has "
                                                             f"{len(region.slots)} slots", []))
            return
        views = [region.slots[s] for s in msg.slots]
        nbytes = [v.nbytes for v in views]
        if self._stager is not None:
            seg, refs = self._stager.stage(views)
            old = self._read_staging.pop((identity, msg.tid), None)
            if old is not None:
                self._stager.release(old[0])
            self._read_staging[(identity, msg.tid)] = (seg, time.monotonic() + self.config.timeout_s)
            self._reply(identity, m.ReadResp(msg.tid, True, "", nbytes, shm=refs))
        else:
            self._reply(identity, m.ReadResp(msg.tid, True, "", nbytes), views)

    def _on_read_resp(self, address: str, msg: m.ReadResp, frames: Sequence[zmq.Frame]) -> None:
        rd = self._reads.get(msg.tid)
        try:
            if rd is None or rd.rec.state.terminal:
                return
            if not msg.ok:
                self._end_read(rd, f"region owner rejected: {msg.reason}")
                return
            try:
                srcs = self._sources(msg.shm, frames)
            except (ValueError, OSError) as e:
                self._end_read(rd, f"unreadable payload: {e}")
                return
            if len(srcs) != len(rd.into):
                self._end_read(rd, f"expected {len(rd.into)} buffers, got {len(srcs)}")
                return
            for i, (dst, src) in enumerate(zip(rd.into, srcs, strict=True)):
                if dst.nbytes != src.nbytes:
                    self._end_read(rd, f"length mismatch in buffer {i}: reader has {dst.nbytes} bytes, "
                                       f"region slot has {src.nbytes}")
                    return
            for dst, src in zip(rd.into, srcs, strict=True):
                np.copyto(dst, src)
            del srcs
            with self._lock:
                rd.rec.bytes_done = rd.rec.bytes_total
            self._end_read(rd, None)
        finally:
            if msg.shm is not None:
                try:
                    self._to_peer(address, m.Consumed(msg.tid, msg.seq))
                except zmq.ZMQError:
                    pass

    # --- housekeeping
    def _io_cancel(self, tid: str, reason: str) -> None:
        if (out := self._out.get(tid)) is not None:
            self._fail_out(out, reason, tell_peer=True)
        elif (inb := self._in.get(tid)) is not None:
            with self._lock:
                inb.rec.fail(reason)
                self._finish_in_locked(inb)
            if inb.identity is not None:
                self._reply(inb.identity, m.Ack(tid, inb.rec.attempt, False, f"receiver: {reason}"))
        elif (rd := self._reads.get(tid)) is not None:
            self._end_read(rd, reason)

    def _io_deregister(self, region_id: str) -> None:
        with self._lock:
            region = self._regions.get(region_id)
            if region is not None:
                self._drop_region_locked(region, ok=False)
            passive = [i for i in self._in.values() if i.region.region_id == region_id and not i.posted]
        for inb in passive:
            with self._lock:
                inb.rec.fail(f"region {region_id!r} deregistered")
                self._finish_in_locked(inb)

    def _io_sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [r.transfer_id for r in self._recs.values() if r.expired(now)]
        for tid in expired:
            rec = self._recs.get(tid)
            if rec is None:
                continue
            self._io_cancel(tid, f"timed out after {rec.timeout_s:g} s without progress "
                                 f"(state {rec.state.name})")
        if now >= self._next_maintenance:
            self._next_maintenance = now + MAINTENANCE_S
            if self._mapper is not None:
                self._mapper.prune_unlinked()
            if self._arena is not None:
                self._arena.counts()  # drains frees, ends quarantines, unlinks idle segments over keep_bytes
        if self._stager is not None and self._read_staging:
            for key, (seg, deadline) in list(self._read_staging.items()):
                if now > deadline:
                    del self._read_staging[key]
                    self._stager.release(seg)

    def _io_fail_all(self) -> None:
        with self._lock:
            live = [t for t, r in self._recs.items() if not r.state.terminal]
        for tid in live:
            self._io_cancel(tid, "transfer backend shut down")


def unique_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def _copy_fenced(fence: np.ndarray, d: m.DirectTarget, dsts: Sequence[np.ndarray], srcs: Sequence[np.ndarray],
                 closed: str) -> str | None:
    """Copy each source into its destination in pieces of at most PIECE_BYTES, checking before every piece that the
    region's fence word still holds `d.token` (else `closed` is returned). None: every byte copied."""
    for i, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
        if dst.nbytes != src.nbytes:
            return f"length mismatch in slot {i}: destination has {dst.nbytes} bytes, source {src.nbytes}"
        for a in range(0, src.nbytes, PIECE_BYTES):
            if fence[d.fence_index] != d.token:
                return closed
            np.copyto(dst[a:a + PIECE_BYTES], src[a:a + PIECE_BYTES])
    return None
