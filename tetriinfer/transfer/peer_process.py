"""A receiver that runs in a child process (spawn), for cross-process tests and benchmarks.

Protocol over multiprocessing queues (test harness only; transfer bytes never go through them): the child posts
`recv(f"{transfer_id}-{i}", buffers)` with zeroed buffers of the given sizes, puts the msgspec-encoded
RemoteRegion, waits for the transfer to end, puts (state value, per-buffer uint8 sums, seconds from first byte
to DONE, reason); this repeats `repeats` times; then it waits for any message on `q_in` before shutting down. Imports only numpy/zmq/msgspec (no torch) to start fast.
With `use_alloc=True` the buffers come from the backend's `alloc()` (shm: its shared-memory arena, so the sender
writes them directly), allocated per repeat and dropped after it, as a decode worker does per request.
The child applies the allocator settings every instance process runs with (`tetriinfer.allocator`).

`child_receiver_batch` posts `batch` transfers at once per repeat (many small requests in flight), puts the list
of encoded regions, then one (states, per-transfer per-buffer sums, reasons) tuple when all are terminal.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np


def child_receiver(kind: str, transfer_id: str, sizes: list[int], q_in: Any, q_out: Any,
                   limit_s: float = 60.0, repeats: int = 1, use_alloc: bool = False) -> None:
    from tetriinfer.allocator import tune_cpu_allocator
    from tetriinfer.transfer.factory import make_backend

    tune_cpu_allocator()  # as an instance process (its engine) does
    b = make_backend(kind)
    try:
        for i in range(repeats):
            _receive_once(b, f"{transfer_id}-{i}", sizes, q_out, limit_s, use_alloc)
        q_in.get(timeout=limit_s)
    finally:
        b.shutdown()


def _buffers(b: Any, sizes: list[int], use_alloc: bool) -> list[np.ndarray]:
    if not use_alloc:
        return [np.zeros(n, np.uint8) for n in sizes]
    dst = b.alloc_like([(n,) for n in sizes], np.uint8)
    for d in dst:
        d[:] = 0  # arena memory may hold an earlier transfer's bytes
    return dst


def child_receiver_batch(kind: str, transfer_id: str, sizes: list[int], batch: int, q_in: Any, q_out: Any,
                         limit_s: float = 60.0, repeats: int = 1, use_alloc: bool = False) -> None:
    from tetriinfer.allocator import tune_cpu_allocator
    from tetriinfer.transfer.factory import make_backend

    tune_cpu_allocator()  # as an instance process (its engine) does
    b = make_backend(kind)
    try:
        for i in range(repeats):
            tids = [f"{transfer_id}-{i}-{j}" for j in range(batch)]
            dsts = [_buffers(b, sizes, use_alloc) for _ in tids]
            regions = [b.recv(t, d, timeout_s=limit_s) for t, d in zip(tids, dsts, strict=True)]
            q_out.put([msgspec.msgpack.encode(r) for r in regions])
            deadline = time.monotonic() + limit_s
            while time.monotonic() < deadline and not all(b.poll(t).terminal for t in tids):
                time.sleep(0.001)
            states = [b.status(t) for t in tids]
            sums = [[int(x.sum(dtype=np.uint64)) for x in d] for d in dsts]
            q_out.put(([s.state.value for s in states], sums, [s.reason for s in states]))
            for t in tids:
                b.release(t)
            del dsts
        q_in.get(timeout=limit_s)
    finally:
        b.shutdown()


def _receive_once(b: Any, transfer_id: str, sizes: list[int], q_out: Any, limit_s: float,
                  use_alloc: bool = False) -> None:
    dst = _buffers(b, sizes, use_alloc)
    region = b.recv(transfer_id, dst, timeout_s=limit_s)
    q_out.put(msgspec.msgpack.encode(region))
    deadline = time.monotonic() + limit_s
    first = None
    while time.monotonic() < deadline:
        st = b.status(transfer_id)
        if first is None and st.bytes_done > 0:
            first = time.perf_counter()
        if st.state.terminal:
            break
        time.sleep(0.001)
    end = time.perf_counter()
    st = b.status(transfer_id)
    sums = [int(d.sum(dtype=np.uint64)) for d in dst]
    q_out.put((st.state.value, sums, end - (first or end), st.reason))
    b.release(transfer_id)


def raw_socket_receiver(port: int, nbytes: int, repeats: int) -> None:
    """The raw-socket baseline's other process: connect to 127.0.0.1:`port`, then `repeats` times recv_into one
    pre-touched buffer of `nbytes` and answer one byte."""
    import socket

    sink = np.ones(nbytes, np.uint8)
    view = memoryview(sink)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(repeats):
            got = 0
            while got < nbytes:
                k = sock.recv_into(view[got:], nbytes - got)
                if k == 0:
                    raise ConnectionError("sender closed early")
                got += k
            sock.sendall(b"k")
