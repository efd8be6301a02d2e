"""shm fast path: alloc()/alloc_like() arena buffers, direct (one-copy) writes, fences, quarantine, no leaks."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch

from tetriinfer.transfer import AgentConfig, RemoteRegion, TransferBackend, TransferState, make_backend
from tetriinfer.transfer import messages as m
from tetriinfer.transfer.arena import ALIGN, ShmArena
from tetriinfer.transfer.peer_process import child_receiver, child_receiver_batch
from tetriinfer.transfer.staging import SHM_DIR, ShmMapper, leaked_segments

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


@pytest.fixture
def pair() -> Iterator[tuple[TransferBackend, TransferBackend]]:
    a = make_backend("shm", config=CFG)
    b = make_backend("shm", config=CFG)
    tags = [a.shm_tag, b.shm_tag]  # type: ignore[attr-defined]
    yield a, b
    a.shutdown()
    b.shutdown()
    for tag in tags:
        assert leaked_segments(tag) == []


def roundtrip(a: TransferBackend, b: TransferBackend, tid: str, src: list, dst: list) -> RemoteRegion:
    region = b.recv(tid, dst)
    region = msgspec.msgpack.decode(msgspec.msgpack.encode(region), type=RemoteRegion)  # as over the wire
    a.send(tid, src, region)
    assert wait_terminal(a, [tid])[tid] is TransferState.DONE, a.status(tid).reason
    assert wait_terminal(b, [tid])[tid] is TransferState.DONE, b.status(tid).reason
    a.release(tid)
    b.release(tid)
    return region


# ---------------------------------------------------------------- alloc
def test_alloc_types_shapes_and_plain_fallback(pair: tuple[TransferBackend, TransferBackend]) -> None:
    _, b = pair
    t = b.alloc((3, 16, 2, 8), torch.bfloat16)
    assert isinstance(t, torch.Tensor) and t.shape == (3, 16, 2, 8) and t.dtype == torch.bfloat16
    assert t.is_contiguous()
    x = b.alloc([5, 7], np.float32)
    assert isinstance(x, np.ndarray) and x.shape == (5, 7) and x.dtype == np.float32 and x.flags.writeable
    kv = b.alloc_like([(4, 16, 2, 8)] * 6, torch.float32)
    assert len(kv) == 6 and all(k.shape == (4, 16, 2, 8) for k in kv)
    ptrs = sorted(k.data_ptr() for k in kv)
    assert len(set(ptrs)) == 6 and all(q - p >= 4 * 16 * 2 * 8 * 4 for p, q in zip(ptrs, ptrs[1:], strict=False))
    assert all(p % 4096 == 0 for p in ptrs)  # every piece starts on a page, as a single alloc() does
    s = b.stats()
    # alloc_like carves its pieces from one arena allocation (one lock, placement and finalizer per request)
    assert s.arena_allocations == 3 and s.arena_segments == 1 and s.arena_bytes >= 6 * 4096
    assert any(n.startswith(b.shm_tag) for n in os.listdir(SHM_DIR))  # type: ignore[attr-defined]
    with make_backend("tcp") as tcp:
        plain = tcp.alloc((2, 3), torch.float16)
        assert plain.shape == (2, 3) and plain.dtype == torch.float16 and tcp.stats().arena_segments == 0
    with pytest.raises(ValueError, match="non-negative"):
        b.alloc((-1, 2), np.float32)


def test_freed_buffers_return_to_the_pool(pair: tuple[TransferBackend, TransferBackend]) -> None:
    _, b = pair
    first = [b.alloc((1000,), np.float32) for _ in range(4)]
    ptrs = [x.ctypes.data for x in first]
    view = first[2][10:20]  # a view keeps its allocation alive
    del first
    s = b.stats()
    assert s.arena_allocations == 1 and s.arena_bytes == 4096
    again = [b.alloc((1000,), np.float32) for _ in range(3)]
    assert sorted(x.ctypes.data for x in again) == sorted(p for i, p in enumerate(ptrs) if i != 2)
    del view, again
    assert b.stats().arena_allocations == 0 and b.stats().arena_bytes == 0
    group = b.alloc_like([(1000,)] * 4, np.float32)  # one allocation: a view of any piece keeps all of it
    view = group[3][:5]
    del group
    assert b.stats().arena_allocations == 1 and b.stats().arena_bytes == 4 * 4096
    del view
    assert b.stats().arena_allocations == 0 and b.stats().arena_bytes == 0
    t = b.alloc((64, 16), torch.bfloat16)
    half = t[32:].view(torch.int16)  # torch views keep the allocation alive too
    del t
    assert b.stats().arena_allocations == 1
    del half
    assert b.stats().arena_allocations == 0


# ---------------------------------------------------------------- direct (one-copy) path
def test_arena_recv_is_written_in_place_with_one_message(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    rng = np.random.default_rng(0)
    src = [torch.from_numpy(rng.standard_normal((4, 16, 2, 8), dtype=np.float32)) for _ in range(6)]
    dst = b.alloc_like([s.shape for s in src], torch.float32)
    for d in dst:
        d.zero_()
    sent: list[type] = []
    orig = a._to_peer  # type: ignore[attr-defined]

    def spy(address: str, msg: m.Message, frames: tuple = ()) -> None:  # type: ignore[type-arg]
        sent.append(type(msg))
        assert not frames, "in-place data must not travel as frames"
        orig(address, msg, frames)

    a._to_peer = spy  # type: ignore[attr-defined]
    region = roundtrip(a, b, "kv", src, dst)
    target = msgspec.msgpack.decode(region.extra, type=m.DirectTarget)
    assert all(r is not None for r in target.slots)
    assert sent == [m.Data]  # data + close folded into one control message; the Ack is the only reply
    for x, y in zip(src, dst, strict=True):
        assert torch.equal(x, y)
    s = a.stats()
    assert s.pooled_segments == 0 and s.staging_segments == 0  # no staging copy was made
    assert_clean(a, b)


def test_large_arena_payload_goes_through_the_io_thread(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 255, 3 << 20, dtype=np.uint8), rng.integers(0, 255, 9 << 20, dtype=np.uint8)]
    dst = b.alloc_like([(s.nbytes,) for s in src], np.uint8)  # 12 MB: above the inline limit, several pieces
    roundtrip(a, b, "big", src, dst)
    assert all(np.array_equal(x, y) for x, y in zip(src, dst, strict=True))
    assert a.stats().pooled_segments == 0
    assert_clean(a, b)


def test_slices_of_one_allocation_and_mixed_slots(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    rng = np.random.default_rng(2)
    block = b.alloc((4, 2, 1000), np.float32)  # one allocation, posted as per-layer K/V slices
    plain = np.zeros(333, np.float64)  # an ordinary buffer: goes through staging
    dst = [block[i, j] for i in range(4) for j in range(2)] + [plain]
    src = [rng.standard_normal(1000).astype(np.float32) for _ in range(8)] + [rng.standard_normal(333)]
    region = roundtrip(a, b, "mix", src, dst)
    target = msgspec.msgpack.decode(region.extra, type=m.DirectTarget)
    assert [r is not None for r in target.slots] == [True] * 8 + [False]
    assert all(np.array_equal(x, y) for x, y in zip(src, dst, strict=True))
    assert_clean(a, b)


def test_chunkwise_appends_into_arena(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    dst = b.alloc_like([(16, 8)] * 6, np.float32)
    region = b.recv("chunks", dst)
    a.open("chunks", region)
    for c in range(3):
        a.append("chunks", [np.full((16, 8), 2 * c + k, np.float32) for k in range(2)])
        deadline = time.monotonic() + 5
        while b.status("chunks").bytes_done < (c + 1) * 2 * 16 * 8 * 4:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert b.poll("chunks") is TransferState.TRANSFERRING  # not DONE before close
    a.close("chunks")
    assert wait_terminal(b, ["chunks"])["chunks"] is TransferState.DONE
    assert wait_terminal(a, ["chunks"])["chunks"] is TransferState.DONE
    assert [float(d[0, 0]) for d in dst] == [0, 1, 2, 3, 4, 5]
    a.release("chunks")
    b.release("chunks")
    assert_clean(a, b)


def test_rewrite_of_a_slot_keeps_the_last_append(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    dst = b.alloc_like([(3 << 20,), (8,)], np.uint8)
    region = b.recv("rw", dst)
    a.open("rw", region)
    a.append("rw", [np.full(3 << 20, 1, np.uint8)], slots=[0])  # large: queued for the I/O thread
    a.append("rw", [np.full(3 << 20, 9, np.uint8)], slots=[0])  # rewrite of the same slot
    a.append("rw", [np.full(8, 5, np.uint8)], slots=[1])  # small: may be copied inline
    a.close("rw")
    assert wait_terminal(b, ["rw"])["rw"] is TransferState.DONE
    assert wait_terminal(a, ["rw"])["rw"] is TransferState.DONE
    assert int(dst[0].min()) == int(dst[0].max()) == 9 and int(dst[1][0]) == 5
    a.release("rw")
    b.release("rw")


def test_sender_arena_buffers_skip_staging(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    src = a.alloc_like([(2000,), (70_000,)], np.int32)  # the sender's own arena: receiver copies straight out
    for i, s in enumerate(src):
        s[:] = np.arange(s.size) * (i + 1)
    dst = [np.zeros(2000, np.int32), np.zeros(70_000, np.int32)]
    roundtrip(a, b, "pull", src, dst)
    assert all(np.array_equal(x, y) for x, y in zip(src, dst, strict=True))
    assert a.stats().pooled_segments == 0 and a.stats().staging_segments == 0
    assert_clean(a, b)


def test_register_arena_region_for_one_sided_writes(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    pool = b.alloc_like([(257,)] * 3, np.float32)
    region = b.register("pool", pool)
    assert region.extra
    new = [np.full(257, float(i), np.float32) for i in range(3)]
    a.write("w1", region, new)
    assert wait_terminal(a, ["w1"])["w1"] is TransferState.DONE
    assert all(np.array_equal(p, n) for p, n in zip(pool, new, strict=True))
    b.deregister("pool")
    before = [p.copy() for p in pool]
    a.write("w2", region, [np.zeros(257, np.float32)] * 3)
    assert wait_terminal(a, ["w2"])["w2"] is TransferState.FAILED
    assert "closed the region" in a.status("w2").reason
    assert all(np.array_equal(p, q) for p, q in zip(pool, before, strict=True))  # nothing landed
    a.release("w1")
    a.release("w2")
    assert_clean(a, b)


def test_one_sided_read_of_an_arena_region_needs_nothing_from_its_owner(
        pair: tuple[TransferBackend, TransferBackend]) -> None:
    """A registered arena region is read straight out of the owner's shared memory, in the reader's thread: done
    when read() returns, even while the owner's I/O thread is stuck (a prefill forward holding its core)."""
    a, b = pair
    rng = np.random.default_rng(5)
    pool = b.alloc_like([(300,), (5 << 20,)], np.uint8)  # the second spans two fence-checked pieces
    for p in pool:
        p[:] = rng.integers(0, 255, p.size, dtype=np.uint8)
    region = b.register("kv", pool)
    region = msgspec.msgpack.decode(msgspec.msgpack.encode(region), type=RemoteRegion)  # as over the wire
    stall = threading.Event()
    b._submit(stall.wait)  # type: ignore[attr-defined]  # the owner's I/O thread does nothing until set
    try:
        into = [np.zeros(5 << 20, np.uint8), np.zeros(300, np.uint8)]
        a.read("rd", region, into, slots=[1, 0])
        assert a.poll("rd") is TransferState.DONE, a.status("rd").reason
        assert a.status("rd").bytes_done == (5 << 20) + 300
        assert np.array_equal(into[0], pool[1]) and np.array_equal(into[1], pool[0])
        with pytest.raises(ValueError, match="destination buffers"):
            a.read("few", region, into[:1], slots=[0, 1])
    finally:
        stall.set()
    b.deregister("kv")  # closes the fence: a later read fails at once, nothing copied
    late = np.full(300, 9, np.uint8)
    a.read("late", region, [late], slots=[0])
    assert a.poll("late") is TransferState.FAILED and "closed the region" in a.status("late").reason
    assert int(late.min()) == 9
    for t in ("rd", "late"):
        a.release(t)
    assert_clean(a, b)


