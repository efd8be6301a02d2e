"""tcp backend's raw data streams: in-place receives, misbehaving peers on the wire, and cut connections.

The fake peers here speak the protocol by hand: a zmq DEALER (control headers, msgspec) with a `tikv-` routing id
and a raw socket to the data port (HELLO, then FRAME headers and bytes), so each test controls exactly which
bytes arrive when.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from tetriinfer.transfer import AgentConfig, TransferState, make_backend
from tetriinfer.transfer import messages as m
from tetriinfer.transfer.tcp import TcpBackend, parse_address
from tetriinfer.transfer.tcp_stream import FRAME, HELLO, MAGIC, PIECE_BYTES

CFG = AgentConfig(timeout_s=2.0, cancel_wait_s=5.0)


def wait_terminal(b: TcpBackend, tid: str, limit_s: float = 10.0) -> TransferState:
    deadline = time.monotonic() + limit_s
    while not (state := b.poll(tid)).terminal:
        assert time.monotonic() < deadline, f"{tid} did not finish: {state}"
        time.sleep(0.001)
    return state


def wait_for(cond: object, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def assert_clean(*backends: TcpBackend) -> None:
    for b in backends:
        s = b.stats()
        assert (s.records, s.active, s.regions, s.pinned_payloads, s.staging_segments) == (0, 0, 0, 0, 0), s
        assert b._inboxes.pending() == 0


class FakePeer:
    """A sender that speaks the tcp backend's protocol by hand."""

    def __init__(self, receiver: TcpBackend, identity: bytes = b"tikv-fake") -> None:
        endpoint, host, port = parse_address(receiver.address)
        self.ctx = zmq.Context.instance()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.ROUTING_ID, identity)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(endpoint)
        self.data = socket.create_connection((host, port))
        self.data.sendall(HELLO.pack(MAGIC, len(identity)) + identity)

    def header(self, tid: str, sizes: list[int], *, seq: int = 0, close: bool = True) -> None:
        msg = m.Data(tid, tid, 0, True, seq, list(range(len(sizes))), sizes,
                     close_nslots=len(sizes) if close else -1)
        self.dealer.send(m.encode(msg))

    def frame(self, tag: int, payload: bytes, *, claimed: int | None = None) -> None:
        self.data.sendall(FRAME.pack(tag, len(payload) if claimed is None else claimed) + payload)

    def ack(self, timeout_s: float = 5.0) -> m.Ack:
        assert self.dealer.poll(int(timeout_s * 1000)), "no Ack"
        msg = m.decode(self.dealer.recv())
        assert isinstance(msg, m.Ack)
        return msg

    def close(self) -> None:
        self.data.close()
        self.dealer.close(linger=0)


@pytest.fixture
def receiver() -> Iterator[TcpBackend]:
    b = make_backend("tcp", config=CFG)
    assert isinstance(b, TcpBackend)
    yield b
    b.shutdown()


def test_address_carries_the_data_port_and_bad_addresses_are_refused(receiver: TcpBackend) -> None:
    endpoint, host, port = parse_address(receiver.address)
    assert endpoint.startswith("tcp://127.0.0.1:") and host == "127.0.0.1" and 0 < port < 65536
    with make_backend("tcp", config=CFG) as a:
        for bad in ("tcp://127.0.0.1:5555", "ipc:///tmp/x", "tcp://127.0.0.1:5?data=x"):
            with pytest.raises(ValueError, match="tcp transfer address"):
                a.open("t", bad)
    with pytest.raises(ValueError, match="data_port"):
        TcpBackend(data_port=70000)
    with pytest.raises(ValueError, match="advertise_host"):
        TcpBackend(host="0.0.0.0")


def test_payload_lands_in_place_once_per_frame(receiver: TcpBackend) -> None:
    """A multi-piece payload and an empty one, sent by a hand-written peer, land exactly and complete the
    transfer; the Ack is sent only once the bytes are in."""
    big = np.random.default_rng(0).integers(0, 255, PIECE_BYTES * 2 + 12345, dtype=np.uint8)
    dst = [np.zeros(big.nbytes, np.uint8), np.zeros(0, np.uint8)]
    receiver.recv("t", dst)
    peer = FakePeer(receiver)
    try:
        peer.header("t", [big.nbytes, 0])
        time.sleep(0.05)
        assert receiver.poll("t") is not TransferState.DONE  # header alone: bytes still missing
        peer.frame(0, big.tobytes())
        peer.frame(1, b"")
        ack = peer.ack()
        assert ack.ok, ack.reason
        assert wait_terminal(receiver, "t") is TransferState.DONE
        assert np.array_equal(dst[0], big)
        receiver.release("t")
        assert_clean(receiver)
    finally:
        peer.close()


