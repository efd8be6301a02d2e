"""torch.distributed backend: the generic transfer suite on an in-process pair of gloo ranks, fault injection and
retries over it, payload tags under concurrency, timeouts and release, two processes (one spawned) over gloo on
127.0.0.1, and the NCCL path (skipped without two CUDA devices; it never ran on the CPU-only development machine).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import torch.distributed as dist

import tests.test_transfer as generic
from tetriinfer.net import free_loopback_port as free_port
from tetriinfer.transfer import (
    AgentConfig,
    RemoteRegion,
    RetryingSender,
    RetryPolicy,
    TransferBackend,
    TransferState,
    make_backend,
)
from tetriinfer.transfer.sidechannel import PUSH, TAG_SPACE
from tetriinfer.transfer.torchdist import TorchDistBackend, TorchDistOptions, parse_address

CFG = AgentConfig(timeout_s=5.0)
FAST = AgentConfig(timeout_s=0.3, sweep_interval_s=0.005)


def make_ranks(world_size: int = 2, **kw: Any) -> list[TorchDistBackend]:
    """All ranks of one gloo world in this process (construction is collective: one thread per rank)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    out: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        try:
            out[rank] = make_backend("torchdist", rank=rank, world_size=world_size, init_method=init,
                                     backend="gloo", pg_timeout_s=30.0, **kw)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def wait_until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def clean(b: TransferBackend) -> bool:
    s = b.stats()
    return (s.records, s.active, s.regions, s.pinned_payloads, s.staging_segments) == (0, 0, 0, 0, 0)


@pytest.fixture
def pair() -> Iterator[tuple[TorchDistBackend, TorchDistBackend]]:
    a, b = make_ranks(config=CFG)
    yield a, b
    a.shutdown()
    b.shutdown()


GENERIC = [
    generic.test_roundtrip_two_sided_exact,
    generic.test_roundtrip_torch_bfloat16_write,
    generic.test_many_concurrent_transfers,
    generic.test_chunkwise_done_only_after_all_chunks,
    generic.test_explicit_slots_out_of_order_and_rewrite,
    generic.test_close_before_all_slots_fails_with_reason,
    generic.test_send_without_posted_recv_fails,
    generic.test_write_checks_sizes_before_moving_bytes,
    generic.test_one_sided_read_and_write_into_registered_region,
    generic.test_cancel_releases_receiver_region,
]


@pytest.mark.parametrize("case", GENERIC, ids=[f.__name__.removeprefix("test_") for f in GENERIC])
def test_generic_suite(case: Callable[[Any], None], pair: tuple[TorchDistBackend, TorchDistBackend]) -> None:
    """The same behaviour the inproc/shm/tcp backends are held to (sizes, slots, rejections, one-sided ops)."""
    case(pair)


def test_both_directions_concurrently_with_many_sizes(pair: tuple[TorchDistBackend, TorchDistBackend]) -> None:
    """Tags keep concurrent payloads apart: both ranks send and receive at once, sizes from 0 B to 4 MiB."""
    a, b = pair
    rng = np.random.default_rng(7)
    sizes = [0, 1, 7, 4096, 65_539, 1 << 20, (4 << 20) + 3]
    plan = {f"{d}-{i}": (s, d) for i, s in enumerate(sizes) for d in ("ab", "ba")}
    src = {t: [rng.integers(0, 256, s, dtype=np.uint8), rng.integers(0, 256, 5 + i % 3, dtype=np.uint8)]
           for i, (t, (s, _)) in enumerate(plan.items())}
    dst = {t: [np.zeros_like(x) for x in v] for t, v in src.items()}
    for t, (_, d) in plan.items():
        (b if d == "ab" else a).recv(t, dst[t])
    for t, (_, d) in plan.items():
        sender, receiver = (a, b) if d == "ab" else (b, a)
        sender.send(t, src[t], receiver.address)
    for t, (_, d) in plan.items():
        sender, receiver = (a, b) if d == "ab" else (b, a)
        assert generic.wait_terminal(receiver, [t])[t] is TransferState.DONE, receiver.status(t).reason
        assert generic.wait_terminal(sender, [t])[t] is TransferState.DONE
        assert all(np.array_equal(x, y) for x, y in zip(src[t], dst[t], strict=True)), t
        sender.release(t)
        receiver.release(t)
    assert clean(a) and clean(b)


