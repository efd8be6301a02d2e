"""Transfer benchmark: backends vs this machine's own memcpy and raw loopback socket, plus chunk-wise overlap.

Everything is measured in the same run (the machine is shared and noisy) and reported as ratios:
- memcpy GB/s (numpy copy of 256 MB into a pre-touched buffer) and raw loopback TCP GB/s (plain sockets,
  sendall/recv_into; two threads of one process, and into a child process), interleaved with the tcp rows;
- each backend's GB/s for a KV-sized payload (64 MB in 16 arrays), sender open -> sender DONE (acknowledged),
  in one process and, for shm/tcp, with the receiver in a child process (as the runtime runs: the decode worker
  posts recv(), the prefill worker sends);
- shm both ways: into ordinary receive buffers (staging path: two copies) and into buffers from the backend's
  alloc() (shared-memory arena: the sender copies once, straight into them), allocated per transfer and dropped
  after it, as a decode worker does per request;
- many small transfers: 64 transfers of 1 MB (8 arrays each) posted at once, receiver in a child process;
- nixl (only when `import nixl` works): the same KV payload in one process and with a child receiver, and one
  `mem_bytes` array written by NIXL (UCX) into a child process vs the memcpy of the same size;
- chunk-wise overlap: N prefill chunks (real torch matmuls) with each chunk's KV sent over a paced link as the
  chunk completes, vs sending everything after prefill; reports the share of transfer time hidden by compute.
Goals: shm >= 50% of memcpy, tcp >= 70% of raw socket, overlap hides >= 80%.
Usage: python benchmarks/bench_transfer.py [--quick] [--out report.md]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tetriinfer.allocator import tune_cpu_allocator  # noqa: E402
from tetriinfer.transfer import PacedLink, RemoteRegion, TransferState, make_backend, nixl_available  # noqa: E402
from tetriinfer.transfer.peer_process import child_receiver, child_receiver_batch, raw_socket_receiver  # noqa: E402

GB = 1e9


def wait(backend: object, tid: str, limit_s: float = 60.0) -> TransferState:
    deadline = time.monotonic() + limit_s
    while True:
        s = backend.poll(tid)  # type: ignore[attr-defined]
        if s.terminal:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tid} stuck in {s}")
        time.sleep(0.0002)


def bench_memcpy(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


def bench_raw_socket(nbytes: int, reps: int) -> float:
    payload = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    sink = np.zeros(nbytes, np.uint8)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    best = float("inf")
    for _ in range(reps):
        view = memoryview(sink)

        def receive(v: memoryview = view) -> None:
            got = 0
            while got < nbytes:
                got += conn.recv_into(v[got:], nbytes - got)

        th = threading.Thread(target=receive)
        t0 = time.perf_counter()
        th.start()
        cli.sendall(memoryview(payload))
        th.join()
        best = min(best, time.perf_counter() - t0)
    assert np.array_equal(payload, sink)
    for s in (cli, conn, srv):
        s.close()
    return nbytes / best / GB


def bench_raw_socket_crossprocess(nbytes: int, reps: int) -> float:
    """Raw loopback TCP into another process (as the tcp backend runs): sendall here, recv_into in a spawned child
    (one pre-touched buffer), timed until the child's one-byte answer."""
    payload = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    proc = mp.get_context("spawn").Process(target=raw_socket_receiver,
                                           args=(srv.getsockname()[1], nbytes, reps + 1), daemon=True)
    proc.start()
    best = float("inf")
    try:
        srv.settimeout(60)
        conn, _ = srv.accept()
        conn.settimeout(60)
        for r in range(reps + 1):  # the first run faults in the child's pages
            t0 = time.perf_counter()
            conn.sendall(memoryview(payload))
            if conn.recv(1) != b"k":
                raise ConnectionError("raw socket receiver failed")
            if r:
                best = min(best, time.perf_counter() - t0)
        conn.close()
        proc.join(timeout=30)
    finally:
        srv.close()
        if proc.is_alive():
            proc.kill()
    return nbytes / best / GB