def test_frame_before_its_header_waits_for_it(receiver: TcpBackend) -> None:
    """Payload and header travel on different sockets: bytes that arrive first wait for their header."""
    dst = [np.zeros(1000, np.uint8)]
    receiver.recv("t", dst)
    peer = FakePeer(receiver)
    try:
        peer.frame(0, bytes(range(250)) * 4)
        time.sleep(0.1)
        assert dst[0].sum() == 0
        peer.header("t", [1000])
        assert peer.ack().ok
        assert np.array_equal(dst[0], np.frombuffer(bytes(range(250)) * 4, np.uint8))
        receiver.release("t")
        assert_clean(receiver)
    finally:
        peer.close()


def test_frame_size_differing_from_its_header_fails_cleanly(receiver: TcpBackend) -> None:
    dst = [np.zeros(100, np.uint8)]
    receiver.recv("t", dst)
    peer = FakePeer(receiver)
    try:
        peer.header("t", [100])
        peer.frame(0, b"\x07" * 60)  # 60 bytes where the header promised 100
        ack = peer.ack()
        assert not ack.ok and "does not match" in ack.reason
        assert wait_terminal(receiver, "t") is TransferState.FAILED
        assert "does not match" in receiver.status("t").reason
        assert dst[0].sum() == 0  # a mismatched frame is dropped, never written
        receiver.release("t")
        assert_clean(receiver)
    finally:
        peer.close()


def test_stalled_sender_cannot_write_after_release(receiver: TcpBackend) -> None:
    """A sender stalls in the middle of a piece: release() cuts its connection (bounded wait), fails the recv,
    and the buffer is never written again; the receiver stays usable."""
    n = 3 * PIECE_BYTES
    dst = [np.zeros(n, np.uint8)]
    receiver.recv("t", dst)
    peer = FakePeer(receiver)
    try:
        peer.header("t", [n])
        peer.frame(0, b"\x01" * (PIECE_BYTES + 1000), claimed=n)  # stalls inside the second piece
        wait_for(lambda: dst[0][PIECE_BYTES] == 1)
        t0 = time.monotonic()
        receiver.release("t")
        assert time.monotonic() - t0 < 6.0  # bounded: the piece in flight is cut after FENCE_WAIT_S
        snapshot = dst[0].copy()
        try:
            peer.data.sendall(b"\x02" * PIECE_BYTES)
        except OSError:
            pass  # the receiver cut the connection
        time.sleep(0.2)
        assert np.array_equal(dst[0], snapshot)
        wait_for(lambda: receiver.stats().staging_segments == 0)
        assert_clean(receiver)
    finally:
        peer.close()
    with make_backend("tcp", config=CFG) as a:  # still serving other senders
        dst2 = [np.zeros(10, np.uint8)]
        region = receiver.recv("u", dst2)
        a.write("u", region, [np.arange(10, dtype=np.uint8)])
        assert wait_terminal(a, "u") is TransferState.DONE
        assert dst2[0].tolist() == list(range(10))
        receiver.release("u")
        a.release("u")


def test_header_without_payload_expires_and_frees_everything(receiver: TcpBackend) -> None:
    """A header whose frame never comes (the sender died between them): the post expires, the receiver fails
    once its timeout passes, and nothing stays pending."""
    receiver.recv("t", [np.zeros(10, np.uint8)])
    peer = FakePeer(receiver)
    try:
        peer.header("t", [10])
        assert wait_terminal(receiver, "t", limit_s=10) is TransferState.FAILED
        wait_for(lambda: receiver._inboxes.pending() == 0 and receiver.stats().staging_segments == 0)
        receiver.release("t")
        assert_clean(receiver)
    finally:
        peer.close()


def test_sender_disconnect_fails_waiting_posts(receiver: TcpBackend) -> None:
    receiver.recv("t", [np.zeros(10, np.uint8), np.zeros(10, np.uint8)])
    peer = FakePeer(receiver)
    peer.header("t", [10, 10])
    peer.frame(0, b"\x03" * 10)
    wait_for(lambda: receiver.status("t").bytes_done == 10)
    peer.data.close()  # the second payload will never come
    assert wait_terminal(receiver, "t") is TransferState.FAILED
    assert "connection" in receiver.status("t").reason
    peer.close()
    receiver.release("t")
    wait_for(lambda: receiver.stats().staging_segments == 0)
    assert_clean(receiver)


@pytest.mark.parametrize("garbage", [b"", b"HTTP/1.1 200 OK\r\n\r\n", HELLO.pack(b"XXXX", 4) + b"tikv",
                                     HELLO.pack(MAGIC, 0), HELLO.pack(MAGIC, 5000)])
