"""torch.distributed backend: the ZmqAgent control plane, payload bytes over point-to-point send/recv.

Each backend is one rank of a private process group (gloo: CPU tensors; NCCL: CUDA tensors) built on a TCPStore
at `init_method` (rank 0 hosts it). Building it is collective: every rank constructs its backend at once.
Address: `torchdist://RANK@HOST:PORT` (the rank, then the zmq control endpoint).

All but the payload is the ZmqAgent's (regions, slots, Close/Ack/Abort, attempts, timeouts, release). A Data or
ReadResp header lists payload sizes and, in `seq`, the tag of its first payload: payload i moves as one
send/recv with tag seq + i (mod TAG_SPACE), tags counted per destination rank.

Invariants:
- Matching: for every payload header it gets, a peer posts one recv per listed payload, wanted or not (stale,
  rejected, unknown region: into scratch, then dropped), so every send is matched. gloo matches on (source,
  tag). NCCL ignores tags and matches in posting order per communicator, so each (channel, direction) has its
  own group -- channel push: Data over the sender's DEALER; read: ReadResp over the owner's ROUTER; direction:
  to a higher or a lower rank. One communicator then carries one FIFO zmq channel, posted in header order on
  both sides (sender: header, then send; receiver: recv as the header arrives), and the two directions never
  queue behind each other (no send/send deadlock).
- Receivers recv into backend-owned staging, copied into the caller's buffers on the I/O thread only while the
  transfer is live: nothing is written into a caller's buffer once its transfer is terminal.
- Held until a transfer's in-flight recvs complete: a receiver's Close judgement, its Acks (either way, "no
  region" included) and its rejection of a header; a reader's failure. A sender judges an Ack once its own
  sends completed (DONE lets the caller reuse its buffers). So a sender, reader or rejecting receiver is
  terminal with no op of its own in flight; only timeouts, cancels and shutdown end a transfer earlier. stats():
  in-flight sends count in `pinned_payloads`, in-flight recvs in `staging_segments`; they drain even after a
  failure (the peer always posts the match).
- Waits: a gloo work reports completion only through wait(), and a timed-out wait closes the pair, so a waiter
  thread per peer rank wait()s its works in posting order (up to `pg_timeout_s`; an error or a dead peer fails
  the transfer). NCCL works are polled with is_completed(). poll() never blocks. Completions from one peer are
  thus handled in header order: a slot written twice ends with the later append.
- NCCL (never run here: the development machine has no CUDA): pair communicators are made at construction (made
  lazily, a first send would block the I/O thread on a peer possibly blocked the same way); before a send the
  I/O thread's stream waits for events recorded on the caller's stream at append(); received bytes are copied
  and synchronized before DONE; register()ed memory must be ready whenever peers may read it. A dead NCCL peer
  is left to NCCL's watchdog.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import re
import socket
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import zmq

from tetriinfer.transfer import messages as m
from tetriinfer.transfer.agent import ZmqAgent, _In, _Out, _Read
from tetriinfer.transfer.base import AgentConfig, Peer, TransferStats
from tetriinfer.transfer.buffers import Buffer, as_byte_view
from tetriinfer.transfer.messages import RemoteRegion

log = logging.getLogger(__name__)

TAG_SPACE = (1 << 31) - 1  # gloo tags are non-negative int32
PUSH, READ = "push", "read"
NCCL_POLL_S = 0.0002
_ADDRESS = re.compile(r"^torchdist://(\d+)@(.+):(\d+)$")

Done = Callable[[str | None], None]  # completion callback, run on the I/O thread with an error or None


@dataclass(frozen=True)
class TorchDistOptions:
    """Where this rank sits. `backend`: gloo (CPU tensors), nccl (CUDA tensors) or auto (nccl when `device` is
    CUDA, or when it is unset and CUDA and NCCL are available). `host` is this rank's interface (zmq control port
    `port`, 0 = any free one; gloo sockets; the TCPStore on rank 0). `pg_timeout_s` bounds the collective
    construction and any single send/recv (gloo closes the link to that peer when it expires).
    `staging_keep_bytes` caps the idle CPU receive staging kept for reuse (fresh memory costs page faults)."""

    rank: int
    world_size: int
    init_method: str
    backend: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    device: str | None = None
    pg_timeout_s: float = 300.0
    staging_keep_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        store_host, store_port = self.store_address
        if not store_host or not 0 < store_port < 65536:
            raise ValueError(f"init_method needs a host and a port in [1, 65535], got {self.init_method!r}")
        if self.host in ("", "0.0.0.0", "*", "::"):
            raise ValueError("host must be the concrete address peers dial, not a wildcard")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.pg_timeout_s > 0:
            raise ValueError(f"pg_timeout_s must be > 0, got {self.pg_timeout_s}")
        if self.staging_keep_bytes < 0:
            raise ValueError(f"staging_keep_bytes must be >= 0, got {self.staging_keep_bytes}")

    @property
    def store_address(self) -> tuple[str, int]:
        match = re.fullmatch(r"tcp://(.+):(\d+)", self.init_method)
        if match is None:
            raise ValueError(f"init_method must look like tcp://HOST:PORT, got {self.init_method!r}")
        return match.group(1), int(match.group(2))

    def resolve(self) -> tuple[str, torch.device]:
        """(backend, device) after resolving 'auto' and the default device."""
        dev = torch.device(self.device) if self.device else None
        backend = self.backend
        if backend == "auto":
            cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
            backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
        if backend == "gloo":
            if dev is not None and dev.type != "cpu":
                raise ValueError(f"gloo moves CPU tensors; device {dev} needs backend='nccl'")
            return backend, torch.device("cpu")
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError("backend='nccl' needs CUDA and a torch build with NCCL")
        if dev is None:
            dev = torch.device("cuda", self.rank % torch.cuda.device_count())
        if dev.type != "cuda":
            raise ValueError(f"nccl moves CUDA tensors, got device {dev}")
        return backend, dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def parse_address(address: str) -> tuple[int, str]:
    """`torchdist://RANK@HOST:PORT` -> (rank, zmq endpoint)."""
    match = _ADDRESS.match(address)
    if match is None:
        raise ValueError(f"not a torchdist address (torchdist://RANK@HOST:PORT): {address!r}")
    return int(match.group(1)), f"tcp://{match.group(2)}:{match.group(3)}"


def _store(opts: TorchDistOptions, timeout: datetime.timedelta) -> dist.TCPStore:
    host, port = opts.store_address
    if opts.rank != 0:
        return dist.TCPStore(host, port, opts.world_size, False, timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:  # bind the store to `host` only (TCPStore alone listens on every interface)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, opts.world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def _groups(opts: TorchDistOptions, backend: str, store: dist.Store,
            timeout: datetime.timedelta) -> dict[tuple[str, bool], Any]:
    """gloo: one group for everything (tags match). nccl: one group per (channel, lower -> higher rank)."""
    if backend == "gloo":
        o = dist.ProcessGroupGloo._Options()
        o._devices = [dist.ProcessGroupGloo.create_device(hostname=opts.host)]
        o._timeout = timeout
        pg = dist.ProcessGroupGloo(dist.PrefixStore("tetri/gloo", store), opts.rank, opts.world_size, o)
        return {(c, up): pg for c in (PUSH, READ) for up in (True, False)}
    groups = {}
    for c in (PUSH, READ):
        for up in (True, False):
            o = dist.ProcessGroupNCCL.Options()
            o.is_high_priority_stream = False
            o._timeout = timeout
            o.group_name = f"tetri-{c}-{'up' if up else 'down'}"
            groups[(c, up)] = dist.ProcessGroupNCCL(dist.PrefixStore(f"tetri/nccl/{o.group_name}", store),
                                                    opts.rank, opts.world_size, o)
    return groups


def _warm_up_nccl(opts: TorchDistOptions, groups: dict[tuple[str, bool], Any], dev: torch.device) -> None:
    """Create every pair communicator now, visiting pairs in one global order on every rank (no cycle)."""
    one = torch.zeros(1, dtype=torch.uint8, device=dev)
    for (_, up), pg in groups.items():
        for i in range(opts.world_size):
            for j in range(i + 1, opts.world_size):
                src, dst = (i, j) if up else (j, i)
                if opts.rank == src:
                    pg.send([one], dst, 0).wait()
                elif opts.rank == dst:
                    pg.recv([one], src, 0).wait()
    torch.cuda.synchronize(dev)


@dataclass
class _ReadRecv:
    rd: _Read | None  # None: draining a response nobody waits for
    remaining: int  # payloads not yet received
    reason: str = ""  # why the read fails once they are


class TorchDistBackend(ZmqAgent):
    """One rank of a torch.distributed KV link (see the module docstring). Construct every rank concurrently."""

    kind = "torchdist"

    def __init__(self, *, rank: int, world_size: int, init_method: str, backend: str = "auto",
                 host: str = "127.0.0.1", port: int = 0, device: str | None = None,
                 pg_timeout_s: float = 300.0, staging_keep_bytes: int = 512 << 20,
                 config: AgentConfig | None = None) -> None:
        self.options = TorchDistOptions(rank, world_size, init_method, backend, host, port, device,
                                        pg_timeout_s, staging_keep_bytes)
        self.backend, self.device = self.options.resolve()
        self.rank = rank
        self._cuda = self.device.type == "cuda"
        # state below is touched by the I/O thread only (the counters are read by stats())
        self._tags = [0] * world_size  # next tag per destination rank
        self._tx_pending: dict[str, int] = {}  # sender tid -> sends in flight
        self._tx_acks: dict[str, list[tuple[str, list[zmq.Frame]]]] = {}  # Acks held until those complete
        self._rx_pending: dict[str, int] = {}  # receiver tid -> recvs in flight
        self._rx_close: dict[str, tuple[bytes, str, str, int, bool]] = {}  # Closes held until those complete
        self._rx_acks: dict[str, list[tuple[bytes, m.Ack]]] = {}  # our Acks (either way) held likewise
        self._rx_reject: dict[str, tuple[_In, int, str]] = {}  # rejections of headers, held likewise
        self._n_tx = 0
        self._n_rx = 0
        self._free: dict[int, list[torch.Tensor]] = {}  # idle CPU staging by size (CUDA: the caching allocator)
        self._free_bytes = 0
        self._ready: deque[Any] = deque()  # CUDA events recorded at append(), waited for before sends
        self._waiters: dict[int, queue.SimpleQueue[tuple[Any, Done] | None]] = {}
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        self._store = _store(self.options, timeout)
        self._groups = _groups(self.options, self.backend, self._store, timeout)
        if self._cuda:
            torch.cuda.set_device(self.device)
            _warm_up_nccl(self.options, self._groups, self.device)
        super().__init__(f"tcp://{host}:{port or '*'}", config=config)
        self._address = f"torchdist://{rank}@{host}:{self._address.rsplit(':', 1)[1]}"
        # a reply to a reader that is gone must fail loudly: its payload would never be received
        self._call_io(lambda: self._router.setsockopt(zmq.ROUTER_MANDATORY, 1))
        if self._cuda:
            self._call_io(lambda: torch.cuda.set_device(self.device))

    # ------------------------------------------------------------------ buffers
    def _byte_views(self, bufs: Sequence[Buffer], *, writable: bool = False) -> list[torch.Tensor]:
        """Flat uint8 tensors on this rank's device, sharing memory with `bufs` (never a copy)."""
        if isinstance(bufs, np.ndarray | torch.Tensor):
            raise ValueError("pass a list of buffers, not a single array")
        views = []
        for b in bufs:
            if isinstance(b, torch.Tensor):
                if b.device != self.device:
                    raise ValueError(f"this {self.backend} link moves tensors on {self.device}, got {b.device}")
                if not b.is_contiguous():
                    raise ValueError("tensor must be contiguous (pass the KV block view, not a strided slice)")
                views.append(b.detach().reshape(-1).view(torch.uint8))
                continue
            if self._cuda:
                raise ValueError(f"the nccl link moves CUDA tensors on {self.device}, got {type(b).__name__}")
            arr = as_byte_view(b, writable=writable)
            with warnings.catch_warnings():  # read-only sources are only read
                warnings.simplefilter("ignore", UserWarning)
                views.append(torch.from_numpy(arr))
        if self._cuda and not writable and views:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._ready.append(ev)
        return views

    def alloc(self, shape: Sequence[int], dtype: Any) -> Buffer:
        """A plain buffer on this rank's device (torch dtype -> tensor; numpy dtype -> array on CPU)."""
        self._check_running()
        if not self._cuda:
            return super().alloc(shape, dtype)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype
        return torch.empty(tuple(int(s) for s in shape), dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ caller API additions
    def _peer_rank(self, address: str) -> int:
        rank = parse_address(address)[0]
        if not 0 <= rank < self.options.world_size or rank == self.rank:
            raise ValueError(f"peer rank {rank} is not another rank of this world of {self.options.world_size}")
        return rank

    def open(self, transfer_id: str, peer: Peer, *, timeout_s: float | None = None,
             attempt: int = 0, max_attempts: int = 1) -> None:
        self._peer_rank(peer.address if isinstance(peer, RemoteRegion) else peer)
        super().open(transfer_id, peer, timeout_s=timeout_s, attempt=attempt, max_attempts=max_attempts)

    def read(self, transfer_id: str, remote_region: RemoteRegion, into_buffers: Sequence[Buffer], *,
             slots: Sequence[int] | None = None, timeout_s: float | None = None) -> None:
        self._peer_rank(remote_region.address)
        super().read(transfer_id, remote_region, into_buffers, slots=slots, timeout_s=timeout_s)

    def stats(self) -> TransferStats:
        s = super().stats()
        return dataclasses.replace(s, pinned_payloads=s.pinned_payloads + self._n_tx,
                                   staging_segments=s.staging_segments + self._n_rx,
                                   pooled_segments=sum(len(v) for v in list(self._free.values())))

    def shutdown(self) -> None:
        """Fail live transfers, stop the I/O and waiter threads, drop the process groups. Idempotent."""
        if not self._running:
            return
        super().shutdown()
        for q in self._waiters.values():
            q.put(None)
        self._groups = {}
        self._store = None
        self._free.clear()

    # ------------------------------------------------------------------ links (I/O thread)
    def _dealer(self, address: str) -> zmq.Socket:
        d = self._dealers.get(address)
        if d is None:
            endpoint = parse_address(address)[1]
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.SNDHWM, 0)
            d.setsockopt(zmq.RCVHWM, 0)
            d.setsockopt(zmq.ROUTING_ID, f"{self.rank}:{uuid.uuid4().hex}".encode())  # tells peers our rank
            d.connect(endpoint)
            self._poller.register(d, zmq.POLLIN)
            self._dealers[address] = d
        return d

    def _identity_rank(self, identity: bytes) -> int | None:
        head = identity.split(b":", 1)[0]
        if not head.isdigit():
            return None
        rank = int(head)
        return rank if 0 <= rank < self.options.world_size and rank != self.rank else None

    def _take_tags(self, dst: int, n: int) -> int:
        tag = self._tags[dst]
        self._tags[dst] = (tag + n) % TAG_SPACE
        return tag

    def _start(self, peer: int, send: bool, tensor: torch.Tensor, tag: int, channel: str, done: Done) -> None:
        """Post one send/recv; `done` runs on the I/O thread once it completed (empty payloads move nothing)."""
        if tensor.numel() == 0:
            self._submit(lambda: done(None))
            return
        pg = self._groups[(channel, self.rank < peer if send else peer < self.rank)]
        try:
            work = pg.send([tensor], peer, tag) if send else pg.recv([tensor], peer, tag)
        except RuntimeError as e:
            reason = f"{type(e).__name__}: {e}"
            self._submit(lambda: done(reason))
            return
        q = self._waiters.get(peer)
        if q is None:
            q = self._waiters[peer] = queue.SimpleQueue()
            threading.Thread(target=self._wait_loop, args=(q,), name=f"xfer-wait-r{peer}", daemon=True).start()
        q.put((work, done))

    def _wait_loop(self, q: queue.SimpleQueue[tuple[Any, Done] | None]) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        while (item := q.get()) is not None:
            work, done = item
            err = None
            try:
                if self._cuda:
                    while not work.is_completed():
                        if not self._running:
                            raise RuntimeError("transfer backend shut down")
                        time.sleep(NCCL_POLL_S)
                work.wait()  # gloo: blocks until done; nccl: done already, raises its error if any
            except Exception as e:  # noqa: BLE001 - any failure of the op fails its transfer
                err = f"{type(e).__name__}: {e}"
            if self._running:  # after shutdown the I/O thread (and its wake-up pipe) is gone
                self._submit(lambda d=done, e=err: d(e))
            del work, done, item

    def _staging(self, n: int) -> torch.Tensor:
        free = self._free.get(n)
        if free:
            self._free_bytes -= n
            return free.pop()
        return torch.empty(n, dtype=torch.uint8, device=self.device)

    def _recycle(self, staging: torch.Tensor, err: str | None) -> None:
        """Keep a received-into staging tensor for reuse (never one whose recv failed: it may be mid-write)."""
        n = staging.nbytes
        if err is None and not self._cuda and 0 < n and self._free_bytes + n <= self.options.staging_keep_bytes:
            self._free.setdefault(n, []).append(staging)
            self._free_bytes += n

    def _deliver(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.inference_mode():  # the caller's buffers may be inference tensors (KV caches often are)
            dst.copy_(src)
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    # --- sender (push channel)
    def _emit(self, out: _Out, seq: int, slots: list[int], views: list[Any], frames: Sequence[Any], *,
              shm: list[m.ShmRef] | None = None, consumed: bool = True, inplace: bool = False,
              last: bool) -> bool:
        """One Data header (`seq` = first payload tag; the Close folded in when last), then a send per payload.
        False: failed."""
        tid = out.rec.transfer_id
        dst = parse_address(out.address)[0]
        tag = self._take_tags(dst, len(views))
        nbytes = [v.nbytes for v in views]
        close_nslots = self._count_sent(out, sum(nbytes), last)
        msg = m.Data(tid, out.region_id, out.rec.attempt, out.final, tag, slots, nbytes,
                     close_nslots=close_nslots)
        try:
            self._to_peer(out.address, msg)
        except zmq.ZMQError as e:
            self._fail_out(out, f"send to {out.address} failed: {e}", tell_peer=False)
            return False
        while self._ready:  # the sends below read only what the caller's stream finished writing
            torch.cuda.current_stream(self.device).wait_event(self._ready.popleft())
        for i, v in enumerate(views):
            self._n_tx += 1
            self._tx_pending[tid] = self._tx_pending.get(tid, 0) + 1
            self._start(dst, True, v, (tag + i) % TAG_SPACE, PUSH, lambda err: self._sent(tid, out, dst, err))
        return True

    def _sent(self, tid: str, out: _Out, dst: int, err: str | None) -> None:
        self._n_tx -= 1
        left = self._tx_pending[tid] - 1
        if left:
            self._tx_pending[tid] = left
        else:
            del self._tx_pending[tid]
        if err is not None and self._out.get(tid) is out:
            self._fail_out(out, f"send to rank {dst} failed: {err}", tell_peer=True)
        if not left:
            for address, parts in self._tx_acks.pop(tid, []):
                super()._on_dealer(address, parts)

    def _on_dealer(self, address: str, parts: list[zmq.Frame]) -> None:
        msg = m.decode(parts[0].buffer)
        if isinstance(msg, m.Ack) and self._tx_pending.get(msg.tid):
            self._tx_acks.setdefault(msg.tid, []).append((address, parts))  # judged once our sends completed
            return
        super()._on_dealer(address, parts)

    # --- receiver (push channel)
    def _on_data(self, identity: bytes, msg: m.Data, frames: Sequence[zmq.Frame]) -> None:
        src = self._identity_rank(identity)
        if src is None or any(n < 0 for n in msg.nbytes):
            self._reply(identity, m.Ack(msg.tid, msg.attempt, False, "not a torchdist peer of this world"))
            return
        tid = msg.tid
        if msg.nbytes:  # counted first: Acks for `tid` wait for these recvs (see _reply), "no region" included
            self._rx_pending[tid] = self._rx_pending.get(tid, 0) + len(msg.nbytes)
        inb = self._inbound(identity, tid, msg.region_id, msg.attempt, msg.final)
        reason = self._check_data(inb, msg) if inb is not None else ""
        if reason and msg.nbytes:
            self._rx_reject.setdefault(tid, (inb, msg.attempt, reason))  # judged once the payloads are drained
        elif reason:
            self._reject(inb, msg.attempt, reason)  # type: ignore[arg-type]
        elif inb is not None:
            with self._lock:
                inb.rec.start()
                inb.rec.touch(time.monotonic())
        target = None if reason else inb
        for i, n in enumerate(msg.nbytes):  # every payload is received, wanted or not (see the invariants)
            slot = msg.slots[i] if target is not None else -1
            staging = self._staging(n)
            self._n_rx += 1
            self._start(src, False, staging, (msg.seq + i) % TAG_SPACE, PUSH,
                        lambda err, s=slot, t=staging: self._received(tid, target, msg.attempt, s, t, src, err))

    @staticmethod
    def _check_data(inb: _In, msg: m.Data) -> str:
        if msg.shm is not None or msg.inplace:
            return "torchdist carries payloads over torch.distributed, not shared memory"
        if len(msg.slots) != len(msg.nbytes):
            return f"malformed data: {len(msg.slots)} slots, {len(msg.nbytes)} sizes"
        region = inb.region.slots
        for slot, n in zip(msg.slots, msg.nbytes, strict=True):
            if not 0 <= slot < len(region):
                return f"slot {slot} out of range: region has {len(region)} slots"
            if n != region[slot].nbytes:
                return f"length mismatch in slot {slot}: receiver reserved {region[slot].nbytes} bytes, got {n}"
        return ""

    def _live_in(self, inb: _In | None, attempt: int) -> bool:
        return (inb is not None and self._in.get(inb.rec.transfer_id) is inb and not inb.rec.state.terminal
                and attempt == inb.rec.attempt and attempt != inb.rejected_attempt)

    def _received(self, tid: str, inb: _In | None, attempt: int, slot: int, staging: torch.Tensor, src: int,
                  err: str | None) -> None:
        self._n_rx -= 1
        left = self._rx_pending[tid] - 1
        if left:
            self._rx_pending[tid] = left
        else:
            del self._rx_pending[tid]
        if self._live_in(inb, attempt):
            assert inb is not None
            if err is not None:
                self._reject(inb, attempt, f"recv from rank {src} failed: {err}")
            else:
                self._deliver(inb.region.slots[slot], staging)
                with self._lock:
                    if slot not in inb.filled:
                        inb.filled.add(slot)
                        inb.rec.bytes_done += staging.nbytes
                    inb.rec.touch(time.monotonic())
        self._recycle(staging, err)
        if left:
            return
        held = self._rx_reject.pop(tid, None)  # then, in arrival order: rejection, held Acks, Close
        if held is not None and self._live_in(held[0], held[1]):
            self._reject(*held)  # type: ignore[arg-type]
        for identity, ack in self._rx_acks.pop(tid, []):
            super()._reply(identity, ack)
        if tid in self._rx_close:
            super()._on_close(*self._rx_close.pop(tid))

    def _reply(self, identity: bytes, msg: m.Message, frames: Sequence[Any] = ()) -> None:
        if isinstance(msg, m.Ack) and self._rx_pending.get(msg.tid):
            self._rx_acks.setdefault(msg.tid, []).append((identity, msg))  # sent once its recvs are drained
            return
        super()._reply(identity, msg, frames)

    def _on_close(self, identity: bytes, tid: str, region_id: str, attempt: int, final: bool) -> None:
        if self._rx_pending.get(tid):
            self._rx_close[tid] = (identity, tid, region_id, attempt, final)  # judged once the data is in
            return
        super()._on_close(identity, tid, region_id, attempt, final)

    # --- one-sided read (read channel): the owner sends region slots, the reader receives them
    def _on_read_req(self, identity: bytes, msg: m.ReadReq) -> None:
        reader = self._identity_rank(identity)
        with self._lock:
            region = self._regions.get(msg.region_id)
        reason = ""
        if reader is None:
            reason = "not a torchdist peer of this world"
        elif region is None:
            reason = f"no region {msg.region_id!r} at {self._address}"
        elif any(not 0 <= s < len(region.slots) for s in msg.slots):
            reason = f"slot out of range: region has {len(region.slots)} slots"
        if reason or region is None or reader is None:
            self._reply(identity, m.ReadResp(msg.tid, False, reason, []))
            return
        views = [region.slots[s] for s in msg.slots]
        tag = self._take_tags(reader, len(views))
        resp = m.ReadResp(msg.tid, True, "", [v.nbytes for v in views], seq=tag)
        try:
            self._router.send_multipart([identity, m.encode(resp)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # reader gone: send nothing it would never receive
        for i, v in enumerate(views):
            self._n_tx += 1
            self._start(reader, True, v, (tag + i) % TAG_SPACE, READ, self._served)

    def _served(self, err: str | None) -> None:
        self._n_tx -= 1
        if err is not None:
            log.warning("serving a read failed: %s", err)

    def _on_read_resp(self, address: str, msg: m.ReadResp, frames: Sequence[zmq.Frame]) -> None:
        rd = self._reads.get(msg.tid)
        if rd is not None and rd.rec.state.terminal:
            rd = None
        if not msg.ok:
            if rd is not None:
                self._end_read(rd, f"region owner rejected: {msg.reason}")
            return
        reason = ""
        if rd is not None and len(msg.nbytes) != len(rd.into):
            reason = f"expected {len(rd.into)} buffers, got {len(msg.nbytes)}"
        elif rd is not None:
            bad = [i for i, (d, n) in enumerate(zip(rd.into, msg.nbytes, strict=True)) if d.nbytes != n]
            if bad:
                reason = (f"length mismatch in buffer {bad[0]}: reader has {rd.into[bad[0]].nbytes} bytes, "
                          f"region slot has {msg.nbytes[bad[0]]}")
        if rd is not None and not msg.nbytes:
            self._end_read(rd, reason or None)
            return
        if rd is not None:
            with self._lock:
                rd.rec.start()
                rd.rec.touch(time.monotonic())
        src = parse_address(address)[0]
        state = _ReadRecv(rd, len(msg.nbytes), reason)
        for i, n in enumerate(msg.nbytes):
            staging = self._staging(n)
            self._n_rx += 1
            self._start(src, False, staging, (msg.seq + i) % TAG_SPACE, READ,
                        lambda err, i=i, t=staging: self._read_piece(state, i, t, src, err))

    def _read_piece(self, state: _ReadRecv, i: int, staging: torch.Tensor, src: int, err: str | None) -> None:
        """One read payload arrived: copy it in while the read is live and sound; the read ends (DONE, or FAILED
        with the first problem) once every payload of the response is in."""
        self._n_rx -= 1
        state.remaining -= 1
        if err is not None and not state.reason:
            state.reason = f"recv from rank {src} failed: {err}"
        rd = state.rd
        live = rd is not None and self._reads.get(rd.rec.transfer_id) is rd and not rd.rec.state.terminal
        if live and not state.reason:
            assert rd is not None
            self._deliver(rd.into[i], staging)
            with self._lock:
                rd.rec.touch(time.monotonic())
        self._recycle(staging, err)
        if live and state.remaining == 0:
            assert rd is not None
            if not state.reason:
                with self._lock:
                    rd.rec.bytes_done = rd.rec.bytes_total
            self._end_read(rd, state.reason or None)