def kv_arrays(total: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(2)
    return [rng.integers(0, 2**16, total // n // 2, dtype=np.uint16) for _ in range(n)]  # bf16 as uint16


def bench_backend_inprocess(kind: str, src: list[np.ndarray], reps: int, arena: bool = False) -> float:
    a, b = make_backend(kind), make_backend(kind)
    dst = b.alloc_like([x.shape for x in src], src[0].dtype) if arena else [np.ones_like(x) for x in src]
    best = float("inf")
    try:
        for r in range(reps + 1):  # first run warms pools, page tables and connections
            tid = f"{kind}-{r}"
            region = b.recv(tid, dst)
            t0 = time.perf_counter()
            a.send(tid, src, region)
            assert wait(a, tid) is TransferState.DONE and wait(b, tid) is TransferState.DONE
            if r:
                best = min(best, time.perf_counter() - t0)
            a.release(tid)
            b.release(tid)
        assert all(np.array_equal(x, y) for x, y in zip(src, dst, strict=True))
    finally:
        a.shutdown()
        b.shutdown()
    return sum(x.nbytes for x in src) / best / GB


def bench_backend_crossprocess(kind: str, src: list[np.ndarray], reps: int, arena: bool = False) -> float:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    sizes = [x.nbytes for x in src]
    proc = ctx.Process(target=child_receiver, args=(kind, "x", sizes, q_in, q_out, 60.0, reps + 1, arena),
                       daemon=True)
    proc.start()
    best = float("inf")
    try:
        with make_backend(kind) as a:
            for r in range(reps + 1):  # the first run connects and faults in staging pages
                region = msgspec.msgpack.decode(q_out.get(timeout=60), type=RemoteRegion)
                t0 = time.perf_counter()
                a.write(region.region_id, region, src)
                state = wait(a, region.region_id)
                if r:
                    best = min(best, time.perf_counter() - t0)
                st, sums, _, reason = q_out.get(timeout=60)
                assert state is TransferState.DONE and st == "done", reason
                assert sums == [int(x.view(np.uint8).sum(dtype=np.uint64)) for x in src]
                a.release(region.region_id)
        q_in.put("bye")
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
    return sum(sizes) / best / GB


def bench_small_crossprocess(kind: str, n: int, per_bytes: int, arrays: int, reps: int, arena: bool) -> float:
    """`n` transfers of `per_bytes` each posted at once by a child receiver; first send -> last sender DONE."""
    rng = np.random.default_rng(3)
    srcs = [[rng.integers(0, 255, per_bytes // arrays, dtype=np.uint8) for _ in range(arrays)] for _ in range(n)]
    sizes = [x.nbytes for x in srcs[0]]
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child_receiver_batch,
                       args=(kind, "s", sizes, n, q_in, q_out, 60.0, reps + 1, arena), daemon=True)
    proc.start()
    best = float("inf")
    try:
        with make_backend(kind) as a:
            for r in range(reps + 1):
                regions = [msgspec.msgpack.decode(x, type=RemoteRegion) for x in q_out.get(timeout=60)]
                t0 = time.perf_counter()
                for region, src in zip(regions, srcs, strict=True):
                    a.send(region.region_id, src, region)
                states = [wait(a, region.region_id) for region in regions]
                if r:
                    best = min(best, time.perf_counter() - t0)
                st, sums, reasons = q_out.get(timeout=60)
                assert all(s is TransferState.DONE for s in states) and set(st) == {"done"}, reasons
                assert sums == [[int(x.sum(dtype=np.uint64)) for x in src] for src in srcs]
                for region in regions:
                    a.release(region.region_id)
        q_in.put("bye")
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
    return n * per_bytes / best / GB


def bench_nixl_write_vs_memcpy(nbytes: int = 256 << 20, reps: int = 3) -> tuple[float, float]:
    """(GB/s of one `nbytes` NIXL write into a child process, sender open -> acknowledged DONE; GB/s of a numpy
    memcpy of the same size), measured back to back. Needs nixl (see nixl_available())."""
    src = [np.random.default_rng(4).integers(0, 255, nbytes, dtype=np.uint8)]
    nixl = bench_backend_crossprocess("nixl", src, reps)
    return nixl, bench_memcpy(nbytes, reps + 1)


def calibrate_matmul(target_s: float) -> tuple[torch.Tensor, int]:
    x = torch.randn(384, 384)
    t0 = time.perf_counter()
    for _ in range(10):
        x @ x
    per = (time.perf_counter() - t0) / 10
    return x, max(1, round(target_s / per))


def prefill_chunk(x: torch.Tensor, iters: int) -> None:
    y = x
    for _ in range(iters):
        y = torch.tanh(x @ y)  # real compute standing in for one chunk's forward pass


def bench_overlap(n_chunks: int, chunk_s: float, link: str, kv_ratio: float) -> dict[str, float]:
    """kv_ratio = (one chunk's KV transfer time on the link) / (one chunk's compute time)."""
    x, iters = calibrate_matmul(chunk_s)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        prefill_chunk(x, iters)
        samples.append(time.perf_counter() - t0)
    chunk_s = float(np.median(samples))
    inner = make_backend("inproc")
    a = PacedLink(inner, bandwidth=link)
    b = make_backend("inproc")
    per_chunk = int(chunk_s * kv_ratio * a.bandwidth_Bps)
    layers = 4
    kv = [[np.full(per_chunk // layers, c, np.uint8) for _ in range(layers)] for c in range(n_chunks)]
    dst = [np.zeros(per_chunk // layers, np.uint8) for _ in range(layers * n_chunks)]
    out = {}
    try:
        for mode in ("after_prefill", "chunkwise"):
            b.recv(mode, dst)
            t0 = time.perf_counter()
            compute = 0.0
            if mode == "chunkwise":
                a.open(mode, b.address)
            for c in range(n_chunks):
                tc = time.perf_counter()
                prefill_chunk(x, iters)
                compute += time.perf_counter() - tc
                if mode == "chunkwise":
                    a.append(mode, kv[c])  # this chunk's KV leaves while the next chunk computes
            if mode == "after_prefill":
                a.open(mode, b.address)
                a.append(mode, [arr for chunk in kv for arr in chunk])
            a.close(mode)
            assert wait(b, mode) is TransferState.DONE and wait(a, mode) is TransferState.DONE
            total = time.perf_counter() - t0
            out[f"{mode}_total_s"] = total
            out[f"{mode}_compute_s"] = compute
            a.release(mode)
            b.release(mode)
    finally:
        a.shutdown()
        b.shutdown()
    transfer = out["after_prefill_total_s"] - out["after_prefill_compute_s"]
    exposed = out["chunkwise_total_s"] - out["chunkwise_compute_s"]
    out["transfer_s"] = transfer
    out["exposed_s"] = exposed
    out["hidden_frac"] = 1.0 - exposed / transfer
    out["ideal_hidden_frac"] = 1.0 - 1.0 / n_chunks  # the last chunk's KV can never hide
    out["chunk_s"] = chunk_s
    out["kv_bytes"] = float(per_chunk * n_chunks)
    return out


NOTES = """## How the shm backend moves bytes, and reading these numbers

- **One copy (arena):** buffers from `backend.alloc(shape, dtype)` / `alloc_like(shapes, dtype)` live in the
  backend's pooled shared-memory arena (64 MB `/dev/shm` segments, reused; freed when the last view is dropped).
  `recv()` into them (or into slices of them) advertises each slot's (segment, offset) and a fence word in
  `RemoteRegion.extra`; the sender maps the segment once (cached, pre-faulted) and copies straight into it,
  re-checking the fence before every 4 MB piece, then sends one `Data` header with the Close folded in; the
  receiver only answers `Ack`. Appends up to 2 MB are copied in the caller's thread (no hand-off to the I/O thread).
  Symmetrically, a sender whose buffers come from its own `alloc()` lets the receiver copy straight out of them.
- **Two copies (staging):** ordinary receive buffers still work unchanged: the sender copies into a pooled staging
  segment, the receiver copies out. The ratio of this path is shown for comparison, not judged.
- **Runtime wiring (decode side):** `staging = backend.alloc_like([shape] * (2 * num_layers), dtype)` instead of
  `torch.empty` per request, then `backend.recv(tid, staging)` as before; drop `staging` after `write_blocks`.
  On inproc/tcp/nixl `alloc_like` returns ordinary tensors, so the same code runs on every backend.
- **Safety:** a receiver's arena buffers are written only while its region is open. Once it is DONE, FAILED,
  cancelled or deregistered, its fence word is zeroed; a sender stops before its next piece. Arena ranges of a
  region that did not end DONE are quarantined (max(1 s, cancel_wait_s)) before reuse, so a piece already in
  flight can never land in memory handed out again. `/dev/shm` files are unlinked at shutdown; `stats()` reports
  `arena_allocations`/`arena_bytes`, which return to 0 when the caller drops its buffers.
- **Two memcpy baselines:** on this machine numpy copies of >= 192 MB run about twice as fast as copies of
  <= 128 MB (glibc's `x86_non_temporal_threshold` here is 0xc000000 = 192 MB, above which it uses non-temporal
  stores). The original 256 MB baseline is in that fast regime; a KV transfer (16 arrays of 4 MB, or 1 MB
  requests) never is, so "payload memcpy" (copying the same arrays once) is the ceiling a one-copy path can reach.
  The goal is judged against the stricter 256 MB baseline.
- **How the tcp backend moves bytes:** control headers (Data/Close/Ack) go over ZeroMQ; payloads go over one raw
  TCP connection per (sender, receiver) pair as frames (16-byte tag+size header, then the bytes), written by a
  sender thread with `sendall` and received by the receiver's reader thread with `recv_into` straight into the
  posted buffer (checked live before every 4 MB piece). So a payload is copied once, by the kernel, exactly as in
  the raw-socket baselines; ZeroMQ frames (the previous design, 51-82% of the raw socket over repeated runs) cost a
  second copy and an allocation per message.
- **Two raw-socket baselines, interleaved:** each tcp row is judged against the raw socket of the same shape (two
  threads of one process; or a child process receiving), and the four are measured in alternating rounds, best of
  all rounds, because single runs on this shared 2-core machine vary by up to 2x (e.g. the raw socket alone:
  1.8-3.2 GB/s across back-to-back runs).
- **Noise:** the machine is shared (load average 3-6 on 2 cores while these ran), so absolute GB/s vary by 2x
  between runs; compare ratios from one run. A full GC pass with torch imported takes ~0.25 s; the benchmark
  `gc.freeze()`s after imports so such a pass does not land inside a timed run.
"""


def bench_memcpy_payload(src: list[np.ndarray], reps: int) -> float:
    """numpy copy of the payload's own arrays into pre-touched arrays: the cost of moving these bytes once."""
    dst = [np.ones_like(x) for x in src]
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for d, x in zip(dst, src, strict=True):
            np.copyto(d, x)
        best = min(best, time.perf_counter() - t0)
    return sum(x.nbytes for x in src) / best / GB


TCP_ROUNDS = 3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller payloads, fewer repetitions")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "transfer.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # leave a core to the transfer I/O threads, as a prefill worker pinned to one core
    tune_cpu_allocator()  # the allocator settings of every instance process (and of the child receivers)
    # torch makes the heap huge: a full GC pass takes ~0.25 s here and would land inside a timed run; freezing
    # the import-time objects (as a serving process should after loading its model) keeps passes short.
    gc.collect()
    gc.freeze()
    mem_bytes = (64 if args.quick else 256) << 20
    kv_bytes = (16 if args.quick else 64) << 20
    reps = 2 if args.quick else 10  # best-of-many: the machine is shared and a quiet window is needed
    src = kv_arrays(kv_bytes, 16)
    res: dict[str, float] = {}
    n_small = 16 if args.quick else 64
    # The tcp rows and both raw-socket baselines are measured in interleaved rounds (best of all rounds), so a
    # noisy spell on this shared machine cannot land on one side of a ratio only.
    tcp_block = ["raw socket", "raw socket x-proc", "tcp", "tcp x-proc"]
    steps = ["memcpy", "memcpy payload", "inproc", "shm", "shm arena", "shm x-proc", "shm arena x-proc",
             "shm small x-proc", "shm arena small x-proc", *tcp_block * (1 if args.quick else TCP_ROUNDS),
             "overlap"]
    has_nixl = nixl_available()
    if has_nixl:
        steps[-1:-1] = ["nixl", "nixl x-proc", "nixl big write x-proc"]
    with tqdm(steps, desc="bench_transfer", unit="step") as bar:
        for step in bar:
            bar.set_postfix_str(step)
            kind, arena = step.split()[0], "arena" in step
            if step == "memcpy":
                res[step] = bench_memcpy(mem_bytes, reps + 1)
            elif step == "memcpy payload":
                res[step] = bench_memcpy_payload(src, reps + 1)
            elif step == "raw socket":
                res[step] = max(res.get(step, 0.0), bench_raw_socket(kv_bytes, reps + 1))
            elif step == "raw socket x-proc":
                res[step] = max(res.get(step, 0.0), bench_raw_socket_crossprocess(kv_bytes, reps))
            elif step in ("tcp", "tcp x-proc"):
                bench = bench_backend_crossprocess if step.endswith("x-proc") else bench_backend_inprocess
                res[step] = max(res.get(step, 0.0), bench(kind, src, reps))
            elif step == "nixl big write x-proc":
                res[step], res["memcpy same size"] = bench_nixl_write_vs_memcpy(mem_bytes, max(2, reps // 3))
            elif "small" in step:
                res[step] = bench_small_crossprocess(kind, n_small, 1 << 20, 8, reps, arena)
            elif step.endswith("x-proc"):
                res[step] = bench_backend_crossprocess(kind, src, reps, arena)
            elif step != "overlap":
                res[step] = bench_backend_inprocess(kind, src, reps, arena)
            else:
                ov = bench_overlap(n_chunks=10, chunk_s=0.03, link="2Gbps", kv_ratio=0.7)
    mem, pay, raw, raw_x = res["memcpy"], res["memcpy payload"], res["raw socket"], res["raw socket x-proc"]

    def goal(v: float, g: float) -> str:
        return f"{v:.0%} ({'meets' if v >= g else 'below'} goal {g:.0%})"

    def shm_row(label: str, key: str, judged: bool) -> str:
        v = res[key]
        first = goal(v / mem, 0.5) if judged else f"{v / mem:.0%}"
        if judged:
            label, first = f"**{label}**", f"**{first}**"
        return f"| {label} | {v:.2f} | {first} of memcpy | {v / pay:.0%} of payload memcpy |"

    lines = [
        "# KV transfer benchmark",
        "",
        f"`python benchmarks/bench_transfer.py{' --quick' if args.quick else ''}` on {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}; payload {kv_bytes >> 20} MB in 16 arrays; best of {reps} runs "
        "(sender open -> sender DONE, i.e. acknowledged by the receiver). Baselines measured in the same run. "
        "\"child receiver\" = the receiver runs in a spawned process and posts `recv()`, the parent sends, as the "
        "decode and prefill workers do. \"arena buffers\" = receive buffers from `backend.alloc_like()`, allocated "
        "per transfer and dropped after it.",
        "",
        "| path | GB/s | ratio to baseline | ratio to payload memcpy |",
        "|---|---|---|---|",
        f"| memcpy (numpy copy, {mem_bytes >> 20} MB) | {mem:.2f} | baseline | |",
        f"| payload memcpy (numpy copy of the 16 payload arrays) | {pay:.2f} | {pay / mem:.0%} of memcpy | "
        "baseline |",
        f"| raw loopback TCP, two threads of one process (sendall/recv_into) | {raw:.2f} | baseline | |",
        f"| raw loopback TCP into a child process (sendall/recv_into) | {raw_x:.2f} | baseline (x-proc) | |",
        f"| inproc backend | {res['inproc']:.2f} | {res['inproc'] / mem:.0%} of memcpy | "
        f"{res['inproc'] / pay:.0%} of payload memcpy |",
        shm_row("shm, ordinary buffers, one process (staging: 2 copies)", "shm", False),
        shm_row("shm, arena buffers, one process (1 copy)", "shm arena", True),
        shm_row("shm, ordinary buffers, child receiver (staging: 2 copies)", "shm x-proc", False),
        shm_row("shm, arena buffers, child receiver (1 copy)", "shm arena x-proc", True),
        shm_row(f"shm, {n_small} x 1 MB in flight, ordinary buffers, child receiver", "shm small x-proc", False),
        shm_row(f"shm, {n_small} x 1 MB in flight, arena buffers, child receiver", "shm arena small x-proc", True),
        f"| **tcp backend (one process)** | {res['tcp']:.2f} | **{goal(res['tcp'] / raw, 0.7)}** of the raw "
        "socket in one process | |",
        f"| **tcp backend (receiver in child process)** | {res['tcp x-proc']:.2f} | "
        f"**{goal(res['tcp x-proc'] / raw_x, 0.7)}** of the raw socket into a child process "
        f"({res['tcp x-proc'] / raw:.0%} of the one-process raw socket) | |",
        *([f"| nixl backend (UCX, one process) | {res['nixl']:.2f} | {res['nixl'] / mem:.0%} of memcpy | "
           f"{res['nixl'] / pay:.0%} of payload memcpy |",
           f"| nixl backend (UCX, receiver in child process) | {res['nixl x-proc']:.2f} | "
           f"{res['nixl x-proc'] / mem:.0%} of memcpy | {res['nixl x-proc'] / pay:.0%} of payload memcpy |",
           f"| nixl, one {mem_bytes >> 20} MB write into a child process | {res['nixl big write x-proc']:.2f} | "
           f"{res['nixl big write x-proc'] / res['memcpy same size']:.0%} of a {mem_bytes >> 20} MB memcpy "
           f"measured right after it ({res['memcpy same size']:.2f} GB/s) | |"] if has_nixl else []),
        "",
        f"Chunk-wise overlap: 10 prefill chunks of {ov['chunk_s'] * 1e3:.0f} ms (torch matmuls, 1 thread), "
        f"{ov['kv_bytes'] / 1e6:.0f} MB of KV over a PacedLink at 2 Gbps (each chunk's KV takes ~0.7x a chunk):",
        "",
        "| mode | total s | compute s | exposed transfer s |",
        "|---|---|---|---|",
        f"| send all KV after prefill (paper) | {ov['after_prefill_total_s']:.3f} | "
        f"{ov['after_prefill_compute_s']:.3f} | {ov['transfer_s']:.3f} |",
        f"| chunk-by-chunk while prefilling | {ov['chunkwise_total_s']:.3f} | {ov['chunkwise_compute_s']:.3f} | "
        f"{ov['exposed_s']:.3f} |",
        "",
        f"Transfer time hidden behind compute: **{goal(ov['hidden_frac'], 0.8)}** "
        f"(upper bound {ov['ideal_hidden_frac']:.0%}: the last chunk's KV cannot overlap).",
        "",
    ]
    text = "\n".join(lines)
    text += "\n" + NOTES
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