def test_read_size_mismatch_fails_once_drained(pair: tuple[TorchDistBackend, TorchDistBackend]) -> None:
    a, b = pair
    region = b.register("pool", [np.arange(100, dtype=np.int32), np.arange(50, dtype=np.int32)])
    into = [np.zeros(100, np.int32), np.zeros(49, np.int32)]
    a.read("rd", region, into)
    assert generic.wait_terminal(a, ["rd"])["rd"] is TransferState.FAILED
    assert "length mismatch in buffer 1" in a.status("rd").reason
    a.release("rd")
    assert clean(a)  # the owner's payloads were received (and dropped) before the read failed
    assert not into[0].any() and not into[1].any()
    b.deregister("pool")
    wait_until(lambda: clean(b))


def test_inference_mode_tensors(pair: tuple[TorchDistBackend, TorchDistBackend]) -> None:
    """KV caches are often inference tensors: they can be sent from and received into."""
    a, b = pair
    with torch.inference_mode():
        src = [torch.randn(4, 16, dtype=torch.bfloat16)]
        dst = [torch.zeros(4, 16, dtype=torch.bfloat16)]
    b.recv("inf", dst)
    a.send("inf", src, b.address)
    assert generic.wait_terminal(b, ["inf"])["inf"] is TransferState.DONE, b.status("inf").reason
    assert torch.equal(src[0], dst[0])


def test_timeout_when_peer_never_sends_frees_everything() -> None:
    a, b = make_ranks(config=FAST)
    try:
        dst = [torch.zeros(1000)]
        b.recv("never", dst)
        a.open("silent", b.address)  # a sender that never appends nor closes
        t0 = time.monotonic()
        assert generic.wait_terminal(b, ["never"])["never"] is TransferState.FAILED
        assert generic.wait_terminal(a, ["silent"])["silent"] is TransferState.FAILED
        assert time.monotonic() - t0 < 2.0
        assert "timed out" in b.status("never").reason and "timed out" in a.status("silent").reason
        assert b.stats().regions == 0  # the region goes with the failure, before release
        b.release("never")
        a.release("silent")
        assert clean(a) and clean(b)
        assert torch.count_nonzero(dst[0]) == 0
    finally:
        a.shutdown()
        b.shutdown()


def test_release_mid_transfer_frees_everything_and_spares_buffers(
        pair: tuple[TorchDistBackend, TorchDistBackend]) -> None:
    """A receiver released while chunks are still coming: its buffers are never written again (later payloads, if
    the sender posts them before hearing of the cancel, are received into scratch and dropped), the sender fails,
    and both sides drain to zero."""
    a, b = pair
    dst = [np.zeros(1 << 20, np.uint8) for _ in range(3)]
    b.recv("gone", dst)
    a.open("gone", b.address)
    a.append("gone", [np.full(1 << 20, 1, np.uint8)])
    wait_until(lambda: b.status("gone").bytes_done == 1 << 20)
    b.release("gone")
    assert clean(b)
    a.append("gone", [np.full(1 << 20, 2, np.uint8), np.full(1 << 20, 3, np.uint8)])
    a.close("gone")
    assert generic.wait_terminal(a, ["gone"])["gone"] is TransferState.FAILED
    reason = a.status("gone").reason
    assert "cancelled by caller" in reason or "no region" in reason, reason
    a.release("gone")
    wait_until(lambda: clean(a) and clean(b))
    assert int(dst[0].min()) == 1 and not dst[1].any() and not dst[2].any()