def test_strangers_on_the_data_port_are_dropped(receiver: TcpBackend, garbage: bytes) -> None:
    with socket.create_connection(parse_address(receiver.address)[1:]) as s:
        s.settimeout(10)
        try:
            s.sendall(garbage)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(1) == b""  # the receiver closed it...
        except OSError:
            pass  # ...possibly with our unread bytes still queued: a reset (ECONNRESET, EPIPE, ENOTCONN)
    with make_backend("tcp", config=CFG) as a:
        dst = [np.zeros(4, np.uint8)]
        region = receiver.recv("ok", dst)
        a.write("ok", region, [np.full(4, 9, np.uint8)])
        assert wait_terminal(a, "ok") is TransferState.DONE and dst[0].tolist() == [9] * 4
        receiver.release("ok")
        a.release("ok")


def test_control_frames_from_a_stranger_are_rejected(receiver: TcpBackend) -> None:
    """Payload frames on the control socket, or an identity that is not a tcp peer: a clean rejection (and the
    transfer, closed without its bytes, fails once with a reason)."""
    ctx = zmq.Context.instance()
    for identity, frames in ((b"tikv-x", [b"\x00" * 4]), (b"stranger", [])):
        dst = [np.zeros(4, np.uint8)]
        receiver.recv("t", dst)
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.ROUTING_ID, identity)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(parse_address(receiver.address)[0])
        d.send_multipart([m.encode(m.Data("t", "t", 0, True, 0, [0], [4], close_nslots=1)), *frames])
        assert d.poll(5000)
        ack = m.decode(d.recv())
        assert isinstance(ack, m.Ack) and not ack.ok and ack.reason
        d.close()
        assert wait_terminal(receiver, "t") is TransferState.FAILED and receiver.status("t").reason
        assert dst[0].sum() == 0
        receiver.release("t")
        assert_clean(receiver)


def test_sender_to_a_dead_receiver_fails_and_frees(receiver: TcpBackend) -> None:
    region = receiver.recv("t", [np.zeros(1 << 20, np.uint8)])
    receiver.shutdown()
    with make_backend("tcp", config=AgentConfig(timeout_s=1.0)) as a:
        a.write("t", region, [np.ones(1 << 20, np.uint8)])
        assert wait_terminal(a, "t") is TransferState.FAILED
        a.release("t")
        wait_for(lambda: a.stats().pinned_payloads == 0)
        assert_clean(a)


def test_release_waits_only_for_the_connection_carrying_its_bytes(receiver: TcpBackend) -> None:
    """Releasing one transfer never stalls on, or cuts, another sender's connection that is mid-frame."""
    n = 2 * PIECE_BYTES
    dst_a = [np.zeros(n, np.uint8)]
    receiver.recv("a", dst_a)
    receiver.recv("b", [np.zeros(10, np.uint8)])
    peer_a, peer_b = FakePeer(receiver, b"tikv-a"), FakePeer(receiver, b"tikv-b")
    try:
        peer_a.header("a", [n])
        peer_a.frame(0, b"\x05" * (PIECE_BYTES + 10), claimed=n)  # A stalls inside its second piece
        peer_b.header("b", [10])  # B's payload never comes
        wait_for(lambda: dst_a[0][PIECE_BYTES] == 5)
        t0 = time.monotonic()
        receiver.release("b")
        assert time.monotonic() - t0 < 1.0
        peer_a.data.sendall(b"\x05" * (n - PIECE_BYTES - 10))  # A's connection is intact: it completes
        assert peer_a.ack().ok
        assert wait_terminal(receiver, "a") is TransferState.DONE and bool((dst_a[0] == 5).all())
        receiver.release("a")
        wait_for(lambda: receiver._inboxes.pending() == 0 and receiver.stats().staging_segments == 0)
        assert_clean(receiver)
    finally:
        peer_a.close()
        peer_b.close()


def test_ipv6_endpoints_carry_a_transfer() -> None:
    """Both ends bound on ::1: the address is written with URL brackets (tcp://[::1]:PORT?data=...), parse_address
    gives the bare host for the data socket, and a multi-piece payload lands exactly."""
    from tetriinfer.net import bare_host, url_host

    assert url_host("::1") == "[::1]" and url_host("[::1]") == "[::1]" and url_host("10.0.0.2") == "10.0.0.2"
    assert bare_host("[::1]") == "::1" and bare_host("10.0.0.2") == "10.0.0.2"
    a, b = TcpBackend(host="::1", config=CFG), TcpBackend(host="::1", config=CFG)
    try:
        endpoint, host, port = parse_address(b.address)
        assert b.address.startswith("tcp://[::1]:") and endpoint.startswith("tcp://[::1]:") and host == "::1"
        src = [np.random.default_rng(1).integers(0, 255, PIECE_BYTES * 2 + 77, dtype=np.uint8)]
        dst = [np.zeros_like(src[0])]
        b.recv("v6", dst)
        a.send("v6", src, b.address)
        assert wait_terminal(a, "v6") is TransferState.DONE and wait_terminal(b, "v6") is TransferState.DONE
        assert np.array_equal(src[0], dst[0])
    finally:
        a.shutdown()
        b.shutdown()
