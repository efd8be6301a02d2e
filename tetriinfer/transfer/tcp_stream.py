"""Raw TCP data streams of the tcp backend: the wire format, the writer (one per destination) and the inbox that
matches incoming payload frames to the recvs the I/O thread posted.

Wire format of one connection (client = sender -> server = receiver), network byte order:
  HELLO  = b"TIKV" + u16 length + identity (the sender agent's zmq routing id), once per connection
  FRAME  = u64 tag + u64 nbytes, followed by exactly nbytes of payload; repeated
Frames are headers of fixed size and raw bytes: nothing is decoded beyond two integers, never unpickled.

Invariants:
- A writer sends frames in posting order, one connection at a time; a failed connection fails the frame being
  sent and every frame queued behind it, and the next post opens a new connection.
- Each posted recv is taken by exactly one party (a connection's reader, the expiry sweep, or the failure of the
  sender's last connection) and its completion callback runs exactly once.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"TIKV"
HELLO = struct.Struct("!4sH")
FRAME = struct.Struct("!QQ")
MAX_IDENTITY = 256
PIECE_BYTES = 4 << 20  # a receiver checks that its transfer is still live before every piece of this size

Finish = Callable[[Callable[[str | None], None], str | None], None]  # hands a completion to the I/O thread


class StreamError(Exception):
    """The peer broke the stream protocol or closed the connection."""


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock` (raises StreamError on EOF)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise StreamError("connection closed by peer")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def shut(sock: socket.socket) -> None:
    """Shut both directions down, waking any thread blocked on `sock` (already gone is fine)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class StreamWriter:
    """Sends payload frames to one peer's data port from its own thread, in posting order."""

    def __init__(self, host: str, port: int, identity: bytes, finish: Finish, connect_timeout_s: float) -> None:
        self._host, self._port, self._identity = host, port, identity
        self._finish = finish
        self._connect_timeout_s = connect_timeout_s
        self._queue: queue.SimpleQueue[tuple[int, np.ndarray, Callable[[str | None], None]] | None] = \
            queue.SimpleQueue()
        self._sock: socket.socket | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"xfer-tx-{host}:{port}", daemon=True)
        self._thread.start()

    def post(self, tag: int, view: np.ndarray, done: Callable[[str | None], None]) -> None:
        self._queue.put((tag, view, done))

    def close(self) -> None:
        """Stop after the frame being sent (queued frames fail); wakes a blocked send."""
        self._closed = True
        self._queue.put(None)
        sock = self._sock
        if sock is not None:
            shut(sock)
        self._thread.join(timeout=5)

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self._host, self._port), timeout=self._connect_timeout_s)
        try:
            tune(sock)
            sock.settimeout(None)
            sock.sendall(HELLO.pack(MAGIC, len(self._identity)) + self._identity)
        except OSError:
            sock.close()
            raise
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            tag, view, done = item
            err = None
            try:
                if self._closed:
                    raise StreamError("transfer backend shut down")
                if self._sock is None:
                    self._sock = self._connect()
                self._sock.sendall(FRAME.pack(tag, view.nbytes))
                if view.nbytes:
                    self._sock.sendall(view)
            except (OSError, StreamError) as e:
                err = f"{type(e).__name__}: {e}"
            del view, item
            if err is None:
                self._finish(done, None)
                continue
            self._drop()  # the stream is out of sync: this frame and every one queued now fail
            failed = [done]
            while True:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                failed.append(nxt[2])
            for d in failed:
                self._finish(d, err)
        self._drop()


@dataclass
class DirectDest:
    """Where a posted recv of `nbytes` lands: the caller's buffer `dst` (None: drop the bytes) while `live()`
    holds. `owner`: the receiving transfer's id ("" when none)."""

    nbytes: int
    dst: np.ndarray | None
    live: Callable[[], bool]
    owner: str = ""


@dataclass
class Post:
    dest: DirectDest
    done: Callable[[str | None], None]
    deadline: float