def test_release_with_recv_in_flight_never_writes_the_buffers(
        pair: tuple[TorchDistBackend, TorchDistBackend]) -> None:
    """The recv for a posted payload is in flight when the receiver releases the transfer: its bytes land in
    staging and are dropped. (The receiver's waiter for rank 0 is held behind a recv that the test matches later,
    so the payload's completion is reported only after the release.)"""
    a, b = pair
    hold, unhold = torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
    b._call_io(lambda: b._start(0, False, hold, TAG_SPACE - 1, PUSH, lambda err: None))
    dst = [np.zeros(1 << 16, np.uint8)]
    b.recv("x", dst)
    a.send("x", [np.full(1 << 16, 7, np.uint8)], b.address)
    wait_until(lambda: b.poll("x") is TransferState.TRANSFERRING and b.stats().staging_segments == 1)
    b.release("x")
    a._call_io(lambda: a._start(1, True, unhold, TAG_SPACE - 1, PUSH, lambda err: None))
    wait_until(lambda: int(hold.sum()) == 8 and clean(b))
    assert generic.wait_terminal(a, ["x"])["x"] is TransferState.FAILED
    a.release("x")
    wait_until(lambda: clean(a))
    assert not dst[0].any()


def test_sender_release_aborts_receiver(pair: tuple[TorchDistBackend, TorchDistBackend]) -> None:
    a, b = pair
    b.recv("ab", [np.zeros(64, np.uint8), np.zeros(64, np.uint8)])
    a.open("ab", b.address)
    a.append("ab", [np.ones(64, np.uint8)])
    wait_until(lambda: b.status("ab").bytes_done == 64)
    a.release("ab")  # cancels: the receiver hears an Abort instead of waiting for its timeout
    assert generic.wait_terminal(b, ["ab"], 2.0)["ab"] is TransferState.FAILED
    assert "aborted by sender" in b.status("ab").reason
    b.release("ab")
    wait_until(lambda: clean(a) and clean(b))


@pytest.mark.parametrize("fault", ["drop", "delay", "corrupt"])
def test_faulty_wrapper(fault: str) -> None:
    a_inner, b = make_ranks(config=FAST)
    a = make_backend("faulty", inner=a_inner, **{f"{fault}_p": 1.0, "delay_s": 0.15})
    try:
        src = [np.arange(5000, dtype=np.float32), np.arange(10, dtype=np.uint16)]
        dst = [np.zeros_like(x) for x in src]
        b.recv("f", dst)
        t0 = time.monotonic()
        a.send("f", src, b.address)
        states = generic.wait_terminal(b, ["f"]), generic.wait_terminal(a, ["f"])
        if fault == "delay":
            assert states[0]["f"] is states[1]["f"] is TransferState.DONE
            assert time.monotonic() - t0 >= 0.15
            assert all(np.array_equal(x, y) for x, y in zip(src, dst, strict=True))
        else:
            assert states[0]["f"] is states[1]["f"] is TransferState.FAILED
            want = "timed out" if fault == "drop" else "length mismatch in slot 1"
            assert want in a.status("f").reason and want in b.status("f").reason
        a.release("f")
        b.release("f")
        wait_until(lambda: clean(a_inner) and clean(b))
    finally:
        a.shutdown()
        b.shutdown()


def test_retry_recovers_after_a_rejected_attempt() -> None:
    """Attempt 0 is corrupted (its payload is still received and dropped), attempt 1 lands: DONE on both sides."""
    a_inner, b = make_ranks(config=FAST)
    a = make_backend("faulty", inner=a_inner, corrupt_p=1.0, faulty_attempts=1)
    try:
        src = [np.arange(777, dtype=np.float32)]
        dst = [np.zeros(777, np.float32)]
        b.recv("r", dst, timeout_s=3.0)
        sender = RetryingSender(a, RetryPolicy(max_attempts=3))
        sender.send("r", src, b.address)
        assert generic.wait_terminal(sender, ["r"])["r"] is TransferState.DONE, sender.status("r").reason
        assert sender.attempts("r") == 2
        assert generic.wait_terminal(b, ["r"])["r"] is TransferState.DONE
        assert np.array_equal(src[0], dst[0])
        sender.release("r")
        b.release("r")
        wait_until(lambda: clean(a_inner) and clean(b))
    finally:
        a.shutdown()
        b.shutdown()


