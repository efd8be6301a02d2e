"""torch.distributed backend: the ZmqAgent control plane, payload bytes over point-to-point send/recv.

Each backend is one rank of a private process group (gloo: CPU tensors; NCCL: CUDA tensors) built on a TCPStore
at `init_method` (rank 0 hosts it). Building it is collective: every rank constructs its backend at once.
Address: `torchdist://RANK@HOST:PORT` (the rank, then the zmq control endpoint).

All but the payload is the SideChannelAgent's (header matching, held Acks and Closes) and the ZmqAgent's.

Invariants (beyond those of `tetriinfer.transfer.sidechannel`):
- gloo matches on (source, tag). NCCL ignores tags and matches in posting order per communicator, so each
  (channel, direction) has its own group -- channel push: Data over the sender's DEALER; read: ReadResp over the
  owner's ROUTER; direction: to a higher or a lower rank. One communicator then carries one FIFO zmq channel,
  posted in header order on both sides (sender: header, then send; receiver: recv as the header arrives), and the
  two directions never queue behind each other (no send/send deadlock).
- Receivers recv into backend-owned staging, copied into the caller's buffers on the I/O thread only while the
  transfer is live: nothing is written into a caller's buffer once its transfer is terminal.
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import zmq

from tetriinfer.transfer.base import AgentConfig, Peer, TransferStats
from tetriinfer.transfer.buffers import Buffer, as_byte_view
from tetriinfer.transfer.messages import RemoteRegion
from tetriinfer.transfer.sidechannel import PUSH, READ, Done, SideChannelAgent

log = logging.getLogger(__name__)

NCCL_POLL_S = 0.0002
_ADDRESS = re.compile(r"^torchdist://(\d+)@(.+):(\d+)$")



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


class TorchDistBackend(SideChannelAgent):
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
        return dataclasses.replace(s, pooled_segments=sum(len(v) for v in list(self._free.values())))

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
    def _dealer_endpoint(self, address: str) -> str:
        return parse_address(address)[1]

    def _dealer_identity(self) -> bytes:
        return f"{self.rank}:{uuid.uuid4().hex}".encode()  # tells peers our rank

    def _peer_of_address(self, address: str) -> int:
        return parse_address(address)[0]

    def _peer_of_identity(self, identity: bytes) -> int | None:
        head = identity.split(b":", 1)[0]
        if not head.isdigit():
            return None
        rank = int(head)
        return rank if 0 <= rank < self.options.world_size and rank != self.rank else None

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

    def _rx_buffer(self, n: int, dst: Any, live: Any, owner: str = "") -> torch.Tensor:
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

    def _before_sends(self) -> None:
        while self._ready:  # the sends below read only what the caller's stream finished writing
            torch.cuda.current_stream(self.device).wait_event(self._ready.popleft())