def test_a_read_whose_region_changes_owner_mid_copy_fails(pair: tuple[TransferBackend, TransferBackend]) -> None:
    """The fence word is checked after the last piece too: a region closed during the copy fails the read."""
    a, b = pair
    pool = b.alloc_like([(5 << 20,)], np.uint8)
    region = b.register("kv", pool)
    target = msgspec.msgpack.decode(region.extra, type=m.DirectTarget)
    real_views = a._mapper.views  # type: ignore[attr-defined]

    def views_then_close(refs: list[m.ShmRef]) -> list[np.ndarray]:
        out = real_views(refs)
        b.deregister("kv")  # the owner closes while the reader holds the mapping
        return out

    a._mapper.views = views_then_close  # type: ignore[attr-defined]
    try:
        a.read("torn", region, [np.zeros(5 << 20, np.uint8)])
    finally:
        a._mapper.views = real_views  # type: ignore[attr-defined]
    assert a.poll("torn") is TransferState.FAILED and "closed the region" in a.status("torn").reason
    evil = m.DirectTarget(target.fence_name, target.fence_index, target.token, [m.ShmRef("/etc/passwd", 0, 64)])
    bad = RemoteRegion(region.address, "kv", [64], "shm", msgspec.msgpack.encode(evil))
    a.read("evil", bad, [np.zeros(64, np.uint8)])
    assert a.poll("evil") is TransferState.FAILED and "cannot map" in a.status("evil").reason
    for t in ("torn", "evil"):
        a.release(t)
    assert_clean(a, b)