def test_three_ranks_route_by_rank() -> None:
    r0, r1, r2 = make_ranks(3, config=CFG)
    try:
        assert [parse_address(r.address)[0] for r in (r0, r1, r2)] == [0, 1, 2]
        d1, d2 = [np.zeros(1000, np.int32)], [np.zeros(1000, np.int32)]
        r1.recv("t", d1)
        r2.recv("w", d2)
        r0.send("t", [np.full(1000, 1, np.int32)], r1.address)
        r2.send("u", [np.full(1000, 2, np.int32)], r1.recv("u", d3 := [np.zeros(1000, np.int32)]))
        r0.write("t2", r2.recv("t2", d4 := [np.zeros(1000, np.int32)]), [np.full(1000, 4, np.int32)])
        r1.send("w", [np.full(1000, 3, np.int32)], r2.address)
        assert generic.wait_terminal(r0, ["t", "t2"]) == {"t": TransferState.DONE, "t2": TransferState.DONE}
        assert generic.wait_terminal(r2, ["u", "w", "t2"]) == dict.fromkeys(["u", "w", "t2"], TransferState.DONE)
        assert generic.wait_terminal(r1, ["t", "u", "w"]) == dict.fromkeys(["t", "u", "w"], TransferState.DONE)
        assert [int(x[0][0]) for x in (d1, d2, d3, d4)] == [1, 3, 2, 4]
    finally:
        for r in (r0, r1, r2):
            r.shutdown()


def test_options_and_inputs_are_validated() -> None:
    good = {"rank": 0, "world_size": 2, "init_method": "tcp://127.0.0.1:29555"}
    for bad in ({"rank": 2}, {"world_size": 1}, {"init_method": "env://"}, {"init_method": "tcp://h:0"},
                {"backend": "mpi"}, {"host": "0.0.0.0"}, {"pg_timeout_s": 0}):
        with pytest.raises(ValueError):
            TorchDistOptions(**{**good, **bad})
        with pytest.raises(ValueError):
            make_backend("torchdist", **{**good, **bad})
    with pytest.raises(ValueError, match="bad options"):
        make_backend("torchdist", **good, colour="blue")
    with pytest.raises(ValueError, match="gloo moves CPU tensors"):
        TorchDistOptions(**good, backend="gloo", device="cuda:0").resolve()
    if not torch.cuda.is_available():
        assert TorchDistOptions(**good).resolve() == ("gloo", torch.device("cpu"))
        with pytest.raises(ValueError, match="needs CUDA"):
            TorchDistOptions(**good, backend="nccl").resolve()
    with pytest.raises(ValueError, match="not a torchdist address"):
        parse_address("tcp://127.0.0.1:5555")