@dataclass
class Inbox:
    """Recvs posted for one sender identity, by tag; `conns` = its live connections."""

    posted: dict[int, Post] = field(default_factory=dict)
    conns: int = 0


class Inboxes:
    """Every sender's inbox under one condition variable (readers wait on it for posts)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._by_identity: dict[bytes, Inbox] = {}
        self.closed = False

    def post(self, identity: bytes, tag: int, post: Post) -> None:
        with self.cond:
            box = self._by_identity.setdefault(identity, Inbox())
            box.posted[tag] = post
            self.cond.notify_all()

    def attach(self, identity: bytes) -> Inbox:
        with self.cond:
            box = self._by_identity.setdefault(identity, Inbox())
            box.conns += 1
            return box

    def detach(self, identity: bytes) -> list[Post]:
        """A connection ended; when it was the sender's last, every post still waiting fails (returned)."""
        with self.cond:
            box = self._by_identity.get(identity)
            if box is None:
                return []
            box.conns -= 1
            if box.conns > 0:
                return []
            posts = list(box.posted.values())
            del self._by_identity[identity]
            return posts

    def take(self, box: Inbox, tag: int, wait_s: float) -> Post | None:
        """The post for `tag`, waiting up to `wait_s` for its header (None: it never came, or shut down)."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while tag not in box.posted and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return box.posted.pop(tag, None)

    def expire(self, now: float) -> list[Post]:
        """Posts whose frame has not started by their deadline (the sender failed it, or is gone)."""
        gone = []
        with self.cond:
            for box in self._by_identity.values():
                for tag in [t for t, p in box.posted.items() if p.deadline < now]:
                    gone.append(box.posted.pop(tag))
        return gone

    def close(self) -> list[Post]:
        with self.cond:
            self.closed = True
            posts = [p for box in self._by_identity.values() for p in box.posted.values()]
            self._by_identity.clear()
            self.cond.notify_all()
            return posts

    def pending(self) -> int:
        with self.cond:
            return sum(len(b.posted) for b in self._by_identity.values())


@dataclass(eq=False)
class Connection:
    """One accepted data connection; `lock` is held while a piece is received into a caller's buffer, and
    `owner` names the transfer whose frame is being received (set before its first piece, cleared after its
    last)."""

    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    owner: str | None = None

    def fence(self, wait_s: float) -> None:
        """Wait until no piece is being received into a caller's buffer; a piece stuck longer than `wait_s`
        (a stalled sender) is cut off by shutting the connection down."""
        if not self.lock.acquire(timeout=wait_s):
            shut(self.sock)
            self.lock.acquire()
        self.lock.release()


def receive_frame(conn: Connection, post: Post, nbytes: int, scratch: np.ndarray) -> None:
    """Receive one frame's payload: into the caller's buffer piece by piece while it is live, else drop it."""
    mv_scratch = memoryview(scratch)
    dst = post.dest.dst
    mv_dst = memoryview(dst) if dst is not None and post.dest.nbytes == nbytes else None
    conn.owner = post.dest.owner
    try:
        for a in range(0, nbytes, PIECE_BYTES):
            b = min(nbytes, a + PIECE_BYTES)
            with conn.lock:
                if mv_dst is not None and post.dest.live():
                    recv_exact_into(conn.sock, mv_dst[a:b])
                else:
                    recv_exact_into(conn.sock, mv_scratch[:b - a])
    finally:
        conn.owner = None


def frame_header(conn: Connection) -> tuple[int, int]:
    return FRAME.unpack(recv_exact(conn.sock, FRAME.size))


def read_hello(sock: socket.socket) -> bytes:
    magic, n = HELLO.unpack(recv_exact(sock, HELLO.size))
    if magic != MAGIC or not 0 < n <= MAX_IDENTITY:
        raise StreamError("not a tetriinfer data stream")
    return recv_exact(sock, n)


def scratch_buffer() -> np.ndarray:
    return np.empty(PIECE_BYTES, dtype=np.uint8)

