"""Transfer stack: exact round trips per backend, chunk-wise transfers, one-sided ops, cross-process links."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch

from tetriinfer.transfer import (
    AgentConfig,
    RemoteRegion,
    TransferBackend,
    TransferState,
    make_backend,
    nixl_available,
)
from tetriinfer.transfer.nixl_backend import NIXL_IMPORT_ERROR
from tetriinfer.transfer.peer_process import child_receiver
from tetriinfer.transfer.staging import leaked_segments

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason=f"nixl is not importable ({NIXL_IMPORT_ERROR}); optional: pip install nixl==1.5.1"))
KINDS = ["inproc", "shm", "tcp", NIXL]
CFG = AgentConfig(timeout_s=5.0)


def wait_terminal(backend: TransferBackend, tids: list[str], limit_s: float = 10.0) -> dict[str, TransferState]:
    deadline = time.monotonic() + limit_s
    while True:
        states = {t: backend.poll(t) for t in tids}
        if all(s.terminal for s in states.values()):
            return states
        assert time.monotonic() < deadline, f"transfers did not finish: {states}"
        time.sleep(0.001)


def assert_clean(*backends: TransferBackend) -> None:
    for b in backends:
        s = b.stats()
        assert (s.records, s.active, s.regions, s.pinned_payloads, s.staging_segments) == (0, 0, 0, 0, 0), s


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TransferBackend, TransferBackend]]:
    a = make_backend(request.param, config=CFG)
    b = make_backend(request.param, config=CFG)
    if request.param == "nixl":  # pay UCX's first-contact wireup (~50 ms) here, not inside chunk timing checks
        a.connect(b.address)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while not a.connected(b.address):  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "nixl agents did not connect"
            time.sleep(0.001)
    tags = [getattr(x, "shm_tag", None) for x in (a, b)]
    yield a, b
    if request.param == "nixl":  # every test releases its transfers: no NIXL memory may stay registered
        assert a.registrations == b.registrations == 0  # type: ignore[attr-defined]
    a.shutdown()
    b.shutdown()
    for tag in tags:
        if tag:
            assert leaked_segments(tag) == []


def kv_payload(rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.standard_normal((2, 16, 4, 8), dtype=np.float32),  # one KV block, float32
        rng.integers(0, 2**16, size=1001, dtype=np.uint16),  # bfloat16 stored as uint16, odd size
        rng.integers(-128, 127, size=7, dtype=np.int8),  # 7 bytes: not a multiple of anything
        np.zeros(0, dtype=np.float32),  # empty slot
        rng.standard_normal(300_000).astype(np.float32),  # 1.2 MB: above zmq's zero-copy threshold
    ]


def test_roundtrip_two_sided_exact(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    src = kv_payload(np.random.default_rng(0))
    dst = [np.full_like(x, 0) for x in src]
    b.recv("req-1", dst)
    a.send("req-1", src, b.address)
    assert wait_terminal(a, ["req-1"])["req-1"] is TransferState.DONE
    assert wait_terminal(b, ["req-1"])["req-1"] is TransferState.DONE
    for x, y in zip(src, dst, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8))
    st = b.status("req-1")
    assert st.bytes_done == st.bytes_total == sum(x.nbytes for x in src)
    a.release("req-1")
    b.release("req-1")
    assert_clean(a, b)


def test_roundtrip_torch_bfloat16_write(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    src = [torch.randn(3, 16, 5, dtype=torch.bfloat16), torch.randn(33, dtype=torch.bfloat16)]
    dst = [torch.zeros_like(t) for t in src]
    region = b.recv("bf", dst)
    # the descriptor is a msgspec value: it survives encoding, as it will over the control plane
    region = msgspec.msgpack.decode(msgspec.msgpack.encode(region), type=RemoteRegion)
    a.write("bf", region, src)
    assert wait_terminal(b, ["bf"])["bf"] is TransferState.DONE
    assert wait_terminal(a, ["bf"])["bf"] is TransferState.DONE
    for x, y in zip(src, dst, strict=True):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    a.release("bf")
    b.release("bf")
    assert_clean(a, b)


def test_many_concurrent_transfers(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    rng = np.random.default_rng(1)
    n = 40
    srcs = {f"t{i}": [rng.standard_normal(int(rng.integers(1, 20_000))).astype(np.float32)
                      for _ in range(int(rng.integers(1, 4)))] for i in range(n)}
    dsts = {t: [np.zeros_like(x) for x in s] for t, s in srcs.items()}
    for t in srcs:
        b.recv(t, dsts[t])
    for t, s in srcs.items():
        a.send(t, s, b.address)
    assert set(wait_terminal(b, list(srcs)).values()) == {TransferState.DONE}
    assert set(wait_terminal(a, list(srcs)).values()) == {TransferState.DONE}
    for t in srcs:
        assert all(np.array_equal(x, y) for x, y in zip(srcs[t], dsts[t], strict=True))
        a.release(t)
        b.release(t)
    assert_clean(a, b)


def test_chunkwise_done_only_after_all_chunks(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    rng = np.random.default_rng(2)
    layers, chunks, blocks_per_chunk = 3, 3, 2
    # receiver reserved chunks*blocks_per_chunk blocks per layer; slot = chunk-major order of (chunk, layer, block)
    src = [[rng.standard_normal((16, 8)).astype(np.float32) for _ in range(layers * blocks_per_chunk)]
           for _ in range(chunks)]
    dst = [np.zeros((16, 8), np.float32) for _ in range(layers * blocks_per_chunk * chunks)]
    b.recv("chunked", dst)
    a.open("chunked", b.address)
    for c in range(chunks):
        a.append("chunked", src[c])
        time.sleep(0.03)  # later chunks are "still being computed"
        assert b.poll("chunked") is TransferState.TRANSFERRING
        assert b.status("chunked").bytes_done == (c + 1) * layers * blocks_per_chunk * 16 * 8 * 4
    a.close("chunked")
    assert wait_terminal(b, ["chunked"])["chunked"] is TransferState.DONE
    assert wait_terminal(a, ["chunked"])["chunked"] is TransferState.DONE
    flat = [x for chunk in src for x in chunk]
    assert all(np.array_equal(x, y) for x, y in zip(flat, dst, strict=True))
    a.release("chunked")
    b.release("chunked")
    assert_clean(a, b)


def test_explicit_slots_out_of_order_and_rewrite(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    dst = [np.zeros(10, np.int32) for _ in range(3)]
    b.recv("slots", dst)
    a.open("slots", b.address)
    a.append("slots", [np.full(10, 2, np.int32)], slots=[2])
    a.append("slots", [np.full(10, 7, np.int32)], slots=[0])  # a partial block, completed later
    a.append("slots", [np.full(10, 0, np.int32), np.full(10, 1, np.int32)], slots=[0, 1])
    a.close("slots")
    assert wait_terminal(b, ["slots"])["slots"] is TransferState.DONE
    assert [int(d[0]) for d in dst] == [0, 1, 2]
    assert wait_terminal(a, ["slots"])["slots"] is TransferState.DONE
    a.release("slots")
    b.release("slots")
    assert_clean(a, b)


def test_close_before_all_slots_fails_with_reason(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    b.recv("short", [np.zeros(4, np.float32), np.zeros(4, np.float32)])
    a.send("short", [np.ones(4, np.float32)], b.address)
    assert wait_terminal(a, ["short"])["short"] is TransferState.FAILED
    assert wait_terminal(b, ["short"])["short"] is TransferState.FAILED
    assert "1 of 2 slots" in a.status("short").reason
    assert "1 of 2 slots" in b.status("short").reason
    assert b.stats().regions == 0  # the posted region is released on failure
    a.release("short")
    b.release("short")
    assert_clean(a, b)


def test_send_without_posted_recv_fails(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    a.send("nobody", [np.ones(4)], b.address)
    assert wait_terminal(a, ["nobody"])["nobody"] is TransferState.FAILED
    assert "no region" in a.status("nobody").reason
    a.release("nobody")
    assert_clean(a, b)


def test_write_checks_sizes_before_moving_bytes(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    region = b.recv("sz", [np.zeros(8, np.uint8)])
    a.write("sz", region, [np.zeros(9, np.uint8)])
    assert wait_terminal(a, ["sz"])["sz"] is TransferState.FAILED
    assert "length mismatch" in a.status("sz").reason
    assert b.poll("sz") is TransferState.PENDING  # nothing reached the receiver
    b.release("sz")  # cancels the posted receive
    a.release("sz")
    assert_clean(a, b)


def test_one_sided_read_and_write_into_registered_region(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    rng = np.random.default_rng(3)
    pool = [rng.standard_normal(257).astype(np.float32) for _ in range(4)]  # owner's KV blocks
    region = b.register("pool", pool)
    into = [np.zeros(257, np.float32) for _ in range(2)]
    a.read("rd", region, into, slots=[3, 1])
    assert wait_terminal(a, ["rd"])["rd"] is TransferState.DONE
    assert np.array_equal(into[0], pool[3]) and np.array_equal(into[1], pool[1])
    new = np.full(257, 5.0, np.float32)
    a.write("wr", region, [new], slots=[2])
    a.open("wr-bad", region)  # writes to a register()ed region must still fill all of its slots
    a.append("wr-bad", [new], slots=[0])
    a.close("wr-bad")
    states = wait_terminal(a, ["wr", "wr-bad"])
    assert states["wr"] is TransferState.FAILED and "1 of 4 slots" in a.status("wr").reason
    assert states["wr-bad"] is TransferState.FAILED
    a.write("wr-all", region, [new] * 4)
    assert wait_terminal(a, ["wr-all"])["wr-all"] is TransferState.DONE
    assert all(np.array_equal(p, new) for p in pool)
    for t in ("rd", "wr", "wr-bad", "wr-all"):
        a.release(t)
    b.deregister("pool")
    a.read("gone", region, into[:1], slots=[0])
    assert wait_terminal(a, ["gone"])["gone"] is TransferState.FAILED
    assert "no region" in a.status("gone").reason
    a.release("gone")
    assert_clean(a, b)


def test_cancel_releases_receiver_region(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    b.recv("c", [np.zeros(4)])
    assert b.stats().regions == 1
    b.release("c")
    assert_clean(a, b)
    with pytest.raises(KeyError):
        b.poll("c")


def test_bad_inputs_raise_clear_errors() -> None:
    with make_backend("inproc") as a:
        with pytest.raises(ValueError, match="C-contiguous"):
            a.recv("x", [np.zeros((4, 4))[:, 0]])
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros(4)
            ro.flags.writeable = False
            a.recv("y", [ro])
        a.recv("z", [np.zeros(4)])
        with pytest.raises(ValueError, match="already"):
            a.recv("z", [np.zeros(4)])
        with pytest.raises(ValueError, match="unknown transfer backend"):
            make_backend("carrier-pigeon")
        with pytest.raises(ValueError, match="bad options"):
            make_backend("tcp", colour="blue")
        with pytest.raises(ValueError, match="timeout_s"):
            AgentConfig(timeout_s=0)


@pytest.mark.parametrize("kind", ["shm", "tcp", NIXL])
def test_cross_process(kind: str) -> None:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    src = [np.arange(100_003, dtype=np.int64).astype(np.uint8), np.full((4, 1000), 0.5, np.float32)]
    sizes = [x.nbytes for x in src]
    proc = ctx.Process(target=child_receiver, args=(kind, "xproc", sizes, q_in, q_out, 20.0), daemon=True)
    proc.start()
    try:
        region = msgspec.msgpack.decode(q_out.get(timeout=30), type=RemoteRegion)
        assert region.slot_nbytes == sizes
        with make_backend(kind) as a:
            a.write("xproc-0", region, src)
            assert wait_terminal(a, ["xproc-0"], 20)["xproc-0"] is TransferState.DONE
            state, sums, _, reason = q_out.get(timeout=20)
            assert state == "done", reason
            assert sums == [int(x.view(np.uint8).sum(dtype=np.uint64)) for x in src]
            a.release("xproc-0")
            assert_clean(a)
            tag = getattr(a, "shm_tag", None)
        q_in.put("bye")
        proc.join(timeout=20)
        assert proc.exitcode == 0
        if tag:
            assert leaked_segments(tag) == []
    finally:
        if proc.is_alive():
            proc.kill()