# ---------------------------------------------------------------- safety
def test_cancelled_arena_recv_is_never_written(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    dst = b.alloc_like([(1000,), (5 << 20,)], np.uint8)
    for d in dst:
        d[:] = 7
    region = b.recv("gone", dst)
    b.release("gone")  # cancelled before the sender starts: the fence is closed
    a.send("gone", [np.zeros(1000, np.uint8), np.zeros(5 << 20, np.uint8)], region)
    assert wait_terminal(a, ["gone"])["gone"] is TransferState.FAILED
    assert "closed the region" in a.status("gone").reason
    assert all(int(d.min()) == 7 for d in dst)
    a.release("gone")
    assert_clean(a, b)


def test_tampered_direct_target_is_rejected(pair: tuple[TransferBackend, TransferBackend]) -> None:
    a, b = pair
    dst = b.alloc_like([(64,)], np.uint8)
    region = b.recv("bad", dst)
    t = msgspec.msgpack.decode(region.extra, type=m.DirectTarget)
    evil = m.DirectTarget(t.fence_name, t.fence_index, t.token, [m.ShmRef("/etc/passwd", 0, 64)])
    bad = RemoteRegion(region.address, region.region_id, region.slot_nbytes, "shm", msgspec.msgpack.encode(evil))
    a.send("bad", [np.ones(64, np.uint8)], bad)
    assert wait_terminal(a, ["bad"])["bad"] is TransferState.FAILED
    assert "unexpected shared-memory name" in a.status("bad").reason
    a.release("bad")
    b.release("bad")
    assert_clean(a, b)


def test_arena_unit_free_coalescing_quarantine_trim_and_shutdown() -> None:
    tag = f"tetrixfer-test-{os.getpid()}-{time.monotonic_ns()}-"
    ar = ShmArena(tag, segment_bytes=1 << 20, keep_bytes=1 << 20, quarantine_s=0.2)
    try:
        xs = [ar.alloc_bytes(100_000) for _ in range(3)]
        refs = ar.locate(xs)
        assert [r.offset for r in refs] == [0, 102_400, 204_800]  # type: ignore[union-attr]
        assert ar.locate([np.zeros(10, np.uint8)]) == [None]
        del xs
        big = ar.alloc_bytes(3 * 102_400)  # the three freed blocks coalesced: it fits at offset 0
        assert ar.locate([big])[0].offset == 0  # type: ignore[union-attr]
        ar.taint(ar.locate([big]))  # as if its region failed
        del big
        y = ar.alloc_bytes(4096)
        assert ar.locate([y])[0].offset == 3 * 102_400  # type: ignore[union-attr]  (quarantined range skipped)
        time.sleep(0.25)
        z = ar.alloc_bytes(4096)
        assert ar.locate([z])[0].offset == 0  # type: ignore[union-attr]  (quarantine over)
        huge = ar.alloc_bytes(3 << 20)  # larger than a segment: its own segment
        assert ar.counts()[0] == 2
        del huge
        assert ar.counts()[0] == 1  # the idle segment above keep_bytes was unlinked
        assert ar.open_fence() is not None
        assert len(leaked_segments(tag)) == 2  # one segment + the fence file
    finally:
        ar.shutdown()
    assert leaked_segments(tag) == []
    assert z[0] == z[0]  # live arrays stay usable after shutdown (the mapping outlives the file)
    assert ALIGN == 4096


def test_mapper_prunes_unlinked_segments() -> None:
    tag = f"tetrixfer-test-{os.getpid()}-{time.monotonic_ns()}-"
    ar = ShmArena(tag, segment_bytes=1 << 20)
    mapper = ShmMapper()
    x = ar.alloc_bytes(1000)
    x[:] = 3
    view = mapper.views(ar.locate([x]))[0]  # type: ignore[list-item]
    assert int(view[0]) == 3 and len(mapper) == 1
    assert mapper.prune_unlinked() == 0
    ar.shutdown()
    assert mapper.prune_unlinked() == 1 and len(mapper) == 0
    mapper.shutdown()


# ---------------------------------------------------------------- cross-process, as the runtime runs it
def test_cross_process_arena_receiver() -> None:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    src = [np.arange(300_003, dtype=np.int64).astype(np.uint8), np.full((4, 1000), 0.5, np.float32)]
    sizes = [x.nbytes for x in src]
    proc = ctx.Process(target=child_receiver, args=("shm", "xa", sizes, q_in, q_out, 20.0, 2, True), daemon=True)
    proc.start()
    try:
        with make_backend("shm") as a:
            for i in range(2):  # the second transfer reuses the child's freed arena memory
                region = msgspec.msgpack.decode(q_out.get(timeout=30), type=RemoteRegion)
                assert region.extra  # the child advertised its arena buffers
                a.write(f"xa-{i}", region, src)
                assert wait_terminal(a, [f"xa-{i}"], 20)[f"xa-{i}"] is TransferState.DONE
                state, sums, _, reason = q_out.get(timeout=20)
                assert state == "done", reason
                assert sums == [int(x.view(np.uint8).sum(dtype=np.uint64)) for x in src]
                a.release(f"xa-{i}")
            assert a.stats().pooled_segments == 0  # every byte went straight into the child's arena
            assert_clean(a)
            tag = a.shm_tag  # type: ignore[attr-defined]
        q_in.put("bye")
        proc.join(timeout=20)
        assert proc.exitcode == 0
        assert leaked_segments(tag) == []
    finally:
        if proc.is_alive():
            proc.kill()


def test_cross_process_many_small_arena_transfers() -> None:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    n = 12
    rng = np.random.default_rng(5)
    srcs = [[rng.integers(0, 255, 20_000, dtype=np.uint8) for _ in range(3)] for _ in range(n)]
    sizes = [x.nbytes for x in srcs[0]]
    proc = ctx.Process(target=child_receiver_batch, args=("shm", "sm", sizes, n, q_in, q_out, 20.0, 1, True),
                       daemon=True)
    proc.start()
    try:
        with make_backend("shm") as a:
            regions = [msgspec.msgpack.decode(x, type=RemoteRegion) for x in q_out.get(timeout=30)]
            for region, src in zip(regions, srcs, strict=True):
                a.send(region.region_id, src, region)
            states = wait_terminal(a, [r.region_id for r in regions], 20)
            assert set(states.values()) == {TransferState.DONE}
            st, sums, reasons = q_out.get(timeout=20)
            assert set(st) == {"done"}, reasons
            assert sums == [[int(x.sum(dtype=np.uint64)) for x in src] for src in srcs]
            for region in regions:
                a.release(region.region_id)
            assert_clean(a)
        q_in.put("bye")
        proc.join(timeout=20)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_retry_after_dropped_attempt_writes_arena_in_place() -> None:
    from tetriinfer.transfer import RetryingSender, RetryPolicy

    fast = AgentConfig(timeout_s=0.3, sweep_interval_s=0.005)
    a = make_backend("faulty", inner="shm", config=fast, drop_p=1.0, faulty_attempts=1)
    b = make_backend("shm", config=fast)
    try:
        dst = b.alloc_like([(777,)], np.float32)
        dst[0][:] = 0
        region = b.recv("r", dst, timeout_s=3.0)  # the receiver outlives the sender's retries
        src = [np.arange(777, dtype=np.float32)]
        sender = RetryingSender(a, RetryPolicy(max_attempts=3))
        sender.send("r", src, region)
        assert wait_terminal(sender, ["r"])["r"] is TransferState.DONE, sender.status("r").reason
        assert sender.attempts("r") == 2
        assert wait_terminal(b, ["r"])["r"] is TransferState.DONE
        assert np.array_equal(src[0], dst[0])
        sender.release("r")
        b.release("r")
        assert_clean(a, b)
    finally:
        a.shutdown()
        b.shutdown()
