"""TCP backend, across hosts: control headers over ZeroMQ, payload bytes over raw TCP streams received in place.

Address: `tcp://HOST:PORT?data=DATA_PORT` -- the agent's zmq ROUTER (control: Data/Close/Ack/Abort/ReadReq headers)
and its data listener. A sender opens one data connection per receiver (`tetriinfer.transfer.tcp_stream`) and
writes each payload as one frame (tag, size, bytes) in header order; the receiver's reader thread for that
connection `recv_into`s the bytes straight into the posted buffer, so a payload is copied once, by the kernel,
as a plain socket does (ZeroMQ frames cost a second copy and an allocation per message). Header matching, held
Acks and Closes come from `SideChannelAgent`; one-sided reads stay on ZeroMQ frames (the runtime only pushes).

Invariants (beyond SideChannelAgent's):
- A reader writes into a caller's buffer only while that transfer is live, checked before every 4 MB piece with
  the connection's lock held; a receiver that becomes terminal with recvs in flight first waits for the piece in
  progress on any connection receiving its frames (a piece stuck for FENCE_WAIT_S on a stalled sender is cut off
  by shutting that connection down; other connections are never touched), so once a caller sees DONE/FAILED, or
  release() returned, its buffers are never written again.
- Every posted recv completes exactly once: its frame arrived, its sender's last connection ended, its header
  came but no frame started within `config.timeout_s`, or shutdown.
- Nothing read from a data socket is decoded beyond two integers; control headers are msgspec structs.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from collections.abc import Hashable
from typing import Any

from tetriinfer.net import bare_host, url_host
from tetriinfer.transfer.agent import ZmqAgent, _In
from tetriinfer.transfer.base import AgentConfig, Peer
from tetriinfer.transfer.messages import RemoteRegion
from tetriinfer.transfer.sidechannel import Done, Live, SideChannelAgent
from tetriinfer.transfer.tcp_stream import (
    Connection,
    DirectDest,
    Inboxes,
    Post,
    StreamError,
    StreamWriter,
    frame_header,
    read_hello,
    receive_frame,
    scratch_buffer,
    shut,
    tune,
)

_ADDRESS = re.compile(r"^tcp://(.+):(\d+)\?data=(\d+)$")
_IDENTITY_PREFIX = b"tikv-"
HELLO_TIMEOUT_S = 5.0
FENCE_WAIT_S = 2.0  # a terminal receiver waits this long for its piece in flight before cutting that connection


def parse_address(address: str) -> tuple[str, str, int]:
    """`tcp://HOST:PORT?data=DATA_PORT` -> (zmq endpoint, host, data port)."""
    match = _ADDRESS.match(address)
    if match is None:
        raise ValueError(f"not a tcp transfer address (tcp://HOST:PORT?data=DATA_PORT): {address!r}")
    host = match.group(1)
    return f"tcp://{url_host(host)}:{match.group(2)}", bare_host(host), int(match.group(3))


class TcpBackend(SideChannelAgent):
    """One endpoint of a TCP KV link (see the module docstring)."""

    kind = "tcp"

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, data_port: int = 0,
                 advertise_host: str | None = None, config: AgentConfig | None = None) -> None:
        for name, p in (("port", port), ("data_port", data_port)):
            if not 0 <= p < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {p}")
        if host in ("0.0.0.0", "*", "::", "") and not advertise_host:
            raise ValueError("binding all interfaces needs advertise_host (the address peers should dial)")
        self._identity = _IDENTITY_PREFIX + uuid.uuid4().hex.encode()
        self._inboxes = Inboxes()
        self._writers: dict[str, StreamWriter] = {}  # by destination address (I/O thread only)
        self._conns: set[Connection] = set()
        self._conns_lock = threading.Lock()
        bind_host = "0.0.0.0" if host == "*" else bare_host(host)
        self._listener = socket.create_server((bind_host, data_port), family=socket.AF_INET6 if ":" in bind_host
                                              else socket.AF_INET, backlog=64)
        try:
            super().__init__(f"tcp://{url_host(host)}:{port or '*'}", config=config, advertise=advertise_host)
        except BaseException:
            self._listener.close()
            raise
        self._address = f"{self._address}?data={self._listener.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept_loop, name="xfer-tcp-accept", daemon=True)
        self._acceptor.start()

    # ------------------------------------------------------------------ caller API additions
    def open(self, transfer_id: str, peer: Peer, *, timeout_s: float | None = None,
             attempt: int = 0, max_attempts: int = 1) -> None:
        parse_address(peer.address if isinstance(peer, RemoteRegion) else peer)
        super().open(transfer_id, peer, timeout_s=timeout_s, attempt=attempt, max_attempts=max_attempts)

    def read(self, transfer_id: str, remote_region: RemoteRegion, into_buffers: Any, *,
             slots: Any = None, timeout_s: float | None = None) -> None:
        parse_address(remote_region.address)
        super().read(transfer_id, remote_region, into_buffers, slots=slots, timeout_s=timeout_s)

    def shutdown(self) -> None:
        """Fail live transfers, stop the I/O thread, then close the data listener, connections and writers."""
        if not self._running:
            return
        super().shutdown()
        shut(self._listener)
        self._listener.close()
        self._inboxes.close()
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            shut(c.sock)
        for w in list(self._writers.values()):
            w.close()
        self._writers.clear()
        self._acceptor.join(timeout=5)

    # ------------------------------------------------------------------ SideChannelAgent hooks
    def _dealer_endpoint(self, address: str) -> str:
        return parse_address(address)[0]

    def _dealer_identity(self) -> bytes:
        return self._identity  # the same id our data streams say hello with

    def _peer_of_address(self, address: str) -> Hashable:
        parse_address(address)
        return address

    def _peer_of_identity(self, identity: bytes) -> Hashable | None:
        return identity if identity.startswith(_IDENTITY_PREFIX) else None

    def _finish(self, done: Done, err: str | None) -> None:
        if self._running:  # after shutdown the I/O thread (and its wake-up pipe) is gone
            self._submit(lambda: done(err))

    def _start(self, peer: Hashable, send: bool, buf: Any, tag: int, channel: str, done: Done) -> None:
        if send:
            address = str(peer)
            w = self._writers.get(address)
            if w is None:
                _, host, port = parse_address(address)
                w = self._writers[address] = StreamWriter(host, port, self._identity, self._finish,
                                                          self.config.timeout_s)
            w.post(tag, buf, done)
            return
        assert isinstance(buf, DirectDest) and isinstance(peer, bytes)
        self._inboxes.post(peer, tag, Post(buf, done, time.monotonic() + self.config.timeout_s))

    def _rx_buffer(self, n: int, dst: Any, live: Live, owner: str = "") -> DirectDest:
        return DirectDest(n, dst, live, owner)

    def _deliver(self, dst: Any, buf: Any) -> None:
        pass  # the reader received straight into `dst`

    def _finish_in_locked(self, inb: _In) -> None:
        super()._finish_in_locked(inb)
        tid = inb.rec.transfer_id
        if self._rx_pending.get(tid):  # a reader may be writing its buffers: wait out that piece
            with self._conns_lock:
                conns = [c for c in self._conns if c.owner == tid]
            for c in conns:
                c.fence(FENCE_WAIT_S)

    def _io_sweep(self) -> None:
        super()._io_sweep()
        for post in self._inboxes.expire(time.monotonic()):
            post.done("no payload arrived for its header (sender failed or gone)")

    # one-sided reads stay on ZeroMQ frames
    _on_read_req = ZmqAgent._on_read_req
    _on_read_resp = ZmqAgent._on_read_resp

    # ------------------------------------------------------------------ data connections (their own threads)
    def _accept_loop(self) -> None:
        while self._running:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="xfer-tcp-rx", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(HELLO_TIMEOUT_S)
            identity = read_hello(sock)
            sock.settimeout(None)
            tune(sock)
        except (OSError, StreamError):
            sock.close()
            return
        conn = Connection(sock)
        with self._conns_lock:
            self._conns.add(conn)
        box = self._inboxes.attach(identity)
        scratch = scratch_buffer()
        post: Post | None = None
        err = "connection closed"
        try:
            while self._running:
                tag, nbytes = frame_header(conn)
                post = self._inboxes.take(box, tag, self.config.timeout_s)
                if post is None:
                    err = f"no header for payload tag {tag} within {self.config.timeout_s:g} s"
                    break
                receive_frame(conn, post, nbytes, scratch)
                p, post = post, None
                self._finish(p.done, None if p.dest.nbytes == nbytes else
                             f"payload size {nbytes} does not match its header's {p.dest.nbytes}")
        except (OSError, StreamError) as e:
            err = f"{type(e).__name__}: {e}"
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            sock.close()
            failed = ([post] if post is not None else []) + self._inboxes.detach(identity)
            for p in failed:
                self._finish(p.done, err)