def test_bad_peers_and_buffers_raise(pair: tuple[TorchDistBackend, TorchDistBackend]) -> None:
    a, b = pair
    with pytest.raises(ValueError, match="not a torchdist address"):
        a.open("t", "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="not another rank"):
        a.open("t", a.address)
    with pytest.raises(ValueError, match="contiguous"):
        b.recv("s", [torch.zeros(4, 4)[:, 0]])
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(4)
        ro.flags.writeable = False
        b.recv("ro", [ro])
    with pytest.raises(ValueError, match="list of buffers"):
        b.recv("one", torch.zeros(4))
    assert clean(a) and clean(b)


# ---------------------------------------------------------------- two processes
def payloads(seed: int, sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def digest(bufs: list[Any]) -> str:
    h = hashlib.sha256()
    for x in bufs:
        h.update(x.numpy().tobytes() if isinstance(x, torch.Tensor) else x.tobytes())
    return h.hexdigest()


CONCURRENT = {f"c{i}": [n, 3 + i] for i, n in enumerate([1, 1000, 65_539, 1 << 20, (3 << 20) + 5])}
CHUNKS = [[4096] * 4, [4096] * 4, [777]]  # chunk-wise: 3 appends, 9 slots


def remote_rank(port: int, q_in: Any, q_out: Any) -> None:
    """Rank 1 in a spawned process: receives the concurrent and chunk-wise transfers, sends one back, and posts a
    receive nobody serves; reports digests and states (harness queues carry only results, never payloads)."""
    b = make_backend("torchdist", rank=1, world_size=2, init_method=f"tcp://127.0.0.1:{port}", backend="gloo",
                     pg_timeout_s=30.0, config=AgentConfig(timeout_s=10.0))
    try:
        dsts = {t: [np.zeros(n, np.uint8) for n in s] for t, s in CONCURRENT.items()}
        dsts["chunked"] = [torch.zeros(n, dtype=torch.uint8) for c in CHUNKS for n in c]
        regions = {t: msgspec.msgpack.encode(b.recv(t, d)) for t, d in dsts.items()}
        b.recv("orphan", [np.zeros(10, np.uint8)], timeout_s=0.5)
        q_out.put((b.address, regions))
        back = msgspec.msgpack.decode(q_in.get(timeout=30), type=RemoteRegion)
        b.write("back", back, payloads(99, back.slot_nbytes))
        tids = [*dsts, "orphan", "back"]
        deadline = time.monotonic() + 30
        while not all(b.poll(t).terminal for t in tids) and time.monotonic() < deadline:
            time.sleep(0.002)
        report = {t: (b.poll(t).value, b.status(t).reason, digest(dsts[t]) if t in dsts else "") for t in tids}
        for t in tids:
            b.release(t)
        s = b.stats()
        q_out.put((report, (s.records, s.active, s.regions, s.pinned_payloads, s.staging_segments)))
        q_in.get(timeout=30)  # keep the rank up until the parent is done with it
    finally:
        b.shutdown()


def test_two_processes_over_gloo() -> None:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=remote_rank, args=(port, q_in, q_out), daemon=True)
    proc.start()
    a = None
    try:
        a = make_backend("torchdist", rank=0, world_size=2, init_method=f"tcp://127.0.0.1:{port}", backend="gloo",
                         pg_timeout_s=30.0, config=AgentConfig(timeout_s=10.0))
        peer, raw = q_out.get(timeout=60)
        regions = {t: msgspec.msgpack.decode(r, type=RemoteRegion) for t, r in raw.items()}
        srcs = {t: payloads(i, s) for i, (t, s) in enumerate(CONCURRENT.items())}
        for t, s in srcs.items():  # all in flight together: two-sided sends to the peer's address
            a.send(t, s, peer)
        chunks = [payloads(100 + i, c) for i, c in enumerate(CHUNKS)]
        a.open("chunked", regions["chunked"])
        for c in chunks:
            a.append("chunked", c)
        a.close("chunked")
        back_dst = [np.zeros(n, np.uint8) for n in (123, 1 << 20)]
        q_in.put(msgspec.msgpack.encode(a.recv("back", back_dst)))
        sent = [*srcs, "chunked"]
        states = generic.wait_terminal(a, [*sent, "back"], 30)
        assert set(states.values()) == {TransferState.DONE}, {t: a.status(t).reason for t in states}
        assert digest(back_dst) == digest(payloads(99, [123, 1 << 20]))
        report, stats = q_out.get(timeout=30)
        for i, t in enumerate(srcs):
            assert report[t] == ("done", "", digest(payloads(i, CONCURRENT[t]))), t
        assert report["chunked"] == ("done", "", digest([x for c in chunks for x in c]))
        assert report["back"][:2] == ("done", "")
        assert report["orphan"][0] == "failed" and "timed out" in report["orphan"][1]
        assert stats == (0, 0, 0, 0, 0)
        for t in [*sent, "back"]:
            a.release(t)
        wait_until(lambda: clean(a))
        q_in.put("bye")
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if a is not None:
            a.shutdown()
        if proc.is_alive():
            proc.kill()


# ---------------------------------------------------------------- NCCL
def cuda_payload(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(rank)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen) for n in NCCL_SIZES]


NCCL_SIZES = [17, 1 << 20, 4096]


def nccl_rank(rank: int, port: int, q_in: Any, q_out: Any) -> None:
    """One rank of a 2-GPU NCCL world, both ranks at once: a chunk-wise write of CUDA tensors to the peer's posted
    region and a one-sided read of the peer's registered pool; reports what it verified."""
    try:
        torch.cuda.set_device(rank)
        b = make_backend("torchdist", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                         backend="nccl", pg_timeout_s=60.0, config=AgentConfig(timeout_s=20.0))
        try:
            assert (b.backend, b.device) == ("nccl", torch.device("cuda", rank))  # type: ignore[attr-defined]
            dst = b.alloc_like([(n,) for n in NCCL_SIZES], torch.uint8)
            assert all(d.device == torch.device("cuda", rank) for d in dst)
            for d in dst:
                d.zero_()
            mine = b.recv("push", dst)
            pool = b.register("pool", [torch.full((2048,), 10 + rank, dtype=torch.int32, device="cuda")])
            q_out.put((rank, msgspec.msgpack.encode(mine), msgspec.msgpack.encode(pool)))
            raw_push, raw_pool = q_in.get(timeout=120)
            peer_push = msgspec.msgpack.decode(raw_push, type=RemoteRegion)
            peer_pool = msgspec.msgpack.decode(raw_pool, type=RemoteRegion)
            src = cuda_payload(rank)
            b.open("out", peer_push)
            b.append("out", src[:2])
            b.append("out", src[2:])
            b.close("out")
            into = [torch.zeros(2048, dtype=torch.int32, device="cuda")]
            b.read("rd", peer_pool, into)
            deadline = time.monotonic() + 60
            while not all(b.poll(t).terminal for t in ("push", "out", "rd")) and time.monotonic() < deadline:
                time.sleep(0.002)
            states = {t: (b.poll(t).value, b.status(t).reason) for t in ("push", "out", "rd")}
            expect = cuda_payload(1 - rank)
            ok = [bool(torch.equal(x, y)) for x, y in zip(dst, expect, strict=True)]
            ok.append(bool((into[0] == 10 + (1 - rank)).all()))
            for t in ("push", "out", "rd"):
                b.release(t)
            b.deregister("pool")
            wait_until(lambda: clean(b), 20)
            q_out.put((rank, states, ok))
            q_in.get(timeout=60)  # both ranks stay up until both reported
        finally:
            b.shutdown()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q_out.put((rank, "error", f"{type(e).__name__}: {e}"))


NCCL_READY = torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= 2


@pytest.mark.skipif(not NCCL_READY,
                    reason="NCCL path needs CUDA with NCCL and two devices (NCCL refuses two ranks on one GPU); "
                           "untested on this CPU-only machine")
def test_two_processes_over_nccl() -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    q_out = ctx.Queue()
    q_ins = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=nccl_rank, args=(r, port, q_ins[r], q_out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        posted: dict[int, tuple[bytes, bytes]] = {}
        while len(posted) < 2:
            rank, x, y = q_out.get(timeout=180)
            assert x != "error", y
            posted[rank] = (x, y)
        for r in (0, 1):
            q_ins[r].put(posted[1 - r])
        for _ in range(2):
            rank, states, ok = q_out.get(timeout=120)
            assert states != "error", ok
            assert states == {t: ("done", "") for t in ("push", "out", "rd")}, (rank, states)
            assert all(ok), (rank, ok)
        for q in q_ins:
            q.put("bye")
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
